"""Host side: a `Signature` from the device statistics of a leaf (`contract.LeafStats`, already
transferred), plus the few decisions cheaper on the host (block alignment and periodicity of the
error profiles, the grid a precision fits).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from peat_jax._src.analyzer.contract import LeafStats, Options, SampleStats, WorstStats, view2d
from peat_jax._src.analyzer.noise import (DEFAULT_REDUCTION_LENGTH, DISTRIBUTION_MIN_ELEMENTS,
                                          NOISE_FREE_SHARE, ConditioningFloor, NoiseFloor,
                                          RoundingFloor, analyzed_format, distribution_ok)
from peat_jax._src.analyzer.quantiles import ULP_QUANTILES
from peat_jax._src.analyzer.signature import (QUANTILES, BlockMatch, Bits, Counts, Errors,
                                              MAX_PERIOD, Permutation, Precision, Ratio, Signature,
                                              Structure, WorstElement)
from peat_jax._src.formats import FloatFormat


_GRID_SHARE = 0.99          # share of values a grid must hold
_MIN_BLOCK_PRECISION = 0.5  # block matches reported


def _ints(v) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


def _quantiles(qs, vals) -> dict:
    return {f"p{100 * q:g}": float(v) for q, v in zip(qs, vals)}


def _share(count, total: int) -> float:
    """count / total (device counts) in float64 on the host, 0 for no total: a share that
    meets a rule's threshold exactly (19 of 20: 0.95) reads below it in float32."""
    return float(count) / total if total else 0.0


def _counts(stats: LeafStats, n: int) -> Counts:
    w = stats.whole
    return Counts(
        elements=n, mismatched=int(w.mismatched),
        nonfinite_candidate=int(w.nonfinite_candidate),
        nonfinite_golden=int(w.nonfinite_golden), new_nonfinite=int(w.new_nonfinite),
        lost_nonfinite=int(w.lost_nonfinite), nan_for_infinite=int(w.nan_for_infinite),
        unjudged=int(w.unjudged),
        significant=int(w.significant),
        flushed=int(w.flushed), significant_not_flushed=int(w.significant_not_flushed),
        golden_flushed=int(w.golden_flushed), subnormal_golden=int(w.subnormal_golden),
        subnormal_candidate=int(w.subnormal_candidate))


def _errors(stats: LeafStats, n: int, options: Options) -> Errors:
    w, q, m = stats.whole, stats.sample.quantiles, stats.sample.moments
    n_sig = int(stats.sample.counts.significant)
    return Errors(
        max_abs=float(w.max_abs), max_ulp=int(w.max_ulp),
        max_floor_ratio=float(w.max_floor_ratio),
        abs_quantiles=_quantiles(QUANTILES, q.abs_error),
        rel_quantiles=_quantiles(QUANTILES, q.rel_error),
        floor_ratio_quantiles=_quantiles(QUANTILES, q.floor_ratio),
        ulp_histogram=_ints(stats.sample.histograms.ulp),
        bias_mean=float(m.bias_mean), bias_std_error=float(m.bias_std_error),
        bias_t=float(m.bias_t), error_slope=float(m.error_slope),
        geo_mean_rel_significant=float(m.geo_mean_rel_significant) if n_sig else 0.0,
        large_rel_significant=_share(stats.sample.counts.large_rel_significant, n_sig),
        sample_size=min(n, options.sample_size), sampled=n > options.sample_size)


def _bits(sample: SampleStats, f: FloatFormat) -> Bits:
    h, k = sample.histograms, sample.counts
    n_sig = int(k.significant)
    hist = _ints(h.differing_bits)
    return Bits(
        histogram=hist, sign=hist[f.sign_bit], exponent=sum(hist[f.mantissa_bits:f.sign_bit]),
        mantissa=sum(hist[:f.mantissa_bits]), popcount_histogram=_ints(h.popcount),
        significant_single_bit=_share(k.single_bit, n_sig),
        single_bit_histogram=_ints(h.single_bit), single_bit_set=_ints(h.single_bit_set),
        golden_bit_set=_ints(h.golden_bit_set), finite=int(k.finite),
        negated=_share(k.negated, n_sig), candidate_zero=_share(k.candidate_zero, n_sig),
        sign_differs=_share(k.sign_differs, n_sig),
        sign_agreement=(float(k.sign_agrees) / float(k.both_nonzero)
                        if int(k.both_nonzero) else 1.0))


