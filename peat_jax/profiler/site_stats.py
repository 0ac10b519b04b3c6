"""Site statistics: compact per-site summaries of what each op produced, recorded in a golden run.

At a statistics step the train step runs through the interpreter with a rule at every site that
computes the site's outputs as usual (the reference op, or the run's candidate where a
substitution puts one) and, from its first floating-point output (the first output for a site
without one), a small `SiteStats` record, on the device, inside the one jitted step:

  nonfinite  count of NaN/Inf elements                         (int32)
  absmax     largest |x|                                        (float32, the output's units)
  mean       mean of the elements                               (float32)
  rms        root mean square of the elements                   (float32)
  zeros      fraction of elements equal to zero                 (float32, 0..1)
  checksum   sum over elements of bits(x_i) * (2 i + 1), mod 2**32: any changed bit pattern or
             moved element changes it (uint32)
             (absmax, mean and rms are NaN or inf when the output holds non-finite values, or
             when its squares overflow float32)
  sample     the values at `sample_indices(n)`: up to `SAMPLE_SIZE` evenly spaced flat indices,
             the same at every step (float32)

Inside a `scan` a site runs once per iteration; its record is reduced over the iterations:
`nonfinite` summed, `absmax` the maximum, `mean` and `zeros` the mean over iterations, `rms` the
root of the mean square, `checksum` the iterations' checksums combined with odd weights
(2 t + 1), and `sample` evenly spaced over the iterations' samples (iteration t = i * T // m for
sample position i). Sites inside `while` or `cond` bodies are not recorded (their outputs cannot
be carried out of the loop or branch): `sites.json` marks them `"recorded": false`.

On disk (`golden/site_stats/`, see `peat_jax.profiler.rundir`): `sites.json` (one entry per site
of the train step: index, primitive, path, phase, output shape and dtype, the sample's size and
offset, whether it is recorded) and one `<step>.npz` per statistics step (written by
`np.savez_compressed`, no pickled objects), holding the statistics stacked over the
recorded sites in index order: `floats` float32 [S, 4] (absmax, mean, rms, zeros), `words`
uint32 [S, 2] (nonfinite, checksum) and `sample` (float32, all recorded sites' samples
concatenated: a site's at `offset .. offset + sample_size` as `sites.json` says).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax import _interpreter as _ip
from peat_jax.errors import PeatError
from peat_jax.sites import Site, Traced, Tracer
from peat_jax.substitute import Candidate, Substitution, fault_key, make_rules, resolve, run_rules

__all__ = ["SAMPLE_SIZE", "STATISTICS", "SiteStats", "StatsSite", "StatsStep", "describe_sites",
           "pack", "read_sites", "read_step", "recorded_steps", "reduce_iterations",
           "sample_indices", "site_stats", "unpack", "write_sites", "write_step"]

SAMPLE_SIZE = 64
"""Elements of each site output kept as its fixed-index sample (fewer for smaller outputs)."""

STATISTICS = ("nonfinite", "absmax", "mean", "rms", "zeros", "checksum")
"""The scalar statistics of a `SiteStats`, in file order."""


class SiteStats(NamedTuple):
    """The statistics of one site output at one step (device arrays while in the step; see the
    module docstring for each field's definition and units)."""

    nonfinite: Any
    absmax: Any
    mean: Any
    rms: Any
    zeros: Any
    checksum: Any
    sample: Any


@dataclasses.dataclass(frozen=True)
class StatsSite:
    """One site as `sites.json` describes it.

    Attributes:
      index, primitive, path, phase: as in `peat.Site`.
      shape, dtype: the recorded output's shape and dtype name.
      output: which of the site's outputs is recorded (its first floating-point one).
      repeats: executions per step (the product of the enclosing `scan` lengths).
      recorded: False for a site inside `while` / `cond` (no statistics).
      sample_size: elements in its sample (0 when not recorded).
      offset: where its sample starts in a step file's `sample` array.
      reduction_length: for a `dot_general`, the contraction length (the analyzer's noise bound
        grows with it); None otherwise.
    """

    index: int
    primitive: str
    path: str
    phase: str
    shape: tuple[int, ...]
    dtype: str
    output: int
    repeats: int
    recorded: bool
    sample_size: int
    offset: int
    reduction_length: Optional[int] = None

    def label(self) -> str:
        """`#5 fwd dot_general @ CNN/hidden`."""
        return f"#{self.index} {self.phase} {self.primitive} @ {self.path or '<top>'}"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "StatsSite":
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["shape"] = tuple(kw["shape"])
        return cls(**kw)


def sample_indices(n: int, size: int = SAMPLE_SIZE) -> np.ndarray:
    """The flat indices sampled from an output of `n` elements: `min(n, size)` evenly spaced
    indices `i * n // m` (int32), the same for every step."""
    m = min(int(n), int(size))
    return (np.arange(m, dtype=np.int64) * int(n) // max(m, 1)).astype(np.int32)


def _bits32(flat: jax.Array) -> jax.Array:
    """Each element's bit pattern as uint32 (64-bit patterns folded: high xor low word)."""
    if flat.dtype == jnp.bool_:
        return flat.astype(jnp.uint32)
    width = jnp.dtype(flat.dtype).itemsize * 8
    uint = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[width]
    u = lax.bitcast_convert_type(flat, uint)
    if width == 64:
        return (u ^ (u >> 32)).astype(jnp.uint32)
    return u.astype(jnp.uint32)


def site_stats(x: jax.Array, size: int = SAMPLE_SIZE) -> SiteStats:
    """The `SiteStats` of one output `x` (jittable). Four passes over `x` that XLA fuses (sum,
    sum of squares, abs-max and zeros, checksum); the non-finite count takes a fifth pass only
    when the sums are not finite."""
    flat = x.reshape(-1)
    n = flat.size
    v = flat.astype(jnp.float32)
    total, squares = jnp.sum(v), jnp.sum(v * v)
    nonfinite = lax.cond(jnp.isfinite(total) & jnp.isfinite(squares), lambda: jnp.int32(0),
                         lambda: jnp.sum(~jnp.isfinite(v), dtype=jnp.int32))
    weights = jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    checksum = jnp.sum(_bits32(flat) * weights, dtype=jnp.uint32)
    return SiteStats(nonfinite=nonfinite, absmax=jnp.max(jnp.abs(v)), mean=total / n,
                     rms=jnp.sqrt(squares / n), zeros=jnp.sum(jnp.where(v == 0, 1.0, 0.0)) / n,
                     checksum=checksum, sample=v[jnp.asarray(sample_indices(n, size))])


def reduce_iterations(stacked: SiteStats) -> SiteStats:
    """One `SiteStats` from a scan's per-iteration records stacked along axis 0 (see the module
    docstring for how each statistic is reduced)."""
    t = stacked.nonfinite.shape[0]
    m = stacked.sample.shape[1]
    weights = jnp.arange(t, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    picks = np.arange(m, dtype=np.int64) * t  # evenly spaced over the t * m stacked values
    return SiteStats(
        nonfinite=jnp.sum(stacked.nonfinite, dtype=jnp.int32), absmax=jnp.max(stacked.absmax),
        mean=jnp.mean(stacked.mean), rms=jnp.sqrt(jnp.mean(jnp.square(stacked.rms))),
        zeros=jnp.mean(stacked.zeros),
        checksum=jnp.sum(stacked.checksum * weights, dtype=jnp.uint32),
        sample=stacked.sample.reshape(-1)[jnp.asarray(picks)])


def _recorded_output(site: Site) -> Optional[int]:
    """The output of `site` whose statistics are recorded (its first real floating-point
    output, else its first integer or bool one), or None for a site that cannot be recorded
    (inside `while` / `cond`, or no non-empty real output)."""
    if "while" in site.scope or "cond" in site.scope:
        return None
    usable = [i for i, d in enumerate(site.out_dtypes)
              if _numeric(d) and math.prod(site.out_shapes[i]) > 0]
    floats = [i for i in usable if jnp.issubdtype(site.out_dtypes[i], jnp.floating)]
    return (floats or usable or [None])[0]


def _numeric(dtype) -> bool:
    try:
        return ((jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))
                and not jnp.issubdtype(dtype, jnp.complexfloating))
    except TypeError:
        return False


def _reduction_length(site: Site) -> Optional[int]:
    if site.primitive != "dot_general" or site.composite:
        return None
    (lhs_contract, _), _ = site.params["dimension_numbers"]
    return int(math.prod(site.in_shapes[0][d] for d in lhs_contract)) or None


def describe_sites(sites: Sequence[Site], size: int = SAMPLE_SIZE) -> list[StatsSite]:
    """`StatsSite` of every site, with sample offsets assigned in index order."""
    out, offset = [], 0
    for s in sites:
        k = _recorded_output(s)
        shape = tuple(s.out_shapes[k if k is not None else 0]) if s.out_shapes else ()
        dtype = s.out_dtypes[k if k is not None else 0] if s.out_dtypes else "none"
        m = len(sample_indices(math.prod(shape), size)) if k is not None else 0
        out.append(StatsSite(index=s.index, primitive=s.primitive, path=s.path, phase=s.phase,
                             shape=shape, dtype=str(np.dtype(dtype)) if _numeric(dtype) else str(dtype),
                             output=k if k is not None else -1, repeats=s.repeats,
                             recorded=k is not None, sample_size=m, offset=offset,
                             reduction_length=_reduction_length(s)))
        offset += m
    return out


class StatsStep:
    """A workload's train step, plain and with site statistics, with an optional substitution in
    place for every step.

    `plain(state, batch) -> (state, metrics)` and `with_stats(state, batch) -> (state, metrics,
    packed statistics)` (see `pack`) are jitted. Without a substitution `plain` is `jit(train_step)`
    itself; the statistics read the site outputs without changing what flows on, so both give
    bitwise the same state and metrics (tests/test_site_stats.py checks it).
    """

    def __init__(self, train_step, substitution: Optional[Substitution] = None, *,
                 sample_size: int = SAMPLE_SIZE):
        self._tracer = Tracer(train_step)
        self._substitution = dict(substitution or {})
        self._size = int(sample_size)
        self._train_step = train_step
        self.plain = jax.jit(self._plain if self._substitution else train_step)
        self.with_stats = jax.jit(self._with_stats)

    def traced(self, state, batch) -> tuple[Traced, dict[int, Candidate]]:
        traced = self._tracer.trace((state, batch), {})
        chosen = resolve(traced.sites, self._substitution) if self._substitution else {}
        return traced, chosen

    def sites(self, state, batch) -> list[StatsSite]:
        """The `StatsSite` of every site of the train step on these arguments."""
        return describe_sites(self.traced(state, batch)[0].sites, self._size)

    def substituted(self, state, batch) -> list[Site]:
        """The sites the substitution puts its candidates at."""
        traced, chosen = self.traced(state, batch)
        return [traced.sites[i] for i in chosen]

    def _plain(self, state, batch):
        traced, chosen = self.traced(state, batch)
        rules = make_rules(traced, chosen, lambda site: None, fault_key)
        return run_rules(traced, rules, (state, batch), {})

    def _with_stats(self, state, batch):
        traced, chosen = self.traced(state, batch)
        base = make_rules(traced, chosen, lambda site: None, fault_key)
        rules = dict(base)
        for s in traced.sites:
            k = _recorded_output(s)
            if k is not None:
                rules[s.index] = _stats_rule(base.get(s.index), k, self._size)
        (state, metrics), sides = run_rules(traced, rules, (state, batch), {}, with_sides=True)
        return state, metrics, pack([sides[s.index] for s in traced.sites if s.index in sides])


def pack(records: Sequence[SiteStats]) -> dict[str, jax.Array]:
    """One step's records (recorded sites in index order) as the three arrays of a step file:
    `floats` float32 [S, 4] (absmax, mean, rms, zeros), `words` uint32 [S, 2] (nonfinite,
    checksum) and `sample` float32 (the samples concatenated). Jittable: three transfers to the
    host instead of seven per site."""
    if not records:
        return {"floats": jnp.zeros((0, 4), jnp.float32), "words": jnp.zeros((0, 2), jnp.uint32),
                "sample": jnp.zeros((0,), jnp.float32)}
    floats = jnp.stack([jnp.stack([r.absmax, r.mean, r.rms, r.zeros]).astype(jnp.float32)
                        for r in records])
    words = jnp.stack([jnp.stack([r.nonfinite.astype(jnp.uint32), r.checksum])
                       for r in records])
    return {"floats": floats, "words": words,
            "sample": jnp.concatenate([r.sample.astype(jnp.float32) for r in records])}


def _stats_rule(base, k: int, size: int):
    """A rule that computes the site's outputs as `base` does (the reference op when None) and
    returns its output `k`'s `SiteStats` as the side."""
    def rule(op, invals, reference):
        outs = list(base(op, invals, reference) if base is not None else reference(*invals))
        return _ip.WithSide(outs, site_stats(outs[k], size), reduce_iterations)

    return rule


# --------------------------------------------------------------------------------------------
# On disk

def write_sites(directory, sites: Sequence[StatsSite], sample_size: int = SAMPLE_SIZE) -> None:
    """Write `sites.json` into `directory`."""
    from peat_jax.profiler.rundir import atomic_write_json
    atomic_write_json(directory / "sites.json", {"sample_size": int(sample_size),
                                                 "statistics": list(STATISTICS),
                                                 "sites": [s.to_json() for s in sites]})


def read_sites(directory) -> list[StatsSite]:
    """The `StatsSite`s of `directory/sites.json`; a PeatError if it is missing or damaged."""
    import json
    p = directory / "sites.json"
    if not p.exists():
        raise PeatError(f"{p} is missing: this run recorded no site statistics; profile it with "
                        "stats_every=K (`peat profile --stats-every K`)")
    try:
        return [StatsSite.from_json(d) for d in json.loads(p.read_text())["sites"]]
    except (ValueError, KeyError, TypeError) as e:
        raise PeatError(f"{p} is damaged ({e}); profile the run again into a new "
                        "directory") from None


def write_step(directory, step: int, packed: Mapping[str, Any]) -> None:
    """Write `<step>.npz` (`np.savez_compressed`, pickle-free) from the host copy of one step's
    `pack`ed statistics."""
    import os
    import tempfile
    arrays = {k: np.asarray(v) for k, v in packed.items()}
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{step}.", suffix=".npz")
    with os.fdopen(fd, "wb") as f:
        np.savez_compressed(f, **arrays)
    os.replace(tmp, directory / f"{int(step)}.npz")


def recorded_steps(directory) -> list[int]:
    """The steps with a statistics file in `directory`, in order."""
    if not directory.exists():
        return []
    return sorted(int(p.stem) for p in directory.glob("*.npz") if p.stem.isdigit())


def read_step(directory, step: int) -> dict[str, np.ndarray]:
    """The statistics of `<step>.npz` (read with `allow_pickle=False`): one array per name of
    `STATISTICS` over the recorded sites in index order, and `sample`; a PeatError if the file
    is damaged."""
    p = directory / f"{int(step)}.npz"
    try:
        with np.load(p, allow_pickle=False) as z:
            return unpack({k: z[k] for k in ("floats", "words", "sample")})
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise PeatError(f"{p} cannot be read ({e}); it is damaged: profile the run again into "
                        "a new directory") from None


def unpack(packed: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The host copy of one step's `pack`ed statistics as `read_step` returns them: one array
    per name of `STATISTICS` over the recorded sites in index order, and `sample`."""
    floats, words = np.asarray(packed["floats"]), np.asarray(packed["words"])
    return {"absmax": floats[:, 0], "mean": floats[:, 1], "rms": floats[:, 2],
            "zeros": floats[:, 3], "nonfinite": words[:, 0].astype(np.int64),
            "checksum": words[:, 1], "sample": np.asarray(packed["sample"])}
