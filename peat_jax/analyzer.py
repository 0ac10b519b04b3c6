"""Analyzer: device-side statistics of a candidate output against the golden (``peat.analyze``).

``analyze(candidate, golden, reference64=None)`` compares two arrays (or two pytrees of arrays)
and returns a `Signature`: the numbers the detector (``peat.detect``) decides an error model from.
Everything is computed inside one jitted function per leaf (per shapes, dtypes and options);
only the summary comes back to the host (a few hundred numbers, plus, when errors exist, the
count of significant errors per index of the last two axes), never a full tensor.

Definitions used throughout (per leaf; ``c`` candidate, ``g`` golden, ``r`` float64 reference):

* **mismatched**: the bit patterns differ (two NaNs count as equal, ``+0`` vs ``-0`` mismatch).
  Bit tests are integer-only (`lax.bitcast_convert_type`), never float compares: on XLA:CPU a
  jitted float compare treats subnormals as zero.
* **ULP distance**: floats are mapped to a monotonic integer line (``+x`` -> its magnitude bits,
  ``-x`` -> minus them, so ``+0`` and ``-0`` both map to 0) and the distance is the integer
  difference, in units in the last place of the golden's dtype. Exact, including subnormals and
  infinities (NaNs are excluded).
* **noise floor** (per element, output units): how far the candidate may be from the truth and
  still count as rounding noise; see `NoiseFloor`. An element is **significant** when it is
  mismatched and its error exceeds the floor, or when a non-finite value differs.
* **sample**: histograms, quantiles, bias, ratio and precision statistics are exact for leaves of
  at most ``sample_size`` elements (default 8192); larger leaves use a deterministic strided
  sample of that many elements (odd stride, so it visits every column of a power-of-two-wide
  matrix). Counts, maxima, the worst elements and the spatial structure are always exact over
  the whole leaf.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax.errors import PeatError

__all__ = [
    "BLOCK_SIZES",
    "DTYPE_ULP_ALLOWANCE",
    "NoiseFloor",
    "Signature",
    "analyze",
    "dtype_noise_bound",
]

BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)
"""Tile sizes tested for block alignment along each of the last two axes."""

QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99, 0.999)
"""Quantile levels reported for error distributions (nearest-rank quantiles)."""

DEFAULT_NOISE_FACTOR = 4.0
"""The stated factor F: a candidate is numerical noise when its error is at most F times the
golden's own error scale (plus the ULP allowance)."""

DEFAULT_REDUCTION_LENGTH = 1024
"""Reduction length K assumed by the dtype bound when none is given (no float64 reference)."""

DTYPE_ULP_ALLOWANCE: Mapping[str, float] = {
    "float64": 4.0, "float32": 4.0, "float16": 1.0, "bfloat16": 1.0,
}
"""ULP allowance of the dtype bound (no float64 reference), in ULPs of the golden's dtype.

Two correct kernels may round their last operation in opposite directions and use transcendental
approximations a few ULPs apart: 4 ULPs for 32/64-bit outputs. 16-bit outputs are in practice
computed in float32 and rounded once, so two correct results differ by at most 1 ULP."""

REFERENCE_ULP_ALLOWANCE = 2.0
"""ULP allowance with a float64 reference: a correctly rounded result is within 0.5 ULP of the
truth and a faithful one within 1; a long reduction dominated by one large term may add another
ULP where the golden happens to be exact, hence 2."""

DISTRIBUTION_ALLOWANCE = 0.5
"""The distribution test (float64 reference only): the candidate's median ULP error may be at
most ``F / 2`` (2 at the default F = 4) times the golden's, and its 90th-percentile ULP error
at most F times the golden's, each plus this many ULPs."""

DISTRIBUTION_MIN_ELEMENTS = 32
"""The distribution test needs at least this many finite elements; smaller leaves rely on the
per-element floor alone."""

NOISE_FREE_SHARE = 0.01
"""A leaf whose elements differ within the noise floor in at most this share is taken as noise
free: the differing bits of its significant elements all belong to the fault."""

DEFAULT_SAMPLE_SIZE = 8192
N_WORST = 16
PERMUTATION_MAX_ELEMENTS = 1 << 22
MAX_PERIOD = 256


# ----------------------------------------------------------------------------------------------
# Float formats and bit decoding (integer-only)
# ----------------------------------------------------------------------------------------------

class _Fmt(NamedTuple):
    """Bit layout of a float dtype and the integer types its statistics use."""

    name: str
    bits: int
    nmant: int
    nexp: int

    @property
    def bias(self) -> int:
        return (1 << (self.nexp - 1)) - 1

    @property
    def container(self) -> int:
        return 64 if self.bits == 64 else 32

    @property
    def uint(self):
        return jnp.uint64 if self.bits == 64 else jnp.uint32

    @property
    def sint(self):
        return jnp.int64 if self.bits == 64 else jnp.int32

    @property
    def cdt(self):
        """Dtype of float arithmetic on values of this format."""
        return jnp.float64 if self.bits == 64 else jnp.float32

    @property
    def eps(self) -> float:
        return 2.0 ** -self.nmant

    @property
    def emin(self) -> int:
        return 1 - self.bias


_SUPPORTED = ("float16", "bfloat16", "float32", "float64")
_F32 = _Fmt("float32", 32, 23, 8)


def _fmt(dtype) -> _Fmt:
    dt = jnp.dtype(dtype)
    if dt.name not in _SUPPORTED:
        raise PeatError(f"analyze supports {', '.join(_SUPPORTED)} (and integer/bool leaves); "
                        f"got {dt.name}")
    fi = jnp.finfo(dt)
    return _Fmt(dt.name, int(fi.bits), int(fi.nmant), int(fi.nexp))


class _Dec(NamedTuple):
    """Decoded bit fields of an array (all integer)."""

    u: Any          # unsigned pattern, widened to uint32 (uint64 for 64-bit)
    neg: Any        # sign bit set
    expf: Any       # biased exponent field
    mant: Any       # mantissa field
    mono: Any       # position on the monotonic integer line
    nonfinite: Any
    nan: Any
    zero: Any       # +0 or -0
    sub: Any        # subnormal


