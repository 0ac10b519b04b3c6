"""The effect of a candidate on one replayed training step, in training terms.

Playback replays step c from its checkpoint twice: as the golden does it, and with the
candidate at one site. The effect compares what the step produced (its loss and metrics, and
its new params, or its new state where there is no ``params`` entry), leaf by leaf:

  * change: a leaf's largest difference relative to its own scale, ``max|got - golden| /
    max|golden|``;
  * noise: what the golden itself allows on that leaf, the largest of `ROUNDING_ULPS` ULPs of
    the leaf's dtype (relative), `REFERENCE_SPREAD_FACTOR` times the reference's own
    run-to-run change (0 for a deterministic reference) and `PSEUDO_FACTOR` times the
    leaf's spread under a rounding pseudo-error at the same site (below);
  * a leaf *moved* when its change exceeds its noise; ``noise_ratio`` is change / noise.

The rounding pseudo-error. On a deterministic backend the golden's own noise is 0, yet a correct
kernel computed another way (another summation order, FMA, a 1-ULP transcendental) changes the
step: Adam's normalisation turns a 1-ULP change of a near-zero gradient into a full-sized change
of its update. What such a kernel may do to the step is measured, not assumed: the golden step
is replayed (on the cell's own compiled executable, the sample number traced) with the site's
reference output perturbed within its rounding floor, every float element ``x`` of every output
made ``x + m * rho * d`` (`pseudo_error`): ``d`` uniform in [-1, 1) from a counter-based hash of
the element's index and a seed per sample, site and output (`pseudo_seed`; a few integer
operations per element, fused into the step, where a random key's generator would double the
replay's compilation time), ``m`` the larger of ``|x|`` and the rms of its row (a sum rounds at
the scale of what it summed; an exact zero stays exact), and ``rho = pseudo_error_size(site)`` =
2 u sqrt(K), ``u`` the unit roundoff of the output's dtype (so 2 u is one ULP at 1: a
transcendental within an ULP) and ``K`` the length the op reduces (a matmul's contraction, a
reduction's extent, a convolution's window; a region's last input axis; 1 for an element-wise
op), since a reordered sum's rounding grows as sqrt(K) u (the probabilistic bound). A leaf's
*spread* is its largest change (the measure above) over `PSEUDO_SAMPLES` such replays; the
candidate's step is judged against `PSEUDO_FACTOR` times it. Samples run only for a cell whose
step moved beyond the other noise, and stop as soon as the candidate's step is within the noise
of the samples run so far (more samples only widen the spread, so the verdict is that of all of
them).

For a state leaf the golden's update ``u = golden - before`` and the candidate's ``v = got -
before`` give how much the step's update changed (``||got - golden|| / ||u||``) and the least
squares factor ``k = <v, u> / <u, u>`` with its residual ``||v - k u|| / ||v||``.

The effect's name (`peat_jax._src.taxonomy.STEP_EFFECTS`), by these sufficient conditions, the first
that holds:
  * ``nan_inf``: a leaf of the candidate's step has a non-finite value where the golden's is
    finite;
  * ``masked``: no leaf moved;
  * ``sign_reversed`` / ``update_scaled``: only state leaves moved (loss and metrics within
    noise), each with a residual <= `FIT_TOLERANCE`, and their factors agree within
    `FIT_TOLERANCE` (relative): ``sign_reversed`` when that factor is within `FIT_TOLERANCE`
    of -1, ``update_scaled`` (factor reported) when it is at least `FIT_TOLERANCE` from 1;
  * ``perturbed``: otherwise.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src import formats, taxonomy
from peat_jax._src.counter_random import mix32, uniforms32
from peat_jax._src.judge.reference_spread import REFERENCE_SPREAD_FACTOR


ROUNDING_ULPS = 4.0
"""A leaf's change within this many ULPs of its dtype (relative to its scale) is rounding."""

PSEUDO_SAMPLES = 3
"""At most this many rounding pseudo-errors per cell (CADNA's three samples)."""

PSEUDO_FACTOR = 4.0
"""A leaf moved when its change exceeds this many times its spread under the rounding
pseudo-error (the detector's factor F on its noise floor)."""

PSEUDO_SEED = 0x5EA7
"""The pseudo-errors' seeds start from this (`pseudo_seed`)."""

