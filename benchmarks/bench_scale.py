"""Playback throughput over processes on jax.distributed, measured side by side.

A small golden run of the vision workload (checkpoints 0, 2, 4, 6 x its 6 dot_general sites = 24
cells) is profiled once; the same campaign (`peat playback --fault "scale(2.0)"`) then runs as 1,
2 and 4 real processes on localhost (`--coordinator`, a port from the OS), in interleaved rounds,
each on a fresh campaign name. An untimed warm-up run at each process count fills the persistent
compilation cache first (a process of a multi-process run compiles other executables than a lone
one), so every timed run loads its executables alike.

cells_per_s: {"1": .., "2": .., "4": ..}: cells over the median wall time from starting the
  processes to the last one's exit (import, restore, trace and compile included: what a user
  waits for).
speedup: cells_per_s over that of one process.
merged_equal_to_single: true when every cell of every merged multi-process campaign equals the
  one-process campaign's (diagnoses, losses, signatures), each cell recorded once.
Each process runs with `XLA_FLAGS=--xla_cpu_multi_thread_eigen=false` (one compute thread for
XLA:CPU's matmuls and convolutions, the one process included), so N processes on N cores do not
fight over threads; on this 2-core machine 4 processes cannot scale past 2.
On a GPU (`--gpu`, for `gpu_check.sh`): the language workload at size="large" with the bundled
Pallas matmul, cells per second of one process, printed as `gpu_cells_per_s`.
Prints one JSON object on one line; runs with no arguments in a few minutes on 2 CPU cores.
"""
from __future__ import annotations

import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from peat_jax import models
from peat_jax.profiler.campaign import merged_records
from peat_jax.profiler.golden import profile

COUNTS = (1, 2, 4)
COMPARED = ("checkpoint", "site", "candidate", "status", "local", "effect", "effect_leaf", "loss",
            "local_signature")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def campaign(run_dir: pathlib.Path, name: str, n: int, env: dict, candidate: list[str]) -> float:
    """Seconds from starting `n` playback processes of campaign `name` to the last one's exit."""
    share = [] if n == 1 else ["--coordinator", f"localhost:{_free_port()}",
                               "--num-processes", str(n)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "peat_jax", "playback", str(run_dir),
                               *candidate, "--name", name, "--json", *share,
                               *(["--process-id", str(i)] if n > 1 else [])],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for i in range(n)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    seconds = time.perf_counter() - t0
    print(f"{name}: {n} process(es), {seconds:.1f} s", file=sys.stderr, flush=True)
    for p, err in zip(procs, errors):
        if p.returncode not in (0, 1):  # 1: the campaign found the fault, as it should
            raise RuntimeError(f"a playback process exited with {p.returncode}: {err[-2000:]}")
    return seconds


def _cells(run_dir: pathlib.Path, name: str) -> dict:
    path = run_dir / "campaigns" / name
    lines = [json.loads(x) for f in path.glob("results*.jsonl") for x in f.read_text().splitlines()]
    if len(lines) != len({(r["checkpoint"], r["site"]) for r in lines}):
        return {}  # a cell recorded twice
    return {(r["checkpoint"], r["site"]): {k: r.get(k) for k in COMPARED}
            for r in merged_records(path)}


def cpu(rounds: int = 2) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = pathlib.Path(tmp) / "run"
        profile(models.get("vision", batch_size=16, width=8, hidden=32), run_dir, steps=8,
                checkpoint_every=2)
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "PEAT_CACHE_DIR": str(pathlib.Path(tmp) / "xla"),
               "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                             " --xla_cpu_multi_thread_eigen=false").strip()}
        candidate = ["--fault", "scale(2.0)"]
        for n in COUNTS:  # compiled executables differ by process count: cache each
            campaign(run_dir, f"warmup-{n}", n, env, candidate)
        times: dict[int, list[float]] = {n: [] for n in COUNTS}
        for r in range(rounds):
            for n in COUNTS:
                times[n].append(campaign(run_dir, f"p{n}-r{r}", n, env, candidate))
        single = _cells(run_dir, "p1-r0")
        equal = bool(single) and all(_cells(run_dir, f"p{n}-r{r}") == single
                                     for n in COUNTS for r in range(rounds))
        per_s = {str(n): round(len(single) / statistics.median(t), 3) for n, t in times.items()}
        return {"cells": len(single), "rounds": rounds, "cells_per_s": per_s,
                "speedup": {n: round(v / per_s["1"], 3) for n, v in per_s.items()},
                "median_s": {str(n): round(statistics.median(t), 2) for n, t in times.items()},
                "merged_equal_to_single": equal, "cpu_count": os.cpu_count(),
                "load_avg_1min": round(os.getloadavg()[0], 2)}


def gpu() -> dict:
    """Cells per second of one playback process on the language workload at size="large" with
    the bundled Pallas matmul (a GPU machine)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = pathlib.Path(tmp) / "lm"
        profile(models.get("language", size="large"), run_dir, steps=4, checkpoint_every=2)
        env = {**os.environ, "PEAT_CACHE_DIR": str(pathlib.Path(tmp) / "xla")}
        candidate = ["--kernel", "pallas_matmul", "--checkpoints", "2"]
        campaign(run_dir, "warmup", 1, env, candidate)
        seconds = campaign(run_dir, "timed", 1, env, candidate)
        n = len(_cells(run_dir, "timed"))
        return {"gpu_cells": n, "gpu_cells_per_s": round(n / seconds, 3)}


def main() -> None:
    out = gpu() if "--gpu" in sys.argv[1:] else cpu()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
