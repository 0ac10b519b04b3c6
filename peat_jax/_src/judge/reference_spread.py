"""The reference's own run-to-run spread as a floor: a reference that differs from itself (an
atomics-based reduction, say) cannot blame the candidate for differing from it by as much.
`check_kernel` measures it over three runs of the reference; playback's step effects over the
golden step's repeats (`profiler.effect`)."""
from __future__ import annotations

from typing import NamedTuple, Optional

from peat_jax._src.detector import Diagnosis


REFERENCE_SPREAD_FACTOR = 4.0
"""A candidate's error within this many times the reference's own run-to-run difference (the
largest over three runs' pairs) is not blamed on the candidate (check_kernel and playback)."""


class Spread(NamedTuple):
    """One output the reference computes nondeterministically (max |differences|, output
    units)."""

    reference: float   # the reference against itself, over three runs
    candidate: float   # the candidate against the reference's first run


def within_reference_spread(d: Diagnosis, spread: Optional[Spread]) -> Diagnosis:
    """`d`, or a pass as ``numerical_noise`` (evidence rule ``within_reference_spread``) when
    it fails by no more than `REFERENCE_SPREAD_FACTOR` times the reference's own run-to-run
    difference."""
    if spread is None or d.passed or \
            spread.candidate > REFERENCE_SPREAD_FACTOR * spread.reference:
        return d
    return Diagnosis(
        model="numerical_noise", passed=True, confidence=0.5,
        evidence={"rule": "within_reference_spread", "max_abs_error": spread.candidate,
                  "reference_run_to_run": spread.reference, "would_be": d.model},
        summary=(f"passes: max |error| {spread.candidate:.3g} is within "
                 f"{REFERENCE_SPREAD_FACTOR:g}x the reference's own run-to-run difference "
                 f"{spread.reference:.3g} (the reference is nondeterministic)"))
