"""Playback throughput over processes on jax.distributed, measured side by side, and what it
projects for a cluster.

A small golden run of the vision workload (checkpoints 0, 2, .., 202 x its 6 dot_general sites =
612 cells: at 204 cells the start-up, 3.9 s, was half of one process's time, and 2 processes gave
1.36x) is profiled once; the same campaign (`peat playback --fault "wrong_scale(2.0)"`) then runs
as 1 and 2 real processes on localhost (`--coordinator`, a port from the OS), in interleaved
rounds, each on a fresh campaign name, beside a one-process campaign of its first checkpoint only
(6 cells). An untimed warm-up run at each process count fills the persistent compilation cache
first; every process writes its own programs there (jax's rule is process 0 only, and the keys
name each process's device), so the timed runs load every program and compile none.

cells_per_s: {"1": .., "2": ..}: cells over the median wall time from starting the processes to
  the last one's exit (import, restore, trace and compile included: what a user waits for).
speedup: cells_per_s over that of one process (goal: >= 1.6 for 2 processes on 2 cores).
per_cell_s, startup_s: from one process's times for 612 and for 6 cells (T = startup + n x
  per_cell); startup_2_s the same for the 2-process campaign (its coordinator join included).
cache_entries_written_by_timed_runs: persistent-cache files the timed runs added (0: every
  process of every timed run loaded all it ran).
projection: for 8, 64 and 512 processes (one core each) and a campaign of 10,000 cells,
  T = startup_2_s + per_cell_s x ceil(10000 / P): the expected wall seconds and speedup over one
  process. It assumes what was measured here carries over: one core per process, the start-up
  of a 2-process run (jax's coordination service joins each process once; its cost per process
  at 512 is not measured), and a run directory on a filesystem that keeps up with P appenders.
merged_equal_to_single: true when every cell of every merged multi-process campaign equals the
  one-process campaign's (diagnoses, losses, signatures), each cell recorded once.
Each process is pinned to one core (`os.sched_setaffinity`, the lone process included): XLA:CPU
otherwise spreads one process over every core, flags or not, and N processes on N cores fight
over them; one core per process is also what the projection assumes.
On a GPU (`--gpu`, for `gpu_check.sh`): the language workload at size="large" with the bundled
Pallas matmul, cells per second of one process, printed as `gpu_cells_per_s`.
Prints one JSON object on one line; runs with no arguments in about 5 minutes on 2 CPU cores.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from peat_jax import models
from peat_jax._src.profiler.campaign import merged_records
from peat_jax._src.profiler.golden import profile

COUNTS = (1, 2)
PROJECTED = (8, 64, 512)
PROJECTED_CELLS = 10_000
COMPARED = ("checkpoint", "site", "candidate", "status", "local", "effect", "effect_leaf", "loss",
            "local_signature")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _on_one_core(i: int):
    """A preexec_fn that pins process `i` to one core of those this process may use (the i-th,
    round-robin): XLA:CPU spreads one process's work over every core it may use whatever
    `--xla_cpu_multi_thread_eigen` says (1.5 cores measured on a matmul loop here), so unpinned
    a lone process is already a multi-core one."""
    cores = sorted(os.sched_getaffinity(0))
    return lambda: os.sched_setaffinity(0, {cores[i % len(cores)]})


def campaign(run_dir: pathlib.Path, name: str, n: int, env: dict, candidate: list[str]) -> float:
    """Seconds from starting `n` playback processes of campaign `name` to the last one's exit."""
    share = [] if n == 1 else ["--coordinator", f"localhost:{_free_port()}",
                               "--num-processes", str(n)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "peat_jax", "playback", str(run_dir),
                               *candidate, "--name", name, "--json", *share,
                               *(["--process-id", str(i)] if n > 1 else [])],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, preexec_fn=_on_one_core(i)) for i in range(n)]
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


def _cache_files(path: pathlib.Path) -> int:
    return sum(1 for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def cpu(rounds: int = 3) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = pathlib.Path(tmp) / "run"
        profile(models.get("vision", batch_size=16, width=8, hidden=32), run_dir, steps=204,
                checkpoint_every=2)
        cache = pathlib.Path(tmp) / "xla"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PEAT_CACHE_DIR": str(cache)}
        candidate = ["--fault", "wrong_scale(2.0)"]
        first = [*candidate, "--checkpoints", "0"]
        for n in COUNTS:  # each process count compiles its own programs: cache them
            campaign(run_dir, f"warmup-{n}", n, env, candidate)
        campaign(run_dir, "warmup-first", 1, env, first)
        cached = _cache_files(cache)
        times: dict[int, list[float]] = {n: [] for n in COUNTS}
        small: list[float] = []
        for r in range(rounds):
            for n in COUNTS:
                times[n].append(campaign(run_dir, f"p{n}-r{r}", n, env, candidate))
            small.append(campaign(run_dir, f"first-r{r}", 1, env, first))
        single = _cells(run_dir, "p1-r0")
        cells, few = len(single), len(_cells(run_dir, "first-r0"))
        equal = bool(single) and all(_cells(run_dir, f"p{n}-r{r}") == single
                                     for n in COUNTS for r in range(rounds))
        median = {n: statistics.median(t) for n, t in times.items()}
        per_cell = (median[1] - statistics.median(small)) / (cells - few)
        startup = median[1] - per_cell * cells
        startup_2 = median[2] - per_cell * math.ceil(cells / 2)
        one = startup + per_cell * PROJECTED_CELLS
        projection = {}
        for p in PROJECTED:
            t = startup_2 + per_cell * math.ceil(PROJECTED_CELLS / p)
            projection[str(p)] = {"wall_s": round(t, 1), "speedup": round(one / t, 1)}
        per_s = {str(n): round(cells / m, 3) for n, m in median.items()}
        return {"cells": cells, "rounds": rounds, "cells_per_s": per_s,
                "speedup": {n: round(v / per_s["1"], 3) for n, v in per_s.items()},
                "median_s": {str(n): round(m, 2) for n, m in median.items()},
                "per_cell_s": round(per_cell, 4), "startup_s": round(startup, 2),
                "startup_2_s": round(startup_2, 2),
                "cache_entries_written_by_timed_runs": _cache_files(cache) - cached,
                "projection": {"cells": PROJECTED_CELLS, "processes": projection},
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
