"""The float64 rules: a failing verdict renamed by what the candidate computes when it runs in
float64 too (`check_kernel` and playback supply the numbers, `judge.float64.float64_evidence`):
``unstable_algorithm`` (exact in float64, amplified rounding in float32), ``approximation``
(wrong in float64 as well) and, passing, ``numerical_noise`` by ``another_algorithms_rounding``
(a right algorithm that rounds about as the reference does: a few elements just past the floor,
or anywhere the reference itself loses its dtype's accuracy)."""
from __future__ import annotations

import math
from typing import Callable, Iterable, NamedTuple, Optional

from peat_jax._src.detector.machinery import Diagnosis, Match, plain, short
from peat_jax._src.formats import unit_roundoff
from peat_jax._src.taxonomy import PASSING


class Float64Evidence(NamedTuple):
    """One failing output, with the candidate also evaluated in float64 on the same inputs.

    Attributes:
      dtype: the candidate's output dtype (its float format).
      error: max |candidate - float64 reference| (output units).
      error64: max |candidate run in float64 - float64 reference| (output units; inf where the
        float64 run is non-finite and the reference is not).
      scale: max |float64 reference| over its finite elements.
      reference_error: max |reference in the dtype - float64 reference| (output units).
      in_float64: False when every value of the float64 run is representable in `dtype` (in
        float32 for a narrower dtype): the candidate computed in its own dtype, or in float32,
        inside (a kernel that casts to float32), so its "float64" run says nothing about its
        algorithm and no float64 rule applies.
    """

    dtype: str
    error: float
    error64: float
    scale: float
    reference_error: float
    in_float64: bool = True


UNSTABLE_FACTOR = 8.0
"""How many times the reference's own max |error| (and the dtype's roundoff at the output's
scale) a candidate's max |error| must exceed to be called unstable: a correct algorithm of the
same dtype rounds about as much as the reference does."""


def _unstable_algorithm(d: Diagnosis, f: Float64Evidence) -> Optional[Match]:
    """The check fails with a model other than nondeterministic or a reduced_precision that a
    narrower format fits (a matmul at tf32 is exact in float64 too: its float64 run cannot
    clear it); the candidate really computes in float64 when given float64 inputs
    (`in_float64`); evaluated so, it matches the float64 reference to within u * max|reference|
    (u the unit roundoff of the candidate's dtype: its algorithm computes the right function);
    and in its dtype its max |error| exceeds 8 times both that bound and the reference's own
    max |error| (the dtype's rounding amplified: cancellation, as in a one-pass variance, or an
    intermediate that overflows or underflows, as haiku's RMSNorm gradient at inputs near
    2**62, where jax's rsqrt derivative -ans / (2 x) underflows float32 and the reference's
    x / sqrt(mean(x * x)) does not: no format fits that dense error)."""
    if d.passed or d.model == "nondeterministic" or not f.in_float64 or (
            d.model == "reduced_precision" and not _unformatted_degradation(d)):
        return None
    bound = unit_roundoff(f.dtype) * f.scale
    if not (f.error64 <= bound and f.error > UNSTABLE_FACTOR * max(bound, f.reference_error)):
        return None
    ev = {"error": f.error, "error_float64": f.error64, "reference_max": f.scale,
          "reference_error": f.reference_error, "would_be": d.model}
    return Match(ev, 0.9, f"the algorithm is right (run in float64 its max |error| is "
                           f"{short(f.error64)}, below {f.dtype}'s roundoff at the output's scale "
                           f"{short(bound)}) but in {f.dtype} it loses it: max |error| "
                           f"{short(f.error)} (cancellation or overflow in an intermediate; "
                           f"the rules alone said {d.model})")


def _unformatted_degradation(d: Diagnosis) -> bool:
    """The failure is dense degradation the signature rules could not tie to a narrower format:
    low_precision_accumulation by the error's slope or bias (its values are not on a narrower
    grid), or reduced_precision of the inputs with no narrow format fitting."""
    ev = d.evidence
    return (d.model == "low_precision_accumulation" and "max_ulp_on_grid" not in ev) or (
        d.model == "reduced_precision" and ev.get("where") == "inputs" and not ev.get("formats"))


def _approximation(d: Diagnosis, f: Float64Evidence) -> Optional[Match]:
    """The check fails as `_unformatted_degradation`, and the candidate, really computing in
    float64 (`in_float64`), is still off the float64 reference by at least half its error in
    its own dtype (the difference is in the function computed, e.g. tanh-GELU for the exact
    GELU or a polynomial exp, not in rounding)."""
    if d.passed or not _unformatted_degradation(d) or not f.in_float64 or not (
            f.error > 0 and f.error64 >= 0.5 * f.error):
        return None
    ev = {"error": f.error, "error_float64": f.error64, "reference_max": f.scale,
          "would_be": d.model}
    return Match(ev, 0.8, f"a different function, not rounding: run in float64 it is still "
                           f"{short(f.error64)} off (max |error| {short(f.error)} in {f.dtype}; "
                           f"relative {short(f.error64 / f.scale if f.scale else 0.0)})")


_ROUNDING_LIKE = frozenset({"bit_flip", "multi_bit_flip", "sign_flip", "zeroed", "random_value",
                            "unknown"})
"""The models the signature rules give a few elements that differ by value alone; the others
name a structure (a tile, a layout, a scale, a stuck bit) or a format, which rounding is not."""

_DTYPE_BOUND = frozenset({"flush_to_zero", "nan_inf", "nondeterministic", "data_race"})
"""Models of what a kernel does in its own dtype or from run to run, which its float64 run
cannot show (so can the formats: reduced_precision and low_precision_accumulation that a
narrower format fits)."""