def _noise(stats: LeafStats, options: Options, reduction_length: Optional[int],
           rounding: Optional[RoundingFloor] = None) -> NoiseFloor:
    sc, q = stats.scales, stats.sample.quantiles
    if sc.golden_max_abs_error is None:
        return NoiseFloor(
            kind="dtype_bound", factor=options.noise_factor, ulp_allowance=options.ulp_allowance,
            abs_floor=float(sc.abs_floor),
            reduction_length=reduction_length or DEFAULT_REDUCTION_LENGTH,
            golden_max_abs_error=None, golden_max_ulp_error=None, golden_ulp_quantiles={},
            candidate_ulp_quantiles={}, distribution_ok=None, rms_golden=float(sc.rms))
    ucq = {f"p{int(100 * p)}": float(v) for p, v in zip(ULP_QUANTILES, q.candidate_ulp)}
    ugq = {f"p{int(100 * p)}": float(v) for p, v in zip(ULP_QUANTILES, q.golden_ulp)}
    dist_ok = None
    if int(stats.sample.counts.distribution) >= DISTRIBUTION_MIN_ELEMENTS:
        yardstick = ugq if rounding is None else {
            q: max(v, rounding.ulp_quantiles.get(q, 0.0)) for q, v in ugq.items()}
        dist_ok = distribution_ok(ucq, yardstick, options.noise_factor)
    k = stats.conditioning
    conditioning = None if k is None else ConditioningFloor(
        max_spread=float(k.max_spread), max_ratio=float(k.max_ratio), dominant=int(k.dominant),
        decisive=int(k.decisive))
    return NoiseFloor(
        kind="float64", factor=options.noise_factor, ulp_allowance=options.ulp_allowance,
        abs_floor=float(sc.abs_floor), reduction_length=reduction_length,
        golden_max_abs_error=float(sc.golden_max_abs_error),
        golden_max_ulp_error=float(sc.golden_max_ulp_error), golden_ulp_quantiles=ugq,
        candidate_ulp_quantiles=ucq, distribution_ok=dist_ok, rms_golden=float(sc.rms),
        conditioning=conditioning, rounding=rounding)


def _ratio(stats: LeafStats) -> Ratio:
    r, n = stats.sample.ratio, int(stats.sample.counts.ratio_elements)
    st = stats.structure
    rtol, spread = float(stats.scales.rel_tol), float(r.spread)
    return Ratio(median=float(r.median), spread=spread, spread_p99=float(r.spread_p99),
                 tolerance=rtol, constant=bool(n >= 2 and spread <= rtol),
                 rows_constant=_share(st.rows_constant, int(st.rows_with_errors)),
                 n=n)


