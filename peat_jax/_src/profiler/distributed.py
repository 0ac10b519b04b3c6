"""Campaigns over processes, on jax's own multi-process runtime (`jax.distributed`).

N processes started with one coordinator address, the count N and each its own id call
`jax.distributed.initialize`; `peat.playback` then splits the grid by `jax.process_index()` of
`jax.process_count()`, each process appends to its own results file, and every reader sees the
merged campaign (`peat_jax._src.profiler.campaign`). Playback runs no collective: the processes
share only the run directory and the coordination service. Every process writes its compiled
programs to the persistent cache (jax's own rule is process 0 only), so a rerun of any share
loads them.

Processes that die:
  * jax's default ends every process when one dies. `start` turns on jax's recoverable mode
    (`jax_enable_recoverability`), so when a process other than 0 dies the others finish their
    share and exit normally; the dead one's finished cells are on disk, and running its share
    again (`--process-id I --num-processes N` without a coordinator) does the rest.
  * Process 0 hosts the coordination service: the others cannot outlive it (jax ends them, with
    their finished cells on disk). So process 0, its own share done, waits in `finish` until
    every other process has finished or been found dead (silent for `heartbeat_timeout` s).
  * A coordinator that cannot be reached within `timeout` seconds is a `PeatError` before jax
    is asked; if the other processes do not all join in that time, jax itself ends the process.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Mapping, Optional

import jax

from peat_jax._src import _jax
from peat_jax._src.errors import PeatError


# The environment read when the flags are not given. jax 0.10.2 to 0.12 read only the first
# themselves (the count and id they take from cluster managers: SLURM, Open MPI, ...); peat
# reads all three, with the same names.
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@dataclasses.dataclass(frozen=True)
class Processes:
    """Which share of a campaign this process runs.

    Attributes:
      index: this process's id, 0 <= index < count.
      count: the number of processes the grid is split over.
      coordinator: "HOST:PORT" of jax's coordination service (hosted by process 0), or None for
        a share run on its own (no runtime: a rerun of one process's share, or machines without
        a network between them).
    """

    index: int
    count: int
    coordinator: Optional[str] = None

    @property
    def share(self) -> tuple[int, int]:
        """(index, count), as `peat.playback(host=...)` takes it."""
        return self.index, self.count


def processes(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
              process_id: Optional[int] = None,
              environ: Mapping[str, str] = os.environ) -> Optional[Processes]:
    """The share asked for by the arguments, else by the environment variables `ENV`; None when
    neither asks for more than one process.

    Raises:
      PeatError: a count or id that is not a whole number, an id outside [0, count), a
        coordinator without a count and an id, or an address that is not HOST:PORT.
    """
    names = dict(zip(("coordinator", "count", "index"), ENV))
    coordinator = coordinator or environ.get(names["coordinator"]) or None
    count = _whole(num_processes, environ.get(names["count"]), "--num-processes", names["count"])
    index = _whole(process_id, environ.get(names["index"]), "--process-id", names["index"])
    if coordinator is None and count is None and index is None:
        return None
    if count is None or index is None:
        raise PeatError(f"a share of a campaign needs both the process count and this process's "
                        f"id (--num-processes N --process-id I, or {names['count']} and "
                        f"{names['index']}); got count={count}, id={index}")
    if not (count >= 1 and 0 <= index < count):
        raise PeatError(f"the process id must lie in [0, {count}) for {count} process(es), "
                        f"got {index}")
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise PeatError(f"the coordinator address must be HOST:PORT, got {coordinator!r}")
    return Processes(index=index, count=count, coordinator=coordinator)


def _whole(flag: Optional[int], env: Optional[str], flag_name: str, env_name: str
           ) -> Optional[int]:
    if flag is not None:
        return int(flag)
    if env is None or env.strip() == "":
        return None
    try:
        return int(env)
    except ValueError:
        raise PeatError(f"{env_name} must be a whole number (the value of {flag_name}), "
                        f"got {env!r}") from None


def start(procs: Processes, *, timeout: float = 120.0, heartbeat_timeout: int = 60) -> None:
    """Join jax's multi-process runtime as process `procs.index` of `procs.count` (nothing to
    do without a coordinator, or for one process). Call it before anything else runs on jax.

    Args:
      timeout: seconds to reach the coordinator and for all processes to join.
      heartbeat_timeout: seconds of silence after which a process is taken for dead.

    Raises:
      PeatError: the coordinator cannot be reached within `timeout`; jax already started (a
        computation ran before), or the runtime already initialised for another share.
    """
    if procs.coordinator is None or procs.count == 1:
        return
    if jax.distributed.is_initialized():
        if (jax.process_index(), jax.process_count()) != procs.share:
            raise PeatError(f"jax.distributed is already initialised as process "
                            f"{jax.process_index()} of {jax.process_count()}, not "
                            f"{procs.index} of {procs.count}")
        return
    if procs.index != 0:
        _wait_for_coordinator(procs.coordinator, timeout)
    jax.config.update("jax_enable_recoverability", True)
    try:
        jax.distributed.initialize(procs.coordinator, procs.count, procs.index,
                                   initialization_timeout=max(1, int(timeout)),
                                   heartbeat_timeout_seconds=max(1, int(heartbeat_timeout)))
    except RuntimeError as e:
        raise PeatError(f"cannot join jax's multi-process runtime: {e}. Start the processes "
                        "afresh, with nothing run on jax before") from None
    # each process compiles for its own device: let it keep its programs for the next run
    _jax.cache_writes_from_every_process()


def _wait_for_coordinator(address: str, timeout: float) -> None:
    """Return once a TCP connection to `address` opens; PeatError after `timeout` seconds
    (jax's own client ends the process when it cannot register, with no message to act on)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise PeatError(
                    f"the coordinator {address} cannot be reached ({e}) after {timeout:g} s: "
                    "start process 0 (which hosts it) with the same --coordinator, check the "
                    "host and port from this machine, or raise --init-timeout") from None
            time.sleep(0.25)


def finish(poll: float = 0.25) -> None:
    """Leave jax's multi-process runtime (nothing to do when it was not started). Process 0
    first waits until every other process has left or is found dead: its coordination service
    must outlive them."""
    if not jax.distributed.is_initialized():
        return
    if jax.process_index() == 0:
        while _jax.live_processes(jax.process_count()) - {0}:
            time.sleep(poll)
    jax.distributed.shutdown()


def refuse(command: str, procs: Optional[Processes]) -> None:
    """A PeatError when `command` (which runs one process's training from start to end) is
    started as one of several processes, by the arguments, the environment or jax itself."""
    count = procs.count if procs is not None else 1
    if count > 1 or jax.process_count() > 1:
        raise PeatError(
            f"peat {command} runs in one process, but it was started as one of "
            f"{max(count, jax.process_count())} (--num-processes/--coordinator, {', '.join(ENV)} "
            f"or jax.distributed): run it once, in one process, without them; only "
            f"`peat playback` splits its campaign over processes")