_NATIVE_UINT = {16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _bits(x, f: _Fmt):
    """Bit pattern of float `x` as the unsigned integer of the same width.

    The analyzer bitcasts its inputs once, first thing, and moves bits (not floats) through
    reshapes, gathers and selects: XLA:CPU computes bfloat16 selects and gathers in float32,
    which quiets signalling NaNs (changing their bits)."""
    return lax.bitcast_convert_type(x, _NATIVE_UINT[f.bits])


class _Pair(NamedTuple):
    """An input seen two ways: its values (for float arithmetic) and its bit patterns (native
    unsigned, exact, for every bit test).

    The bits are bitcast from the values where they are used, so each fused computation reads
    the input once (bits materialized as a separate array cost two extra passes on XLA:CPU),
    except after a gather, where the gathered bits are kept (XLA:CPU gathers bfloat16 values
    through float32, which quiets signalling NaNs).
    """

    vals: Any
    gathered_bits: Any = None
    fmt: Any = None

    @property
    def bits(self):
        if self.gathered_bits is not None:
            return self.gathered_bits
        return _bits(self.vals, self.fmt)

    @property
    def shape(self):
        return self.vals.shape

    @property
    def size(self):
        return self.vals.size

    @property
    def ndim(self):
        return self.vals.ndim

    def reshape(self, *shape):
        gb = None if self.gathered_bits is None else self.gathered_bits.reshape(*shape)
        return _Pair(self.vals.reshape(*shape), gb, self.fmt)

    def swapaxes(self, a, b):
        gb = None if self.gathered_bits is None else jnp.swapaxes(self.gathered_bits, a, b)
        return _Pair(jnp.swapaxes(self.vals, a, b), gb, self.fmt)


def _pair_of_bits(u, f: _Fmt) -> _Pair:
    return _Pair(lax.bitcast_convert_type(u, jnp.dtype(f.name)), u, f)


def _values(x, f: _Fmt):
    """Float values (compute dtype) of a `_Pair` or of native unsigned bit patterns."""
    if isinstance(x, _Pair):
        return x.vals.astype(f.cdt)
    return lax.bitcast_convert_type(x, jnp.dtype(f.name)).astype(f.cdt)


def _decode(x, f: _Fmt) -> _Dec:
    """Bit fields of `x`: a `_Pair`, native unsigned bit patterns, or floats of format `f`."""
    if isinstance(x, _Pair):
        x = x.bits
    if not jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        x = _bits(x, f)
    u = x.astype(f.uint)
    ut, it = f.uint, f.sint
    mag = (u & ut((1 << (f.bits - 1)) - 1)).astype(it)
    neg = (u >> ut(f.bits - 1)) != ut(0)
    inf_bits = it(((1 << f.nexp) - 1) << f.nmant)      # magnitude of +inf
    zero = mag == it(0)
    # Class tests as magnitude compares (fewer operations per element than field extraction).
    return _Dec(u, neg, mag >> it(f.nmant), mag & it((1 << f.nmant) - 1), jnp.where(neg, -mag, mag),
                mag >= inf_bits, mag > inf_bits, zero, (mag < it(1 << f.nmant)) & ~zero)


def _ulp_distance(dc: "_Dec", dg: "_Dec", f: _Fmt):
    """|mono_c - mono_g| on the monotonic line, unsigned: the difference of the magnitudes for
    equal signs, their sum for opposite signs (fits: each magnitude is below 2**(bits-1))."""
    mc, mg = jnp.abs(dc.mono), jnp.abs(dg.mono)
    same = dc.neg == dg.neg
    return jnp.where(same, jnp.abs(mc - mg).astype(f.uint), mc.astype(f.uint) + mg.astype(f.uint))


def _bit_length(d, f: _Fmt):
    """Number of significant bits of an unsigned integer (0 for 0): the log2 ULP bucket."""
    return (f.container - lax.clz(d)).astype(jnp.int32)


def _ulp_of_bits(d: "_Dec", f: _Fmt):
    """Spacing of the format at the decoded values `d`, as a float of the compute dtype, built
    from the exponent bits (integer-only; `jnp.ldexp` is slow on XLA:CPU): the compute dtype's
    exponent field is the value's exponent field shifted and offset. Spacings below the compute
    dtype's smallest normal are clamped to it (XLA:CPU treats subnormals as zero in arithmetic
    anyway)."""
    cf = _Fmt("float64", 64, 52, 11) if f.bits == 64 else _F32
    it = cf.sint
    emask = ((1 << f.nexp) - 1) << f.nmant
    e = jnp.maximum(jnp.abs(d.mono).astype(it) & it(emask), it(1 << f.nmant))
    field = (e << it(cf.nmant - f.nmant)) + it((cf.bias - f.bias - f.nmant) << cf.nmant)
    field = jnp.clip(field, it(1 << cf.nmant), it((2 * cf.bias) << cf.nmant))
    return lax.bitcast_convert_type(field.astype(cf.uint), cf.cdt)


def _ulp_of_value(r, f: _Fmt):
    """Spacing of format `f` at the float64 values `r`: ``2**(max(floor(log2|r|), emin) -
    nmant)`` (the subnormal spacing below the smallest normal), built from bit patterns."""
    f64 = _Fmt("float64", 64, 52, 11)
    e = _decode(r.astype(jnp.float64), f64).expf - f64.bias
    e = jnp.maximum(e, f.emin) - f.nmant
    return lax.bitcast_convert_type((e + f64.bias).astype(jnp.uint64) << jnp.uint64(52),
                                    jnp.float64)


def _from_mono(mono, f: _Fmt):
    """Inverse of the monotonic map: native unsigned bit patterns."""
    ut = f.uint
    mag = jnp.abs(mono).astype(ut)
    return jnp.where(mono < 0, mag | ut(1 << (f.bits - 1)), mag).astype(_NATIVE_UINT[f.bits])


def _to_float(mono, f: _Fmt, dtype):
    """Inverse of the monotonic map: floats of `dtype`."""
    return lax.bitcast_convert_type(_from_mono(mono, f), dtype)


# ----------------------------------------------------------------------------------------------
# Noise floor
# ----------------------------------------------------------------------------------------------

def dtype_noise_bound(dtype, reduction_length: Optional[int] = None,
                      noise_factor: float = DEFAULT_NOISE_FACTOR) -> tuple[float, float]:
    """The documented per-dtype noise bound used when no float64 reference exists.

    An element is within noise when ``|c - g| <= a * ulp(g) + F * eps_acc * sqrt(K) * rms(g)``:

    * ``a``: `DTYPE_ULP_ALLOWANCE` for the dtype (ULPs of the golden's dtype at ``g``);
    * ``F``: `noise_factor`;
    * ``eps_acc``: machine epsilon (``2**-nmant``) of the accumulation format, the wider of the
      dtype and float32 (16-bit kernels accumulate in float32);
    * ``K``: the reduction length (`DEFAULT_REDUCTION_LENGTH` when unknown): the error of a
      K-term float sum grows like ``eps * sqrt(K)`` times the output's magnitude;
    * ``rms(g)``: root mean square of the finite golden values (over the sample).

    Returns:
      ``(a, F * eps_acc * sqrt(K))``: the ULP allowance and the relative-to-rms coefficient.
    """
    f = _fmt(dtype)
    k = DEFAULT_REDUCTION_LENGTH if reduction_length is None else int(reduction_length)
    if k < 1:
        raise PeatError(f"reduction_length must be >= 1, got {reduction_length}")
    eps_acc = 2.0 ** -max(f.nmant, 23)
    return DTYPE_ULP_ALLOWANCE[f.name], noise_factor * eps_acc * math.sqrt(k)


@dataclasses.dataclass(frozen=True)
class NoiseFloor:
    """How the per-element noise floor was set, and the golden's own error.

    With a float64 reference ``r`` (``kind="float64"``): the golden's absolute error is
    ``e_g = |g - r|`` (output units) and its ULP error ``u_g = e_g / ulp(r)`` (ULPs of the
    golden's dtype at ``r``). The candidate's error is ``e_c = |c - r|`` and the floor at element
    i is ``F * max(E_loc(i), U90 * ulp(r_i)) + a * ulp(r_i)``, where ``U90`` is the 90th
    percentile of the golden's ULP error and ``E_loc(i)`` is the golden's worst absolute error
    in i's row or in i's column of the 2-D view, whichever is smaller (rows: the leading axes
    flattened; only the row maximum when columns are shorter than 32, only the column maximum
    when rows are, the leaf's maximum when both are). The rounding error of a reduction scales
    with the magnitude of its summands, not of its result, and rows and columns carry that
    magnitude (an outlier input row inflates one output row only); an element with heavy
    cancellation is judged in absolute terms like its neighbours, and an element much larger
    than its neighbours in relative terms (the golden's typical ULP error). A candidate is
    numerical noise when no element exceeds the floor and its ULP-error distribution is no
    worse than the golden's (``distribution_ok``), which catches dense mild degradation (e.g.
    a bfloat16 accumulator) that no single element shows.

    Without one (``kind="dtype_bound"``): the floor on ``|c - g|`` is `dtype_noise_bound`.

    Attributes:
      kind: "float64" or "dtype_bound".
      factor: F (dimensionless).
      ulp_allowance: a, in ULPs of the golden's dtype.
      abs_floor: the largest absolute part of the floor, output units (``F * max E_loc`` or
        ``F * eps_acc * sqrt(K) * rms(g)``).
      reduction_length: K used by the dtype bound (None with a float64 reference).
      golden_max_abs_error: E (output units), None without a reference.
      golden_max_ulp_error: U (ULPs), None without a reference.
      golden_ulp_quantiles / candidate_ulp_quantiles: {q: ULPs} of ``u_g`` and ``u_c`` (sample),
        empty without a reference.
      distribution_ok: True when ``p50(u_c) <= F/2 * p50(u_g) + 0.5`` and ``p90(u_c) <= F *
        p90(u_g) + 0.5`` (`DISTRIBUTION_ALLOWANCE`); None without a reference or with fewer
        than `DISTRIBUTION_MIN_ELEMENTS` finite elements.
      rms_golden: root mean square of the finite golden values (sample), output units.
    """

    kind: str
    factor: float
    ulp_allowance: float
    abs_floor: float
    reduction_length: Optional[int]
    golden_max_abs_error: Optional[float]
    golden_max_ulp_error: Optional[float]
    golden_ulp_quantiles: Mapping[str, float]
    candidate_ulp_quantiles: Mapping[str, float]
    distribution_ok: Optional[bool]
    rms_golden: float


# ----------------------------------------------------------------------------------------------
# Result types
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Counts:
    """Element counts over the whole leaf (exact).

    Attributes:
      elements: number of elements.
      mismatched: bit patterns differ (NaN vs NaN is a match).
      nonfinite_candidate / nonfinite_golden: NaN or +-inf in each.
      new_nonfinite: candidate non-finite where the golden is finite.
      lost_nonfinite: golden non-finite where the candidate is finite.
      significant: mismatched beyond the noise floor, or a differing non-finite value.
      flushed: golden subnormal and candidate +-0 (a flush to zero).
      significant_not_flushed: significant elements that are not flushes.
      golden_flushed: golden +-0 where the candidate is subnormal (the golden flushed).
      subnormal_golden: subnormal golden values.
    """

    elements: int
    mismatched: int
    nonfinite_candidate: int
    nonfinite_golden: int
    new_nonfinite: int
    lost_nonfinite: int
    significant: int
    flushed: int
    significant_not_flushed: int
    golden_flushed: int
    subnormal_golden: int


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
        (within tolerance) and differs from 1 by more than the tolerance (whole leaf; 0 when
        there are no significant errors).
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
      worst: the worst significant elements (up to 16).
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


# ----------------------------------------------------------------------------------------------
# Device side
# ----------------------------------------------------------------------------------------------

class _Cfg(NamedTuple):
    """Static options of the jitted statistics."""

    noise_factor: float
    ulp_allowance: float
    bound_coef: float       # F * eps_acc * sqrt(K) (dtype bound only)
    sample_size: int
    blocks: tuple[int, ...]


class _Scales(NamedTuple):
    """Leaf-wide quantities the per-element floor needs (device values).

    With a float64 reference, `E_row` / `E_col` are the golden's worst absolute error in each row
    / column of the 2-D view (see `_view2d`); the local scale of an element is the smaller of
    its row's and its column's (`_eloc`).
    """

    rms: Any
    abs_floor: Any
    E: Any = None
    U: Any = None
    E_row: Any = None
    E_col: Any = None
    U90: Any = None


_THIN = 32  # rows / columns shorter than this give no reliable per-column / per-row maximum


def _eloc(s: _Scales, rows, cols, C: int, R: int):
    """Local absolute error scale of the golden at elements (rows, cols) of the 2-D view:
    ``min(E_row[row], E_col[col])``; the row maximum alone when columns are shorter than 32, the
    column maximum alone when rows are, the leaf's maximum when both are (the maximum of fewer
    golden errors is too often small by luck)."""
    use_row, use_col = C >= _THIN, R >= _THIN
    if use_row and use_col:
        return jnp.minimum(s.E_row[rows], s.E_col[cols])
    if use_row:
        return s.E_row[rows]
    if use_col:
        return s.E_col[cols]
    return jnp.broadcast_to(s.E, jnp.shape(rows))


def _vreduce(ops: Sequence, kinds: Sequence[str], axes):
    """One variadic reduction ("sum" / "max" / "min" per operand): a single pass over the data
    (XLA:CPU vectorises multi-operand integer reductions much better than separate ones)."""
    inits = []
    for o, k in zip(ops, kinds):
        dt = o.dtype
        if k == "sum":
            inits.append(jnp.zeros((), dt))
        elif jnp.issubdtype(dt, jnp.floating):
            inits.append(jnp.asarray(-jnp.inf if k == "max" else jnp.inf, dt))
        else:
            ii = jnp.iinfo(dt)
            inits.append(jnp.asarray(ii.min if k == "max" else ii.max, dt))

    def comb(x, y):
        return tuple(a + b if k == "sum" else (jnp.maximum(a, b) if k == "max" else
                                               jnp.minimum(a, b))
                     for a, b, k in zip(x, y, kinds))

    return lax.reduce(tuple(ops), tuple(inits), comb, axes)


class _El(NamedTuple):
    """Per-element quantities shared by every stage."""

    dc: _Dec
    dg: _Dec
    mis: Any
    fin: Any        # finite in both
    cf: Any         # candidate in the compute dtype
    gf: Any
    err_cg: Any     # |c - g|
    err: Any        # the error the floor applies to (|c - r| with a reference, else |c - g|)
    ulp: Any        # ULP of the golden's dtype at the element (at r with a reference)
    floor: Any
    ratio: Any      # err / floor
    sig: Any
    ftz: Any
    dist: Any       # ULP distance c vs g (unsigned)
    noise_bits: Any  # bit length of floor / ULP: differing bits below it may be noise


def _elements(c, g, r, s: _Scales, cfg: _Cfg, f: _Fmt, eloc=None) -> _El:
    """Per-element quantities; `eloc` (reference only) is the local absolute error scale of the
    golden at each element (`_eloc`)."""
    dc, dg = _decode(c, f), _decode(g, f)
    mis = (dc.u != dg.u) & ~(dc.nan & dg.nan)
    fin = ~dc.nonfinite & ~dg.nonfinite
    cf, gf = _values(c, f), _values(g, f)
    err_cg = jnp.abs(cf - gf)
    if r is None:
        err = err_cg
        ulp = _ulp_of_bits(dg, f)
        floor = cfg.ulp_allowance * ulp + s.abs_floor
        tiny = jnp.finfo(f.cdt).tiny
    else:
        # Only the error against the float64 reference and its floor are float64.
        rf = r.astype(jnp.float64)
        err = jnp.abs(cf.astype(jnp.float64) - rf)
        ulp = _ulp_of_value(rf, f)
        local = s.E if eloc is None else eloc
        floor = cfg.noise_factor * jnp.maximum(local, s.U90 * ulp) + cfg.ulp_allowance * ulp
        tiny = jnp.finfo(jnp.float64).tiny
    floor = jnp.maximum(floor, tiny)
    over = err > floor
    ratio = jnp.where(fin, err / floor, jnp.inf).astype(f.cdt)
    golden_only_nf = dg.nonfinite & ~dc.nonfinite
    if r is None:
        gold_nf_sig = golden_only_nf
    else:
        gold_nf_sig = golden_only_nf & (over | ~jnp.isfinite(err))
    sig = mis & ((fin & over) | dc.nonfinite | gold_nf_sig)
    ftz = mis & dg.sub & dc.zero
    q = jnp.clip(jnp.floor(floor / ulp), 0, 2.0 ** 30).astype(jnp.int32)
    noise_bits = (32 - lax.clz(q)).astype(jnp.int32)
    return _El(dc, dg, mis, fin, cf, gf, err_cg, err, ulp, floor, ratio, sig, ftz,
               _ulp_distance(dc, dg, f), noise_bits)


def _i32(m):
    return m.astype(jnp.int32)


def _sample_index(n: int, size: int) -> Optional[np.ndarray]:
    """Flat indices of the deterministic strided sample (None: the whole leaf)."""
    if n <= size:
        return None
    stride = n // size
    if stride % 2 == 0:
        stride -= 1
    return np.arange(size, dtype=np.int64) * stride


def _take(x, idx):
    """Flat elements `idx` of an array or `_Pair` (all of them when idx is None)."""
    if isinstance(x, _Pair):
        return _Pair(_take(x.vals, idx), _take(x.bits, idx), x.fmt)
    flat = x.reshape(-1)
    return flat if idx is None else flat[jnp.asarray(idx, jnp.int32)]


def _nonneg_key(v, valid):
    """Sort key of non-negative floats (their float32 bit patterns are monotonic); invalid and
    NaN values sort last."""
    v32 = jnp.where(valid, v.astype(jnp.float32), jnp.inf)
    v32 = jnp.where(jnp.isnan(v32), jnp.inf, v32)
    return lax.bitcast_convert_type(v32, jnp.int32)


def _signed_key(v, valid):
    """Sort key of float32 values on the monotonic integer line; invalid and NaN sort last."""
    d = _decode(v.astype(jnp.float32), _F32)
    return jnp.where(valid & ~d.nan, d.mono, jnp.iinfo(jnp.int32).max)


def _ranks(n, qs, size: int):
    """Nearest-rank positions of quantiles `qs` among `n` sorted valid values."""
    pos = jnp.ceil(jnp.asarray(qs, jnp.float32) * n).astype(jnp.int32) - 1
    return jnp.clip(pos, 0, size - 1)


def _scales(c, g, r, idx, cfg: _Cfg, f: _Fmt) -> _Scales:
    gs = _values(_take(g, idx), f)
    fin = ~_decode(_take(g, idx), f).nonfinite
    n = jnp.maximum(jnp.sum(_i32(fin)), 1)
    # rms = m * sqrt(mean((g / m)**2)) with m = max|g|: squaring tiny values would underflow.
    m = jnp.max(jnp.where(fin, jnp.abs(gs), 0))
    m = jnp.where(m > 0, m, 1)
    rms = m * jnp.sqrt(jnp.sum(jnp.where(fin, (gs / m) ** 2, 0)) / n)
    if r is None:
        return _Scales(rms, cfg.bound_coef * rms)
    R, C, _, _ = _view2d(g.shape)
    rf = r.reshape(R, C).astype(jnp.float64)
    g2 = g.reshape(R, C)
    ok = ~_decode(g2, f).nonfinite & jnp.isfinite(rf)
    e_g = jnp.where(ok, jnp.abs(_values(g2, f).astype(jnp.float64) - rf), 0.0)
    u_g = e_g / _ulp_of_value(rf, f)
    E_row, U_row = _vreduce([e_g, u_g], ["max", "max"], (1,))
    E_col = jnp.max(e_g, axis=0)
    E, U = jnp.max(E_row), jnp.max(U_row)
    # 90th percentile of the golden's ULP error over the sample.
    us = _take(u_g, idx)
    oks = _take(ok, idx)
    key = jnp.sort(_nonneg_key(us, oks))
    n_ok = jnp.sum(_i32(oks))
    U90 = lax.bitcast_convert_type(key[_ranks(n_ok, (0.9,), us.shape[0])[0]], jnp.float32)
    U90 = jnp.where(n_ok > 0, U90, 0.0).astype(jnp.float64)
    return _Scales(rms, cfg.noise_factor * E, E, U, E_row, E_col, U90)


def _eloc_2d(s: _Scales, R: int, C: int):
    """`_eloc` for every element of the (R, C) view (None without a reference)."""
    if s.E_row is None:
        return None
    rows = jnp.arange(R, dtype=jnp.int32)[:, None]
    cols = jnp.arange(C, dtype=jnp.int32)[None, :]
    return _eloc(s, jnp.broadcast_to(rows, (R, C)), jnp.broadcast_to(cols, (R, C)), C, R)


def _eloc_flat(s: _Scales, idx, n: int, R: int, C: int):
    """`_eloc` for the flat indices `idx` (None: all n elements)."""
    if s.E_row is None:
        return None
    flat = jnp.arange(n, dtype=jnp.int32) if idx is None else jnp.asarray(idx, jnp.int32)
    return _eloc(s, flat // C, flat % C, C, R)


def _main_pass(c, g, r, s: _Scales, cfg: _Cfg, f: _Fmt) -> dict:
    """Exact whole-leaf counts and maxima.

    One variadic reduction computes the common counts and maxima; the rare ones (non-finite,
    subnormal and flush counts) are counted in a second pass only when the first saw any.
    """
    R, C, _, _ = _view2d(c.shape)
    c, g = c.reshape(R, C), g.reshape(R, C)
    r = None if r is None else r.reshape(R, C)
    eloc = _eloc_2d(s, R, C)
    el = _elements(c, g, r, s, cfg, f, eloc)
    rare = el.dc.nonfinite | el.dg.nonfinite | el.dc.sub | el.dg.sub
    zero_f = jnp.zeros((), el.err_cg.dtype)
    axes = (0, 1)
    n_mis, n_sig, n_rare, max_abs, max_ratio, max_ulp = _vreduce(
        [_i32(el.mis), _i32(el.sig), _i32(rare), jnp.where(el.fin, el.err_cg, zero_f),
         jnp.where(el.fin, el.ratio, 0).astype(el.err_cg.dtype),
         jnp.where(el.dc.nan | el.dg.nan, 0, el.dist).astype(f.uint)],
        ["sum", "sum", "sum", "max", "max", "max"], axes)

    def rare_counts(_):
        e = _elements(c, g, r, s, cfg, f, eloc)
        return _vreduce(
            [_i32(e.dc.nonfinite), _i32(e.dg.nonfinite), _i32(e.dc.nonfinite & ~e.dg.nonfinite),
             _i32(e.dg.nonfinite & ~e.dc.nonfinite), _i32(e.ftz), _i32(e.sig & e.ftz),
             _i32(e.mis & e.dg.zero & e.dc.sub), _i32(e.dg.sub)], ["sum"] * 8, axes)

    def none(_):
        return tuple(jnp.zeros((), jnp.int32) for _ in range(8))

    nf_c, nf_g, new_nf, lost_nf, ftz, sig_ftz, gold_fl, sub_g = lax.cond(
        n_rare > 0, rare_counts, none, None)
    return dict(mismatched=n_mis, nonfinite_candidate=nf_c, nonfinite_golden=nf_g,
                new_nonfinite=new_nf, lost_nonfinite=lost_nf, significant=n_sig, flushed=ftz,
                significant_not_flushed=n_sig - sig_ftz, golden_flushed=gold_fl,
                subnormal_golden=sub_g, max_abs=max_abs, max_floor_ratio=max_ratio,
                max_ulp=max_ulp)


def _sample_stats(c, g, r, idx, s: _Scales, cfg: _Cfg, f: _Fmt, noise_free) -> dict:
    """Distributions on the sample (the whole leaf when it is small).

    `noise_free` (traced bool): at most 1% of the elements differ within the noise floor
    (`NOISE_FREE_SHARE`), so every differing bit of a significant element belongs to the fault;
    otherwise bits below
    each element's noise bits are ignored by the single-bit statistics, and a negation is
    recognised within the floor.

    Written as a few stacked reductions (counts, per-bit histograms, one-hot histograms, float
    sums) and one batched integer sort, to keep the compiled program small.
    """
    cs, gs = _take(c, idx), _take(g, idx)
    rs = None if r is None else _take(r, idx)
    R, C, _, _ = _view2d(c.shape)
    el = _elements(cs, gs, rs, s, cfg, f, _eloc_flat(s, idx, c.size, R, C))
    n = cs.shape[0]
    out = {}
    fin, mis, sig = el.fin, el.mis, el.sig
    dc, dg = el.dc, el.dg
    x = dc.u ^ dg.u
    pc = lax.population_count(x).astype(jnp.int32)
    nb = jnp.where(noise_free, 0, el.noise_bits).astype(f.uint)
    x_hi = x & ~((jnp.ones((), f.uint) << nb) - f.uint(1))     # bits at or above the noise
    single = sig & (lax.population_count(x_hi) == 1)
    ref = el.gf if r is None else rs.astype(jnp.float64)
    negated = (x == f.uint(1 << (f.bits - 1))) | (
        ~noise_free & el.fin & (jnp.abs(el.cf.astype(ref.dtype) + ref) <= el.floor) &
        (dc.neg != dg.neg))
    tiny = jnp.asarray(jnp.finfo(jnp.dtype(f.name)).tiny, el.gf.dtype)
    rel = el.err_cg / jnp.maximum(jnp.abs(el.gf), tiny)
    nz = ~dc.zero & ~dg.zero
    both = fin & nz
    rsel = fin & (jnp.abs(el.gf) >= s.rms) & ~dg.zero & ~dg.sub
    sel = mis & fin & (el.err_cg > 0) & ~dg.zero & ~dg.sub   # for the error slope
    # 1. Counts (one stacked reduction).
    names = ("n_fin", "n_sig", "n_mis", "n_single", "n_negated", "n_czero", "n_sign_differs",
             "n_sign_agree", "n_sign_both", "n_large_rel_sig", "n_sigf", "n_sel", "n_mis_fin",
             "ratio_n")
    masks = (fin, sig, mis, single, sig & negated, sig & dc.zero,
             sig & nz & (dc.neg != dg.neg), both & (dc.neg == dg.neg), both,
             sig & (~fin | (rel >= 1.0 / 16)), sig & fin, sel, mis & fin, rsel)
    # 2. Per-bit-position histograms, in the same reduction as the counts (the masks packed
    #    as the bits of one flag word per element).
    flags = sum(m.astype(jnp.uint32) << jnp.uint32(k) for k, m in enumerate(masks))
    pos = jnp.arange(f.bits, dtype=f.uint)
    xb = (x[:, None] >> pos) & f.uint(1)
    xhb = (x_hi[:, None] >> pos) & f.uint(1)
    cb = (dc.u[:, None] >> pos) & f.uint(1)
    gb = (dg.u[:, None] >> pos) & f.uint(1)
    cols = jnp.concatenate([
        (flags[:, None] >> jnp.arange(len(masks), dtype=jnp.uint32)) & jnp.uint32(1),
        (xb * mis.astype(f.uint)[:, None]).astype(jnp.uint32),
        (xhb * single.astype(f.uint)[:, None]).astype(jnp.uint32),
        (xhb * cb * single.astype(f.uint)[:, None]).astype(jnp.uint32),
        (gb * fin.astype(f.uint)[:, None]).astype(jnp.uint32)], axis=1)
    tot = jnp.sum(cols.astype(jnp.int32), axis=0)
    k0 = len(masks)
    cv = dict(zip(names, (tot[i] for i in range(k0))))
    out.update(cv)
    hb = tot[k0:].reshape(4, f.bits)
    out["bit_histogram"], out["single_bit_histogram"] = hb[0], hb[1]
    out["single_bit_set"], out["golden_bit_set"] = hb[2], hb[3]
    # 3. One-hot histograms: ULP bit length, popcount, trailing zeros of c and g mantissas.
    def tz(dd):
        m = dd.mant.astype(jnp.int32)
        return jnp.minimum(lax.population_count((m & -m) - 1), f.nmant)
    normal_c = (dc.expf > 0) & ~dc.nonfinite
    normal_g = (dg.expf > 0) & ~dg.nonfinite
    vals = jnp.stack([_bit_length(el.dist, f), pc, tz(dc), tz(dg)])
    ok = jnp.stack([~dc.nan & ~dg.nan, mis, normal_c, normal_g])
    buckets = jnp.arange(f.bits + 1, dtype=jnp.int32)
    oh = jnp.sum(((vals[:, :, None] == buckets) & ok[:, :, None]).astype(jnp.int32), axis=1)
    out["ulp_histogram"], out["popcount_histogram"] = oh[0], oh[1]
    out["tz_c"], out["tz_g"] = oh[2, :f.nmant + 1], oh[3, :f.nmant + 1]
    # 4. Quantiles: one batched integer sort of every sort key.
    ratio = jnp.where(rsel, el.cf / jnp.where(rsel, el.gf, 1), 0).astype(jnp.float32)
    keys = [_nonneg_key(el.err_cg, fin), _nonneg_key(rel, fin), _nonneg_key(el.ratio, fin),
            _nonneg_key(rel, fin & mis), _signed_key(ratio, rsel)]
    counts = [cv["n_fin"], cv["n_fin"], cv["n_fin"], cv["n_mis_fin"], cv["ratio_n"]]
    if r is not None:
        rf = rs.astype(jnp.float64)
        okr = fin & jnp.isfinite(rf)
        keys += [_nonneg_key(el.err / el.ulp, okr),
                 _nonneg_key(jnp.abs(el.gf.astype(jnp.float64) - rf) / el.ulp, okr)]
        n_okr = jnp.sum(_i32(okr))
        counts += [n_okr, n_okr]
    srt = jnp.sort(jnp.stack(keys), axis=1)

    def qv(i, qs):
        v = lax.bitcast_convert_type(srt[i][_ranks(counts[i], qs, n)], jnp.float32)
        return jnp.where(counts[i] > 0, v, jnp.nan)

    q = QUANTILES
    out["abs_q"], out["rel_q"], out["floor_q"] = qv(0, q), qv(1, q), qv(2, q)
    out["rel_q_mis"] = qv(3, (0.5,))
    rq = _to_float(srt[4][_ranks(counts[4], (0.005, 0.5, 0.995, 1.0), n)], _F32, jnp.float32)
    rmin = _to_float(srt[4][0], _F32, jnp.float32)
    med = rq[1]
    scale = jnp.maximum(jnp.abs(med), 1e-30)
    ok_r = counts[4] > 0
    out["ratio_median"] = jnp.where(ok_r, med, jnp.nan)
    out["ratio_spread"] = jnp.where(ok_r, jnp.maximum(rq[3] - med, med - rmin) / scale, jnp.nan)
    out["ratio_spread_p99"] = jnp.where(ok_r, jnp.maximum(rq[2] - med, med - rq[0]) / scale,
                                        jnp.nan)
    if r is not None:
        out["u_c_q"] = qv(5, (0.5, 0.9, 0.99, 1.0))
        out["u_g_q"] = qv(6, (0.5, 0.9, 0.99, 1.0))
    # 5. Float sums: bias (signed error vs r, or vs g), error slope, geometric mean rel error.
    if r is None:
        d = jnp.where(fin, el.cf - el.gf, 0).astype(jnp.float32)
    else:
        d = jnp.where(fin, el.cf.astype(jnp.float64) - rs.astype(jnp.float64), 0).astype(
            jnp.float32)
    lx = jnp.where(sel, jnp.log2(jnp.where(sel, jnp.abs(el.gf), 1)), 0).astype(jnp.float32)
    ly = jnp.where(sel, jnp.log2(jnp.where(sel, el.err_cg, 1)), 0).astype(jnp.float32)
    lrel = jnp.where(sig & fin, jnp.log2(jnp.maximum(rel, 1e-30)), 0).astype(jnp.float32)
    dmax = jnp.max(jnp.abs(d))
    dmax = jnp.where(dmax > 0, dmax, 1)
    d = d / dmax     # unit scale: squares of tiny errors would underflow
    s1 = jnp.sum(jnp.stack([d, lx, ly, lrel]), axis=1)
    nf, ns = jnp.maximum(cv["n_fin"], 1), jnp.maximum(cv["n_sel"], 1)
    mean, mx, my = s1[0] / nf, s1[1] / ns, s1[2] / ns
    dx = jnp.where(sel, lx - mx, 0)
    s2 = jnp.sum(jnp.stack([jnp.where(fin, (d - mean) ** 2, 0), dx * dx,
                            dx * jnp.where(sel, ly - my, 0)]), axis=1)
    se = jnp.sqrt(s2[0] / jnp.maximum(nf - 1, 1) / nf)
    out["bias_mean"], out["bias_se"] = mean * dmax, se * dmax
    out["bias_t"] = jnp.where(se > 0, mean / jnp.where(se > 0, se, 1), 0.0)
    out["slope"] = jnp.where(s2[1] > 0, s2[2] / jnp.where(s2[1] > 0, s2[1], 1), jnp.nan)
    out["geo_rel_sig"] = jnp.exp2(s1[3] / jnp.maximum(cv["n_sigf"], 1))
    # 6. Error in ULPs of coarser grids (k bits dropped): is c the golden rounded to the grid?
    ks = jnp.arange(f.nmant + 1, dtype=jnp.float32)
    grid_ulp = el.dist.astype(jnp.float32)[:, None] * jnp.exp2(-ks)[None, :]
    mf = (mis & fin)[:, None]
    out["max_ulp_grid"] = jnp.max(jnp.where(mf, grid_ulp, 0), axis=0)
    out["beyond_half_grid"] = jnp.sum(_i32(mf & (grid_ulp > 0.5625)), axis=0)
    return out


def _view2d(shape) -> tuple[int, int, int, int]:
    """(rows, cols, lead, rows along axis -2) of the 2-D view of a leaf."""
    if len(shape) == 0:
        return 1, 1, 1, 1
    if len(shape) == 1:
        return 1, shape[0], 1, 1
    r2 = shape[-2]
    lead = math.prod(shape[:-2])
    return lead * r2, shape[-1], lead, r2


def _profile_stats(p: np.ndarray, per_index: int, blocks) -> tuple:
    """Block alignment and periodicity of an error profile (host side; the profile, counts of
    significant errors per index of one axis, is one of the few vectors that come back).

    Returns (list of (block, pattern, precision, recall, start, stop), smallest period or None,
    first index with errors or -1, last or -1).
    """
    p = np.asarray(p, np.int64)
    n = p.shape[0]
    total = max(int(p.sum()), 1)
    j = np.arange(n)
    out = []
    for b in blocks:
        if n <= b:
            continue
        start = (n // b) * b if n % b else n - b
        for pattern, mask in (("edges", (j % b == 0) | (j % b == b - 1) | (j == n - 1)),
                              ("last_block", j >= start)):
            inside = int(p[mask].sum())
            out.append((b, pattern, inside / total, inside / max(int(mask.sum()) * per_index, 1),
                        0 if pattern == "edges" else start, n))
    on = p > 0
    period = None
    if on.any() and not on.all():
        for q in range(2, min(n // 2, MAX_PERIOD) + 1):
            if np.array_equal(on[q:], on[:-q]):
                period = q
                break
    nz = np.nonzero(on)[0]
    first, last = (int(nz[0]), int(nz[-1])) if nz.size else (-1, -1)
    return out, period, first, last


def _score(el: _El):
    """Sort key of significant elements: error / floor, non-finite first, others -1."""
    score = jnp.where(el.sig, jnp.where(el.fin, el.ratio, jnp.inf), -1.0).astype(jnp.float32)
    return jnp.where(jnp.isnan(score), jnp.inf, score)


def _structure(c, g, r, s, cfg, f, n_sig, rel_tol):
    """Worst elements and row / column / block structure of the significant mask (gated: it
    runs only when significant errors exist).

    One pass over the 2-D view reduces each row (significant count, worst score, ratio range)
    and another each column; the worst elements are then found among the rows with the
    largest worst scores (the top k elements lie in the top k rows), so no sort of the leaf.
    """
    R, C, lead, R2 = _view2d(c.shape)
    k_rows = min(N_WORST, R)
    k = min(N_WORST, R * C)

    def dense(c2, g2, r2):
        """Column counts and per-row ratio ranges: whole-leaf passes (column reductions are
        slow on XLA:CPU), run only when the errors are too many to be all listed."""
        el = _elements(c2, g2, r2, s, cfg, f, _eloc_2d(s, R, C))
        rsel = el.fin & (jnp.abs(el.gf) >= s.rms) & ~el.dg.zero & ~el.dg.sub
        ratio = jnp.where(rsel, el.cf / jnp.where(rsel, el.gf, 1), 0).astype(jnp.float32)
        rmax, rmin = _vreduce([jnp.where(rsel, ratio, -jnp.inf), jnp.where(rsel, ratio, jnp.inf)],
                              ["max", "min"], (1,))
        col_cnt, _ = _vreduce([_i32(el.sig), _i32(el.sig & el.dc.zero)], ["sum", "sum"], (0,))
        return col_cnt, rmax, rmin

    def run(_):
        c2, g2 = c.reshape(R, C), g.reshape(R, C)
        r2 = None if r is None else r.reshape(R, C)
        el = _elements(c2, g2, r2, s, cfg, f, _eloc_2d(s, R, C))
        row_cnt, row_score = _vreduce([_i32(el.sig), _score(el)], ["sum", "max"], (1,))
        # Worst elements: top k among the k rows with the largest worst score.
        _, rows = lax.top_k(row_score, k_rows)
        rows = rows.astype(jnp.int32)
        sub_c = _Pair(c2.vals[rows], c2.bits[rows], f)
        sub_g = _Pair(g2.vals[rows], g2.bits[rows], f)
        sub_r = None if r2 is None else r2[rows]
        eloc = None
        if s.E_row is not None:
            cols = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32)[None, :], (k_rows, C))
            eloc = _eloc(s, jnp.broadcast_to(rows[:, None], (k_rows, C)), cols, C, R)
        sub = _elements(sub_c, sub_g, sub_r, s, cfg, f, eloc)
        vals, pos = lax.top_k(_score(sub).reshape(-1), k)
        flat = rows[pos // C] * C + pos % C
        worst = (flat.astype(jnp.int32), vals, sub.dc.u.reshape(-1)[pos],
                 sub.dg.u.reshape(-1)[pos], sub.cf.reshape(-1)[pos].astype(jnp.float32),
                 sub.gf.reshape(-1)[pos].astype(jnp.float32),
                 sub.noise_bits.reshape(-1)[pos], sub.floor.reshape(-1)[pos].astype(jnp.float32))

        def sparse(_):
            # Every significant element is among the worst: count columns from them.
            listed = (vals >= 0).astype(jnp.int32)
            col = jnp.zeros((C,), jnp.int32).at[flat % C].add(listed)
            nan = jnp.full((R,), jnp.nan, jnp.float32)
            return col, nan, nan

        col_cnt, rmax, rmin = lax.cond(n_sig > k, lambda _: dense(c2, g2, r2), sparse, None)
        total = jnp.maximum(jnp.sum(row_cnt), 1)
        full_r = (row_cnt >= math.ceil(0.9 * C)) & (C >= 2)
        full_c = (col_cnt >= math.ceil(0.9 * R)) & (R >= 2)
        fr_idx = jnp.nonzero(full_r, size=8, fill_value=-1)[0]
        fc_idx = jnp.nonzero(full_c, size=8, fill_value=-1)[0]
        has = row_cnt > 0
        scale = jnp.maximum(jnp.abs(rmax), jnp.abs(rmin))
        const = has & jnp.isfinite(rmax) & (rmax - rmin <= rel_tol * scale) & \
            (jnp.abs(0.5 * (rmax + rmin) - 1) > rel_tol)
        rows_const = jnp.sum(_i32(const)) / jnp.maximum(jnp.sum(_i32(has)), 1)
        return worst, dict(
            profile_col=col_cnt, profile_row=row_cnt.reshape(lead, R2).sum(axis=0),
            rows_with=jnp.sum(_i32(has)), cols_with=jnp.sum(_i32(col_cnt > 0)),
            full_rows=fr_idx.astype(jnp.int32), full_cols=fc_idx.astype(jnp.int32),
            n_full_rows=jnp.sum(_i32(full_r)), n_full_cols=jnp.sum(_i32(full_c)),
            in_full_rows=jnp.sum(jnp.where(full_r, row_cnt, 0)) / total,
            in_full_cols=jnp.sum(jnp.where(full_c, col_cnt, 0)) / total,
            rows_const=rows_const.astype(jnp.float32))

    shapes = jax.eval_shape(run, None)

    def empty(_):
        out = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes)
        worst = (jnp.full((k,), -1, jnp.int32),) + out[0][1:]
        return worst, out[1]

    return lax.cond(n_sig > 0, run, empty, None)


def _permutation(c, g, r, s, cfg, f, n_sig):
    """Sorted-equality and transpose checks (gated; leaves up to PERMUTATION_MAX_ELEMENTS)."""
    square = c.ndim >= 2 and c.shape[-1] == c.shape[-2] and c.shape[-1] > 1
    if c.size > PERMUTATION_MAX_ELEMENTS:
        return tuple(jnp.asarray(-1, jnp.int32) for _ in range(3))
    abs_floor = s.abs_floor if r is None else cfg.noise_factor * s.E

    def within(a, b):
        """Count of positions where a differs from b beyond a floor set at b."""
        da, db = _decode(a, f), _decode(b, f)
        cdt = f.cdt if r is None else jnp.float64
        fin = ~da.nonfinite & ~db.nonfinite
        ulp = _ulp_of_bits(db, f).astype(cdt)
        floor = cfg.ulp_allowance * ulp + abs_floor
        err = jnp.abs(_values(a, f).astype(cdt) - _values(b, f).astype(cdt))
        bad = jnp.where(fin, err > floor, (da.u != db.u) & ~(da.nan & db.nan))
        return jnp.sum(_i32(bad))

    def run(_):
        dc, dg = _decode(c.reshape(-1), f), _decode(g.reshape(-1), f)
        mc = jnp.sort(jnp.where(dc.nan, jnp.iinfo(f.sint).max, dc.mono))
        mg = jnp.sort(jnp.where(dg.nan, jnp.iinfo(f.sint).max, dg.mono))
        beyond = within(_pair_of_bits(_from_mono(mc, f), f), _pair_of_bits(_from_mono(mg, f), f))
        differ = jnp.sum(_i32(mc != mg))
        tr = within(c, g.swapaxes(-1, -2)) if square else jnp.asarray(-1, jnp.int32)
        return (beyond.astype(jnp.int32), differ.astype(jnp.int32), jnp.asarray(tr, jnp.int32))

    def empty(_):
        return tuple(jnp.asarray(-1, jnp.int32) for _ in range(3))

    return lax.cond(n_sig > 0, run, empty, None)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _leaf_stats(c, g, r, cfg: _Cfg):
    f = _fmt(g.dtype)
    c, g = _Pair(c, None, f), _Pair(g, None, f)
    idx = _sample_index(c.size, cfg.sample_size)
    s = _scales(c, g, r, idx, cfg, f)
    main = _main_pass(c, g, r, s, cfg, f)
    # Relative tolerance of ratio tests: twice the typical floor at |g| = rms, relative.
    eps = 2.0 ** -f.nmant
    typical = s.abs_floor if r is None else cfg.noise_factor * jnp.median(s.E_row)
    rel_floor = cfg.ulp_allowance * eps + typical / jnp.maximum(s.rms, 1e-30)
    rel_tol = jnp.maximum(2.0 * rel_floor, 4.0 * eps).astype(jnp.float32)
    noise_free = (main["mismatched"] - main["significant"]) <= NOISE_FREE_SHARE * c.size
    sample = _sample_stats(c, g, r, idx, s, cfg, f, noise_free)
    n_sig = main["significant"]
    worst, struct = _structure(c, g, r, s, cfg, f, n_sig, rel_tol)
    perm = _permutation(c, g, r, s, cfg, f, n_sig)
    scal = dict(rms=s.rms, abs_floor=s.abs_floor, rel_tol=rel_tol)
    if r is not None:
        scal.update(E=s.E, U=s.U)
    return dict(main=main, sample=sample, worst=worst, structure=struct, perm=perm, scales=scal)


@jax.jit
def _nonfloat_stats(c, g):
    mis = c != g
    return jnp.sum(_i32(mis)), jnp.argmax(mis.reshape(-1)) if c.size else jnp.asarray(0)


# ----------------------------------------------------------------------------------------------
# Host side: from the device summary to a Signature
# ----------------------------------------------------------------------------------------------

def _q(qs, values) -> dict:
    return {f"p{100 * q:g}": float(v) for q, v in zip(qs, values)}


def _grid_bits(tz_hist: np.ndarray, nmant: int) -> int:
    """Mantissa bits used by >= 99% of values: nmant - (largest k with >= 99% having >= k
    trailing zero bits)."""
    total = tz_hist.sum()
    if total == 0:
        return nmant
    at_least = np.cumsum(tz_hist[::-1])[::-1] / total  # share with tz >= k
    k = int(np.max(np.nonzero(at_least >= 0.99)[0]))
    return nmant - k


def _build(path: str, shape, dtype, comparison: str, out: dict, cfg: _Cfg, kind: str,
           reduction_length: Optional[int]) -> Signature:
    f = _fmt(dtype)
    m = {k: np.asarray(v) for k, v in out["main"].items()}
    s = {k: np.asarray(v) for k, v in out["sample"].items()}
    sc = {k: float(np.asarray(v)) for k, v in out["scales"].items()}
    n = int(math.prod(shape))
    counts = Counts(
        elements=n, mismatched=int(m["mismatched"]),
        nonfinite_candidate=int(m["nonfinite_candidate"]),
        nonfinite_golden=int(m["nonfinite_golden"]), new_nonfinite=int(m["new_nonfinite"]),
        lost_nonfinite=int(m["lost_nonfinite"]), significant=int(m["significant"]),
        flushed=int(m["flushed"]), significant_not_flushed=int(m["significant_not_flushed"]),
        golden_flushed=int(m["golden_flushed"]), subnormal_golden=int(m["subnormal_golden"]))
    sample_n = min(n, cfg.sample_size)
    n_sig_s = int(s["n_sig"])

    def share(key):
        return float(s[key]) / n_sig_s if n_sig_s else 0.0

    rel_mis = float(s["rel_q_mis"][0])
    eff_bits = None
    if counts.mismatched >= 0.5 * n and rel_mis > 0 and math.isfinite(rel_mis):
        eff_bits = -math.log2(rel_mis) - 2.0
    errors = Errors(
        max_abs=float(m["max_abs"]), max_ulp=int(m["max_ulp"]),
        max_floor_ratio=float(m["max_floor_ratio"]),
        abs_quantiles=_q(QUANTILES, s["abs_q"]), rel_quantiles=_q(QUANTILES, s["rel_q"]),
        floor_ratio_quantiles=_q(QUANTILES, s["floor_q"]),
        ulp_histogram=tuple(int(v) for v in s["ulp_histogram"]),
        bias_mean=float(s["bias_mean"]), bias_std_error=float(s["bias_se"]),
        bias_t=float(s["bias_t"]), error_slope=float(s["slope"]),
        geo_mean_rel_significant=float(s["geo_rel_sig"]) if n_sig_s else 0.0,
        large_rel_significant=share("n_large_rel_sig"),
        sample_size=sample_n, sampled=n > cfg.sample_size)
    hist = tuple(int(v) for v in s["bit_histogram"])
    bits = Bits(
        histogram=hist, sign=hist[-1], exponent=sum(hist[f.nmant:f.bits - 1]),
        mantissa=sum(hist[:f.nmant]),
        popcount_histogram=tuple(int(v) for v in s["popcount_histogram"]),
        significant_single_bit=share("n_single"),
        single_bit_histogram=tuple(int(v) for v in s["single_bit_histogram"]),
        single_bit_set=tuple(int(v) for v in s["single_bit_set"]),
        golden_bit_set=tuple(int(v) for v in s["golden_bit_set"]), finite=int(s["n_fin"]),
        negated=share("n_negated"), candidate_zero=share("n_czero"),
        sign_differs=share("n_sign_differs"),
        sign_agreement=(float(s["n_sign_agree"]) / float(s["n_sign_both"])
                        if int(s["n_sign_both"]) else 1.0))
    if kind == "float64":
        ucq = {f"p{int(100 * q)}": float(v) for q, v in zip((0.5, 0.9, 0.99, 1.0), s["u_c_q"])}
        ugq = {f"p{int(100 * q)}": float(v) for q, v in zip((0.5, 0.9, 0.99, 1.0), s["u_g_q"])}
        F = cfg.noise_factor
        dist_ok = None
        if int(s["n_fin"]) >= DISTRIBUTION_MIN_ELEMENTS:
            dist_ok = (ucq["p50"] <= F / 2 * ugq["p50"] + DISTRIBUTION_ALLOWANCE and
                       ucq["p90"] <= F * ugq["p90"] + DISTRIBUTION_ALLOWANCE)
        noise = NoiseFloor("float64", cfg.noise_factor, cfg.ulp_allowance, sc["abs_floor"],
                           None, sc["E"], sc["U"], ugq, ucq, dist_ok, sc["rms"])
    else:
        noise = NoiseFloor("dtype_bound", cfg.noise_factor, cfg.ulp_allowance, sc["abs_floor"],
                           reduction_length or DEFAULT_REDUCTION_LENGTH, None, None, {}, {},
                           None, sc["rms"])
    st = {k: np.asarray(v) for k, v in out["structure"].items()}
    rtol = sc["rel_tol"]
    spread = float(s["ratio_spread"])
    ratio = Ratio(median=float(s["ratio_median"]), spread=spread,
                  spread_p99=float(s["ratio_spread_p99"]), tolerance=rtol,
                  constant=bool(int(s["ratio_n"]) >= 2 and spread <= rtol),
                  rows_constant=float(st["rows_const"]), n=int(s["ratio_n"]))
    R, C, lead, R2 = _view2d(tuple(shape))
    blocks, period, span = [], {}, {}
    for axis, prof, per in ((-1, st["profile_col"], R), (-2, st["profile_row"], lead * C)):
        matches, period[axis], first, last = _profile_stats(prof, per, cfg.blocks)
        span[axis] = (first, last)
        for pattern in ("edges", "last_block"):
            cands = [m for m in matches if m[1] == pattern and m[2] >= 0.5]
            if cands:
                b, _, prec, rec, lo, hi = max(cands, key=lambda m: (min(m[2], m[3]), m[3], m[0]))
                blocks.append(BlockMatch(axis, b, pattern, prec, rec, lo, hi))
    structure = Structure(
        rows_with_errors=int(st["rows_with"]), cols_with_errors=int(st["cols_with"]),
        full_rows=tuple(int(v) for v in st["full_rows"] if v >= 0),
        full_cols=tuple(int(v) for v in st["full_cols"] if v >= 0),
        n_full_rows=int(st["n_full_rows"]), n_full_cols=int(st["n_full_cols"]),
        in_full_rows=float(st["in_full_rows"]), in_full_cols=float(st["in_full_cols"]),
        span=span, blocks=tuple(blocks), period=period, n_rows=R, n_cols=C)
    tz_c, tz_g = s["tz_c"], s["tz_g"]
    cg, gg = _grid_bits(tz_c, f.nmant), _grid_bits(tz_g, f.nmant)
    dropped = f.nmant - cg
    precision = Precision(
        candidate_grid_bits=cg, golden_grid_bits=gg, effective_mantissa_bits=eff_bits,
        on_narrow_grid=(gg - cg >= 2 and int(tz_c.sum()) > 0),
        max_ulp_on_grid=float(s["max_ulp_grid"][dropped]),
        beyond_half_ulp_on_grid=(float(s["beyond_half_grid"][dropped]) /
                                 max(int(s["n_mis_fin"]), 1)))
    pv, pd, tv = (int(np.asarray(v)) for v in out["perm"])
    permutation = Permutation(is_permutation=None if pv < 0 else pv == 0,
                              is_transpose=None if tv < 0 else tv == 0,
                              sorted_differ=None if pd < 0 else pd)
    widx, wval, wcu, wgu, wc, wg, wnb, wfl = (np.asarray(v) for v in out["worst"])
    noise_free = counts.mismatched - counts.significant <= NOISE_FREE_SHARE * n
    worst = []
    for i, sc_, cu, gu, cv, gv, nb, fl in zip(widx, wval, wcu, wgu, wc, wg, wnb, wfl):
        if i < 0 or sc_ < 0:
            continue
        x = int(cu) ^ int(gu)
        worst.append(WorstElement(
            index=tuple(int(v) for v in np.unravel_index(int(i), tuple(shape))) if shape else (),
            candidate=float(cv), golden=float(gv), candidate_bits=int(cu), golden_bits=int(gu),
            differing_bits=tuple(b for b in range(f.bits) if (x >> b) & 1),
            floor_ratio=float(sc_), noise_bits=0 if noise_free else int(nb), floor=float(fl)))
    return Signature(path=path, shape=tuple(shape), dtype=f.name, comparison=comparison,
                     counts=counts, errors=errors, bits=bits, noise=noise, ratio=ratio,
                     structure=structure, precision=precision, permutation=permutation,
                     worst=tuple(worst))


def _nonfloat_signature(path, c, g, comparison) -> Signature:
    n_mis, first = (int(v) for v in _nonfloat_stats(jnp.asarray(c), jnp.asarray(g)))
    n = int(np.size(c))
    counts = Counts(n, n_mis, 0, 0, 0, 0, n_mis, 0, n_mis, 0, 0)
    errors = Errors(0.0, 0, 0.0, {}, {}, {}, (), 0.0, 0.0, 0.0, float("nan"), 0.0, 0.0, n,
                    False)
    worst = ()
    if n_mis:
        idx = tuple(int(v) for v in np.unravel_index(first, np.shape(c))) if np.ndim(c) else ()
        worst = (WorstElement(idx, float(np.asarray(c).reshape(-1)[first]),
                              float(np.asarray(g).reshape(-1)[first]), 0, 0, (), float("inf")),)
    return Signature(path, tuple(np.shape(c)), str(jnp.result_type(c)), comparison, counts,
                     errors, None, None, None, None, None, None, worst)


def _severity(sig: Signature) -> tuple:
    n = max(sig.counts.elements, 1)
    return (sig.counts.new_nonfinite > 0, sig.counts.significant / n,
            sig.errors.max_floor_ratio if math.isfinite(sig.errors.max_floor_ratio) else 1e300,
            sig.counts.mismatched / n)


def analyze(candidate, golden, reference64=None, *, reduction_length: Optional[int] = None,
            noise_factor: float = DEFAULT_NOISE_FACTOR, ulp_allowance: Optional[float] = None,
            comparison: str = "golden", sample_size: int = DEFAULT_SAMPLE_SIZE) -> Signature:
    """Statistics of `candidate` against `golden` (arrays or pytrees of the same structure).

    Args:
      candidate: the output of the kernel under test (array or pytree of arrays).
      golden: the reference output, same structure, shapes and dtypes.
      reference64: optional float64 evaluation of the same op (same structure): sets the noise
        floor from the golden's own error (see `NoiseFloor`). Computed under
        `jax.enable_x64`; floats of any dtype are accepted and cast to float64.
      reduction_length: K of the dtype bound when there is no float64 reference (the op's
        reduction length; 1 for elementwise ops). Default: `DEFAULT_REDUCTION_LENGTH`.
      noise_factor: F (default 4).
      ulp_allowance: a, in ULPs of the golden's dtype (default: `REFERENCE_ULP_ALLOWANCE` = 2
        with a float64 reference, `DTYPE_ULP_ALLOWANCE` otherwise).
      comparison: "golden", or "repeat" when `golden` is an earlier run of the same candidate
        (the runs are compared directly, with the dtype bound as the floor).
      sample_size: elements the distribution statistics use per leaf (larger leaves are sampled).

    Returns:
      A `Signature` (for a pytree: the worst leaf's, with every leaf's in ``.leaves``).

    Raises:
      PeatError: mismatched structures, shapes or dtypes, or an unsupported dtype.
    """
    if comparison not in ("golden", "repeat"):
        raise PeatError(f"comparison must be 'golden' or 'repeat', got {comparison!r}")
    if comparison == "repeat" and reference64 is not None:
        raise PeatError("comparison='repeat' compares two runs of the candidate directly, with "
                        "the dtype bound as the floor; pass reference64=None")
    if sample_size < 16:
        raise PeatError(f"sample_size must be >= 16, got {sample_size}")
    if not (noise_factor > 0 and math.isfinite(noise_factor)):
        raise PeatError(f"noise_factor must be a positive finite number, got {noise_factor}")
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(candidate)
    g_leaves, g_def = jax.tree_util.tree_flatten(golden)
    if g_def != treedef:
        raise PeatError(f"candidate and golden have different structures: {treedef} vs {g_def}")
    r_leaves = [None] * len(g_leaves)
    if reference64 is not None:
        r_leaves, r_def = jax.tree_util.tree_flatten(reference64)
        if r_def != treedef:
            raise PeatError(f"reference64 has a different structure from golden: {r_def} vs "
                            f"{g_def}")
    if not g_leaves:
        raise PeatError("analyze needs at least one array")
    sigs = []
    for (kp, c), g, r in zip(path_leaves, g_leaves, r_leaves):
        path = jax.tree_util.keystr(kp)
        sigs.append(_analyze_leaf(path, c, g, r, reduction_length, noise_factor, ulp_allowance,
                                  comparison, sample_size))
    if len(sigs) == 1 and not path_leaves[0][0]:
        return sigs[0]
    worst = max(sigs, key=_severity)
    return dataclasses.replace(worst, leaves=tuple(sigs))


def _home(*xs):
    """The device the statistics run on: that of the first single-device jax array among `xs`,
    else the default device. Every operand is committed to it, so the jitted statistics compile
    once per (shape, dtype, device): a committed and an uncommitted array of the same shape
    would otherwise be two cache entries, i.e. two ~1.5 s compilations."""
    for x in xs:
        if isinstance(x, jax.Array):
            devs = x.sharding.device_set
            if len(devs) == 1:
                return next(iter(devs))
    return jax.devices()[0]


def _analyze_leaf(path, c, g, r, reduction_length, noise_factor, ulp_allowance, comparison,
                  sample_size) -> Signature:
    c_shape, g_shape = tuple(np.shape(c)), tuple(np.shape(g))
    where = f" at {path}" if path else ""
    if c_shape != g_shape:
        raise PeatError(f"candidate{where} has shape {c_shape}, golden has {g_shape}")
    c_dt, g_dt = jnp.result_type(c), jnp.result_type(g)
    if c_dt != g_dt:
        raise PeatError(f"candidate{where} has dtype {jnp.dtype(c_dt).name}, golden has "
                        f"{jnp.dtype(g_dt).name}")
    if not jnp.issubdtype(g_dt, jnp.floating):
        return _nonfloat_signature(path, c, g, comparison)
    f = _fmt(g_dt)
    if math.prod(g_shape) == 0:
        raise PeatError(f"leaf{where} is empty: nothing to analyze")
    if r is not None and tuple(np.shape(r)) != g_shape:
        raise PeatError(f"reference64{where} has shape {tuple(np.shape(r))}, golden has "
                        f"{g_shape}")
    kind = "dtype_bound" if r is None else "float64"
    if ulp_allowance is None:
        ulp_allowance = DTYPE_ULP_ALLOWANCE[f.name] if r is None else REFERENCE_ULP_ALLOWANCE
    _, coef = dtype_noise_bound(g_dt, reduction_length, noise_factor)
    cfg = _Cfg(float(noise_factor), float(ulp_allowance), float(coef), int(sample_size),
               BLOCK_SIZES)
    device = _home(c, g)
    c, g = jax.device_put(c, device), jax.device_put(g, device)
    if r is None:
        out = jax.device_get(_leaf_stats(c, g, None, cfg))
    else:
        with jax.enable_x64(True):
            r64 = jax.device_put(jnp.asarray(r, jnp.float64), device)
            out = jax.device_get(_leaf_stats(c, g, r64, cfg))
    return _build(path, g_shape, g_dt, comparison, out, cfg, kind, reduction_length)
