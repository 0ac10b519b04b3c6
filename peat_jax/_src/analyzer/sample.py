"""Device side: distribution statistics over the sample (the whole leaf when it is small).

Written as a few stacked reductions (every count and histogram in one over uint32 words, float
sums), to keep the compiled program small; the quantiles' sort keys are returned
unsorted (the host sorts them: `quantiles`).
"""
from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax.numpy as jnp
from jax import lax

from peat_jax._src.analyzer.bits import Operand, bit_length, nonneg_key, signed_key, take
from peat_jax._src.analyzer.contract import (GridFit, Moments, Options, RatioStats, SampleCounts,
                                             SampleHistograms, SampleQuantiles, SampleStats, view2d)
from peat_jax._src.analyzer.elements import Elements, Local, Scales, elements, i32, local_scale_flat
from peat_jax._src.formats import FloatFormat
from peat_jax._src.sums import row_sums


_LARGE_REL = 1.0 / 16
_HALF_GRID_ULP = 0.5625                    # 0.5 ULP of the grid, plus the golden's rounding


class _Sample(NamedTuple):
    """Per-element quantities of the sample, beyond `Elements`."""

    el: Elements
    rs: Any             # the float64 reference's sample, or None
    x: Any              # differing bits (XOR of the patterns, wide_uint)
    x_hi: Any           # differing bits at or above the element's noise bits
    single: Any         # significant, one differing bit above the noise
    negated: Any        # the golden negated (within the floor, unless noise free)
    rel: Any            # |c - g| / max(|g|, smallest normal)
    nonzero: Any        # both non-zero
    ratio_sel: Any      # finite, |g| >= rms(g), g normal: elements of the ratio statistics
    slope_sel: Any      # mismatched, finite, g normal: elements of the error slope
    dist_sel: Any       # finite (the reference too), noise floor >= conditioning floor:
    #                     elements of the distribution test


def _sample(el: Elements, rs, s: Scales, f: FloatFormat, noise_free) -> _Sample:
    dc, dg = el.dc, el.dg
    ut = f.wide_uint
    x = dc.pattern ^ dg.pattern
    nb = jnp.where(noise_free, 0, el.noise_bits).astype(ut)
    x_hi = x & ~((jnp.ones((), ut) << nb) - ut(1))
    ref = el.gv if rs is None else rs.astype(jnp.float64)
    negated = (x == ut(1 << f.sign_bit)) | (
        ~noise_free & el.finite & (jnp.abs(el.cv.astype(ref.dtype) + ref) <= el.floor) &
        (dc.negative != dg.negative))
    tiny = jnp.asarray(jnp.finfo(f.dtype).tiny, el.gv.dtype)
    g_normal = ~dg.zero & ~dg.subnormal
    dist_sel = el.finite & ~el.conditioned
    if rs is not None:
        dist_sel = dist_sel & jnp.isfinite(rs.astype(jnp.float64))
    return _Sample(
        el=el, rs=rs, x=x, x_hi=x_hi,
        single=el.significant & (lax.population_count(x_hi) == 1), negated=negated,
        rel=el.err_cg / jnp.maximum(jnp.abs(el.gv), tiny), nonzero=~dc.zero & ~dg.zero,
        ratio_sel=el.finite & (jnp.abs(el.gv) >= s.rms) & g_normal,
        slope_sel=el.mismatched & el.finite & (el.err_cg > 0) & g_normal, dist_sel=dist_sel)


