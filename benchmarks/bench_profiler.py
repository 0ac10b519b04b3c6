"""Profiler costs, measured side by side on the bundled language workload (34 GEMM sites).

playback_speedup: time of the default playback campaign of a 20-step run (checkpoints 0 and 10 x
  every dot_general site = 68 cells; one compiled executable for the grid; local and effect
  diagnoses included), over the time of the same cells each replayed by a freshly compiled
  `jit(substitute(train_step, {site: cand}))` with the effect diagnosis only.
  playback_speedup_one_checkpoint: the same for checkpoint 10 alone (34 cells), where the fixed
  cost (tracing and compiling the replay, ~5 s) weighs most. The analyzer's own compilations (one
  per distinct tensor shape, the same in both ways and paid once per process) are warmed up
  before either is timed. Goal >= 10 at >= 30 cells.
playback_pseudo_ratio: the default campaign's time with the rounding pseudo-errors its effects
  are judged against (`peat_jax._src.profiler.effect`: the golden step replayed with a
  pseudo-error at a cell's site, only for cells whose step moved beyond the dtype's rounding)
  over the same campaign without them (`PSEUDO_SAMPLES` 0), interleaved, ratio of medians of 2;
  `playback_pseudo_cell_ratio` the same per cell, the campaign's fixed cost (tracing and
  compiling the replay, measured as a one-cell campaign) taken out of both. Goal <= 1.5.
  playback_pseudo_share: of the campaign's time, the share spent running the samples (timed
  around playback's `pseudo_errors`), with `pseudo_samples` (the replays it ran) and
  `cells_pseudo_sampled`; the recompiling baseline runs none.
storage_ratio: bytes the campaign stored (its directory) over the bytes a dump of every site's
  operands and outputs at every replayed step would take (per-iteration tensors of sites inside
  `scan` counted once per iteration). Goal <= 0.01.
stats_overhead_ratio: on the same language workload, the median time of the golden step with
  site statistics at every site (its statistics fetched to the host, one `jax.device_get` a
  step) over the median time of the plain jitted step, timed interleaved from the same state.
  Goal <= 1.5 (<= 1.15 the next). stats_overhead_ratio_on_device: the same with the statistics
  left on the device, as the golden run leaves them until it writes a chunk (interleaved in the
  same rounds; the difference is `jax.device_get`'s own cost, ~0.1 ms a call here).
stats_storage_ratio: bytes a 5-step run with `stats_every=1` stored under `golden/site_stats/`
  over the bytes of a dump of the same site outputs at those steps (each site's recorded output,
  per iteration inside `scan`). Goal < 0.01. The same two ratios on the tiny vision workload are
  printed as `stats_overhead_ratio_vision` and `stats_storage_ratio_vision`.
Prints one JSON object on one line; runs with no arguments in a few minutes on 2 CPU cores.
"""
from __future__ import annotations

import json
import logging
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import peat_jax as peat
from peat_jax import models
from peat_jax._src.analyzer import analyze
from peat_jax._src.detector import detect
from peat_jax._src.profiler import playback as _playback
from peat_jax._src.profiler.golden import profile, restore
from peat_jax._src.profiler.playback import diagnose_effect, playback
from peat_jax._src.profiler.rundir import RunDir
from peat_jax._src.profiler.site_stats import StatsStep, read_sites


def _bytes(shapes, dtypes) -> int:
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes))


def stats_costs(name: str, steps: int = 10, reps: int = 30) -> dict:
    """`stats_overhead_ratio` and `stats_storage_ratio` on workload `name` (see above)."""
    wl = models.get(name)
    stepper = StatsStep(wl.train_step)
    state = wl.init(jax.random.key(0))
    batch = jax.tree.map(jnp.asarray, wl.batch(0))

    def plain():
        jax.block_until_ready(stepper.plain(state, batch))

    def with_stats(fetch: bool = True):
        out = stepper.with_stats(state, batch)
        if fetch:
            jax.device_get(out[2])
        jax.block_until_ready(out)

    plain(), with_stats()  # compile both
    t_plain, t_stats, t_device = [], [], []
    for _ in range(reps):
        for fn, times in ((plain, t_plain), (with_stats, t_stats),
                          (lambda: with_stats(fetch=False), t_device)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        run = pathlib.Path(tmp) / "run"
        profile(wl, run, steps=steps, checkpoint_every=steps, stats_every=1)
        stats_dir = RunDir(run).site_stats
        stored = sum(p.stat().st_size for p in stats_dir.rglob("*") if p.is_file())
        dump = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize * s.repeats
                   for s in read_sites(stats_dir) if s.recorded) * steps
    return {"stats_overhead_ratio": round(float(np.median(t_stats) / np.median(t_plain)), 3),
            "stats_overhead_ratio_on_device": round(float(np.median(t_device)
                                                          / np.median(t_plain)), 3),
            "stats_step_ms": round(1e3 * float(np.median(t_stats)), 3),
            "plain_step_ms": round(1e3 * float(np.median(t_plain)), 3),
            "stats_storage_ratio": round(stored / dump, 6),
            "stats_stored_bytes": stored, "stats_dump_bytes": dump}


