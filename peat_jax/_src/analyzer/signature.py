"""What `analyze` returns: a `Signature` and the records it is made of.

These are plain frozen dataclasses of Python numbers, built on the host (`build.py`) from the
device-side statistics; they are the analyzer's interface to the detector, the report and the
JSON results. The sampling and pattern constants below say what the statistics were computed
over.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

import numpy as np

from peat_jax._src.analyzer.noise import NoiseFloor


BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)
"""Tile sizes tested for block alignment along each of the last two axes."""

QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99, 0.999)
"""Quantile levels reported for error distributions (nearest-rank quantiles)."""

DEFAULT_SAMPLE_SIZE = 8192
"""Elements the distribution statistics use per leaf; larger leaves use a deterministic strided
sample of this many elements."""

N_WORST = 16
"""The worst significant elements listed per leaf."""

PERMUTATION_MAX_ELEMENTS = 1 << 22
"""Largest leaf (elements) checked for being a permutation of the golden (a sort of the leaf)."""

MAX_PERIOD = 256
"""Largest period looked for in an axis' error profile."""


@dataclasses.dataclass(frozen=True)
class Counts:
    """Element counts over the whole leaf (exact).

    Attributes:
      elements: number of elements.
      mismatched: bit patterns differ (NaN vs NaN is a match).
      nonfinite_candidate / nonfinite_golden: NaN or +-inf in each.
      new_nonfinite: candidate non-finite where the golden is finite.
      lost_nonfinite: golden non-finite where the candidate is finite.
      nan_for_infinite: candidate NaN where the golden is +-inf (a log-sum-exp of a fully
        masked row that computes -inf - (-inf) where the reference returns -inf).
      unjudged: of those, the elements where the float64 reference is not finite either (a
        naive reference's exp past float64's range, inf / inf): nothing judges the candidate's
        value there (never significant; 0 without a float64 reference).
      significant: mismatched beyond the noise floor, or a differing non-finite value (not an
        unjudged one).
      flushed: golden subnormal and candidate +-0 (a flush to zero).
      significant_not_flushed: significant elements that are not flushes.
      golden_flushed: golden +-0 where the candidate is subnormal (the golden flushed).
      subnormal_golden: subnormal golden values.
      subnormal_candidate: subnormal candidate values (a kernel that flushes its results to zero
        leaves none).
    """

    elements: int
    mismatched: int
    nonfinite_candidate: int
    nonfinite_golden: int
    new_nonfinite: int
    lost_nonfinite: int
    nan_for_infinite: int
    unjudged: int
    significant: int
    flushed: int
    significant_not_flushed: int
    golden_flushed: int
    subnormal_golden: int
    subnormal_candidate: int


@dataclasses.dataclass(frozen=True)
class Errors:
    """Error magnitudes. ``abs`` is ``|c - g|`` in output units; ``rel`` is
    ``|c - g| / max(|g|, smallest normal)`` (dimensionless); both over elements finite in both.

    Attributes:
      max_abs: exact maximum of ``|c - g|`` (whole leaf).
      max_ulp: exact maximum ULP distance between c and g (whole leaf; infinities included,
        NaNs excluded).
      max_floor_ratio: exact maximum of error / noise floor (<= 1: within noise).
      abs_quantiles / rel_quantiles / floor_ratio_quantiles: {q: value} at `QUANTILES` (sample).
      ulp_histogram: counts (sample, non-NaN elements) by ULP distance d: bucket 0 holds d = 0,
        bucket b >= 1 holds ``2**(b-1) <= d < 2**b`` (b = bit length of d).
      bias_mean: mean signed error (``c - r`` with a reference, else ``c - g``), output units.
      bias_std_error: its standard error (sample std / sqrt(n)), output units.
      bias_t: ``bias_mean / bias_std_error`` (0 when the error is constant zero).
      error_slope: least-squares slope of ``log2|c - g|`` against ``log2|g|`` over mismatched
        elements (1: error proportional to the value, as with rounding of the output or of an
        accumulator; 0: error independent of the value, as with rounded inputs of a reduction).
      geo_mean_rel_significant: geometric mean of the relative error of significant elements.
      large_rel_significant: share of significant elements with relative error >= 1/16.
      sample_size: elements the sampled statistics were computed on.
      sampled: True when the sample is a strict subset of the leaf.
    """

    max_abs: float
    max_ulp: int
    max_floor_ratio: float
    abs_quantiles: Mapping[str, float]
    rel_quantiles: Mapping[str, float]
    floor_ratio_quantiles: Mapping[str, float]
    ulp_histogram: tuple[int, ...]
    bias_mean: float
    bias_std_error: float
    bias_t: float
    error_slope: float
    geo_mean_rel_significant: float
    large_rel_significant: float
    sample_size: int
    sampled: bool