def _another_algorithms_rounding(d: Diagnosis, f: Float64Evidence) -> Optional[Match]:
    """The candidate's algorithm is right and rounds about as much as the reference does, where
    the golden cannot tell the two roundings apart. All of:

    - the candidate really computes in float64 (`in_float64`) and, so evaluated, matches the
      float64 reference to within u * max|reference| (u the unit roundoff of its dtype: its
      algorithm computes the right function, so no structure, scale or corruption of the
      values is in its code);
    - in its dtype its max |error| is within `UNSTABLE_FACTOR` times the larger of that bound and
      the reference's own max |error|, the line past which `_unstable_algorithm` calls it
      unstable;
    - and either the reference itself is inaccurate here (its own max |error| exceeds
      sqrt(u) * max|reference|: half its dtype's significand lost, as where an intermediate
      overflows or underflows in its dtype, which the rounding floor, rounding at the dtype's
      precision with float64's range, does not model), with any model but those of the
      dtype (`_DTYPE_BOUND`, or a narrower format); or the failure is a few isolated elements
      (``evidence["isolated"]``: at most `isolated_limit`, the distribution test holding) with
      a model of values alone (`_ROUNDING_LIKE`).

    jax.nn.sigmoid's gradient s * (1 - s) loses a few ULPs to cancellation where the reference's
    exp(-x) / (1 + exp(-x))^2 does not (isolated); a layer norm's gradient at inputs near
    2**63, where the variance's power -3/2 underflows float32 in the reference and the
    candidate alike (the reference off by 8% of the gradient's scale, flax's LayerNorm by 28%:
    "random_value", "low_precision_accumulation", or "permuted_layout" where its values, all
    within the reference's own error, sort alike).
    """
    if d.passed or not f.in_float64:
        return None
    u = unit_roundoff(f.dtype)
    bound = u * f.scale
    isolated = int(d.evidence.get("isolated") or 0)
    formatted = (d.model in ("reduced_precision", "low_precision_accumulation")
                 and not _unformatted_degradation(d))
    # half the significand lost (float32: 2**-12 of the scale, 4096 roundoffs), far past what
    # a composite function's rounding reaches (sigmoid's gradient: 9 roundoffs)
    reference_unstable = f.reference_error > math.sqrt(u) * f.scale
    if reference_unstable:
        if d.model in _DTYPE_BOUND or formatted:
            return None
    elif not isolated or d.model not in _ROUNDING_LIKE:
        return None
    if not (f.error64 <= bound and f.error <= UNSTABLE_FACTOR * max(bound, f.reference_error)):
        return None
    ev = {"error": f.error, "error_float64": f.error64, "reference_max": f.scale,
          "reference_error": f.reference_error, "would_be": d.model}
    right = (f"the algorithm is right (run in float64 its max |error| is {short(f.error64)}, "
             f"below {f.dtype}'s roundoff at the output's scale {short(bound)})")
    if not reference_unstable:
        ev["elements"] = isolated
        return Match(ev, 0.7, f"{isolated} element{'s' if isolated > 1 else ''} just past the "
                              f"floor, but {right} and in {f.dtype} its max |error| "
                              f"{short(f.error)} is within {UNSTABLE_FACTOR:g}x the reference's "
                              f"own {short(f.reference_error)}: another algorithm's rounding "
                              f"(the rules alone said {d.model})")
    ev["reference_error_roundoffs"] = roundoffs = (f.reference_error / bound if bound
                                                   else math.inf)
    return Match(ev, 0.6, f"the reference itself is inaccurate here (its max |error| in "
                          f"{f.dtype}, {short(f.reference_error)}, is {short(roundoffs)}x "
                          f"{f.dtype}'s roundoff at the output's scale: more than half its "
                          f"significand lost), {right} and in {f.dtype} its max |error| "
                          f"{short(f.error)} is within {UNSTABLE_FACTOR:g}x the reference's: "
                          f"nothing in {f.dtype} judges it finer (the rules alone said "
                          f"{d.model})")


FLOAT64_RULES: tuple[tuple[str, str, Callable[[Diagnosis, Float64Evidence], Optional[Match]]],
                     ...] = (
    ("unstable_algorithm", "unstable_algorithm", _unstable_algorithm),
    ("approximation", "approximation", _approximation),
    ("another_algorithms_rounding", "numerical_noise", _another_algorithms_rounding))
"""(rule, model, condition) over a failing diagnosis and the candidate's float64 evaluation, in
order; `check_kernel` applies them (`by_float64`)."""


def by_float64(d: Diagnosis, f: Float64Evidence, *, allow: Iterable[str] = ()) -> Diagnosis:
    """`d` renamed by the first of `FLOAT64_RULES` whose condition holds (``evidence["rule"]``
    names the rule, ``evidence["would_be"]`` keeps the signature rules' model; a passing model
    passes), else `d` itself."""
    for rule, model, test in FLOAT64_RULES:
        m = test(d, f)
        if m is None:
            continue
        allowed = model in frozenset(allow) and model not in PASSING
        passed = allowed or model in PASSING
        kept = ("leaf", "max_floor_ratio", "conditioning_floor", "rounding_floor", "unjudged")
        ev = {**{k: v for k, v in d.evidence.items() if k in kept},
              **m.evidence, "rule": rule}
        if allowed:
            ev["allowed"] = True
        verdict = "passes" if passed else "fails"
        return Diagnosis(model, passed, m.confidence, plain(ev),
                         f"{verdict}: {model}{' (allowed)' if allowed else ''}, {m.detail}")
    return d
