"""Test helpers for kernel authors: ``assert_kernel_matches`` (and the ``peat_check`` pytest
fixture in `peat_jax._src.pytest_plugin`)."""
from __future__ import annotations

import json
from typing import Callable

from peat_jax._src.check import check_kernel
from peat_jax._src.detector import Diagnosis


def format_diagnosis(d: Diagnosis) -> str:
    """The diagnosis as a message: the summary line, then the evidence as indented JSON (the
    per-check list last)."""
    ev = dict(d.evidence)
    checks = ev.pop("checks", None)
    lines = [d.summary, f"model: {d.model}  passed: {d.passed}  confidence: {d.confidence}",
             "evidence: " + json.dumps(ev, indent=2, sort_keys=True, default=str)]
    if checks:
        lines.append("checks (variant, output, model):")
        lines.extend(f"  {v:14s} {o:18s} {m}" for v, o, m in checks)
    return "\n".join(lines)


def assert_kernel_matches(candidate: Callable, reference: Callable, *example_args,
                          **options) -> Diagnosis:
    """Assert that `candidate` behaves like `reference` (`peat.check_kernel`, forward and
    backward, example and adversarial inputs, repeats).

    Args:
      candidate, reference, *example_args, **options: as for `peat.check_kernel` (e.g.
        ``allow=("reduced_precision",)``, ``variants=("example",)``, ``backward=False``).

    Returns:
      The passing `Diagnosis` (``exact``, ``numerical_noise`` or an allowed model).

    Raises:
      AssertionError: the diagnosis fails; the message is its summary and evidence.
    """
    d = check_kernel(candidate, reference, *example_args, **options)
    if not d.passed:
        raise AssertionError(format_diagnosis(d))
    return d
