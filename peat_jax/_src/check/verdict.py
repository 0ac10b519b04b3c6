"""The verdict of one `check_kernel` call: the worst check's diagnosis, with where it came from
and what every check found."""
from __future__ import annotations

import math
from typing import Optional, Sequence, cast

from peat_jax._src.check.judging import Check, narrowest_formats
from peat_jax._src.check.programs import VJP_FORWARD
from peat_jax._src.check.running import Float64Reference
from peat_jax._src.detector import (TRAINING_RANGE_LOG2, UNSTABLE_FACTOR, Diagnosis,
                                    beyond_training_range, narrowed, only_near_overflow,
                                    only_on_odd_shapes, severity, swamped_by_outliers)
from peat_jax._src.judge.reference_spread import Spread
from peat_jax._src.judge.rounding import ROUNDING_SAMPLES


def _check_key(c: Check) -> tuple:
    """Worst last: failing, then model class (`severity`), then a forward failure before the
    gradient failures it usually causes, then the floor ratio."""
    failing, rank, ratio = severity(c.diagnosis)
    return (failing, rank, c.output in ("forward", VJP_FORWARD), ratio)


def _judged(checks: Sequence[Check], near_overflow_log2: float
            ) -> tuple[Check, Diagnosis, list[Check], Optional[Diagnosis]]:
    """(the worst check, its diagnosis renamed by the variants that fail, the failing checks,
    None); the example inputs' worst check and its diagnosis where the worst is
    `swamped_by_outliers`; where the failures are `beyond_training_range`, the same over the
    other checks with the near_overflow diagnosis last."""
    failing = [c for c in checks if not c.diagnosis.passed]
    failing_variants = {c.variant for c in failing}
    passing = {c.variant for c in checks} - failing_variants
    worst = max(checks, key=_check_key)
    formats = narrowest_formats(checks)
    d = only_near_overflow(only_on_odd_shapes(narrowed(worst.diagnosis, formats),
                                              failing_variants, passing),
                           failing_variants, passing)
    example = max((c for c in checks if c.variant == "example"), key=_check_key, default=None)
    models: dict[str, set[str]] = {}
    for c in failing:
        models.setdefault(c.variant, set()).add(c.diagnosis.model)
    swamped = swamped_by_outliers(
        d, worst.variant, None if example is None else narrowed(example.diagnosis, formats),
        models)
    if swamped is not None:
        return cast(Check, example), swamped, failing, None
    if not beyond_training_range(d, failing_variants, passing, near_overflow_log2):
        return worst, d, failing, None
    rest = [c for c in checks if c.variant != "near_overflow"]
    within = max(rest, key=_check_key)
    return within, narrowed(within.diagnosis, narrowest_formats(rest)), [], d


def _out_of_range_note(beyond: Diagnosis, checks: Sequence[Check], near_overflow_log2: float,
                       ev: dict) -> str:
    """The note (and ``evidence["beyond_training_range"]``) of a verdict whose only failures
    are `beyond_training_range`."""
    where = sorted(f"{c.output} on {c.variant}" for c in checks if not c.diagnosis.passed)
    ev["beyond_training_range"] = {"model": beyond.model, "failing_checks": where,
                                   "max_abs_log2": near_overflow_log2,
                                   "summary": beyond.summary}
    return (f"; note: fails as {beyond.model} only at inputs near overflow, beyond any "
            f"training's magnitudes (max |x| ~ 2**{near_overflow_log2:g} > "
            f"2**{TRAINING_RANGE_LOG2}): {', '.join(where)} (evidence: beyond_training_range)")


