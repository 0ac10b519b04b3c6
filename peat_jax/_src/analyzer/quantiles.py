"""Host side: the sample's nearest-rank quantiles and ratio statistics, from the sort keys
`sample.sample_stats` returns unsorted.

The keys are sorted here, in NumPy: XLA:CPU sorts with a compiled comparator called per
comparison, and the batched sort of 4-6 keys of 8192 elements was about two thirds of
`sample_program`'s run (1.9 of 3.0 ms on 2 CPU cores) against ~0.3 ms in NumPy; on a GPU
the keys are one more slice of the same transfer (32-48 KiB per key). The integer keys sort
the same on either side, and the rank arithmetic is float32's, as it was on the device.
"""
from __future__ import annotations

import numpy as np

from peat_jax._src.analyzer.bits import ranks
from peat_jax._src.analyzer.contract import RatioStats, SampleQuantiles, SampleStats
from peat_jax._src.analyzer.signature import QUANTILES

ULP_QUANTILES = (0.5, 0.9, 0.99, 1.0)
"""The quantiles of the candidate's and the golden's ULP error against the float64 reference."""

_RATIO_RANKS = (0.005, 0.5, 0.995, 1.0)   # p0.5, median, p99.5, max of the ratio

# rows of `SampleStats.keys`, in order (`sample._sort_keys`)
ABS_ERROR, REL_ERROR, FLOOR_RATIO, RATIO, CANDIDATE_ULP, GOLDEN_ULP = range(6)


def _as_float32(keys) -> np.ndarray:
    """Non-negative float32 sort keys (`bits.nonneg_key`) back to their floats."""
    return np.asarray(keys, np.int32).view(np.float32)


def monotonic_to_float32(mono) -> np.ndarray:
    """Signed sort keys (`bits.signed_key`: float32's monotonic line) back to their floats
    (-0 is 0 on the line: it comes back as +0)."""
    mono = np.asarray(mono, np.int32)
    mag = np.abs(mono.astype(np.int64)).astype(np.uint32)
    return np.where(mono < 0, mag | np.uint32(1 << 31), mag).astype(np.uint32).view(np.float32)


def with_quantiles(s: SampleStats) -> SampleStats:
    """`s` (host arrays, as `sample_program` returned it) with its ``quantiles`` and ``ratio``
    computed from its ``keys``, which it drops. NaN where no element of the sample qualifies."""
    srt = np.sort(np.asarray(s.keys), axis=1)
    n, c = srt.shape[1], s.counts
    nan = np.float32(np.nan)

    def at(row, valid, qs):
        v = _as_float32(srt[row][ranks(valid, qs, n, np)])
        return np.where(valid > 0, v, nan)

    # a finite element that matches has relative error exactly 0, so the mismatched ones are
    # the last `mismatched_finite` of the finite ones in sorted order
    m = c.mismatched_finite
    pos = np.minimum(c.finite - m + ranks(m, (0.5,), n, np), n - 1)
    reference = len(srt) > RATIO + 1
    quantiles = SampleQuantiles(
        abs_error=at(ABS_ERROR, c.finite, QUANTILES),
        rel_error=at(REL_ERROR, c.finite, QUANTILES),
        floor_ratio=at(FLOOR_RATIO, c.finite, QUANTILES),
        rel_error_mismatched=np.where(m > 0, _as_float32(srt[REL_ERROR][pos]), nan),
        candidate_ulp=at(CANDIDATE_ULP, c.distribution, ULP_QUANTILES) if reference else None,
        golden_ulp=at(GOLDEN_ULP, c.distribution, ULP_QUANTILES) if reference else None)
    rq = monotonic_to_float32(srt[RATIO][ranks(c.ratio_elements, _RATIO_RANKS, n, np)])
    rmin = monotonic_to_float32(srt[RATIO][0])
    med = rq[1]
    scale = np.maximum(np.abs(med), np.float32(1e-30))
    ok = c.ratio_elements > 0
    ratio = RatioStats(
        median=np.where(ok, med, nan),
        spread=np.where(ok, np.maximum(rq[3] - med, med - rmin) / scale, nan),
        spread_p99=np.where(ok, np.maximum(rq[2] - med, med - rq[0]) / scale, nan))
    return s._replace(quantiles=quantiles, ratio=ratio, keys=None)