@dataclasses.dataclass(frozen=True)
class Bits:
    """Which bits differ (sample, mismatched elements).

    Attributes:
      histogram: per bit position (0 = least significant), elements whose patterns differ there.
      sign / exponent / mantissa: totals of `histogram` over each field.
      popcount_histogram: elements by number of differing bits (index = count).
      significant_single_bit: share of significant elements differing in exactly one bit.
      single_bit_histogram: per position, significant single-bit elements flipped there.
      single_bit_set: per position, how many of those have the bit set in the candidate.
      golden_bit_set: per position, finite golden values (sample) with the bit set.
      finite: finite elements in the sample (the denominator of `golden_bit_set`).
      negated: share of significant elements whose patterns differ only in the sign bit.
      candidate_zero: share of significant elements where the candidate is +-0.
      sign_differs: share of significant elements (both non-zero) with opposite signs.
      sign_agreement: share of elements (both non-zero, finite) with the same sign.
    """

    histogram: tuple[int, ...]
    sign: int
    exponent: int
    mantissa: int
    popcount_histogram: tuple[int, ...]
    significant_single_bit: float
    single_bit_histogram: tuple[int, ...]
    single_bit_set: tuple[int, ...]
    golden_bit_set: tuple[int, ...]
    finite: int
    negated: float
    candidate_zero: float
    sign_differs: float
    sign_agreement: float


@dataclasses.dataclass(frozen=True)
class Ratio:
    """The ratio ``c / g`` over finite elements with ``|g| >= rms(g)`` (sample).

    Attributes:
      median: median ratio.
      spread: max ``|ratio - median| / |median|`` (dimensionless).
      spread_p99: 99th percentile of the same.
      tolerance: the relative spread noise alone explains: twice the typical relative floor at
        ``|g| = rms(g)`` (``a * eps + F * median_row(E_row) / rms``, or ``a * eps + F * eps_acc *
        sqrt(K)`` for the dtype bound), at least 4 eps.
      constant: ``spread <= tolerance`` and at least 2 elements.
      rows_constant: share of rows holding significant errors whose ratio is constant
        (within tolerance) over two or more elements with ``|g| >= rms(g)`` and differs from 1
        by more than the tolerance (whole leaf; 0 when there are no significant errors, or
        when they are few enough to be all listed among the worst).
      n: elements used.
    """

    median: float
    spread: float
    spread_p99: float
    tolerance: float
    constant: bool
    rows_constant: float
    n: int


@dataclasses.dataclass(frozen=True)
class BlockMatch:
    """How well significant errors align with a tile pattern along one axis.

    ``precision``: share of significant errors inside the pattern's indices; ``recall``: share of
    the pattern's elements that are significant. Patterns: "edges" (first and last index of each
    block of `block`, and the axis' last index) and "last_block" (indices from
    ``(n // block) * block``, or the last full block when `block` divides n).
    """

    axis: int
    block: int
    pattern: str
    precision: float
    recall: float
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Structure:
    """Spatial structure of the significant-error mask over the last two axes (exact).

    Rows are all leading indices flattened (``prod(shape[:-1])`` rows of ``shape[-1]``); the
    per-axis profiles count significant errors per index of axis -1 (columns) and axis -2.

    Attributes:
      rows_with_errors / cols_with_errors: flattened rows / columns holding significant errors.
      full_rows / full_cols: up to 8 indices of rows / columns with >= 90% of elements wrong.
      n_full_rows / n_full_cols: how many such rows / columns.
      in_full_rows / in_full_cols: share of significant errors inside them.
      span: {axis: (first, last)} index along axis -1 and -2 holding significant errors.
      blocks: the best `BlockMatch` per (axis, pattern) among `BLOCK_SIZES` (ones with
        precision >= 0.5 only).
      period: {axis: smallest p in 2..256 for which the axis profile's error / no-error pattern
        repeats every p (None if none)}.
      n_rows / n_cols: rows and columns of the 2-D view.
    """

    rows_with_errors: int
    cols_with_errors: int
    full_rows: tuple[int, ...]
    full_cols: tuple[int, ...]
    n_full_rows: int
    n_full_cols: int
    in_full_rows: float
    in_full_cols: float
    span: Mapping[int, tuple[int, int]]
    blocks: tuple[BlockMatch, ...]
    period: Mapping[int, Optional[int]]
    n_rows: int
    n_cols: int


