"""Device side: the statistics of one leaf (`leaf_stats`): jitted programs, `shape_program`
compiled once per shapes, dtypes, device and `Options`, `sample_program` once per dtypes and
`Options` (the sample is padded to a fixed size, so every shape shares it), and
`detail_program`, like `shape_program`, but compiled and run only for a leaf with significant
errors.

Stages, in order: the leaf-wide scales of the floor (`elements.leaf_scales`); exact whole-leaf
counts and maxima (`whole_leaf`); distributions over the sample (`sample.sample_stats`); and,
only when significant errors exist, the worst elements, the mask's structure and the permutation
checks (`structure`). What comes back is a `contract.LeafStats`.

`shape_program` and `detail_program` are each jitted twice (`LeafProgram`): as XLA compiles by
default, and, for a leaf of at most `SMALL_LEAF` elements on a CPU, at XLA:CPU's backend
optimisation level 0, which compiles in about 60% of the time and runs as fast at that size.
`sample_program` runs on a padded sample of fixed size whatever the leaf, where level 0 runs
~4 ms slower an analysis: it keeps XLA's default.
"""
from __future__ import annotations

import functools
import math
from typing import TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax._src._jax import cache_size, x64_enabled
from peat_jax._src.analyzer.bits import Operand
from peat_jax._src.analyzer.contract import (ConditioningStats, LeafScales, LeafStats, Options,
                                             PermutationStats, SampleStats, StructureStats,
                                             WholeLeaf, WorstStats, view2d)
from peat_jax._src.analyzer.elements import (Elements, Scales, elements, i32, leaf_scales,
                                             local_scale_2d, sample_index)
from peat_jax._src.analyzer.noise import NOISE_FREE_SHARE, analyzed_format
from peat_jax._src.analyzer.quantiles import with_quantiles
from peat_jax._src.analyzer.sample import Gathered, gather_sample, sample_stats
from peat_jax._src.analyzer.structure import no_detail, permutation, structure
from peat_jax._src.formats import FloatFormat
from peat_jax._src.sums import vreduce

T = TypeVar("T")


def _ulp_distance(e: Elements, f: FloatFormat):
    """Each element's ULP distance, 0 where either is NaN (`wide_uint`): what
    `WholeLeaf.max_ulp` is the maximum of."""
    return jnp.where(e.dc.nan | e.dg.nan, 0, e.ulp_dist).astype(f.wide_uint)


def _rare_counts(c, g, r, s: Scales, options: Options, f: FloatFormat, eloc):
    """(nonfinite c, nonfinite g, new nonfinite, lost nonfinite, NaN for an infinite golden,
    unjudged, flushed, significant flushed, golden flushed, subnormal g, subnormal c) counts and
    the largest ULP distance, in one reduction."""
    e = elements(c, g, r, s, options, f, eloc)
    dc, dg = e.dc, e.dg
    return vreduce(
        [i32(dc.nonfinite), i32(dg.nonfinite), i32(dc.nonfinite & ~dg.nonfinite),
         i32(dg.nonfinite & ~dc.nonfinite), i32(dc.nan & dg.nonfinite & ~dg.nan),
         i32(e.unjudged), i32(e.flushed), i32(e.significant & e.flushed),
         i32(e.mismatched & dg.zero & dc.subnormal), i32(dg.subnormal), i32(dc.subnormal),
         _ulp_distance(e, f)], ["sum"] * 11 + ["max"],
        (0, 1))