class _PseudoTimer:
    """Times playback's rounding pseudo-errors (`pseudo_errors`) while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner = _playback.pseudo_errors

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def __enter__(self) -> "_PseudoTimer":
        _playback.pseudo_errors = self
        return self

    def __exit__(self, *exc) -> None:
        _playback.pseudo_errors = self._inner


class _NoPseudo:
    """Playback without rounding pseudo-errors (`PSEUDO_SAMPLES` 0) while entered."""

    def __enter__(self) -> "_NoPseudo":
        self._samples, _playback.PSEUDO_SAMPLES = _playback.PSEUDO_SAMPLES, 0
        return self

    def __exit__(self, *exc) -> None:
        _playback.PSEUDO_SAMPLES = self._samples


def main() -> None:
    logging.getLogger("absl").setLevel(logging.ERROR)
    stats = stats_costs("language", steps=5, reps=40)
    vision = stats_costs("vision", reps=100)
    stats.update({f"{k}_vision": vision[k]
                  for k in ("stats_overhead_ratio", "stats_overhead_ratio_on_device",
                            "stats_storage_ratio")})
    wl = models.get("language")
    with tempfile.TemporaryDirectory() as tmp:
        run = pathlib.Path(tmp) / "run"
        profile(wl, run, steps=20, checkpoint_every=10)
        kernel = peat.kernels.blocked_matmul(block_k=16)
        state = restore(run, 10)
        batch = jax.tree.map(jnp.asarray, wl.batch(10))
        sites = peat.list_sites(wl.train_step, state, batch)
        for shape, dtype in {(s.out_shapes[0], s.out_dtypes[0]) for s in sites
                             if s.primitive == "dot_general"} | {
                                 (x.shape, x.dtype) for x in jax.tree.leaves(state["params"])} | {
                                 ((), jnp.dtype("float32"))}:
            z = jnp.zeros(shape, dtype)
            detect(analyze(z + 1, z + 1))
        t0 = time.perf_counter()
        res = playback(run, {"dot_general": kernel}, checkpoints=[10], name="bench34",
                       devices=jax.devices()[:1])
        t_one_34 = time.perf_counter() - t0
        t0 = time.perf_counter()
        playback(run, {"dot_general": kernel}, checkpoints=[10], name="fixed",
                 devices=jax.devices()[:1],
                 sites=next(s.index for s in sites if s.primitive == "dot_general"))
        t_fixed = time.perf_counter() - t0   # a one-cell campaign: the fixed cost
        with_pseudo, without = [], []
        for i in range(2):
            t0 = time.perf_counter()
            with _PseudoTimer() as pseudo:
                res = playback(run, {"dot_general": kernel}, name=f"bench{i}",  # ckpts 0, 10
                               devices=jax.devices()[:1])
            with_pseudo.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with _NoPseudo():
                playback(run, {"dot_general": kernel}, name=f"plain{i}",
                         devices=jax.devices()[:1])
            without.append(time.perf_counter() - t0)
        t_one = with_pseudo[-1]
        samples = [c.effect.pseudo_samples for c in res.cells if c.effect is not None]
        cells = res.records()
        t_re, t_re_34 = 0.0, 0.0
        for ckpt in sorted({r["checkpoint"] for r in cells}):
            state = restore(run, ckpt)
            batch = jax.tree.map(jnp.asarray, wl.batch(ckpt))
            t0 = time.perf_counter()
            golden = jax.jit(wl.train_step)(state, batch)
            for rec in cells:
                if rec["checkpoint"] != ckpt:
                    continue
                got = jax.jit(peat.substitute(wl.train_step, {rec["site"]: kernel}))(state, batch)
                diagnose_effect((golden[0], golden[1]), (got[0], got[1]), before=state)
            dt = time.perf_counter() - t0
            t_re += dt
            if ckpt == 10:
                t_re_34 = dt
        stored = sum(p.stat().st_size for p in (run / "campaigns" / "bench1").rglob("*")
                     if p.is_file())
        steps = len({r["checkpoint"] for r in cells})
        dump = sum((_bytes(s.in_shapes, s.in_dtypes) + _bytes(s.out_shapes, s.out_dtypes))
                   * s.repeats for s in sites) * steps  # every site's tensors at every step
    print(json.dumps({
        "playback_speedup": round(t_re / t_one, 2),
        "cells": len(cells),
        "playback_one_compile_s": round(t_one, 2),
        "playback_recompile_s": round(t_re, 2),
        "playback_speedup_one_checkpoint": round(t_re_34 / t_one_34, 2),
        "playback_pseudo_ratio": round(float(np.median(with_pseudo) / np.median(without)), 3),
        "playback_pseudo_cell_ratio": round(float(
            (np.median(with_pseudo) - t_fixed) / (np.median(without) - t_fixed)), 3),
        "playback_with_pseudo_s": [round(t, 2) for t in with_pseudo],
        "playback_without_pseudo_s": [round(t, 2) for t in without],
        "playback_fixed_s": round(t_fixed, 2),
        "playback_pseudo_share": round(pseudo.seconds / t_one, 3),
        "playback_pseudo_s": round(pseudo.seconds, 2),
        "pseudo_samples": sum(samples),
        "cells_pseudo_sampled": sum(1 for n in samples if n),
        "cells_one_checkpoint": len(cells) // 2,
        "storage_ratio": round(stored / dump, 6),
        "stored_bytes": stored,
        "dump_bytes": dump,
        "workload": wl.name,
        **stats,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }))


if __name__ == "__main__":
    sys.exit(main())