def _profile_stats(p: np.ndarray, per_index: int, blocks) -> tuple:
    """Block alignment and periodicity of an error profile (significant errors per index of one
    axis; `per_index`: elements per index; -1 everywhere when the gated stage did not run).

    Returns:
      (list of (block, pattern, precision, recall, start, stop), smallest period or None, first
      index with errors or -1, last or -1); ([], None, -1, -1) for a profile without errors.
    """
    p = np.asarray(p, np.int64)
    on = p > 0
    if not on.any():
        return [], None, -1, -1
    n = p.shape[0]
    total = max(int(p.sum()), 1)
    out = []
    for b in blocks:
        if n <= b:
            continue
        # the edges (first and last index of each block, and the axis' last) by strided sums;
        # the last index is counted apart only when it is no block's edge already
        last_apart = (n - 1) % b not in (0, b - 1)
        edges = int(p[::b].sum() + p[b - 1::b].sum() + (p[n - 1] if last_apart else 0))
        n_edges = len(range(0, n, b)) + len(range(b - 1, n, b)) + int(last_apart)
        start = (n // b) * b if n % b else n - b
        last_block = int(p[start:].sum())
        out.append((b, "edges", edges / total, edges / max(n_edges * per_index, 1), 0, n))
        out.append((b, "last_block", last_block / total,
                    last_block / max((n - start) * per_index, 1), start, n))
    period = None
    if not on.all():
        for q in range(2, min(n // 2, MAX_PERIOD) + 1):
            if np.array_equal(on[q:], on[:-q]):
                period = q
                break
    nz = np.nonzero(on)[0]
    return out, period, int(nz[0]), int(nz[-1])


def _structure(stats: LeafStats, shape, options: Options) -> Structure:
    st = stats.structure
    R, C, lead, _ = view2d(tuple(shape))
    blocks, period, span = [], {}, {}
    for axis, prof, per in ((-1, st.profile_cols, R), (-2, st.profile_rows, lead * C)):
        matches, period[axis], first, last = _profile_stats(prof, per, options.blocks)
        span[axis] = (first, last)
        for pattern in ("edges", "last_block"):
            cands = [m for m in matches if m[1] == pattern and m[2] >= _MIN_BLOCK_PRECISION]
            if cands:
                b, _, prec, rec, lo, hi = max(cands, key=lambda m: (min(m[2], m[3]), m[3], m[0]))
                blocks.append(BlockMatch(axis=axis, block=b, pattern=pattern, precision=prec,
                                         recall=rec, start=lo, stop=hi))
    return Structure(
        rows_with_errors=int(st.rows_with_errors), cols_with_errors=int(st.cols_with_errors),
        full_rows=tuple(int(v) for v in st.full_rows if v >= 0),
        full_cols=tuple(int(v) for v in st.full_cols if v >= 0),
        n_full_rows=int(st.n_full_rows), n_full_cols=int(st.n_full_cols),
        in_full_rows=_share(st.in_full_rows, int(stats.whole.significant)),
        in_full_cols=_share(st.in_full_cols, int(stats.whole.significant)),
        span=span, blocks=tuple(blocks), period=period, n_rows=R, n_cols=C)


def _grid_bits(tz_hist: np.ndarray, nmant: int) -> int:
    """Mantissa bits used by >= 99% of values: nmant - (largest k with >= 99% having >= k
    trailing zero bits)."""
    total = tz_hist.sum()
    if total == 0:
        return nmant
    at_least = np.cumsum(tz_hist[::-1])[::-1] / total  # share with tz >= k
    k = int(np.max(np.nonzero(at_least >= _GRID_SHARE)[0]))
    return nmant - k


def _precision(stats: LeafStats, counts: Counts, f: FloatFormat) -> Precision:
    s = stats.sample
    rel_mis = float(s.quantiles.rel_error_mismatched[0])
    eff_bits = None
    if counts.mismatched >= 0.5 * counts.elements and rel_mis > 0 and math.isfinite(rel_mis):
        eff_bits = -math.log2(rel_mis) - 2.0
    tz_c = np.asarray(s.histograms.candidate_trailing_zeros)
    cg = _grid_bits(tz_c, f.mantissa_bits)
    gg = _grid_bits(np.asarray(s.histograms.golden_trailing_zeros), f.mantissa_bits)
    dropped = f.mantissa_bits - cg
    return Precision(
        candidate_grid_bits=cg, golden_grid_bits=gg, effective_mantissa_bits=eff_bits,
        on_narrow_grid=(gg - cg >= 2 and int(tz_c.sum()) > 0),
        max_ulp_on_grid=float(s.grid.max_ulp[dropped]),
        beyond_half_ulp_on_grid=(float(s.grid.beyond_half[dropped]) /
                                 max(int(s.counts.mismatched_finite), 1)))


def _permutation(stats: LeafStats) -> Permutation:
    pv, pd, tv = (int(v) for v in stats.permutation)
    return Permutation(is_permutation=None if pv < 0 else pv == 0,
                       is_transpose=None if tv < 0 else tv == 0,
                       sorted_differ=None if pd < 0 else pd)


def _worst(w: WorstStats, counts: Counts, shape, f: FloatFormat) -> tuple[WorstElement, ...]:
    noise_free = counts.mismatched - counts.significant <= NOISE_FREE_SHARE * counts.elements
    out = []
    for i, score, cu, gu, cv, gv, nb, fl in zip(*(np.asarray(v) for v in w)):
        if i < 0 or score < 0:
            continue
        x = int(cu) ^ int(gu)
        out.append(WorstElement(
            index=tuple(int(v) for v in np.unravel_index(int(i), tuple(shape))) if shape else (),
            candidate=float(cv), golden=float(gv), candidate_bits=int(cu), golden_bits=int(gu),
            differing_bits=tuple(b for b in range(f.bits) if (x >> b) & 1),
            floor_ratio=float(score), noise_bits=0 if noise_free else int(nb), floor=float(fl)))
    return tuple(out)


def build_signature(path: str, shape, dtype, comparison: str, stats: LeafStats, options: Options,
                    reduction_length: Optional[int],
                    rounding: Optional[RoundingFloor] = None) -> Signature:
    """The `Signature` of a float leaf from its transferred `LeafStats` (host values), with its
    `RoundingFloor` where the caller measured one."""
    f = analyzed_format(dtype)
    counts = _counts(stats, int(math.prod(shape)))
    return Signature(
        path=path, shape=tuple(shape), dtype=f.name, comparison=comparison, counts=counts,
        errors=_errors(stats, counts.elements, options), bits=_bits(stats.sample, f),
        noise=_noise(stats, options, reduction_length, rounding), ratio=_ratio(stats),
        structure=_structure(stats, shape, options), precision=_precision(stats, counts, f),
        permutation=_permutation(stats), worst=_worst(stats.worst, counts, shape, f))


def nonfloat_signature(path: str, shape, dtype: str, comparison: str, n_mis: int,
                       first: Optional[tuple[float, float, tuple[int, ...]]]) -> Signature:
    """The `Signature` of an integer / bool leaf: `n_mis` mismatched elements, `first` the
    (candidate, golden, index) of the first mismatch (None when there is none)."""
    n = int(math.prod(shape))
    counts = Counts(
        elements=n, mismatched=n_mis, nonfinite_candidate=0, nonfinite_golden=0,
        new_nonfinite=0, lost_nonfinite=0, nan_for_infinite=0, unjudged=0, significant=n_mis,
        flushed=0,
        significant_not_flushed=n_mis, golden_flushed=0, subnormal_golden=0,
        subnormal_candidate=0)
    errors = Errors(
        max_abs=0.0, max_ulp=0, max_floor_ratio=0.0, abs_quantiles={}, rel_quantiles={},
        floor_ratio_quantiles={}, ulp_histogram=(), bias_mean=0.0, bias_std_error=0.0,
        bias_t=0.0, error_slope=float("nan"), geo_mean_rel_significant=0.0,
        large_rel_significant=0.0, sample_size=n, sampled=False)
    worst: tuple[WorstElement, ...] = ()
    if first is not None:
        c, g, index = first
        worst = (WorstElement(index=index, candidate=c, golden=g, candidate_bits=0,
                              golden_bits=0, differing_bits=(), floor_ratio=float("inf")),)
    return Signature(path=path, shape=tuple(shape), dtype=dtype, comparison=comparison,
                     counts=counts, errors=errors, bits=None, noise=None, ratio=None,
                     structure=None, precision=None, permutation=None, worst=worst)
