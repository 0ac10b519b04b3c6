"""The noise floor: how far a candidate may be from the truth and still count as rounding noise.

`dtype_noise_bound` states the floor used without a float64 reference; `NoiseFloor` records the
floor a `Signature` was judged against. The per-element floor itself is computed on device
(`peat_jax._src.analyzer.elements`); this module holds its constants and its documented formulas.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence

import numpy as np

from peat_jax._src.errors import PeatError
from peat_jax._src.formats import FloatFormat, float_format


FLOAT_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
"""The float dtypes `analyze` supports (those with a documented noise bound)."""

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
"""The distribution test (float64 reference only): the candidate fails it when its median ULP
error is beyond ``F / 2`` (2 at the default F = 4) times the golden's or its 90th-percentile
ULP error beyond F times the golden's, and its 99th-percentile ULP error is beyond F times the
golden's too, each plus this many ULPs (`distribution_ok`)."""

DISTRIBUTION_MIN_ELEMENTS = 32
"""The distribution test needs at least this many finite elements; smaller leaves rely on the
per-element floor alone."""

NOISE_FREE_SHARE = 0.01
"""A leaf whose elements differ within the noise floor in at most this share is taken as noise
free: the differing bits of its significant elements all belong to the fault."""

_ACCUMULATOR_MANTISSA_BITS = 23
"""Kernels accumulate in float32 at least (16-bit kernels included)."""


