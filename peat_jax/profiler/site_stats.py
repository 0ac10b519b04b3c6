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

The outputs of the sites outside any `scan` are carried to the end of the step and reduced
together (`batch_stats`: the small ones padded into one buffer of `BLOCK`-element blocks, so the
statistics of a step take a handful of kernels, not several per site); the checksum and sample are
bitwise what `site_stats` gives for each output alone, the sums equal up to float32 rounding.
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

__all__ = ["ALONE", "BLOCK", "SAMPLE_SIZE", "STATISTICS", "SiteStats", "StatsSite", "StatsStep",
           "batch_stats", "describe_sites", "pack", "read_sites", "read_step", "recorded_steps", "reduce_iterations",
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


BLOCK = 512
"""Elements per block of `batch_stats` (each output padded to a multiple of it)."""

ALONE = 1 << 16
"""Outputs with at least this many elements (a whole number of blocks) are reduced where they
are, not copied into `batch_stats`' shared buffer: for them the copy costs more than the
kernels it saves."""


class _Layout(NamedTuple):
    """Where `batch_stats` puts each output in its padded, concatenated [blocks, BLOCK] buffer
    (static: numpy arrays, fixed by the output sizes)."""

    sizes: np.ndarray        # int64 [S]: elements per output
    pads: np.ndarray         # int32 [S]: zeros appended to each
    first_block: np.ndarray  # int64 [S]: each output's first block
    offsets: np.ndarray      # uint32 [blocks]: each block's first element, within its output
    fold: np.ndarray         # int32 [S, max blocks]: each output's blocks (`blocks`: padding)
    sample: np.ndarray       # int32 [sum m_i]: the samples' flat indices in the buffer


def _layout(sizes: Sequence[int], size: int) -> _Layout:
    n = np.asarray(sizes, np.int64)
    blocks = -(-n // BLOCK)
    first = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
    total = int(blocks.sum())
    fold = np.full((len(n), int(blocks.max())), total, np.int32)
    offsets = np.zeros(total, np.uint32)
    for i, (f, b) in enumerate(zip(first, blocks)):
        fold[i, :b] = np.arange(f, f + b)
        offsets[f:f + b] = np.arange(b, dtype=np.uint32) * np.uint32(BLOCK)
    sample = np.concatenate([f * BLOCK + sample_indices(k, size) for f, k in zip(first, n)])
    return _Layout(sizes=n, pads=(blocks * BLOCK - n).astype(np.int32), first_block=first,
                   offsets=offsets, fold=fold, sample=sample.astype(np.int32))


_NONFINITE = 4096.0  # > BLOCK: a block's zero and non-finite counts share one exact float32 sum


def _row_sums(values: jax.Array, offsets: jax.Array):
    """Per block of [blocks, BLOCK]: sum, sum of squares, abs-max, zero and non-finite counts,
    and sum of bit patterns times (2 i + 1), i the element's index in its output (`offsets`:
    each block's first). Five plain reductions: XLA:CPU vectorises each, not a variadic one."""
    bits = lax.bitcast_convert_type(values, jnp.uint32)
    i = lax.broadcasted_iota(jnp.uint32, values.shape, 1) + offsets[:, None]
    counts = jnp.sum(jnp.where(values == 0, 1.0, 0.0)
                     + jnp.where(jnp.isfinite(values), 0.0, _NONFINITE), axis=1)
    return (jnp.sum(values, axis=1), jnp.sum(values * values, axis=1),
            jnp.max(jnp.abs(values), axis=1), counts,
            jnp.sum(bits * (i * jnp.uint32(2) + jnp.uint32(1)), axis=1, dtype=jnp.uint32))


def batch_stats(xs: Sequence[jax.Array], size: int = SAMPLE_SIZE) -> SiteStats:
    """The `SiteStats` of each output in `xs` (non-empty arrays), stacked: every field [len(xs)]
    and `sample` the samples concatenated in order. Jittable, and a handful of kernels whatever
    the number of outputs: outputs under `ALONE` elements are padded to whole blocks and
    concatenated (float32 ones apart from the others, whose bit patterns need a buffer of their
    own), five reductions go over the blocks and a gather folds each output's blocks (the
    checksum exactly: each element is weighted by its index in its output); larger ones are
    reduced where they are (`site_stats`)."""
    rest = [i for i, x in enumerate(xs) if x.size < ALONE]
    groups = [g for g in ([i for i in rest if xs[i].dtype == jnp.float32],
                          [i for i in rest if xs[i].dtype != jnp.float32]) if g]
    alone = [i for i, x in enumerate(xs) if x.size >= ALONE]
    lengths = lambda idx: [len(sample_indices(xs[i].size, size)) for i in idx]  # noqa: E731
    parts = [(g, lengths(g), _blocked_stats([xs[i] for i in g], size)) for g in groups]
    if alone:
        parts.append((alone, lengths(alone), _stacked([site_stats(xs[i], size) for i in alone])))
    return _in_order(parts)


def _stacked(records: Sequence[SiteStats]) -> SiteStats:
    """Scalar records as one: fields stacked, samples concatenated."""
    return SiteStats(**{k: jnp.stack([getattr(r, k) for r in records]) for k in STATISTICS},
                     sample=jnp.concatenate([r.sample for r in records]))


def _in_order(parts: Sequence[tuple[list[int], list[int], SiteStats]]) -> SiteStats:
    """Stacked records (each part: the positions it holds, their sample lengths, the record) as
    one stacked record in position order (static gathers; none for a single part)."""
    if len(parts) == 1:
        return parts[0][2]
    positions = [i for idx, _, _ in parts for i in idx]
    lengths = [n for _, ns, _ in parts for n in ns]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    order = np.argsort(positions, kind="stable")
    elements = np.concatenate([np.arange(starts[j], starts[j] + lengths[j]) for j in order]
                              + [np.zeros(0, np.int64)]).astype(np.int32)
    return SiteStats(**{k: jnp.concatenate([getattr(r, k) for _, _, r in parts])[order]
                        for k in STATISTICS},
                     sample=jnp.concatenate([r.sample for _, _, r in parts])[elements])


def _blocked_stats(xs: Sequence[jax.Array], size: int) -> SiteStats:
    """`batch_stats` of outputs that are all float32, or none of them."""
    L = _layout([x.size for x in xs], size)
    flats = [x.reshape(-1) for x in xs]

    def buffer(parts, dtype):
        # zeros as concatenate operands (not jnp.pad): XLA makes one fusion of it
        pieces = []
        for p, k in zip(parts, L.pads):
            pieces += [p, jnp.zeros((int(k),), dtype)] if k else [p]
        return jnp.concatenate(pieces).reshape(-1, BLOCK)

    values = buffer([f.astype(jnp.float32) for f in flats], jnp.float32)
    s, q, m, c, checksum = _row_sums(values, jnp.asarray(L.offsets))
    if xs[0].dtype != jnp.float32:  # the bit patterns of the output's own dtype
        bits = buffer([_bits32(f) for f in flats], jnp.uint32)
        i = lax.broadcasted_iota(jnp.uint32, bits.shape, 1) + jnp.asarray(L.offsets)[:, None]
        checksum = jnp.sum(bits * (i * jnp.uint32(2) + jnp.uint32(1)), axis=1, dtype=jnp.uint32)
    nf = jnp.floor(c / _NONFINITE)
    z = c - nf * _NONFINITE
    fold = jnp.asarray(L.fold)

    def per_output(partial, reduce):
        return reduce(jnp.concatenate([partial, jnp.zeros((1,), partial.dtype)])[fold], axis=1)

    n = jnp.asarray(L.sizes, jnp.float32)
    return SiteStats(nonfinite=per_output(nf.astype(jnp.int32), jnp.sum),
                     absmax=per_output(m, jnp.max),
                     mean=per_output(s, jnp.sum) / n, rms=jnp.sqrt(per_output(q, jnp.sum) / n),
                     zeros=(per_output(z.astype(jnp.int32), jnp.sum)
                            - jnp.asarray(L.pads)).astype(jnp.float32) / n,
                     checksum=per_output(checksum, jnp.sum).astype(jnp.uint32),
                     sample=values.reshape(-1)[jnp.asarray(L.sample)])


def site_stats(x: jax.Array, size: int = SAMPLE_SIZE) -> SiteStats:
    """The `SiteStats` of one output `x` (jittable), computed where it is (no copy): what a site
    inside a `scan` records per iteration. Four reductions over `x` (sum, sum of squares,
    abs-max and zeros, checksum); the non-finite count takes a fifth only when the sums are not
    finite."""
    flat = x.reshape(-1)
    n = flat.size
    v = flat.astype(jnp.float32)
    total, squares = jnp.sum(v), jnp.sum(v * v)
    # zeros_like: inside `shard_map` both branches vary over the mesh alike
    nonfinite = lax.cond(jnp.isfinite(total) & jnp.isfinite(squares),
                         lambda: jnp.zeros_like(total, jnp.int32),
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
        recorded = [s for s in traced.sites if _recorded_output(s) is not None]
        for s in recorded:
            rules[s.index] = _stats_rule(base.get(s.index), _recorded_output(s), self._size,
                                         mapped=bool({"scan", "shard_map"} & set(s.scope)))
        (state, metrics), sides = run_rules(traced, rules, (state, batch), {}, with_sides=True)
        return state, metrics, pack([sides[s.index] for s in recorded if s.index in sides],
                                    self._size)


def pack(sides: Sequence[Any], size: int = SAMPLE_SIZE) -> dict[str, jax.Array]:
    """One step's records (recorded sites in index order: a site's output itself, or the
    `SiteStats` reduced over a scan's iterations) as the three arrays of a step file: `floats`
    float32 [S, 4] (absmax, mean, rms, zeros), `words` uint32 [S, 2] (nonfinite, checksum) and
    `sample` float32 (the samples concatenated). Jittable; the outputs' statistics are computed
    together (`batch_stats`), and three transfers to the host serve the whole step."""
    outputs = [i for i, x in enumerate(sides) if not isinstance(x, SiteStats)]
    reduced = [i for i, x in enumerate(sides) if isinstance(x, SiteStats)]
    parts = []
    if outputs:
        parts.append((outputs, [len(sample_indices(sides[i].size, size)) for i in outputs],
                      batch_stats([sides[i] for i in outputs], size)))
    if reduced:
        parts.append((reduced, [sides[i].sample.shape[0] for i in reduced],
                      _stacked([sides[i] for i in reduced])))
    if not parts:
        return {"floats": jnp.zeros((0, 4), jnp.float32), "words": jnp.zeros((0, 2), jnp.uint32),
                "sample": jnp.zeros((0,), jnp.float32)}
    r = _in_order(parts)
    return {"floats": jnp.stack([r.absmax, r.mean, r.rms, r.zeros], axis=1).astype(jnp.float32),
            "words": jnp.stack([r.nonfinite.astype(jnp.uint32), r.checksum.astype(jnp.uint32)],
                               axis=1),
            "sample": r.sample.astype(jnp.float32)}


def _stats_rule(base, k: int, size: int, mapped: bool):
    """A rule that computes the site's outputs as `base` does (the reference op when None) and
    returns as the side its output `k` (its statistics are computed with every other site's
    at the end of the step, `pack`), or, `mapped` (inside a `scan` or a `shard_map` body), that
    output's `SiteStats`, reduced over the iterations or shards (an output per iteration would
    be stacked: a dump)."""
    def rule(op, invals, reference):
        outs = list(base(op, invals, reference) if base is not None else reference(*invals))
        if mapped:
            return _ip.WithSide(outs, site_stats(outs[k], size), reduce_iterations)
        return _ip.WithSide(outs, outs[k], _outside_scans)

    return rule


def _outside_scans(stacked):
    raise PeatError("a site output outside any scan or shard_map came out stacked; please "
                    "report it (site statistics)")


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