FIT_TOLERANCE = 0.05
"""Relative tolerance of the update fits (``sign_reversed``, ``update_scaled``): the new state
is rounded to its own grid, so a small update is measured with a relative error of
ULP(param) / |update|."""


@dataclasses.dataclass(frozen=True)
class Effect:
    """What a candidate at one site did to one replayed training step.

    Attributes:
      model: the effect's name, one of `peat_jax._src.taxonomy.EFFECTS` (``masked``, ...).
      passed: True for ``masked``.
      summary: one line saying what changed and by how much.
      moved: paths (``params/Dense_0/kernel``, ``loss``, ``metrics/accuracy``) of the leaves
        whose change exceeds their noise, most-moved first.
      nonfinite: paths of the leaves with a non-finite value where the golden's is finite.
      leaf: the leaf with the largest change against its noise ("" when nothing differs).
      noise_ratio: that leaf's change / its noise ("x times the noise"; inf for a non-finite
        value, 0.0 when bitwise equal).
      change: that leaf's ``max|got - golden| / max|golden|``.
      noise: that leaf's noise, relative to its scale like `change`.
      reference_spread: that leaf's run-to-run change between golden replays (0.0: the
        reference is deterministic).
      pseudo_spread: that leaf's spread under the rounding pseudo-error at the site (its
        largest change over `pseudo_samples` replays; 0.0 when none ran or none moved it).
      pseudo_samples: rounding pseudo-errors replayed for the cell (0: the step moved
        nothing beyond the other noise, so none was needed).
      update_change: for a state leaf, ``||got - golden|| / ||golden - before||`` (1.0: the
        step's update changed by as much as the update itself); None otherwise.
      update_factor: the common factor of the moved leaves' updates for ``update_scaled`` /
        ``sign_reversed``; None otherwise.
      loss: (golden, with candidate) loss of the step.
      metrics: the step's other metrics, name -> (golden, with candidate).
    """

    model: str
    passed: bool
    summary: str
    moved: tuple[str, ...] = ()
    nonfinite: tuple[str, ...] = ()
    leaf: str = ""
    noise_ratio: float = 0.0
    change: float = 0.0
    noise: float = 0.0
    reference_spread: float = 0.0
    pseudo_spread: float = 0.0
    pseudo_samples: int = 0
    update_change: Optional[float] = None
    update_factor: Optional[float] = None
    loss: tuple[float, float] = (math.nan, math.nan)
    metrics: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (one line of results.jsonl's ``effect``)."""
        d = dataclasses.asdict(self)
        d.update(moved=list(self.moved), nonfinite=list(self.nonfinite), loss=list(self.loss),
                 metrics={k: list(v) for k, v in self.metrics.items()})
        return d

    def short(self) -> str:
        """A table cell's worth: ``masked``, or the name, the most-moved leaf and how far, and
        the loss where it changed (``perturbed: params/head/kernel 37x noise; loss 2.301 ->
        2.304``)."""
        if self.passed or not self.leaf:
            return self.model
        head = f"{self.model} x{self.update_factor:.3g}" if self.model == "update_scaled" \
            else self.model
        where = (self.nonfinite[0] if self.nonfinite
                 else f"{self.leaf} {self.noise_ratio:.2g}x noise")
        loss = f"; loss {self.loss[0]:.4g} -> {self.loss[1]:.4g}" if self.loss[0] != self.loss[1] \
            else ""
        return f"{head}: {where}{loss}"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Effect":
        """The Effect of `to_dict`'s output."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw.update(moved=tuple(d.get("moved", ())), nonfinite=tuple(d.get("nonfinite", ())),
                  loss=tuple(d.get("loss", (math.nan,) * 2)),
                  metrics={k: tuple(v) for k, v in (d.get("metrics") or {}).items()})
        return cls(**kw)


def effect_tree(state, metrics) -> dict:
    """What the effect compares of a step's `(new state, metrics)`: ``loss``, the other
    ``metrics``, and ``params`` (or the whole ``state`` where it has no ``params`` entry)."""
    out = {"loss": metrics["loss"], "metrics": {k: v for k, v in metrics.items() if k != "loss"}}
    out.update(state_part(state))
    return out


def state_part(state) -> dict:
    """The state leaves the effect follows: ``{"params": ...}``, or ``{"state": state}``."""
    if isinstance(state, dict) and "params" in state:
        return {"params": state["params"]}
    return {"state": state}


@jax.jit
def _changes(got, golden):
    """Per leaf, a float32 pair: (max |got - golden| / max(max |golden|, tiny), 1.0 where the
    candidate has a non-finite value where the golden's is finite), NaN-aware (change inf when
    the non-finite pattern differs)."""
    def one(c, g):
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            return jnp.stack([jnp.where(jnp.all(c == g), 0.0, jnp.inf), 0.0]).astype(jnp.float32)
        ft = jnp.promote_types(g.dtype, jnp.float32)  # float64 leaves measured as such
        c32, g32 = c.astype(ft), g.astype(ft)
        new_bad = jnp.any(~jnp.isfinite(c32) & jnp.isfinite(g32))
        d = jnp.where(jnp.isnan(c32) & jnp.isnan(g32), 0.0, jnp.abs(c32 - g32))
        d = jnp.where(jnp.isnan(d), jnp.inf, d)
        scale = jnp.maximum(jnp.max(jnp.where(jnp.isfinite(g32), jnp.abs(g32), 0.0)), 1e-30)
        change = jnp.max(d) / scale if d.size else jnp.float32(0)
        return jnp.stack([change.astype(jnp.float32), new_bad.astype(jnp.float32)])
    return jax.tree.map(one, got, golden)


@jax.jit
def _update_fits(got, golden, before):
    """Per state leaf, a float32 triple: (update change ||got - golden|| / ||u||, factor
    k = <v, u> / <u, u>, residual ||v - k u|| / ||v||) with u = golden - before and
    v = got - before (NaN for a leaf that is not a float)."""
    def one(c, g, b):
        if not jnp.issubdtype(g.dtype, jnp.floating) or not g.size:
            return jnp.full((3,), jnp.nan, jnp.float32)
        u, v = g.astype(jnp.float32) - b, c.astype(jnp.float32) - b
        s = jnp.maximum(jnp.maximum(jnp.max(jnp.abs(u)), jnp.max(jnp.abs(v))), 1e-30)
        u, v = u / s, v / s  # no overflow in the sums of squares
        uu = jnp.sum(u * u)
        k = jnp.sum(v * u) / uu
        resid = jnp.sqrt(jnp.sum((v - k * u) ** 2) / jnp.maximum(jnp.sum(v * v), 1e-30))
        return jnp.stack([jnp.sqrt(jnp.sum((v - u) ** 2) / uu), k, resid])
    return jax.tree.map(one, got, golden, before)


def _named(tree) -> dict[str, Any]:
    """The leaves of `tree` by path name (``params/Dense_0/kernel``), on the host."""
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return {_path_name(p): v for p, v in flat}


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def reference_spread(replay: Callable[[], tuple], golden) -> Any:
    """Per effect leaf (`effect_tree`), the largest relative change between golden replays of
    the step (floats on the host): all 0.0 for a deterministic reference (two replays agree
    bitwise); otherwise the maximum over three replays' pairs, a steadier estimate of the
    reference's own spread. `replay()` runs the golden step again; `golden` is its first
    `(new state, metrics)`."""
    def rel(a, b):
        return jax.tree.map(lambda x: float(x[0]), jax.device_get(_changes(a, b)))

    g = effect_tree(*golden[:2])
    runs = [effect_tree(*replay()[:2])]
    first = rel(runs[0], g)
    if not any(v > 0 for v in jax.tree.leaves(first)):
        return first
    runs.append(effect_tree(*replay()[:2]))
    return jax.tree.map(max, first, rel(runs[1], g), rel(runs[1], runs[0]))


def step_changes(golden, got) -> dict[str, tuple[float, bool]]:
    """Per effect leaf (`effect_tree`) by path: ``(change, new non-finite)`` of the step `got`
    against the step `golden` (each `(new state, metrics)`): the leaf's ``max|got - golden| /
    max|golden|`` (inf where the non-finite pattern differs) and whether `got` has a
    non-finite value where the golden's is finite."""
    return {p: (float(v[0]), bool(v[1])) for p, v in
            _named(_changes(effect_tree(*got[:2]), effect_tree(*golden[:2]))).items()}


class PseudoSpread:
    """A step's spread under rounding pseudo-errors at one site, gathered sample by sample.

    Attributes:
      spread: effect leaf path -> its largest finite change over the samples added (a leaf
        a sample made non-finite is not excused by it: a candidate doing the same is
        ``nan_inf``).
      samples: samples added.
      error: why the samples could not be run ("" when they could).
    """

    def __init__(self) -> None:
        self.spread: dict[str, float] = {}
        self.samples = 0
        self.error = ""

    def add(self, changes: Mapping[str, tuple[float, bool]]) -> None:
        """Add one sample's `step_changes` against the golden step."""
        for path, (change, _) in changes.items():
            if math.isfinite(change):
                self.spread[path] = max(self.spread.get(path, 0.0), change)
        self.samples += 1


def pseudo_error_size(site) -> float:
    """``rho``: the largest relative change the rounding pseudo-error makes to an element of
    the output of `site` (`peat.Site`), ``2 u sqrt(K)``: ``u`` the unit roundoff of the site's
    first float output dtype and ``K`` the length the op reduces (`sites.reduction_length`;
    a composite site's first input's last axis; 1 otherwise). See the module's docstring."""
    from peat_jax._src.sites import reduction_length
    dtype = next((d for d in site.out_dtypes if jnp.issubdtype(d, jnp.inexact)), jnp.float32)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        dtype = jnp.finfo(dtype).dtype
    k = reduction_length(site) if not site.composite else (
        site.in_shapes[0][-1] if site.in_shapes and site.in_shapes[0] else None)
    return formats.float_format(dtype).eps * math.sqrt(max(int(k or 1), 1))


def pseudo_seed(sample, site_index, output=0) -> jax.Array:
    """The uint32 seed of rounding pseudo-error number `sample` at output `output` of site
    `site_index` (each may be traced): `PSEUDO_SEED`, `sample`, `site_index` and `output`
    mixed in turn by MurmurHash3's finaliser."""
    h = jnp.uint32(PSEUDO_SEED)
    for v in (sample, site_index, output):
        h = mix32(h ^ jnp.asarray(v).astype(jnp.uint32))
    return h


def pseudo_error(x: jax.Array, seed, rho: float) -> jax.Array:
    """`x` with each element moved within its rounding floor: ``x + m * rho * d``, ``d``
    uniform in [-1, 1) (on a grid of 2^-23) from the hash of the element's flat index and the
    uint32 `seed` (`pseudo_seed`), and ``m`` the larger of ``|x|`` and the rms of its row (the
    last axis): the scale a reordered sum rounds at, so an element that cancelled to near
    zero moves like its row's others. Computed in at least float32 and rounded back to `x`'s
    dtype; an exact zero, a non-finite element and a non-float `x` are left as they are.
    Jittable; a few integer operations per element and one reduction per row."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or not x.size:
        return x
    ft = jnp.promote_types(x.dtype, jnp.float32)
    d = uniforms32(seed, x.shape, ft)
    xf = x.astype(ft)
    finite = jnp.isfinite(xf)
    magnitude = jnp.abs(jnp.where(finite, xf, 0))
    # a reordered sum rounds at the scale of what it summed: an element that cancelled to
    # near zero moves like its row's typical element (the rms along the last axis), not
    # relative to its own small value; an exact zero (nothing summed) stays exact
    row = _row_rms(magnitude) if x.ndim else magnitude
    scale = jnp.where(xf == 0, 0, jnp.maximum(magnitude, row))
    return jnp.where(finite, xf + scale * (jnp.asarray(rho, ft) * d), xf).astype(x.dtype)



def _row_rms(magnitude: jax.Array) -> jax.Array:
    """The rms of the finite, non-negative `magnitude` along its last axis (kept), as the row's
    largest element times the rms of the row over it: no square overflows (a row holding
    1e20 has a finite rms in float32) or vanishes below the smallest normal."""
    top = jnp.max(magnitude, axis=-1, keepdims=True)
    unit = magnitude / jnp.where(top > 0, top, 1)
    return top * jnp.sqrt(jnp.mean(unit * unit, axis=-1, keepdims=True))


def _noise(eps: Mapping[str, float], spreads: Mapping[str, float],
           pseudo: Optional[PseudoSpread]) -> dict[str, float]:
    got = pseudo.spread if pseudo is not None else {}
    return {p: max(REFERENCE_SPREAD_FACTOR * spreads.get(p, 0.0),
                   PSEUDO_FACTOR * got.get(p, 0.0), ROUNDING_ULPS * e) for p, e in eps.items()}


def _leaf_eps(golden) -> dict[str, float]:
    return _named(jax.tree.map(_eps, effect_tree(*golden[:2])))


def _spreads(ref_spread) -> dict[str, float]:
    return {p: float(v) for p, v in _named(ref_spread).items()} if ref_spread else {}


def moved_leaves(golden, changes: Mapping[str, tuple[float, bool]], ref_spread=None,
                 pseudo: Optional[PseudoSpread] = None) -> tuple[str, ...]:
    """The paths of the leaves whose `changes` (`step_changes` against the step `golden`)
    exceed their noise (the dtype's rounding, `ref_spread`, `pseudo`): () when every leaf
    is within it (the step is ``masked``)."""
    noise = _noise(_leaf_eps(golden), _spreads(ref_spread), pseudo)
    return tuple(p for p, (c, _) in changes.items() if _ratio(c, noise[p]) > 1.0)


def diagnose_effect(golden, got, ref_spread=None, before=None,
                    pseudo: Optional[PseudoSpread] = None,
                    changes: Optional[Mapping[str, tuple[float, bool]]] = None) -> Effect:
    """The effect of a step with the candidate, `got` = (new state, metrics), against the
    golden step's `golden` = (new state, metrics).

    Args:
      golden, got: the golden's and the candidate's `(new state, metrics)` of the same step.
      ref_spread: `reference_spread` of the step (None: a deterministic reference).
      before: the state the step started from (for the update measures; None: without them).
      pseudo: the step's `PseudoSpread` under rounding pseudo-errors at the candidate's site
        (None: none ran; the noise is then the dtype's rounding and `ref_spread`).
      changes: `step_changes(golden, got)`, when already computed.

    Returns:
      An `Effect` named by the sufficient conditions in this module's docstring.
    """
    (gs, gm), (cs, cm) = golden[:2], got[:2]
    if changes is None:
        changes = step_changes((gs, gm), (cs, cm))
    spreads = _spreads(ref_spread)
    noise = _noise(_leaf_eps((gs, gm)), spreads, pseudo)
    pspread = pseudo.spread if pseudo is not None else {}
    ratio = {p: _ratio(float(v[0]), noise[p]) for p, v in changes.items()}
    moved = tuple(sorted((p for p in ratio if ratio[p] > 1.0), key=lambda p: -ratio[p]))
    nonfinite = tuple(p for p in moved if changes[p][1])
    fits = {} if before is None else {p: tuple(float(x) for x in v) for p, v in _named(
        _update_fits(state_part(cs), state_part(gs), state_part(before))).items()}
    name, factor = _name(moved, nonfinite, fits)
    top = max(ratio, key=ratio.__getitem__) if any(r > 0 for r in ratio.values()) else ""
    update_change = fits.get(top, (math.nan,))[0]
    e = Effect(model=name, passed=taxonomy.EFFECT_BY_NAME[name].passes, summary="",
               moved=moved, nonfinite=nonfinite, leaf=top, noise_ratio=ratio.get(top, 0.0),
               change=float(changes[top][0]) if top else 0.0, noise=noise.get(top, 0.0),
               reference_spread=spreads.get(top, 0.0),
               pseudo_spread=pspread.get(top, 0.0),
               pseudo_samples=pseudo.samples if pseudo is not None else 0,
               update_change=None if math.isnan(update_change) else update_change,
               update_factor=factor, loss=(float(gm["loss"]), float(cm["loss"])),
               metrics={k: (float(gm[k]), float(cm[k])) for k in gm
                        if k != "loss" and np.ndim(gm[k]) == 0})
    summary = _summary(e)
    if pseudo is not None and pseudo.error:
        summary += f" (no rounding pseudo-error: {pseudo.error})"
    return dataclasses.replace(e, summary=summary)


def _eps(leaf) -> float:
    """The relative rounding unit of `leaf`'s dtype (0.0 for a leaf that is not a float)."""
    dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
    if jnp.issubdtype(dtype, jnp.complexfloating):
        dtype = jnp.finfo(dtype).dtype
    return formats.float_format(dtype).eps if jnp.issubdtype(dtype, jnp.floating) else 0.0


def _ratio(change: float, noise: float) -> float:
    if change == 0.0:
        return 0.0
    return change / noise if noise > 0 else math.inf


def _name(moved: tuple[str, ...], nonfinite: tuple[str, ...],
          fits: Mapping[str, tuple[float, ...]]) -> tuple[str, Optional[float]]:
    """The effect's name by the module's sufficient conditions, and the update factor (None
    unless ``update_scaled`` / ``sign_reversed``)."""
    if nonfinite:
        return "nan_inf", None
    if not moved:
        return "masked", None
    if any(p not in fits or not fits[p][2] <= FIT_TOLERANCE for p in moved):
        return "perturbed", None
    ks = [fits[p][1] for p in moved]
    k = float(np.median(ks))
    if any(abs(x - k) > FIT_TOLERANCE * max(1.0, abs(k)) for x in ks):
        return "perturbed", None
    if abs(k + 1.0) <= FIT_TOLERANCE:
        return "sign_reversed", k
    if abs(k - 1.0) >= FIT_TOLERANCE:
        return "update_scaled", k
    return "perturbed", None


def _samples(n: int) -> str:
    return f"{n} sample{'s' if n != 1 else ''}"


def _noise_source(e: Effect) -> str:
    """What set the top leaf's noise, for a masked step's summary (a nondeterministic
    reference is named whenever it spread on the leaf)."""
    if e.reference_spread > 0 and REFERENCE_SPREAD_FACTOR * e.reference_spread >= e.noise:
        return " (the reference's own run-to-run change)"
    if e.pseudo_spread > 0 and PSEUDO_FACTOR * e.pseudo_spread >= e.noise:
        return (f" ({PSEUDO_FACTOR:g}x its spread under a rounding pseudo-error at the site, "
                f"{_samples(e.pseudo_samples)})")
    if e.reference_spread > 0:
        return " (its dtype's rounding, above the reference's own run-to-run change)"
    return ""


def _past_pseudo(e: Effect) -> str:
    """How far past the rounding pseudo-error the top leaf went, for a moved step."""
    if e.pseudo_spread > 0:
        return (f" ({e.change / e.pseudo_spread:.3g}x the rounding pseudo-error's spread, "
                f"{_samples(e.pseudo_samples)})")
    if e.pseudo_samples:
        return f" (the rounding pseudo-error did not move it, {_samples(e.pseudo_samples)})"
    return ""


def _summary(e: Effect) -> str:
    """One line: the name, what moved and how much, the loss golden -> with candidate."""
    loss = f"loss {e.loss[0]:.6g} -> {e.loss[1]:.6g}"
    metrics = "".join(f", {k} {g:.4g} -> {c:.4g}" for k, (g, c) in e.metrics.items() if g != c)
    if e.model == "nan_inf":
        n = len(e.nonfinite)
        bad = ", ".join(e.nonfinite[:3]) + (f" and {n - 3} more" if n > 3 else "")
        return f"nan_inf: non-finite values where the golden's are finite ({bad}); {loss}"
    if e.model == "masked":
        largest = (f"; largest {e.leaf} at {e.noise_ratio:.2g}x its noise{_noise_source(e)}"
                   if e.leaf else "; bitwise equal")
        return f"masked: every leaf within the golden's noise{largest}; {loss}"
    more = f" (and {len(e.moved) - 1} more leaves)" if len(e.moved) > 1 else ""
    what = f"{e.leaf} moved {e.noise_ratio:.3g}x its step noise{_past_pseudo(e)}{more}"
    if e.model == "sign_reversed":
        what += "; its update is the golden's negated"
    elif e.model == "update_scaled":
        what += f"; its update is {e.update_factor:.3g}x the golden's"
    elif e.update_change is not None:
        what += f"; its update changed by {100 * e.update_change:.3g}% of the golden's"
    return f"{e.model}: {what}; {loss}{metrics}"