def _counts_and_histograms(sm: _Sample, f: FloatFormat):
    """`SampleCounts`, the per-bit-position histograms [4, f.bits] and the one-hot histograms
    (ulp, popcount, candidate and golden trailing zeros), in one reduction (`bit_counts`) over
    uint32 words: the count masks packed as the bits of one flag word per element, the
    patterns (two words each for a 64-bit format) masked to the elements each histogram
    counts, and each small value v as the bit v of its one-hot words."""
    el, dc, dg = sm.el, sm.el.dc, sm.el.dg
    sig, fin = el.significant, el.finite
    both = fin & sm.nonzero
    masks = SampleCounts(
        finite=fin, significant=sig, mismatched=el.mismatched, single_bit=sm.single,
        negated=sig & sm.negated, candidate_zero=sig & dc.zero,
        sign_differs=sig & sm.nonzero & (dc.negative != dg.negative),
        sign_agrees=both & (dc.negative == dg.negative), both_nonzero=both,
        large_rel_significant=sig & (~fin | (sm.rel >= _LARGE_REL)), significant_finite=sig & fin,
        slope_elements=sm.slope_sel, mismatched_finite=el.mismatched & fin,
        ratio_elements=sm.ratio_sel, distribution=sm.dist_sel)
    flags = sum(m.astype(jnp.uint32) << jnp.uint32(k) for k, m in enumerate(masks))
    ut = f.wide_uint
    patterns = [jnp.where(m, v, ut(0)) for v, m in (
        (sm.x, el.mismatched), (sm.x_hi, sm.single), (sm.x_hi & dc.pattern, sm.single),
        (dg.pattern, fin))]
    if f.wide_bits == 64:   # each pattern as its low and high 32-bit words
        patterns = [w for v in patterns for w in (v.astype(jnp.uint32),
                                                   (v >> ut(32)).astype(jnp.uint32))]
    one_hot = _one_hot_words(sm, f)
    tot = bit_counts(jnp.stack([flags] + patterns + one_hot))
    counts = SampleCounts(*(tot[0, i] for i in range(len(masks))))
    per_bit = tot[1:1 + len(patterns)].reshape(4, f.wide_bits)[:, :f.bits]
    oh = tot[1 + len(patterns):].reshape(4, -1)
    mant = f.mantissa_bits + 1
    return counts, per_bit, (oh[0, :f.bits + 1], oh[1, :f.bits + 1], oh[2, :mant], oh[3, :mant])


