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
  sample     the values at `sample_indices(n)`: max(1, n // `SAMPLE_DENSITY`) evenly spaced flat
             indices, at most `SAMPLE_SIZE`, the same at every step (float32)

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

On disk (`golden/site_stats/`, see `peat_jax._src.profiler.rundir`): `sites.json` (compact JSON: the
`Sampling`, the `StatsSite` field names, and one row of them per site of the train step: index,
primitive, path, phase, output shape and dtype, the sample's size and offset, whether it is
recorded) and the statistics steps in
chunks, `<first>-<last>.npz` (written by `np.savez_compressed`, no pickled objects): the golden
run buffers the steps between two checkpoints and writes them as one file before it saves the
checkpoint (and at the end, or once `CHUNK_STEPS` are buffered), holding `steps` int64 [T] and
the statistics stacked over those steps and the recorded sites in index order: `floats` float32
[T, S, 4] (absmax, mean, rms, zeros), `words` uint32 [T, S, 2] (nonfinite, checksum) and
`sample` float32 [T, M] (all recorded sites' samples concatenated: a site's at `offset ..
offset + sample_size` as `sites.json` says). Runs profiled before chunks hold one `<step>.npz` a
step (the same arrays, unstacked); `recorded_steps` and `read_step` read both. A resumed run
drops the statistics of the steps it redoes (`drop_steps`).

Bytes per step, measured on the vision workload (44 recorded sites whose outputs take 378 KB,
statistics at every step, one 10-step chunk): the 500-value sample 1.7 KB compressed, `floats`
0.5 KB, `words` 0.2 KB, `sites.json` (3.2 KB once) 0.3 KB: 0.73% of a dump of the same outputs
(`benchmarks/bench_profiler.py`'s `stats_storage_ratio_vision`; 2.5% with a 64-value sample per
site, a file per step and an indented sites.json).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import re
import zipfile
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax._src import _interpreter as _ip
from peat_jax._src.errors import PeatError
from peat_jax._src.profiler.rundir import atomic_write, atomic_write_json
from peat_jax._src.sites import Site, Traced, Tracer, reduction_length
from peat_jax._src.substitute import (Candidate, Substitution, fault_key, make_rules, resolve,
                                      run_rules)
from peat_jax._src.sums import reduce_all, row_sums


SAMPLE_SIZE = 64
"""Most elements of a site output kept as its fixed-index sample."""

SAMPLE_DENSITY = 128
"""Elements of a site output per sampled element: an output of n elements keeps
max(1, n // SAMPLE_DENSITY) of them (at most `SAMPLE_SIZE`), so its sample stays under 1% of
its bytes (most outputs of a small model hold a few hundred elements, where a fixed 64 would be
a tenth of the output)."""

CHUNK_STEPS = 256
"""Most statistics steps buffered before they are written as one file (a run with rare
checkpoints stays bounded in memory)."""

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


class Sampling(NamedTuple):
    """Which elements of an output its sample keeps: `min(n, size, max(1, n // density))`
    evenly spaced ones (`sample_indices`). A run's sampling is recorded in `sites.json`."""

    size: int = SAMPLE_SIZE
    density: int = SAMPLE_DENSITY


def sample_indices(n: int, sampling: Sampling = Sampling()) -> np.ndarray:
    """The flat indices sampled from an output of `n` elements: `m = min(n, sampling.size,
    max(1, n // sampling.density))` evenly spaced indices `i * n // m` (int32), the same for
    every step."""
    n = int(n)
    m = min(n, int(sampling.size), max(1, n // int(sampling.density)))
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


def _layout(sizes: Sequence[int], sampling: Sampling) -> _Layout:
    n = np.asarray(sizes, np.int64)
    blocks = -(-n // BLOCK)
    first = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
    total = int(blocks.sum())
    fold = np.full((len(n), int(blocks.max())), total, np.int32)
    offsets = np.zeros(total, np.uint32)
    for i, (f, b) in enumerate(zip(first, blocks)):
        fold[i, :b] = np.arange(f, f + b)
        offsets[f:f + b] = np.arange(b, dtype=np.uint32) * np.uint32(BLOCK)
    sample = np.concatenate([f * BLOCK + sample_indices(k, sampling) for f, k in zip(first, n)])
    return _Layout(sizes=n, pads=(blocks * BLOCK - n).astype(np.int32), first_block=first,
                   offsets=offsets, fold=fold, sample=sample.astype(np.int32))


def _block_sums(values: jax.Array, offsets: jax.Array, bits: Optional[jax.Array] = None):
    """Per block of [blocks, BLOCK] float32 `values`: sum, sum of squares and abs-max (float
    reductions XLA:CPU vectorises), and the exact counts and checksum (`_exact_counts`) of
    `bits`, the outputs' own bit patterns (None: `values` are them)."""
    if bits is None:
        bits = lax.bitcast_convert_type(values, jnp.uint32)
    return (jnp.sum(values, axis=1), jnp.sum(values * values, axis=1),
            jnp.max(jnp.abs(values), axis=1), *_exact_counts(values, bits, offsets))


def _exact_counts(values: jax.Array, bits: jax.Array, offsets: jax.Array):
    """(zero count int32, non-finite count int32, checksum uint32) of each row of [R, L] arrays:
    `values` (the outputs as float32), `bits` (their own bit patterns, `_bits32`), `offsets`
    (uint32 [R]: the index of each row's first element in its output). Integer sums
    (`sums.row_sums`: XLA:CPU would otherwise write each summand out at full size first)."""
    index = offsets[:, None] + lax.broadcasted_iota(jnp.uint32, values.shape, 1)
    return tuple(row_sums(_count_terms(values, bits, index)))


def _count_terms(values: jax.Array, bits: jax.Array, index: jax.Array) -> list[jax.Array]:
    """The summands of the zero count, the non-finite count (int32 masks) and the checksum
    (uint32: each element's bit pattern times 2 i + 1, `index` its i in its output)."""
    return [(values == 0).astype(jnp.int32), (~jnp.isfinite(values)).astype(jnp.int32),
            bits * (index * jnp.uint32(2) + jnp.uint32(1))]


def batch_stats(xs: Sequence[jax.Array], sampling: Sampling = Sampling()) -> SiteStats:
    """The `SiteStats` of each output in `xs` (non-empty arrays), stacked: every field [len(xs)]
    and `sample` the samples concatenated in order. Jittable, and a handful of kernels whatever
    the number of outputs: outputs under `ALONE` elements are padded to whole blocks and
    concatenated (float32 ones apart from the others, whose bit patterns need a buffer of their
    own), a few reductions go over the blocks (`_block_sums`), one matrix product folds each
    output's blocks' sums (`_fold_sums`; the checksum exactly: each element is weighted by its
    index in its output) and a gather their abs-max; larger ones are reduced where they are
    (`site_stats`)."""
    rest = [i for i, x in enumerate(xs) if x.size < ALONE]
    groups = [g for g in ([i for i in rest if xs[i].dtype == jnp.float32],
                          [i for i in rest if xs[i].dtype != jnp.float32]) if g]
    alone = [i for i, x in enumerate(xs) if x.size >= ALONE]
    lengths = lambda idx: [len(sample_indices(xs[i].size, sampling)) for i in idx]  # noqa: E731
    parts = [(g, lengths(g), _blocked_stats([xs[i] for i in g], sampling)) for g in groups]
    if alone:
        parts.append((alone, lengths(alone),
                      _stacked([site_stats(xs[i], sampling) for i in alone])))
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


def _blocked_stats(xs: Sequence[jax.Array], sampling: Sampling) -> SiteStats:
    """`batch_stats` of outputs that are all float32, or none of them."""
    L = _layout([x.size for x in xs], sampling)
    flats = [x.reshape(-1) for x in xs]

    def buffer(parts, dtype):
        # zeros as concatenate operands (not jnp.pad): XLA makes one fusion of it
        pieces = []
        for p, k in zip(parts, L.pads):
            pieces += [p, jnp.zeros((int(k),), dtype)] if k else [p]
        return jnp.concatenate(pieces).reshape(-1, BLOCK)

    values = buffer([f.astype(jnp.float32) for f in flats], jnp.float32)
    # the bit patterns of the outputs' own dtype, where it is not float32
    bits = None if xs[0].dtype == jnp.float32 else buffer([_bits32(f) for f in flats], jnp.uint32)
    s, q, m, z, nf, checksum = _block_sums(values, jnp.asarray(L.offsets), bits)
    absmax = _gathered(L, m, jnp.max)
    fold = _fold_sums if len(L.sizes) * len(L.offsets) <= FOLD_MAX else _gathered_sums
    sums = fold(L, s, q, z, nf, checksum)
    n = jnp.asarray(L.sizes, jnp.float32)
    return SiteStats(nonfinite=sums[3], absmax=_with_nans(absmax, sums[3]), mean=sums[0] / n,
                     rms=jnp.sqrt(sums[1] / n),
                     zeros=(sums[2] - jnp.asarray(L.pads)).astype(jnp.float32) / n,
                     checksum=sums[4], sample=values.reshape(-1)[jnp.asarray(L.sample)])


FOLD_MAX = 1 << 15
"""`_fold_sums` for at most this many (output, block) pairs (its matrix: 128 KB, about 0.4 M
multiply-adds), `_gathered_sums` beyond. On 2 CPU cores, the vision workload (43 outputs in 213
blocks), its statistics step on the device over the plain step: 1.136 against 1.154 with
`_gathered_sums` (medians of five interleaved runs)."""


def _with_nans(absmax: jax.Array, nonfinite: jax.Array) -> jax.Array:
    """`absmax` NaN where the output holds `nonfinite` values but its maximum came out below
    infinity: they are NaNs, which XLA:CPU's float max skips on jax 0.10 and 0.11
    (`sums.reduce_all`)."""
    return jnp.where((nonfinite > 0) & (absmax != jnp.inf), jnp.nan, absmax)


def _gathered(L: _Layout, partial: jax.Array, reduce) -> jax.Array:
    """`reduce` (jnp.sum, jnp.max) of each output's blocks' `partial`: a gather, then a
    reduction per output."""
    padded = jnp.concatenate([partial, jnp.zeros((1,), partial.dtype)])
    return reduce(padded[jnp.asarray(L.fold)], axis=1)


def _gathered_sums(L: _Layout, s, q, z, nf, checksum):
    """What `_fold_sums` returns, by `_gathered` sums (a gather and a tree of reductions each)."""
    return (_gathered(L, s, jnp.sum), _gathered(L, q, jnp.sum), _gathered(L, z, jnp.sum),
            _gathered(L, nf, jnp.sum), _gathered(L, checksum, jnp.sum).astype(jnp.uint32))


def _fold_sums(L: _Layout, s, q, z, nf, checksum):
    """Each output's sums of its blocks' partials (float32 `s`, `q`; int32 `z`, `nf`; uint32
    `checksum`): (sum, sum of squares, zero count, non-finite count, checksum), as one float32
    matrix product with the outputs' 0/1 block membership: one kernel, where
    `_gathered_sums` takes about fifteen.

    The products see only finite values (a 0 * NaN would reach every output): a float sum's
    non-finite partials are counted apart, by kind, and give it the value IEEE addition would
    (NaN with a NaN or with both infinities, else the infinity). The integer sums are exact:
    the counts are below 2**24 (an output under `ALONE` elements), and the checksum goes as its
    16-bit halves, each summed over at most `ALONE // BLOCK` blocks (< 2**23), then joined
    modulo 2**32."""
    # each output's blocks as `_layout` folds them (its padding: the one extra column, dropped)
    member = np.zeros((len(L.sizes), len(L.offsets) + 1), np.float32)
    member[np.arange(len(L.sizes))[:, None], L.fold] = 1
    member = member[:, :-1]
    columns = [z, nf, checksum & jnp.uint32(0xFFFF), checksum >> jnp.uint32(16)]
    for x in (s, q):
        columns += [jnp.where(jnp.isfinite(x), x, 0), jnp.isnan(x), x == jnp.inf, x == -jnp.inf]
    parts = jnp.stack([c.astype(jnp.float32) for c in columns], axis=1)
    out = jnp.dot(jnp.asarray(member), parts, precision=lax.Precision.HIGHEST)

    def ieee(finite, nan, pos, neg):
        return jnp.where((nan > 0) | ((pos > 0) & (neg > 0)), jnp.nan,
                         jnp.where(pos > 0, jnp.inf, jnp.where(neg > 0, -jnp.inf, finite)))

    joined = out[:, 2].astype(jnp.uint32) + (out[:, 3].astype(jnp.uint32) << jnp.uint32(16))
    return (ieee(*(out[:, 4 + j] for j in range(4))), ieee(*(out[:, 8 + j] for j in range(4))),
            out[:, 0].astype(jnp.int32), out[:, 1].astype(jnp.int32), joined)


def site_stats(x: jax.Array, sampling: Sampling = Sampling()) -> SiteStats:
    """The `SiteStats` of one output `x` (jittable), computed where it is (no copy): what a site
    inside a `scan` records per iteration, and `batch_stats` for a large output. One pass over
    `x` for all six statistics (`sums.reduce_all`); the counts and checksum of the same summands
    as `_exact_counts` (bitwise its), the sums equal to `jnp.sum`'s up to float32 rounding."""
    flat = x.reshape(-1)
    n = flat.size
    v = flat.astype(jnp.float32)
    total, squares, absmax, zeros, nonfinite, checksum = reduce_all(
        [v, v * v, jnp.abs(v), *_count_terms(v, _bits32(flat), lax.iota(jnp.uint32, n))],
        ["sum", "sum", "max", "sum", "sum", "sum"])
    return SiteStats(nonfinite=nonfinite, absmax=absmax, mean=total / n,
                     rms=jnp.sqrt(squares / n), zeros=zeros.astype(jnp.float32) / n,
                     checksum=checksum, sample=v[jnp.asarray(sample_indices(n, sampling))])


def reduce_iterations(stacked: SiteStats) -> SiteStats:
    """One `SiteStats` from a scan's per-iteration records stacked along axis 0 (see the module
    docstring for how each statistic is reduced)."""
    t = stacked.nonfinite.shape[0]
    m = stacked.sample.shape[1]
    weights = jnp.arange(t, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    picks = np.arange(m, dtype=np.int64) * t  # evenly spaced over the t * m stacked values
    nonfinite = jnp.sum(stacked.nonfinite, dtype=jnp.int32)
    return SiteStats(
        nonfinite=nonfinite, absmax=_with_nans(jnp.max(stacked.absmax), nonfinite),
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
    chosen = floats or usable
    return chosen[0] if chosen else None


def _numeric(dtype) -> bool:
    try:
        return ((jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))
                and not jnp.issubdtype(dtype, jnp.complexfloating))
    except TypeError:
        return False


def _reduction_length(site: Site) -> Optional[int]:
    """K of a matmul site's dtype bound (other sites keep the default)."""
    if site.primitive != "dot_general" or site.composite:
        return None
    return reduction_length(site)


def describe_sites(sites: Sequence[Site], sampling: Sampling = Sampling()) -> list[StatsSite]:
    """`StatsSite` of every site, with sample offsets assigned in index order."""
    out, offset = [], 0
    for s in sites:
        k = _recorded_output(s)
        shape = tuple(s.out_shapes[k if k is not None else 0]) if s.out_shapes else ()
        dtype = s.out_dtypes[k if k is not None else 0] if s.out_dtypes else "none"
        m = len(sample_indices(math.prod(shape), sampling)) if k is not None else 0
        out.append(StatsSite(index=s.index, primitive=s.primitive, path=s.path, phase=s.phase,
                             shape=shape,
                             dtype=str(np.dtype(dtype)) if _numeric(dtype) else str(dtype),
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
    bitwise the same state and metrics, except where XLA compiles a GEMM the statistics read
    otherwise than the plain step does (about an ULP: the vision workload on jax 0.12.1,
    transformers' Flax Llama on 0.10.2; docs/compare.md; checked by
    tests/profiler/test_site_stats.py). `sampling`
    says which elements each site's sample keeps (a recorded run's own, `read_sampling`, to replay
    one of its steps).
    """

    def __init__(self, train_step, substitution: Optional[Substitution] = None, *,
                 sampling: Sampling = Sampling()):
        self._tracer = Tracer(train_step)
        self._substitution = dict(substitution or {})
        self.sampling = Sampling(int(sampling.size), int(sampling.density))
        self._train_step = train_step
        self.plain = jax.jit(self._plain if self._substitution else train_step)
        self.with_stats = jax.jit(self._with_stats)

    def traced(self, state, batch) -> tuple[Traced, dict[int, Candidate]]:
        traced = self._tracer.trace((state, batch), {})
        chosen = resolve(traced.sites, self._substitution) if self._substitution else {}
        return traced, chosen

    def sites(self, state, batch) -> list[StatsSite]:
        """The `StatsSite` of every site of the train step on these arguments."""
        return describe_sites(self.traced(state, batch)[0].sites, self.sampling)

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
            rules[s.index] = _stats_rule(base.get(s.index), _recorded_output(s), self.sampling,
                                         mapped=bool({"scan", "shard_map"} & set(s.scope)))
        (state, metrics), sides = run_rules(traced, rules, (state, batch), {}, with_sides=True)
        return state, metrics, pack([sides[s.index] for s in recorded if s.index in sides],
                                    self.sampling)


def pack(sides: Sequence[Any], sampling: Sampling = Sampling()) -> dict[str, jax.Array]:
    """One step's records (recorded sites in index order: a site's output itself, or the
    `SiteStats` reduced over a scan's iterations) as the three arrays of a step file: `floats`
    float32 [S, 4] (absmax, mean, rms, zeros), `words` uint32 [S, 2] (nonfinite, checksum) and
    `sample` float32 (the samples concatenated). Jittable; the outputs' statistics are computed
    together (`batch_stats`), and three transfers to the host serve the whole step."""
    outputs = [i for i, x in enumerate(sides) if not isinstance(x, SiteStats)]
    reduced = [i for i, x in enumerate(sides) if isinstance(x, SiteStats)]
    parts = []
    if outputs:
        parts.append((outputs, [len(sample_indices(sides[i].size, sampling)) for i in outputs],
                      batch_stats([sides[i] for i in outputs], sampling)))
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


def _stats_rule(base, k: int, sampling: Sampling, mapped: bool):
    """A rule that computes the site's outputs as `base` does (the reference op when None) and
    returns as the side its output `k` (its statistics are computed with every other site's
    at the end of the step, `pack`), or, `mapped` (inside a `scan` or a `shard_map` body), that
    output's `SiteStats`, reduced over the iterations or shards (an output per iteration would
    be stacked: a dump)."""
    def rule(op, invals, reference):
        outs = list(base(op, invals, reference) if base is not None else reference(*invals))
        if mapped:
            return _ip.WithSide(outs, site_stats(outs[k], sampling), reduce_iterations)
        return _ip.WithSide(outs, outs[k], _outside_scans)

    return rule


def _outside_scans(stacked):
    raise PeatError("a site output outside any scan or shard_map came out stacked; please "
                    "report it (site statistics)")


# --------------------------------------------------------------------------------------------
# On disk

_FIELDS = tuple(f.name for f in dataclasses.fields(StatsSite))


def write_sites(directory, sites: Sequence[StatsSite], sampling: Sampling = Sampling()) -> None:
    """Write `sites.json` into `directory`: compact JSON, the sites as rows of `fields` (each
    field named once, not once per site)."""
    rows = [[s.to_json()[f] for f in _FIELDS] for s in sites]
    atomic_write_json(directory / "sites.json", {"sample_size": int(sampling.size),
                                                 "sample_density": int(sampling.density),
                                                 "statistics": list(STATISTICS),
                                                 "fields": list(_FIELDS), "sites": rows},
                      indent=None)


def _sites_json(directory) -> dict:
    """{"sites": the `StatsSite`s, "sampling": the `Sampling`} of `directory/sites.json`."""
    import json
    p = directory / "sites.json"
    if not p.exists():
        raise PeatError(f"{p} is missing: this run recorded no site statistics; profile it with "
                        "stats_every=K (`peat profile --stats-every K`)")
    try:
        d = json.loads(p.read_text())
        entries = ([dict(zip(d["fields"], row)) for row in d["sites"]] if "fields" in d
                   else d["sites"])  # runs profiled before rows: one object per site
        return {"sites": [StatsSite.from_json(s) for s in entries],
                # runs profiled before `sample_density` existed sampled min(n, size) elements
                "sampling": Sampling(int(d.get("sample_size", SAMPLE_SIZE)),
                                     int(d.get("sample_density", 1)))}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PeatError(f"{p} is damaged ({e}); profile the run again into a new "
                        "directory") from None


def read_sites(directory) -> list[StatsSite]:
    """The `StatsSite`s of `directory/sites.json`; a PeatError if it is missing or damaged."""
    return _sites_json(directory)["sites"]


def read_sampling(directory) -> Sampling:
    """The `Sampling` the run of `directory/sites.json` recorded its samples with."""
    return _sites_json(directory)["sampling"]


_CHUNK = re.compile(r"(\d+)-(\d+)")
_ARRAYS = ("floats", "words", "sample")  # a statistics file's arrays besides `steps`


def write_chunk(directory, steps: Sequence[int], packed: Sequence[Mapping[str, Any]]) -> None:
    """Write the host copies of several steps' `pack`ed statistics as one file,
    `<first>-<last>.npz` (`np.savez_compressed`, pickle-free, via a temporary file and a
    rename): `steps` int64 [T] and each of `floats`, `words`, `sample` stacked over the steps."""
    arrays = {"steps": np.asarray(steps, np.int64),
              **{k: np.stack([np.asarray(p[k]) for p in packed]) for k in _ARRAYS}}
    _write_npz(directory, f"{int(steps[0])}-{int(steps[-1])}.npz", arrays)


def _write_npz(directory, name: str, arrays: Mapping[str, np.ndarray]) -> None:
    # numpy's stub types **kwds with its allow_pickle: bool (no array is named so)
    save = lambda f: np.savez_compressed(f, **arrays)  # type: ignore[arg-type]
    atomic_write(directory / name, save, binary=True)


class ChunkWriter:
    """Buffers the statistics of a golden run's steps as the step returned them (device arrays:
    the step does not wait for them) and writes them as one `write_chunk` file at `flush` (the
    golden run flushes before each checkpoint and at the end) or once `chunk_steps` are
    buffered."""

    def __init__(self, directory, chunk_steps: int = CHUNK_STEPS):
        self._directory, self._chunk_steps = directory, int(chunk_steps)
        self._steps: list[int] = []
        self._packed: list[Any] = []

    def add(self, step: int, packed: Mapping[str, Any]) -> None:
        self._steps.append(int(step))
        self._packed.append(packed)
        if len(self._steps) >= self._chunk_steps:
            self.flush()

    def flush(self) -> None:
        """Write the buffered steps (if any) as one file and empty the buffer."""
        if self._steps:
            write_chunk(self._directory, self._steps, jax.device_get(self._packed))
        self._steps, self._packed = [], []


def _files(directory) -> list[tuple[int, int, Any]]:
    """(first step, last step, path) of every statistics file in `directory`: chunks
    `<first>-<last>.npz` and the `<step>.npz` of runs profiled before chunks, in step order."""
    if not directory.exists():
        return []
    out = []
    for p in directory.glob("*.npz"):
        m = _CHUNK.fullmatch(p.stem)
        if m:
            out.append((int(m[1]), int(m[2]), p))
        elif p.stem.isdigit():
            out.append((int(p.stem), int(p.stem), p))
    return sorted(out, key=lambda f: (f[0], f[1]))


def _load(path) -> dict[str, np.ndarray]:
    """The arrays of one statistics file, stacked over its steps (a `<step>.npz` as a chunk of
    one step); cached by path, modification time and size, so a walk over many steps reads
    each chunk once. A PeatError naming the file if it is damaged."""
    try:
        st = path.stat()
        return _load_cached(str(path), st.st_mtime_ns, st.st_size)
    except (OSError, ValueError, KeyError, IndexError, EOFError, zipfile.BadZipFile) as e:
        raise PeatError(f"{path} cannot be read ({e}); it is damaged: profile the run again "
                        "into a new directory") from None


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int, size: int) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in _ARRAYS}
        if "steps" not in z.files:  # a `<step>.npz`: one step, unstacked
            step = int(pathlib.Path(path).stem)
            return _read_only({"steps": np.asarray([step], np.int64),
                               **{k: v[None] for k, v in arrays.items()}})
        steps = z["steps"]
    t = len(steps)
    if steps.ndim != 1 or any(v.shape[:1] != (t,) for v in arrays.values()) or \
            arrays["floats"].ndim != 3 or arrays["words"].ndim != 3:
        raise ValueError("its arrays are not stacked over its steps")
    return _read_only({"steps": steps.astype(np.int64), **arrays})


def _read_only(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays`, made read-only: they are cached and shared by every reader."""
    for v in arrays.values():
        v.flags.writeable = False
    return arrays


def recorded_steps(directory) -> list[int]:
    """The steps with statistics in `directory`, in order."""
    steps: set[int] = set()
    for first, last, p in _files(directory):  # a one-step file's name says its step
        steps.update(_load(p)["steps"].tolist() if first != last else [first])
    return sorted(steps)


def read_step(directory, step: int) -> dict[str, np.ndarray]:
    """The statistics of one step (read with `allow_pickle=False`): one array per name of
    `STATISTICS` over the recorded sites in index order, and `sample`; a PeatError if the file
    holding it is damaged, or none holds it."""
    step = int(step)
    for first, last, p in _files(directory):
        if first <= step <= last:
            arrays = _load(p)
            hit = np.flatnonzero(arrays["steps"] == step)
            if hit.size:
                return unpack({k: arrays[k][hit[0]] for k in _ARRAYS})
    raise PeatError(f"{directory} holds no statistics of step {step} (recorded: "
                    f"{_shown(recorded_steps(directory))}); compare the steps both runs recorded")


def _shown(steps: Sequence[int]) -> str:
    return (", ".join(map(str, steps[:10])) + (" ..." if len(steps) > 10 else "")) or "none"


def drop_steps(directory, start: int) -> None:
    """Remove the statistics of steps >= `start` from `directory` (a resumed golden run records
    them again): files holding only such steps are deleted, a chunk holding steps on both sides
    is rewritten with its steps < `start`."""
    for first, last, p in _files(directory):
        if last < start:
            continue
        if first < start:
            arrays = _load(p)
            keep = arrays["steps"] < start
            kept = arrays["steps"][keep]
            _write_npz(directory, f"{first}-{int(kept[-1])}.npz",
                       {k: v[keep] for k, v in arrays.items()})
        p.unlink()


def unpack(packed: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The host copy of one step's `pack`ed statistics as `read_step` returns them: one array
    per name of `STATISTICS` over the recorded sites in index order, and `sample`."""
    floats, words = np.asarray(packed["floats"]), np.asarray(packed["words"])
    return {"absmax": floats[:, 0], "mean": floats[:, 1], "rms": floats[:, 2],
            "zeros": floats[:, 3], "nonfinite": words[:, 0].astype(np.int64),
            "checksum": words[:, 1], "sample": np.asarray(packed["sample"])}
