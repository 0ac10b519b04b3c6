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

Where the values blew up: a fault that makes a huge but finite value (an exponent bit flipped in a
matmul's output) is often first non-finite several sites later (the square in a layer norm's
variance overflows). So the same replay also records the abs-max of each site's output (its first
non-empty real floating-point one, the output the site statistics record), and `NanOrigin.blew_up`
names the first site, in the same order, before the first non-finite one whose output left the
range it is judged against (`BlowUp`):

  - the golden run's: where the run directory has site statistics for the site (same index,
    primitive and path, a floating-point output, a finite non-zero abs-max at some recorded step),
    out of range is abs-max > `GOLDEN_FACTOR` x the largest finite abs-max the golden run recorded
    there (over its recorded steps; for `golden_nan_origin`, those before the replayed step);
  - else the step's own: abs-max > `STEP_FACTOR` x max(1, the site's reduction length) x the
    largest abs-max of the step's floating-point inputs (state and batch) and of the outputs of
    every site that ran before it.

`blew_up` is None when no output left its range before the first non-finite one: the value went
non-finite where it blew up (a fault that writes NaN or inf directly), and `site` says where.
The abs-maxes come out of the one replay that finds the NaN (which runs only once a step was seen
non-finite); the steps of the run themselves compute nothing more.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src import _interpreter
from peat_jax._src.errors import PeatError
from peat_jax._src.formats import is_inexact
from peat_jax._src.profiler.golden import (available_checkpoints, load_workload, restore,
                                           scalar_metrics)
from peat_jax._src.profiler.hostio import quiet, to_device
from peat_jax._src.profiler.rundir import PathLike, RunDir
from peat_jax._src.profiler.site_stats import read_sites, read_step, recorded_steps
from peat_jax._src.profiler.workload import Workload
from peat_jax._src.schedule import Schedule, inject, step_fault_key
from peat_jax._src.sites import Site, reduction_length
from peat_jax._src.substitute import Substitution, make_rules, substitute


GOLDEN_FACTOR = 2.0 ** 8
"""A site's output left the golden run's range when its abs-max exceeds this many times the
largest the golden run recorded at that site (over its recorded steps). 8 binades: the replayed
step's state is not the golden's (earlier firings and their effect on training moved it), and a
site's abs-max drifts by a few binades over training, far less than 8; setting an exponent bit
from bit 27 up multiplies a float32 by 2^16 to 2^128, far more."""

STEP_FACTOR = 2.0 ** 16
"""Without golden statistics for a site, its output blew up when its abs-max exceeds this many
times max(1, its reduction length) times the largest abs-max of the step's inputs and of the
outputs of the sites that ran before it. Coarser than `GOLDEN_FACTOR`, since an op may rightly
grow its inputs: a sum by up to its reduction length (allowed for), a product of two values by
the larger of them (within 2^16 while values stay under 65536), exp by e^x (within 2^16 up to
x = 14). The exponent flips that make a finite value huge (bits 28 to 30 of a float32: 2^32 to
2^128) still exceed it."""


class SiteRange(NamedTuple):
    """What the golden run recorded at one site: its primitive and path (to check that a replayed
    site is the same one) and the largest finite abs-max of its output over the steps read."""

    primitive: str
    path: str
    absmax: float