def verdict(checks: Sequence[Check], *, skipped: dict[str, str],
             spread: dict[tuple[str, str], Spread], precision: str,
             no_float64: dict[str, str], float64: Float64Reference,
             no_rounding: Optional[dict[str, str]] = None,
             near_overflow_log2: float = math.inf) -> Diagnosis:
    """The worst check's diagnosis, its evidence extended with where it came from, every
    check's model, the skipped variants, the reference's matmul precision and its
    nondeterminism, the elements no reference could judge (``unjudged``), the variants
    without a float64 reference (and why) and how the float64 reference was had from a
    reference that pins a narrower dtype. Failures only at magnitudes no training reaches
    (`beyond_training_range`; the near_overflow inputs' max |x| ~ 2**near_overflow_log2)
    pass, with a note."""
    worst, d, failing, beyond = _judged(checks, near_overflow_log2)
    ev = dict(d.evidence)
    note = "" if beyond is None else _out_of_range_note(beyond, checks, near_overflow_log2, ev)
    if spread:
        ev["reference_nondeterministic"] = {f"{o} on {v}": s.reference
                                            for (v, o), s in spread.items()}
        note = (f"; note: the reference itself is nondeterministic (run-to-run max |diff| up to "
                f"{max(s.reference for s in spread.values()):.3g})")
    if float64.note:
        ev["float64_reference"] = float64.note
    if no_float64:
        ev["no_float64_reference"] = dict(no_float64)
        note += (f"; note: the floor is the dtype bound, not a float64 reference, on "
                 f"{len(no_float64)} of {len({c.variant for c in checks})} variants: the "
                 f"reference {next(iter(no_float64.values()))}"
                 + (f"; {float64.note}" if float64.note and not float64.widened else ""))
    if no_rounding:
        ev["no_rounding_floor"] = dict(no_rounding)
        if not d.passed:
            note += (f"; note: no rounding floor on {len(no_rounding)} variants: the reference "
                     f"could not be evaluated under Monte Carlo arithmetic "
                     f"({next(iter(no_rounding.values()))})")
    rounded = _rounded(checks)
    if rounded:
        ev["rounding_checks"] = rounded
        if d.passed:
            note += (f"; {len(rounded)} checks pass within the rounding floor (the spread of "
                     f"{ROUNDING_SAMPLES} correct roundings of the reference, Monte Carlo "
                     "arithmetic) rather than the reference's own error")
    conditioned = _conditioned(checks)
    if conditioned:
        ev["conditioned_checks"] = conditioned
        note += (f"; {len(conditioned)} passing checks are within the problem's conditioning "
                 "rather than the reference's own error")
    unjudged = {f"{c.output} on {c.variant}": c.diagnosis.evidence["unjudged"] for c in checks
                if c.diagnosis.evidence.get("unjudged")}
    if unjudged:
        ev["unjudged"] = unjudged
        note += (f"; note: the reference is not finite, in float64 too, at "
                 f"{sum(unjudged.values())} elements where the candidate is (in {len(unjudged)} "
                 "checks): nothing judges those elements")
    inaccurate = {f"{c.output} on {c.variant}": c.diagnosis.evidence["reference_error_roundoffs"]
                  for c in checks if c.diagnosis.passed
                  and "reference_error_roundoffs" in c.diagnosis.evidence}
    if inaccurate:
        ev["inaccurate_reference"] = inaccurate
        worst_check, roundoffs = max(inaccurate.items(), key=lambda kv: kv[1])
        note += (f"; note: the reference itself is inaccurate on {len(inaccurate)} checks "
                 f"({worst_check}: its max |error| is {roundoffs:.3g}x its dtype's roundoff at the "
                 "output's scale), where the candidate, right in float64, errs within "
                 f"{UNSTABLE_FACTOR:g}x as much: judge those against a more accurate reference")
    ev["origin"] = {"variant": worst.variant, "output": worst.output}
    ev["reference_precision"] = precision
    if d.model in ("reduced_precision", "low_precision_accumulation"):
        note = f"; reference at matmul precision {precision!r}" + note
    ev["checks"] = [[c.variant, c.output, c.diagnosis.model] for c in checks]
    if skipped:
        ev["skipped"] = skipped
    if not d.passed:
        ev["failing_checks"] = sorted({f"{c.output} on {c.variant}" for c in failing})
    where = f" [{worst.output}, {worst.variant} inputs]"
    tail = (f" ({len(failing)} of {len(checks)} checks fail)" if failing
            else f" ({len(checks)} checks)")
    return Diagnosis(model=d.model, passed=d.passed, confidence=d.confidence, evidence=ev,
                     summary=d.summary + where + tail + note)


def _rounded(checks: Sequence[Check]) -> list[str]:
    """The checks ("output on variant") judged with the rounding floor (they failed without
    it)."""
    return [f"{c.output} on {c.variant}" for c in checks
            if c.diagnosis.evidence.get("rounding_floor") is not None]


def _conditioned(checks: Sequence[Check]) -> list[str]:
    """The passing checks ("output on variant") that the conditioning floor made pass: elements
    beyond the noise floor within it; not those judged with the rounding floor (`_rounded`),
    which it joins there: they failed without it."""
    return [f"{c.output} on {c.variant}" for c in checks if c.diagnosis.passed and
            c.diagnosis.evidence.get("rounding_floor") is None and
            (c.diagnosis.evidence.get("conditioning_floor") or {}).get("decisive", 0) > 0]