@dataclasses.dataclass(frozen=True)
class Precision:
    """Format evidence for precision models (sample).

    Attributes:
      candidate_grid_bits / golden_grid_bits: mantissa bits actually used by >= 99% of the
        normal non-zero values (the dtype's mantissa width minus their common trailing zeros).
      effective_mantissa_bits: ``-log2(median relative error) - 2`` over mismatched elements when
        at least half the leaf is mismatched (rounding to p bits gives a median relative error
        of about ``2**-(p+2)``), else None.
      on_narrow_grid: the candidate uses at least 2 mantissa bits fewer than the golden.
      max_ulp_on_grid: the largest error in ULPs of the candidate's grid (sample); <= 0.5 means
        the candidate is the golden rounded to that grid.
      beyond_half_ulp_on_grid: share of the mismatched elements (sample) more than 0.5625 ULP of
        the candidate's grid away from the golden (~0 when the output is the golden rounded to
        that grid, rounding noise of the golden's own precision aside; large when the narrow
        format was used for more than the final rounding).
    """

    candidate_grid_bits: int
    golden_grid_bits: int
    effective_mantissa_bits: Optional[float]
    on_narrow_grid: bool
    max_ulp_on_grid: float
    beyond_half_ulp_on_grid: float = 0.0


@dataclasses.dataclass(frozen=True)
class Permutation:
    """Whether the candidate holds the golden's values in other places (exact; leaves up to
    4M elements; None: not checked, because nothing is significant or the leaf is larger).

    Attributes:
      is_permutation: the sorted candidate equals the sorted golden within the noise floor.
      sorted_differ: positions where the sorted arrays differ bitwise (0: exactly the same
        multiset of values; a value replaced by another shifts every rank in between, so this
        is large for a replacement and at most the number of noisy elements for a permutation).
      is_transpose: the candidate equals the golden with its last two axes swapped, within the
        noise floor (square last two axes only).
    """

    is_permutation: Optional[bool]
    is_transpose: Optional[bool]
    sorted_differ: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class WorstElement:
    """One of the worst significant elements (largest error / floor; non-finite first).

    Attributes:
      index: multi-dimensional index into the leaf.
      candidate / golden: the values.
      candidate_bits / golden_bits: bit patterns as unsigned ints.
      differing_bits: bit positions that differ (0 = LSB).
      floor_ratio: error / noise floor (inf for non-finite).
      noise_bits: differing bits below this position are within the element's noise floor
        (the bit length of floor / ULP); 0 when at most 1% of the elements differ within noise
        (`NOISE_FREE_SHARE`), so that every differing bit belongs to the fault.
      floor: the element's noise floor, output units.
    """

    index: tuple[int, ...]
    candidate: float
    golden: float
    candidate_bits: int
    golden_bits: int
    differing_bits: tuple[int, ...]
    floor_ratio: float
    noise_bits: int = 0
    floor: float = 0.0

    @property
    def fault_bits(self) -> tuple[int, ...]:
        """Differing bits at or above `noise_bits`."""
        return tuple(b for b in self.differing_bits if b >= self.noise_bits)


@dataclasses.dataclass(frozen=True)
class Signature:
    """Statistics of a candidate against the golden, for one leaf or a pytree.

    For a pytree, the top-level fields are those of the worst leaf (most new non-finite values,
    then largest share of significant errors, then largest floor ratio), `path` names it, and
    `leaves` holds every leaf's signature in tree order.

    Attributes:
      path: the leaf's key path ("" for a single array).
      shape / dtype: of the leaf.
      comparison: "golden" (candidate vs reference output) or "repeat" (a candidate run vs an
        earlier run of the same candidate).
      counts, errors, bits, noise, ratio, structure, precision, permutation: see their types.
      worst: the worst significant elements (up to `N_WORST`).
      leaves: per-leaf signatures of a pytree (empty for a single array).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    comparison: str
    counts: Counts
    errors: Errors
    bits: Optional[Bits]
    noise: Optional[NoiseFloor]
    ratio: Optional[Ratio]
    structure: Optional[Structure]
    precision: Optional[Precision]
    permutation: Optional[Permutation]
    worst: tuple[WorstElement, ...] = ()
    leaves: tuple["Signature", ...] = ()

    @property
    def is_float(self) -> bool:
        return self.bits is not None

    def to_dict(self) -> dict:
        """A JSON-able dict (non-finite floats become the strings "inf", "-inf", "nan")."""
        return _jsonable(dataclasses.asdict(self))


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v
    return x