def whole_leaf(c, g, r, s: Scales, options: Options, f: FloatFormat) -> tuple[WholeLeaf, jax.Array]:
    """Exact whole-leaf counts and maxima of `Operand`s `c`, `g` (and the float64 reference `r`
    or None), and the significant elements of each row of the 2-D view (int32 [R], kept on the
    device for `structure`).

    One variadic reduction computes the common counts and maxima; the rare ones (non-finite,
    subnormal and flush counts) are counted in a second pass only when the first saw any. The
    first marks a rare element (non-finite or subnormal, in either operand) by a ULP distance no
    two floats have (`wide_uint`'s largest) rather than counting it, and the second pass takes
    the largest ULP distance again: five reductions in one loop, where six made XLA:CPU's loop
    much slower (16M float32 elements, 2 cores: `shape_program` 1.45-1.52x a bare jitted
    max|a-b| against 1.85-2.15x with six).
    """
    R, C, _, _ = view2d(c.shape)
    c, g = c.reshape(R, C), g.reshape(R, C)
    r = None if r is None else r.reshape(R, C)
    eloc = local_scale_2d(s, R, C)
    el = elements(c, g, r, s, options, f, eloc)
    dc, dg = el.dc, el.dg
    rare = dc.nonfinite | dg.nonfinite | dc.subnormal | dg.subnormal
    # above every distance: two floats are at most twice the infinity's magnitude bits apart
    marked = jnp.asarray(np.iinfo(f.wide_uint).max, f.wide_uint)
    zero_f = jnp.zeros((), el.err_cg.dtype)
    kinds = ["sum", "sum", "max", "max", "max"]
    # per row first: XLA:CPU splits a reduction that keeps the rows over its threads, and runs
    # one to a scalar on a single thread
    per_row = vreduce(
        [i32(el.mismatched), i32(el.significant), jnp.where(el.finite, el.err_cg, zero_f),
         jnp.where(el.finite, el.ratio, 0).astype(el.err_cg.dtype),
         jnp.where(rare, marked, _ulp_distance(el, f))], kinds, (1,))
    n_mis, n_sig, max_abs, max_ratio, max_ulp = vreduce(per_row, kinds, (0,))

    def none(_):
        return tuple(jnp.zeros((), jnp.int32) for _ in range(11)) + (max_ulp,)

    (nf_c, nf_g, new_nf, lost_nf, nan_inf, unjudged, ftz, sig_ftz, gold_fl, sub_g, sub_c,
     max_ulp) = lax.cond(max_ulp == marked,
                         lambda _: _rare_counts(c, g, r, s, options, f, eloc), none, None)
    padding = c.size - s.rows * s.cols    # a bucket's NaNs, equal in candidate and golden
    nf_c, nf_g = nf_c - padding, nf_g - padding
    return WholeLeaf(
        mismatched=n_mis, significant=n_sig, nonfinite_candidate=nf_c, nonfinite_golden=nf_g,
        new_nonfinite=new_nf, lost_nonfinite=lost_nf, nan_for_infinite=nan_inf,
        unjudged=unjudged, flushed=ftz,
        significant_not_flushed=n_sig - sig_ftz, golden_flushed=gold_fl,
        subnormal_golden=sub_g, subnormal_candidate=sub_c, max_abs=max_abs,
        max_floor_ratio=max_ratio, max_ulp=max_ulp), per_row[1]


def conditioning_stats(c, g, r, s: Scales, options: Options,
                       f: FloatFormat) -> ConditioningStats:
    """The `ConditioningStats` of `Operand`s `c`, `g` against the float64 reference `r`, given
    the conditioning spread ``s.K``: one more whole-leaf reduction."""
    R, C, _, _ = view2d(c.shape)
    el = elements(c.reshape(R, C), g.reshape(R, C), r.reshape(R, C), s, options, f,
                  local_scale_2d(s, R, C))
    fin = el.finite
    decisive = el.mismatched & fin & (el.err > el.noise_floor) & ~(el.err > el.floor)
    max_ratio, dominant, n_decisive = vreduce(
        [jnp.where(fin, el.floor / el.noise_floor, 1.0), i32(el.conditioned & fin),
         i32(decisive)], ["max", "sum", "sum"], (0, 1))
    return ConditioningStats(max_spread=jnp.max(s.K), max_ratio=max_ratio, dominant=dominant,
                             decisive=n_decisive)


