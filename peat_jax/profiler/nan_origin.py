"""Where a NaN is born: the first site whose output went non-finite in a training step.

Nothing is stored while training runs. Once a step's output (its loss, or the new state) is
non-finite, that one step is replayed from its input state (kept in memory by `peat.runtime`, or
rebuilt from a golden run's checkpoints) through the jaxpr interpreter with a watching rule at
every site: it computes what the step computed there (the candidate where the injection fired,
with the step's own fault key; the reference elsewhere) and records whether any floating-point
output was non-finite, per iteration inside a `scan`.

"First" is execution order: site index order (program order: the forward pass, then the backward
pass, then the optimizer update, as a `value_and_grad` train step computes them) with the
iterations of a `scan` unrolled in the order they run (a reversed backward scan included), so a
value born in layer 0 of a scanned stack is not blamed on layer 1's first site. Sites inside a
`while` or a `cond` are not watched.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax import _interpreter
from peat_jax.errors import PeatError
from peat_jax.profiler.golden import available_checkpoints, load_workload, restore, scalar_metrics
from peat_jax.profiler.hostio import quiet, to_device
from peat_jax.profiler.rundir import PathLike, RunDir
from peat_jax.profiler.workload import Workload
from peat_jax.schedule import Schedule, inject, step_fault_key
from peat_jax.sites import Site
from peat_jax.substitute import Substitution, make_rules, substitute

__all__ = ["NanOrigin", "all_finite", "golden_nan_origin", "step_nan_origin"]


@dataclasses.dataclass(frozen=True)
class NanOrigin:
    """The first site whose output was non-finite, at the first step whose output was.

    Attributes:
      step: the training step.
      site: the site's index (in the train step's numbering, as `peat.list_sites` gives it).
      phase, primitive, path: the site's.
      iteration: inside `scan`s, the iteration of each enclosing scan, outermost first, in the
        order the scan runs (empty outside scans).
      fired: whether the injection was active at that step.
    """

    step: int
    site: int
    phase: str
    primitive: str
    path: str
    iteration: tuple[int, ...] = ()
    fired: bool = False

    def __str__(self) -> str:
        where = f" (iteration {', '.join(map(str, self.iteration))})" if self.iteration else ""
        return (f"step {self.step}, site #{self.site} {self.phase} {self.primitive} @ "
                f"{self.path or '<top>'}{where}")

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> Optional["NanOrigin"]:
        """The record `dataclasses.asdict` made (None stays None)."""
        if d is None:
            return None
        return cls(**{**d, "iteration": tuple(d.get("iteration", ()))})


_finite = jax.jit(lambda leaves: jnp.all(jnp.stack(
    [jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.ones((), bool)])))


def _is_float(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jnp.inexact)


def all_finite(tree) -> bool:
    """Whether every floating-point leaf of `tree` is finite everywhere (on the host)."""
    return bool(_finite([x for x in jax.tree.leaves(tree) if _is_float(x)]))


def _watching(site: Site, rule) -> Any:
    """A rule for `site` that computes what `rule` does (the reference when None) and returns,
    as its side, whether any floating-point output was non-finite (stacked, not reduced, over
    the iterations of enclosing scans)."""
    def watch(op, invals, reference):
        outs = list(rule(op, invals, reference) if rule is not None else reference(*invals))
        bad = jnp.zeros((), bool)
        for o in outs:
            if _is_float(o):
                bad = bad | ~jnp.all(jnp.isfinite(o))
        return _interpreter.WithSide(outs, bad, lambda stacked: stacked)

    return watch


def _first_bad(sides: Mapping[int, Any], traced) -> Optional[tuple[Site, tuple[int, ...]]]:
    """The site (and scan iterations) that ran first among those whose output was non-finite."""
    loops = {op.index: op.loops for op in traced.program.ops()}
    best = None
    for idx, mask in sides.items():
        mask = np.asarray(mask)
        for where in np.argwhere(mask) if mask.ndim else ([()] if mask else []):
            ran = tuple(int(L.length - 1 - i if L.reverse else i)
                        for L, i in zip(loops[idx], where))
            key = tuple(itertools.chain.from_iterable(
                (L.base, r) for L, r in zip(loops[idx], ran))) + (idx,)
            if best is None or key < best[0]:
                best = (key, idx, ran)
    return None if best is None else (traced.sites[best[1]], best[2])


def step_nan_origin(train_step, state, batch, step: int, *,
                    substitution: Optional[Substitution] = None,
                    schedule: Optional[Schedule] = None,
                    regions: Sequence[type] = ()) -> Optional[NanOrigin]:
    """Replay `train_step(state, batch)` as step `step` of a run (with `substitution` active if
    `schedule` fires at `step`, its faults keyed by the step as `peat.inject` keys them) with
    every site watched.

    Returns:
      The `NanOrigin` of the site that ran first among those whose output was non-finite, or
      None when no watched site's output was (the value was born outside the sites: in plain
      arithmetic, or in the input state).
    """
    if substitution and schedule is not None:
        fn = inject(train_step, substitution, schedule, regions=regions)
        fired = bool(schedule(step))
    else:
        fn, fired = substitute(train_step, {}, regions=regions), False
    traced, _ = fn.prepare((state, batch), {})

    def rules_for(traced, chosen):
        active = (make_rules(traced, chosen, lambda site: None, step_fault_key(step))
                  if fired else {})
        # a region is watched through the sites inside it, unless the candidate replaces it
        return {s.index: _watching(s, active.get(s.index)) for s in traced.sites
                if not s.composite or s.index in active}

    replay = jax.jit(lambda state, batch: fn.evaluate((state, batch), {}, rules_for,
                                                      with_sides=True)[1])
    found = _first_bad(jax.device_get(replay(state, batch)), traced)
    if found is None:
        return None
    site, iteration = found
    return NanOrigin(step=int(step), site=site.index, phase=site.phase, primitive=site.primitive,
                     path=site.path, iteration=iteration, fired=fired)


def golden_nan_origin(run_dir: PathLike, *,
                      workload: Optional[Workload] = None) -> Optional[NanOrigin]:
    """Where the golden run in `run_dir` first went non-finite: from the latest checkpoint
    whose state is finite and that precedes the first non-finite loss, the plain steps are
    re-run until one's loss or new state is non-finite, and that step is replayed with every
    site watched (`step_nan_origin`).

    Returns:
      The `NanOrigin`, or None when every golden loss is finite (or no site's output was
      non-finite at that step).
    """
    rd = RunDir(run_dir)
    m = rd.manifest()
    wl = load_workload(m, workload)
    losses = np.asarray(rd.golden_losses(), np.float64)
    bad = np.flatnonzero(~np.isfinite(losses))
    if not bad.size:
        return None
    first = int(bad[0])
    state, start = None, None
    with quiet():
        for c in sorted((c for c in available_checkpoints(rd) if c <= first), reverse=True):
            state = restore(rd.path, c, workload=wl)
            if all_finite(state):
                start = c
                break
    if start is None:
        raise PeatError(f"no checkpoint in {rd.checkpoints} at or before step {first} (the first "
                        "non-finite golden loss) holds a finite state; the NaN's origin cannot be "
                        "replayed")
    step_fn = jax.jit(wl.train_step)
    for i in range(start, first + 1):
        batch = to_device(wl.batch(i))
        new, metrics = step_fn(state, batch)
        if not np.isfinite(scalar_metrics(metrics)["loss"]) or not all_finite(new):
            return step_nan_origin(wl.train_step, state, batch, i)
        state = new
    return None