@dataclasses.dataclass(frozen=True)
class BlowUp:
    """The first site whose output left its range, before the first non-finite output.

    Attributes:
      site, phase, primitive, path, iteration: the site's, as in `NanOrigin`.
      absmax: the largest |x| of its output (finite).
      reference: the abs-max it was judged against: the golden run's at the site
        (`against="golden"`), or the largest of the step's inputs and earlier sites'
        (`against="step"`).
      limit: the bound it exceeded: `GOLDEN_FACTOR` x reference, or `STEP_FACTOR` x max(1,
        reduction length) x reference.
      against: "golden" or "step".
    """

    site: int
    phase: str
    primitive: str
    path: str
    iteration: tuple[int, ...] = ()
    absmax: float = 0.0
    reference: float = 0.0
    limit: float = 0.0
    against: str = "golden"

    def __str__(self) -> str:
        where = f" (iteration {', '.join(map(str, self.iteration))})" if self.iteration else ""
        ref = ("the golden run's" if self.against == "golden"
               else "the largest in the step before it,")
        return (f"site #{self.site} {self.phase} {self.primitive} @ {self.path or '<top>'}{where}: "
                f"abs-max {self.absmax:.3g}, {ref} {self.reference:.3g}")

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> Optional["BlowUp"]:
        """The record `dataclasses.asdict` made (None stays None)."""
        if d is None:
            return None
        return cls(**{**d, "iteration": tuple(d.get("iteration", ()))})


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
      blew_up: the first site before it whose output, still finite, left its range (`BlowUp`;
        the module docstring gives the rule), or None when none did (the value went non-finite
        where it blew up) or the record predates it.
    """

    step: int
    site: int
    phase: str
    primitive: str
    path: str
    iteration: tuple[int, ...] = ()
    fired: bool = False
    blew_up: Optional[BlowUp] = None

    def __str__(self) -> str:
        """One line: `step 4, site #13 fwd reduce_sum @ LN; blew up at site #12 fwd dot_general
        @ Dense: abs-max 1.7e+38, the golden run's 3.2`."""
        where = f" (iteration {', '.join(map(str, self.iteration))})" if self.iteration else ""
        blew = f"; blew up at {self.blew_up}" if self.blew_up is not None else ""
        return (f"step {self.step}, site #{self.site} {self.phase} {self.primitive} @ "
                f"{self.path or '<top>'}{where}{blew}")

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> Optional["NanOrigin"]:
        """The record `dataclasses.asdict` made (None stays None; a record without `blew_up`
        reads as None)."""
        if d is None:
            return None
        return cls(**{**d, "iteration": tuple(d.get("iteration", ())),
                      "blew_up": BlowUp.from_dict(d.get("blew_up"))})


def tree_finite(tree) -> jax.Array:
    """A bool scalar array: every floating-point leaf of `tree` is finite everywhere (traceable:
    a step folds it into its own program, so reading it costs no program of its own)."""
    leaves = [x for x in jax.tree.leaves(tree) if is_inexact(x)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.ones((), bool)]))


_finite = jax.jit(tree_finite)


def all_finite(tree) -> bool:
    """Whether every floating-point leaf of `tree` is finite everywhere (on the host)."""
    return bool(_finite(tree))


def _judged_output(outs) -> Optional[Any]:
    """The output whose abs-max is judged: the first non-empty real floating-point one (the one
    the site statistics record), or None."""
    for o in outs:
        dtype = getattr(o, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jnp.floating) and o.size:
            return o
    return None


def _watching(site: Site, rule) -> Any:
    """A rule for `site` that computes what `rule` does (the reference when None) and returns,
    as its side, whether any floating-point output was non-finite and the abs-max of its judged
    output (0 without one), both stacked, not reduced, over the iterations of enclosing scans."""
    def watch(op, invals, reference):
        outs = list(rule(op, invals, reference) if rule is not None else reference(*invals))
        bad = jnp.zeros((), bool)
        for o in outs:
            if is_inexact(o):
                bad = bad | ~jnp.all(jnp.isfinite(o))
        judged = _judged_output(outs)
        top = (jnp.zeros((), jnp.float32) if judged is None
               else jnp.max(jnp.abs(judged)).astype(jnp.float32))
        return _interpreter.WithSide(outs, (bad, top), lambda stacked: stacked)

    return watch


def _inputs_absmax(tree) -> jax.Array:
    """The largest |x| over the floating-point leaves of `tree` (0 without any)."""
    tops = [jnp.max(jnp.abs(x)).astype(jnp.float32) for x in jax.tree.leaves(tree)
            if _judged_output([x]) is not None]
    return jnp.max(jnp.stack(tops)) if tops else jnp.zeros((), jnp.float32)


class _Run(NamedTuple):
    """One execution of a watched site: its place in execution order, the site, the scan
    iterations it ran in, whether an output was non-finite, and its judged output's abs-max."""

    key: tuple[int, ...]
    site: int
    iteration: tuple[int, ...]
    bad: bool
    absmax: float


def _executions_in_order(sides: Mapping[int, Any], traced) -> list[_Run]:
    """Every execution of a watched site, in the order they ran: site index order with the
    iterations of a scan unrolled in the order the scan runs them."""
    loops = {op.index: op.loops for op in traced.program.ops()}
    runs = []
    for idx, (mask, top) in sides.items():
        mask, top = np.asarray(mask), np.asarray(top)
        for where in np.ndindex(mask.shape):
            ran = tuple(int(L.length - 1 - i if L.reverse else i)
                        for L, i in zip(loops[idx], where))
            key = tuple(itertools.chain.from_iterable(
                (L.base, r) for L, r in zip(loops[idx], ran))) + (idx,)
            runs.append(_Run(key, idx, ran, bool(mask[where]), float(top[where])))
    return sorted(runs, key=lambda r: r.key)


