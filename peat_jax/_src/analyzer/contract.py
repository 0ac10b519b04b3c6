"""The contract between the host and the device side of the analyzer.

`Options` goes in (a static argument of the jitted statistics: one compilation per distinct
value); `LeafStats` comes out: a tree of NamedTuples of device scalars and small vectors, the
only thing transferred back. Counts are int32, error magnitudes are in output units (float32 or
float64), ULP quantities in ULPs of the golden's dtype. Fields marked "reference only" are None
without a float64 reference; "-1" marks a stage that did not run (gated) or an empty slot.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple


Array = Any


class Options(NamedTuple):
    """Static options of the statistics (hashable)."""

    noise_factor: float        # F
    ulp_allowance: float       # a, ULPs
    bound_coef: float          # F * eps_acc * sqrt(K) (dtype bound only)
    sample_size: int
    blocks: tuple[int, ...]    # tile sizes tested for block alignment


class LeafScales(NamedTuple):
    """The leaf-wide scales the floor was set from (output units)."""

    rms: Array                 # rms of the finite golden values (sample)
    abs_floor: Array           # largest absolute part of the floor
    rel_tol: Array             # relative tolerance of ratio tests (dimensionless)
    golden_max_abs_error: Array = None   # E (reference only)
    golden_max_ulp_error: Array = None   # U, ULPs (reference only)


class WholeLeaf(NamedTuple):
    """Exact counts and maxima over the whole leaf (see `Counts` and `Errors`)."""

    mismatched: Array
    significant: Array
    nonfinite_candidate: Array
    nonfinite_golden: Array
    new_nonfinite: Array
    lost_nonfinite: Array
    nan_for_infinite: Array
    unjudged: Array
    flushed: Array
    significant_not_flushed: Array
    golden_flushed: Array
    subnormal_golden: Array
    subnormal_candidate: Array
    max_abs: Array
    max_floor_ratio: Array
    max_ulp: Array


class SampleCounts(NamedTuple):
    """Elements of the sample satisfying each condition."""

    finite: Array                  # finite in both
    significant: Array
    mismatched: Array
    single_bit: Array              # significant, one differing bit above the noise bits
    negated: Array                 # significant, the golden negated
    candidate_zero: Array          # significant, candidate +-0
    sign_differs: Array            # significant, both non-zero, opposite signs
    sign_agrees: Array             # finite, both non-zero, same sign
    both_nonzero: Array            # finite, both non-zero
    large_rel_significant: Array   # significant with relative error >= 1/16 (or non-finite)
    significant_finite: Array
    slope_elements: Array          # mismatched elements the error slope is fitted on
    mismatched_finite: Array
    ratio_elements: Array          # finite with |g| >= rms(g) (ratio statistics)
    distribution: Array            # elements of the distribution test (reference only: finite,
    #                                the noise floor at least the conditioning floor)


class SampleHistograms(NamedTuple):
    """Histograms over the sample (int32 vectors)."""

    differing_bits: Array      # per bit position: mismatched elements differing there
    single_bit: Array          # per position: single-bit significant elements flipped there
    single_bit_set: Array      # per position: of those, the candidate has the bit set
    golden_bit_set: Array      # per position: finite golden values with the bit set
    ulp: Array                 # by bit length of the ULP distance (bucket 0: equal)
    popcount: Array            # mismatched elements by number of differing bits
    candidate_trailing_zeros: Array  # normal candidates by trailing zero mantissa bits
    golden_trailing_zeros: Array


class SampleQuantiles(NamedTuple):
    """Nearest-rank quantiles over the sample (NaN when no element qualifies)."""

    abs_error: Array           # at QUANTILES, output units
    rel_error: Array           # at QUANTILES
    floor_ratio: Array         # at QUANTILES
    rel_error_mismatched: Array  # median over mismatched finite elements (1-vector)
    candidate_ulp: Array = None  # p50, p90, p99, p100 of |c - r| / ulp(r) (reference only)
    golden_ulp: Array = None     # the same of |g - r| / ulp(r) (reference only)


class RatioStats(NamedTuple):
    """The ratio c / g over finite elements with |g| >= rms(g) (see `Ratio`)."""

    median: Array
    spread: Array
    spread_p99: Array


class Moments(NamedTuple):
    """Float sums over the sample (see `Errors`)."""

    bias_mean: Array           # output units
    bias_std_error: Array      # output units
    bias_t: Array
    error_slope: Array
    geo_mean_rel_significant: Array


class GridFit(NamedTuple):
    """The error in ULPs of coarser grids, per mantissa bits dropped k = 0..nmant."""

    max_ulp: Array             # largest (mismatched finite elements)
    beyond_half: Array         # count more than 0.5625 ULP of the grid away


class SampleStats(NamedTuple):
    """Distribution statistics over the sample."""

    counts: SampleCounts
    histograms: SampleHistograms
    quantiles: SampleQuantiles   # None as `sample_program` returns it (computed on the host)
    ratio: RatioStats            # likewise
    moments: Moments
    grid: GridFit
    keys: Array = None           # int32 [K, n]: the quantiles' sort keys, unsorted (device
    #                              side only: `quantiles.with_quantiles` sorts and drops them)


class WorstStats(NamedTuple):
    """The worst significant elements, worst first (vectors of length min(N_WORST, size))."""

    index: Array               # flat index (-1: empty slot)
    score: Array               # error / floor (inf: non-finite; -1: not significant)
    candidate_bits: Array      # bit patterns (unsigned)
    golden_bits: Array
    candidate: Array           # values, float32 (float64 for a float64 leaf)
    golden: Array
    noise_bits: Array          # bit length of floor / ULP
    floor: Array               # output units, float32 (float64 for a float64 leaf)


class StructureStats(NamedTuple):
    """Structure of the significant mask over the 2-D view (see `Structure`)."""

    profile_cols: Array        # significant per index of axis -1
    profile_rows: Array        # significant per index of axis -2
    rows_with_errors: Array
    cols_with_errors: Array
    full_rows: Array           # up to 8 indices (-1: empty slot)
    full_cols: Array
    n_full_rows: Array
    n_full_cols: Array
    in_full_rows: Array        # significant errors inside them (a count: `build` makes the
    in_full_cols: Array        #   share on the host, exact where it meets a threshold)
    rows_constant: Array       # error rows with a constant ratio != 1 (a count, as in_full_rows)


class PermutationStats(NamedTuple):
    """Permutation checks (-1: not checked)."""

    beyond_floor: Array        # sorted candidate vs sorted golden: positions beyond the floor
    sorted_differ: Array       # positions where the sorted arrays differ bitwise
    transpose_beyond: Array    # candidate vs golden transposed: positions beyond the floor


class ConditioningStats(NamedTuple):
    """Whole-leaf statistics of the conditioning floor (given a conditioning spread K)."""

    max_spread: Array          # max K, output units
    max_ratio: Array           # max over finite elements of floor / noise floor (>= 1)
    dominant: Array            # elements whose conditioning floor exceeds their noise floor
    decisive: Array            # mismatched finite elements beyond the noise floor, within
    #                            the floor: passed by the conditioning floor alone


class LeafStats(NamedTuple):
    """Everything the device side returns for one float leaf."""

    whole: WholeLeaf
    sample: SampleStats
    worst: WorstStats
    structure: StructureStats
    permutation: PermutationStats
    scales: LeafScales
    conditioning: Any = None   # ConditioningStats, None without a conditioning spread


def view2d(shape) -> tuple[int, int, int, int]:
    """(rows, cols, lead, rows along axis -2) of the 2-D view of a leaf: rows are all leading
    indices flattened, columns the last axis."""
    if len(shape) == 0:
        return 1, 1, 1, 1
    if len(shape) == 1:
        return 1, shape[0], 1, 1
    r2 = shape[-2]
    lead = math.prod(shape[:-2])
    return lead * r2, shape[-1], lead, r2