def _one_hot_words(sm: _Sample, f: FloatFormat) -> list:
    """uint32 [n] words, ceil((f.bits + 1) / 32) for each of the ulp bit length, the popcount
    of the differing bits and the candidate's and golden's trailing zeros (values 0..f.bits):
    value v sets bit v % 32 of its word v // 32, where the histogram counts the element."""
    dc, dg = sm.el.dc, sm.el.dg

    def trailing_zeros(d):
        m = d.mantissa.astype(f.wide_int)   # a float64 mantissa's 52 bits need 64
        return jnp.minimum(lax.population_count((m & -m) - 1), f.mantissa_bits).astype(jnp.int32)

    vals = [bit_length(sm.el.ulp_dist, f), lax.population_count(sm.x).astype(jnp.int32),
            trailing_zeros(dc), trailing_zeros(dg)]
    ok = [~dc.nan & ~dg.nan, sm.el.mismatched, (dc.exponent > 0) & ~dc.nonfinite,
          (dg.exponent > 0) & ~dg.nonfinite]
    words = -(-(f.bits + 1) // 32)
    one = jnp.uint32(1)
    return [jnp.where(k & (v >> 5 == j), one << (v & 31).astype(jnp.uint32), jnp.uint32(0))
            for v, k in zip(vals, ok) for j in range(words)]


_LANES = 0x01010101   # bit 0 of each byte of a uint32
_BLOCK = 128          # elements summed per byte lane: each lane's sum stays below 256


def bit_counts(words):
    """int32 [S, 32]: for each row of uint32 `words` [S, n], how many of its words have each
    bit set (column p: bit p).

    Eight bits at a time (SWAR): shifted right by s and masked to bit 0 of each byte, a word's
    bytes hold its bits s, s + 8, s + 16, s + 24, and the sum of 128 such words holds each
    bit's count in its own byte, without carries. That is 8 shifts and masks per word, not 32,
    summed along the minor axis (`sums.row_sums`)."""
    s, n = words.shape
    words = jnp.pad(words, ((0, 0), (0, -n % _BLOCK))).reshape(s, 1, -1, _BLOCK)
    shifts = jnp.arange(8, dtype=jnp.uint32)[None, :, None, None]
    blocks, = row_sums([(words >> shifts) & jnp.uint32(_LANES)])
    lanes = (blocks[..., None] >> (jnp.uint32(8) * jnp.arange(4, dtype=jnp.uint32))) & 0xFF
    per_shift = jnp.sum(lanes.astype(jnp.int32), axis=2)        # [S, shift s, byte k]
    return jnp.swapaxes(per_shift, 1, 2).reshape(s, 32)        # column 8 k + s


def _sort_keys(sm: _Sample):
    """int32 [K, n]: the sort keys of every quantile (`quantiles.with_quantiles` sorts them on
    the host), in the rows `quantiles` names: non-negative errors and the ratio c / g; with a
    reference, the candidate's and the golden's ULP errors against it. Invalid elements and
    NaNs sort last."""
    el = sm.el
    fin = el.finite
    ratio = jnp.where(sm.ratio_sel, el.cv / jnp.where(sm.ratio_sel, el.gv, 1), 0).astype(
        jnp.float32)
    keys = [nonneg_key(el.err_cg, fin), nonneg_key(sm.rel, fin), nonneg_key(el.ratio, fin),
            signed_key(ratio, sm.ratio_sel)]
    if sm.rs is not None:
        rf = sm.rs.astype(jnp.float64)
        okr = sm.dist_sel
        keys += [nonneg_key(el.err / el.ulp, okr),
                 nonneg_key(jnp.abs(el.gv.astype(jnp.float64) - rf) / el.ulp, okr)]
    return jnp.stack(keys)


def _moments(sm: _Sample, counts: SampleCounts) -> Moments:
    """Float sums: bias (signed error vs r, or vs g), error slope, geometric mean rel error."""
    el, sel, fin = sm.el, sm.slope_sel, sm.el.finite
    if sm.rs is None:
        d = jnp.where(fin, el.cv - el.gv, 0).astype(jnp.float32)
    else:
        d = jnp.where(fin, el.cv.astype(jnp.float64) - sm.rs.astype(jnp.float64), 0).astype(
            jnp.float32)
    lx = jnp.where(sel, jnp.log2(jnp.where(sel, jnp.abs(el.gv), 1)), 0).astype(jnp.float32)
    ly = jnp.where(sel, jnp.log2(jnp.where(sel, el.err_cg, 1)), 0).astype(jnp.float32)
    lrel = jnp.where(el.significant & fin, jnp.log2(jnp.maximum(sm.rel, 1e-30)), 0).astype(
        jnp.float32)
    dmax = jnp.max(jnp.abs(d))
    dmax = jnp.where(dmax > 0, dmax, 1)
    d = d / dmax     # unit scale: squares of tiny errors would underflow
    s1 = jnp.sum(jnp.stack([d, lx, ly, lrel]), axis=1)
    nf, ns = jnp.maximum(counts.finite, 1), jnp.maximum(counts.slope_elements, 1)
    mean, mx, my = s1[0] / nf, s1[1] / ns, s1[2] / ns
    dx = jnp.where(sel, lx - mx, 0)
    s2 = jnp.sum(jnp.stack([jnp.where(fin, (d - mean) ** 2, 0), dx * dx,
                            dx * jnp.where(sel, ly - my, 0)]), axis=1)
    se = jnp.sqrt(s2[0] / jnp.maximum(nf - 1, 1) / nf)
    return Moments(
        bias_mean=mean * dmax, bias_std_error=se * dmax,
        bias_t=jnp.where(se > 0, mean / jnp.where(se > 0, se, 1), 0.0),
        error_slope=jnp.where(s2[1] > 0, s2[2] / jnp.where(s2[1] > 0, s2[1], 1), jnp.nan),
        geo_mean_rel_significant=jnp.exp2(s1[3] / jnp.maximum(counts.significant_finite, 1)))


def _grid_fit(el: Elements, f: FloatFormat) -> GridFit:
    """The error in ULPs of coarser grids (k mantissa bits dropped): is c the golden rounded to
    the grid?"""
    ks = jnp.arange(f.mantissa_bits + 1, dtype=jnp.float32)
    # one row per grid, the elements along the minor axis (row reductions vectorise)
    grid_ulp = jnp.exp2(-ks)[:, None] * el.ulp_dist.astype(jnp.float32)[None, :]
    mf = (el.mismatched & el.finite)[None, :]
    return GridFit(max_ulp=jnp.max(jnp.where(mf, grid_ulp, 0), axis=1),
                   beyond_half=row_sums([i32(mf & (grid_ulp > _HALF_GRID_ULP))])[0])


class Gathered(NamedTuple):
    """The sample of a leaf, padded to ``Options.sample_size`` elements (device arrays).

    Padding elements hold the same NaN in the candidate and the golden (and NaN in the
    reference): equal NaNs are neither mismatched nor finite, which excludes them from every
    sample statistic, so the sample's program serves every leaf shape."""

    c_vals: Any
    c_bits: Any
    g_vals: Any
    g_bits: Any
    r: Any = None               # float64 reference at the sample (None without one)
    noise: Any = None           # `Local.noise` at the sample (reference only)
    conditioning: Any = None    # `Local.conditioning` at the sample (given only)
    rounding: Any = None        # `Local.rounding` at the sample (a rounding spread given only)


def _padded(x, size: int, fill):
    return None if x is None else jnp.pad(x, (0, size - x.shape[0]), constant_values=fill)


def gather_sample(c, g, r, idx, s: Scales, options: Options, f: FloatFormat,
                  valid=None) -> Gathered:
    """The `Gathered` sample `idx` (None: the whole leaf) of `Operand`s `c`, `g`, the float64
    reference `r` (or None) and the local scales of the floor there; `valid` (or None: all)
    marks the positions of `idx` that are the leaf's, the others are a bucket's padding."""
    cs, gs = take(c, idx), take(g, idx)
    R, C, _, _ = view2d(c.shape)
    eloc = local_scale_flat(s, idx, c.size, R, C)
    if eloc is not None and valid is not None:
        eloc = Local(*(None if x is None else jnp.where(valid, x, 0.0) for x in eloc))
    size = options.sample_size
    nan = jnp.full((), jnp.nan, f.dtype)
    nan_bits = lax.bitcast_convert_type(nan, cs.bits.dtype)
    return Gathered(
        c_vals=_padded(cs.vals, size, nan), c_bits=_padded(cs.bits, size, nan_bits),
        g_vals=_padded(gs.vals, size, nan), g_bits=_padded(gs.bits, size, nan_bits),
        r=None if r is None else _padded(take(r, idx).astype(jnp.float64), size, jnp.nan),
        noise=None if eloc is None else _padded(eloc.noise, size, 0.0),
        conditioning=None if eloc is None else _padded(eloc.conditioning, size, 0.0),
        rounding=None if eloc is None else _padded(eloc.rounding, size, 0.0))


def sample_stats(sample: Gathered, s: Scales, options: Options, f: FloatFormat,
                 noise_free) -> SampleStats:
    """Distributions over the `Gathered` sample, given the leaf's `Scales` (its leaf-wide
    scalars: the local scales come with the sample).

    `noise_free` (traced bool): at most 1% of the elements differ within the noise floor
    (`NOISE_FREE_SHARE`), so every differing bit of a significant element belongs to the fault;
    otherwise bits below each element's noise bits are ignored by the single-bit statistics,
    and a negation is recognised within the floor.
    """
    cs = Operand(sample.c_vals, sample.c_bits, f)
    gs = Operand(sample.g_vals, sample.g_bits, f)
    rs = sample.r
    eloc = None if sample.noise is None else Local(sample.noise, sample.conditioning,
                                                   sample.rounding)
    el = elements(cs, gs, rs, s, options, f, eloc)
    sm = _sample(el, rs, s, f, noise_free)
    counts, per_bit, (ulp, popcount, tz_c, tz_g) = _counts_and_histograms(sm, f)
    histograms = SampleHistograms(
        differing_bits=per_bit[0], single_bit=per_bit[1], single_bit_set=per_bit[2],
        golden_bit_set=per_bit[3], ulp=ulp, popcount=popcount, candidate_trailing_zeros=tz_c,
        golden_trailing_zeros=tz_g)
    # quantiles and ratio: on the host, from the keys (`quantiles.with_quantiles`)
    return SampleStats(counts=counts, histograms=histograms,
                       quantiles=cast(SampleQuantiles, None), ratio=cast(RatioStats, None),
                       moments=_moments(sm, counts), grid=_grid_fit(el, f),
                       keys=_sort_keys(sm))