def _blew_up(runs: Sequence[_Run], traced, inputs_absmax: float,
             golden: Mapping[int, SiteRange]) -> Optional[BlowUp]:
    """The first of `runs` (in order, before the first non-finite one) whose abs-max left its
    range (the module docstring's rule), or None."""
    high = float(inputs_absmax)  # the largest abs-max so far: the inputs', then every output's
    for run in runs:
        if run.bad:
            return None
        site = traced.sites[run.site]
        g = golden.get(run.site)
        if (g is not None and (g.primitive, g.path) == (site.primitive, site.path)
                and np.isfinite(g.absmax) and g.absmax > 0):
            reference, limit, against = g.absmax, GOLDEN_FACTOR * g.absmax, "golden"
        else:
            reference, against = high, "step"
            limit = STEP_FACTOR * max(1, reduction_length(site) or 1) * high
        if reference > 0 and run.absmax > limit:
            return BlowUp(site=site.index, phase=site.phase, primitive=site.primitive,
                          path=site.path, iteration=run.iteration, absmax=run.absmax,
                          reference=float(reference), limit=float(limit), against=against)
        high = max(high, run.absmax)
    return None


def golden_absmax(run_dir: PathLike, *, before: Optional[int] = None) -> dict[int, SiteRange]:
    """The range the golden run in `run_dir` recorded at each site: {site index: `SiteRange`}
    from its site statistics (`profile(stats_every=K)`), the largest finite abs-max of the
    site's output over the recorded steps (those before step `before` when given), for the
    sites whose recorded output is floating-point and reached a non-zero abs-max. Empty when
    the run recorded no site statistics (or no step before `before`)."""
    directory = RunDir(run_dir).site_stats
    if not (directory / "sites.json").exists():
        return {}
    sites = [s for s in read_sites(directory) if s.recorded]
    steps = [t for t in recorded_steps(directory) if before is None or t < before]
    if not steps or not sites:
        return {}
    tops = np.stack([np.asarray(read_step(directory, t)["absmax"], np.float64) for t in steps])
    if tops.shape[1] != len(sites):
        raise PeatError(f"{directory} holds statistics of {tops.shape[1]} sites where sites.json "
                        f"records {len(sites)}: it is damaged; profile the run again into a new "
                        "directory")
    best = np.max(np.where(np.isfinite(tops), tops, 0.0), axis=0)
    return {s.index: SiteRange(s.primitive, s.path, float(b)) for s, b in zip(sites, best)
            if _floating_name(s.dtype) and b > 0}


def _floating_name(dtype: str) -> bool:
    try:
        return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))
    except TypeError:
        return False


def step_nan_origin(train_step, state, batch, step: int, *,
                    substitution: Optional[Substitution] = None,
                    schedule: Optional[Schedule] = None,
                    regions: Sequence[type] = (),
                    golden: Optional[Mapping[int, SiteRange]] = None) -> Optional[NanOrigin]:
    """Replay `train_step(state, batch)` as step `step` of a run (with `substitution` active if
    `schedule` fires at `step`, its faults keyed by the step as `peat.inject` keys them) with
    every site watched.

    `golden`: the golden run's range at each site (`golden_absmax`), to judge where the values
    blew up; a site it lacks is judged against the step's own earlier sites (the module
    docstring gives the rule).

    Returns:
      The `NanOrigin` of the site that ran first among those whose output was non-finite (its
      `blew_up`: the first site before it whose output left its range, or None), or None when no
      watched site's output was (the value was born outside the sites: in plain arithmetic, or
      in the input state).
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

    replay = jax.jit(lambda state, batch: (
        fn.evaluate((state, batch), {}, rules_for, with_sides=True)[1],
        _inputs_absmax((state, batch))))
    sides, inputs_absmax = jax.device_get(replay(state, batch))
    runs = _executions_in_order(sides, traced)
    first = next((r for r in runs if r.bad), None)
    if first is None:
        return None
    site = traced.sites[first.site]
    return NanOrigin(step=int(step), site=site.index, phase=site.phase, primitive=site.primitive,
                     path=site.path, iteration=first.iteration, fired=fired,
                     blew_up=_blew_up(runs, traced, float(inputs_absmax), golden or {}))


def golden_nan_origin(run_dir: PathLike, *,
                      workload: Optional[Workload] = None) -> Optional[NanOrigin]:
    """Where the golden run in `run_dir` first went non-finite: from the latest checkpoint
    whose state is finite and that precedes the first non-finite loss, the plain steps are
    re-run until one's loss or new state is non-finite, and that step is replayed with every
    site watched (`step_nan_origin`).

    Returns:
      The `NanOrigin`, or None when every golden loss is finite (or no site's output was
      non-finite at that step). Its `blew_up` is judged against the site statistics the run
      recorded before that step, where it has them.
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
            return step_nan_origin(wl.train_step, state, batch, i,
                                   golden=golden_absmax(rd.path, before=i))
        state = new
    return None