def _median(x, n):
    """The median of the first `n` (an int, or traced) of the finite values `x`."""
    v = jnp.sort(jnp.where(jnp.arange(x.shape[0]) < n, x, jnp.inf))
    return 0.5 * (v[(n - 1) // 2] + v[n // 2])


def _relative_tolerance(s: Scales, r, options: Options, f: FloatFormat):
    """Relative tolerance of ratio tests: twice the typical floor at |g| = rms, relative (at
    least 4 eps), float32."""
    typical = s.abs_floor if r is None else options.noise_factor * _median(s.E_row, s.rows)
    rel_floor = options.ulp_allowance * f.eps + typical / jnp.maximum(s.rms, 1e-30)
    return jnp.maximum(2.0 * rel_floor, 4.0 * f.eps).astype(jnp.float32)


def _in_flat_order(shape, extent):
    """(flat positions, valid) that gather a bucket's leaf from its padded `shape` in the leaf's
    own flat order, then padding (the last position, a NaN, as its own sample would be padded)."""
    rows, cols = extent
    k = jnp.arange(math.prod(shape), dtype=jnp.int32)
    valid = k < rows * cols
    return jnp.where(valid, (k // cols) * shape[-1] + k % cols, k.shape[0] - 1), valid


SMALL_LEAF = 1 << 16
"""Leaves of at most this many elements run `LeafProgram.small` on a CPU. Measured on 2 cores
(jax 0.10.2): `shape_program` compiles in 0.6-0.7 s against 1.0 s at XLA's default, and an
analysis takes 2.8 against 2.7 ms at 4,160 elements, 3.9 against 3.1 ms at 65,792; at 16M
elements level 0 runs 30x slower (a loop XLA's default vectorises)."""

LEVEL_0 = {"xla_backend_optimization_level": 0}
"""The compiler options of `LeafProgram.small`."""


class LeafProgram:
    """A statistics program over a whole leaf (its first argument), jitted twice with `options`
    static: `default` as XLA compiles, `small` at `LEVEL_0` for a leaf of at most `SMALL_LEAF`
    elements on a CPU (see the module docstring). Called, it runs the one `for_leaf` picks."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.default = jax.jit(fn, static_argnames=("options",))
        self.small = jax.jit(fn, static_argnames=("options",), compiler_options=LEVEL_0)

    def for_leaf(self, c: jax.Array):
        """`small` for a concrete array `c` of at most `SMALL_LEAF` elements on CPU devices (a
        NumPy array: on this process's first device, where `api._home` commits it), else
        `default`."""
        devices = c.devices() if isinstance(c, jax.Array) else jax.local_devices()[:1]
        small = np.size(c) <= SMALL_LEAF and all(d.platform == "cpu" for d in devices)
        return self.small if small else self.default

    def __call__(self, c, *args, **kwargs):
        return self.for_leaf(c)(c, *args, **kwargs)

    def _cache_size(self) -> int:
        """Executables both have compiled (what `_jax.cache_size` reads of a jitted function)."""
        return cache_size(self.default) + cache_size(self.small)


@LeafProgram
def shape_program(c, g, r, options: Options, k=None, extent=None, m=None):
    """Everything but the sample's distributions and the stages of `detail_program`, compiled
    once per (shapes, dtypes, options) (a `LeafProgram`).

    `extent`: None for a leaf as it is; for a leaf padded into a bucket (`analyzer.bucket`),
    its (rows, cols) as int32 scalars, so that every leaf of the bucket shares the program.
    `m`: the rounding spread of the reference's Monte Carlo samples or None (`leaf_scales`).

    Returns:
      (a `LeafStats` whose ``sample``, ``worst``, ``structure`` and ``permutation`` are None,
      the `Gathered` sample, the leaf's `Scales` without its per-row, per-column and
      per-element arrays, noise_free, the significant elements of each row of the 2-D view):
      `sample_program` takes the sample, the scales and noise_free, `detail_program` the
      scales and the rows' counts.
    """
    f = analyzed_format(g.dtype)
    c, g = Operand(c, None, f), Operand(g, None, f)
    idx = sample_index(c.size, options.sample_size)
    s = leaf_scales(c, g, r, idx, options, f, k, extent, m)
    whole, row_cnt = whole_leaf(c, g, r, s, options, f)
    rel_tol = _relative_tolerance(s, r, options, f)
    noise_free = (whole.mismatched - whole.significant) <= NOISE_FREE_SHARE * s.rows * s.cols
    # the sample's statistics come from sample_program, the rest from detail_program: leaf_stats
    # puts them here
    stats = LeafStats(
        whole=whole, sample=cast(SampleStats, None), worst=cast(WorstStats, None),
        structure=cast(StructureStats, None), permutation=cast(PermutationStats, None),
        scales=LeafScales(rms=s.rms, abs_floor=s.abs_floor, rel_tol=rel_tol,
                          golden_max_abs_error=s.E, golden_max_ulp_error=s.U),
        conditioning=None if s.K is None else conditioning_stats(c, g, r, s, options, f))
    valid = None
    if extent is not None:
        idx, valid = _in_flat_order(c.shape, extent)
    return (stats, gather_sample(c, g, r, idx, s, options, f, valid),
            s._replace(E_row=None, E_col=None, K=None, rows=None, cols=None, M_row=None,
                       M_col=None), noise_free,
            row_cnt)


@LeafProgram
def detail_program(c, g, r, scales: Scales, n_sig, rel_tol, row_cnt, options: Options, k=None,
                   extent=None, m=None) -> tuple[WorstStats, StructureStats, PermutationStats]:
    """The worst elements, the structure of the significant mask and the permutation checks
    (`structure`) of a leaf with `n_sig` > 0 significant elements, given what `shape_program`
    returned for it (`scales`, its `rel_tol` and the rows' counts): compiled only when a leaf
    of these shapes first fails, so a correct kernel never builds them. The per-row and
    per-column scales are computed again (maxima: exactly the same); the rms, a sum, is
    `scales`' own."""
    f = analyzed_format(g.dtype)
    c, g = Operand(c, None, f), Operand(g, None, f)
    s = leaf_scales(c, g, r, sample_index(c.size, options.sample_size), options, f, k, extent,
                    m)
    s = s._replace(rms=scales.rms, abs_floor=scales.abs_floor)
    worst, struct = structure(c, g, r, s, options, f, n_sig, rel_tol, row_cnt)
    return worst, struct, permutation(c, g, r, s, options, f, n_sig)


@functools.partial(jax.jit, static_argnames=("options",))
def sample_program(sample: Gathered, s: Scales, noise_free, options: Options) -> SampleStats:
    """`sample.sample_stats`, compiled once per (dtype, reference or not, options): the sample
    is padded to ``options.sample_size``, so leaves of every shape share it. Its quantiles
    and ratio statistics are None: `leaf_stats` computes them on the host from its keys."""
    return sample_stats(sample, s, options, analyzed_format(sample.g_vals.dtype), noise_free)


def leaf_stats(c, g, r, options: Options, k=None, extent=None, m=None) -> LeafStats:
    """The statistics of candidate `c` against golden `g` (same shape and float dtype), with the
    float64 reference `r` or None and, with `r`, the conditioning spread `k` (output units,
    `g`'s shape; its magnitude counts, a non-finite element as 0) or None, on the host:
    `shape_program`, then `sample_program` on its sample (dispatched without waiting; a new
    shape compiles only the first), both fetched in one transfer per dtype (`to_host`); then,
    only where that says significant errors exist, `detail_program` and a second transfer
    (else `structure.no_detail`, built on the host). `extent`: see `shape_program` (the
    operands then are a bucket's padded arrays); `m`: the rounding spread of the reference's
    Monte Carlo samples or None (`elements.leaf_scales`).

    Returns:
      A `LeafStats` of numpy scalars and small vectors (see `contract`); for a bucket, in the
      padded array's coordinates (`bucket.unpad` maps them back).
    """
    stats, sample, scales, noise_free, row_cnt = shape_program(c, g, r, options, k, extent, m)
    stats = to_host(stats._replace(sample=sample_program(sample, scales, noise_free, options)))
    stats = stats._replace(sample=with_quantiles(stats.sample))
    if stats.whole.significant > 0:
        worst, struct, perm = to_host(detail_program(
            c, g, r, scales, stats.whole.significant, stats.scales.rel_tol, row_cnt, options, k,
            extent, m))
    else:
        worst, struct, perm = _no_detail(tuple(c.shape), np.dtype(c.dtype), x64_enabled())
    return stats._replace(worst=worst, structure=struct, permutation=perm)


@functools.lru_cache(maxsize=256)
def _no_detail(shape: tuple, dtype: np.dtype, x64: bool
               ) -> tuple[WorstStats, StructureStats, PermutationStats]:
    """`structure.no_detail` of a leaf of `shape` and `dtype` as read-only host arrays (shared by
    the passing leaves of that shape)."""
    def read_only(x):
        x.flags.writeable = False
        return x

    return jax.tree.map(read_only, no_detail(shape, analyzed_format(dtype), x64))


def _groups(leaves) -> dict:
    """The positions of `leaves` by dtype, dtypes in order of first appearance."""
    groups: dict = {}
    for i, x in enumerate(leaves):
        groups.setdefault(x.dtype, []).append(i)
    return groups


@jax.jit
def _by_dtype(leaves):
    """The leaves flattened and concatenated, one vector per dtype (`_groups` order)."""
    return [jnp.concatenate([leaves[i].reshape(-1) for i in idx])
            for idx in _groups(leaves).values()]


def to_host(stats: T) -> T:
    """`stats` (a tree of device arrays: a `LeafStats`, or part of one) as numpy arrays, in one
    transfer per dtype: fetching its ~75 small arrays one by one costs ~13 us each on the CPU,
    and a round trip each on a GPU."""
    leaves, treedef = jax.tree_util.tree_flatten(stats)
    out = [None] * len(leaves)
    for flat, idx in zip(jax.device_get(_by_dtype(leaves)), _groups(leaves).values()):
        start = 0
        for i in idx:
            n = leaves[i].size
            out[i] = flat[start:start + n].reshape(leaves[i].shape)
            start += n
    return jax.tree_util.tree_unflatten(treedef, out)


@jax.jit
def nonfloat_stats(c, g):
    """(mismatched count, flat index of the first mismatch or 0) of integer / bool leaves."""
    mis = c != g
    return jnp.sum(i32(mis)), jnp.argmax(mis.reshape(-1)) if c.size else jnp.asarray(0)