def analyzed_format(dtype) -> FloatFormat:
    """The `FloatFormat` of a dtype `analyze` supports.

    Raises:
      PeatError: any other dtype.
    """
    f = float_format(dtype)
    if f.name not in FLOAT_DTYPES:
        raise PeatError(f"analyze supports {', '.join(FLOAT_DTYPES)} (and integer/bool leaves); "
                        f"got {f.name}")
    return f


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
      ``(a, F * eps_acc * sqrt(K))``: the ULP allowance (ULPs) and the relative-to-rms
      coefficient (dimensionless).
    """
    f = analyzed_format(dtype)
    k = DEFAULT_REDUCTION_LENGTH if reduction_length is None else int(reduction_length)
    if k < 1:
        raise PeatError(f"reduction_length must be >= 1, got {reduction_length}")
    eps_acc = 2.0 ** -max(f.mantissa_bits, _ACCUMULATOR_MANTISSA_BITS)
    return DTYPE_ULP_ALLOWANCE[f.name], noise_factor * eps_acc * math.sqrt(k)


def distribution_ok(candidate_ulp: Mapping[str, float], golden_ulp: Mapping[str, float],
                    noise_factor: float) -> bool:
    """The distribution test on ULP-error quantiles (``{"p50": ..., "p90": ..., "p99": ...}``,
    ULPs of the golden's dtype against the float64 reference).

    Returns:
      False (the candidate's errors are distributionally worse) when the body of the
      distribution is worse, ``p50(u_c) > F/2 * p50(u_g) + 0.5`` or ``p90(u_c) > F * p90(u_g) +
      0.5``, and so is its tail, ``p99(u_c) > F * p99(u_g) + 0.5``; True otherwise.
    """
    # A narrow accumulator (or a long sequential sum) scales every error, so every quantile
    # moves (calibrated: p90 and p99 >= 6.9x the golden's). Another correct summation order
    # only reshuffles which elements round which way: where the ULP errors are bimodal (small
    # values left by cancellation sit orders of magnitude above the rest) the median falls in
    # the gap and moves by 2-3x on its own, while the tail stays at the golden's.
    def beyond(q: str, factor: float) -> bool:
        return candidate_ulp[q] > factor * golden_ulp[q] + DISTRIBUTION_ALLOWANCE

    body = beyond("p50", noise_factor / 2) or beyond("p90", noise_factor)
    return not (body and beyond("p99", noise_factor))


@dataclasses.dataclass(frozen=True)
class ConditioningFloor:
    """The conditioning floor of a leaf: what the problem itself allows.

    Given a conditioning spread ``K`` (per element, output units: how far the float64 result
    moves when the inputs are perturbed at the last bit of their dtype; `peat.check_kernel`
    measures it), the floor at element i is ``F * max(E_loc(i), U90 * ulp(r_i), K(i)) + a *
    ulp(r_i)``: the larger of the noise floor and the conditioning floor ``F * K(i) + a *
    ulp(r_i)``. Elements whose conditioning floor is the larger are left out of the
    distribution test (the problem, not the golden, sets their yardstick).

    Attributes:
      max_spread: max K, output units.
      max_ratio: max over finite elements of floor / noise floor (1: the noise floor dominates
        everywhere).
      dominant: elements whose conditioning floor exceeds their noise floor.
      decisive: mismatched elements beyond the noise floor but within the floor: those the
        conditioning floor alone passes (0: it made no difference).
    """

    max_spread: float
    max_ratio: float
    dominant: int
    decisive: int


@dataclasses.dataclass(frozen=True)
class RoundingFloor:
    """The rounding floor of a leaf: the spread of S correct roundings of the reference's
    algorithm (Monte Carlo arithmetic on its float64 shadow, `peat_jax._src.judge.rounding`).

    Its per-element spread R(i) (the largest |sample - float64 reference|, output units) joins
    the conditioning spread: the floor at element i is ``F * max(E_loc(i), U90 * ulp(r_i),
    K(i), R(i)) + a * ulp(r_i)``, and the `ConditioningFloor` record counts both. The
    distribution test reads the samples too: the golden's ULP-error quantiles are replaced by
    the largest of the golden's and each sample's (the candidate against the spread of S correct
    roundings, not against one).

    Attributes:
      samples: S, the Monte Carlo evaluations.
      max_spread: max R, output units.
      ulp_quantiles: {q: ULPs} the largest over the samples of their ULP-error quantile q
        (empty when no element is finite).
    """

    samples: int
    max_spread: float
    ulp_quantiles: Mapping[str, float]


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
    worse than the golden's in its body and its tail (``distribution_ok``), which catches dense
    mild degradation (e.g. a bfloat16 accumulator) that no single element shows.

    Without one (``kind="dtype_bound"``): the floor on ``|c - g|`` is `dtype_noise_bound`.

    Attributes:
      kind: "float64" or "dtype_bound".
      factor: F (dimensionless).
      ulp_allowance: a, in ULPs of the golden's dtype.
      abs_floor: the largest absolute part of the floor, output units (``F * max E_loc`` or
        ``F * eps_acc * sqrt(K) * rms(g)``).
      reduction_length: K, the elements the op sums into one output element: with the dtype
        bound, the K it assumed (given, else `DEFAULT_REDUCTION_LENGTH`); with a float64
        reference, the K given (None if none), which widens how far the detector lets rounding
        at the tensor's scale reach (``F * sqrt(K)`` ULPs there: K roundings of partial sums at
        that scale).
      golden_max_abs_error: E (output units), None without a reference.
      golden_max_ulp_error: U (ULPs), None without a reference.
      golden_ulp_quantiles / candidate_ulp_quantiles: {q: ULPs} of ``u_g`` and ``u_c`` (sample),
        empty without a reference.
      distribution_ok: False when ``p50(u_c) > F/2 * p50(u_g) + 0.5`` or ``p90(u_c) > F *
        p90(u_g) + 0.5``, and ``p99(u_c) > F * p99(u_g) + 0.5`` (`distribution_ok`); None
        without a reference or with fewer than `DISTRIBUTION_MIN_ELEMENTS` finite elements.
      rms_golden: root mean square of the finite golden values (sample), output units.
      conditioning: the `ConditioningFloor`, None when no conditioning spread was given.
      rounding: the `RoundingFloor`, None when no rounding samples were given.
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
    conditioning: Optional[ConditioningFloor] = None
    rounding: Optional[RoundingFloor] = None


_ROUNDING_QUANTILE_ELEMENTS = 1 << 15
"""Elements of a leaf the rounding samples' ULP quantiles read (at a fixed stride beyond)."""


def rounding_floor(samples, reference64, dtype,
                   quantiles: Sequence[float] = (0.5, 0.9, 0.99, 1.0)
                   ) -> tuple[np.ndarray, RoundingFloor]:
    """The rounding spread and `RoundingFloor` of one leaf from its Monte Carlo samples.

    Args:
      samples: (S, *shape) float64: S evaluations of the reference under Monte Carlo arithmetic
        (`peat_jax._src.judge.rounding`).
      reference64: the leaf's float64 reference.
      dtype: the golden's dtype (the ULPs the quantiles are in).

    Returns:
      ``(R, floor)``: R the per-element max |sample - reference64| (float64, output units; 0
      where either is not finite), and the record, whose quantiles are the largest over the
      samples of each quantile of ``|sample - r| / ulp(r)`` (finite elements; leaves over
      `_ROUNDING_QUANTILE_ELEMENTS` read at a fixed stride).
    """
    f = analyzed_format(dtype)
    s = np.asarray(samples, np.float64)
    r = np.asarray(reference64, np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        d = np.abs(s - r[None])
        spread = np.where(np.isfinite(d), d, 0.0).max(axis=0)
        flat_r, flat_d = r.reshape(-1), d.reshape(len(s), -1)
        stride = max(1, flat_r.size // _ROUNDING_QUANTILE_ELEMENTS)
        flat_r, flat_d = flat_r[::stride], flat_d[:, ::stride]
        e = np.floor(np.log2(np.abs(flat_r)))
        e = np.where(np.isfinite(e), e, f.min_exponent)
        ulp = np.ldexp(1.0, (np.maximum(e, f.min_exponent) - f.mantissa_bits).astype(int))
        u = flat_d / ulp[None]
    ok = np.isfinite(u).all(axis=0)
    qs = {}
    if ok.any():
        q = np.quantile(u[:, ok], quantiles, axis=1).max(axis=1)
        qs = {f"p{int(100 * p)}": float(v) for p, v in zip(quantiles, q)}
    return spread, RoundingFloor(samples=len(s), max_spread=float(spread.max(initial=0.0)),
                                 ulp_quantiles=qs)
