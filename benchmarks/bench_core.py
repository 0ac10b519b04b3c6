"""Core costs, measured side by side on the bundled language workload (scan+remat char GPT).

runtime_overhead_ratio: median time of a scheduled-injection train step on steps where the schedule
  does not fire, over the median time of the plain jitted train step (interleaved calls, same state
  and batch), with the switch `peat.runtime` uses on this backend (`switch`: "site" on CPU, "host"
  on a GPU; see `peat_jax._src.schedule.SWITCHES`). Goal <= 1.03 on CPU, <= 1.05 on a GPU.
  Measured with the candidate switched at every dot_general site (the main figure), at one site,
  and for the vision workload (`runtime_overhead_ratio_vision`); `*_site` / `*_host` give both
  switches side by side on both workloads. On a GPU both workloads run at `size="large"`.
sweep_speedup: time to run the train step once per dot_general site with a fault at that site,
  recompiling per site (`jit(substitute(step, {i: fault}))`), over the time to do the same sweep on
  one compiled `switched` executable (its compile included). Goal >= 10 at >= 30 sites.
finite_fold_ratio: a runtime step as `peat.runtime` ran it before (the step, its loss read, then
  a separate jitted "is the new state finite" reduction synced to the host) over the step as it
  runs now (the finiteness folded into the step's program, read with its loss), interleaved,
  medians (language workload). > 1: folding it saves the extra launch and sync.

Prints one JSON object on one line. Runs with no arguments in a few minutes on 2 CPU cores.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import peat_jax as peat
from peat_jax import models
from peat_jax._src.schedule import SWITCHES, InjectedStep, default_switch


def _time(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def overhead(train_step, state, batch, selector, repeats: int, switch: str) -> float:
    plain = jax.jit(train_step)
    injected = InjectedStep(train_step, {selector: peat.faults.wrong_scale(2.0)},
                            peat.every(1_000_000, offset=999_999), switch=switch)
    jax.block_until_ready(plain(state, batch))
    jax.block_until_ready(injected(state, batch, 0))
    a, b = [], []
    for i in range(repeats):
        if i % 2:
            a.append(_time(plain, state, batch))
            b.append(_time(injected, state, batch, i))
        else:
            b.append(_time(injected, state, batch, i))
            a.append(_time(plain, state, batch))
    assert injected.compiles() == 1, "injection recompiled"
    return statistics.median(b) / statistics.median(a)


def sweep(train_step, state, batch, n_sites: int) -> tuple[float, int, float, float]:
    sites = [s.index for s in peat.list_sites(train_step, state, batch)
             if s.primitive == "dot_general"][:n_sites]
    fault = peat.faults.wrong_scale(2.0)
    t0 = time.perf_counter()
    sw = jax.jit(peat.switched(train_step, {"dot_general": fault}))
    for i in sites:
        jax.block_until_ready(sw(i, state, batch))
    one_compile = time.perf_counter() - t0
    assert sw._cache_size() == 1, "switched sweep recompiled"
    t0 = time.perf_counter()
    for i in sites:
        jax.block_until_ready(jax.jit(peat.substitute(train_step, {i: fault}))(state, batch))
    recompile = time.perf_counter() - t0
    return recompile / one_compile, len(sites), one_compile, recompile


def finite_fold(train_step, state, batch, repeats: int) -> float:
    from peat_jax._src.profiler.nan_origin import all_finite, tree_finite
    apart = jax.jit(train_step)

    def with_finite(s, b):
        new, metrics = train_step(s, b)
        return new, metrics, tree_finite(new)

    folded = jax.jit(with_finite)

    def one_apart():
        new, metrics = apart(state, batch)
        return float(metrics["loss"]), all_finite(new)

    def one_folded():
        new, metrics, finite = folded(state, batch)
        return float(metrics["loss"]), bool(finite)

    one_apart(), one_folded()
    a, b = [], []
    for i in range(repeats):
        for fn, out in ((one_apart, a), (one_folded, b))[::1 if i % 2 else -1]:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(a) / statistics.median(b)


def _workload(name: str, size: str):
    wl = models.get(name, size=size)
    state = wl.init(jax.random.key(0))
    return wl, state, jax.tree.map(jnp.asarray, wl.batch(0))


def main() -> None:
    # On a GPU the workloads' large settings (a step long enough to time); on CPU the defaults.
    size = "large" if jax.default_backend() == "gpu" else "small"
    wl, state, batch = _workload("language", size)
    n_all = sum(s.primitive == "dot_general" for s in peat.list_sites(wl.train_step, state, batch))
    switch = default_switch()
    other = "host" if switch == "site" else "site"
    ratios = {s: overhead(wl.train_step, state, batch, "dot_general", 41, s)
              for s in (switch, other)}
    ratio_one = overhead(wl.train_step, state, batch, 0, 41, switch)
    fold = finite_fold(wl.train_step, state, batch, repeats=41)
    speedup, n, t_one, t_re = sweep(wl.train_step, state, batch, n_sites=n_all)
    vwl, vstate, vbatch = _workload("vision", size)
    vision = {s: overhead(vwl.train_step, vstate, vbatch, "dot_general", 41, s)
              for s in (switch, other)}
    print(json.dumps({
        "runtime_overhead_ratio": round(ratios[switch], 4),
        "runtime_overhead_ratio_one_site": round(ratio_one, 4),
        "runtime_overhead_ratio_vision": round(vision[switch], 4),
        "switch": switch,
        **{f"runtime_overhead_ratio_{s}": round(ratios[s], 4) for s in SWITCHES},
        **{f"runtime_overhead_ratio_vision_{s}": round(vision[s], 4) for s in SWITCHES},
        "finite_fold_ratio": round(fold, 4),
        "switched_sites": n_all,
        "sweep_speedup": round(speedup, 2),
        "sweep_sites": n,
        "sweep_one_compile_s": round(t_one, 2),
        "sweep_recompile_s": round(t_re, 2),
        "workload": wl.name,
        "size": size,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
    }))


if __name__ == "__main__":
    sys.exit(main())
