"""pytest plugin: the ``peat_check`` fixture for kernel authors.

Registered as a ``pytest11`` entry point (``peat_jax = "peat_jax._src.pytest_plugin"``), so
installing peat_jax makes it available in every test suite::

    def test_my_matmul(peat_check):
        a, b = ...
        peat_check(my_matmul, jnp.matmul, a, b)                      # raises AssertionError
        peat_check(my_matmul, jnp.matmul, a, b, allow=("reduced_precision",))

Command-line options: ``--peat-variants=example,large`` restricts the input variants (default:
all of `peat_jax._src.check.VARIANTS`); ``--peat-no-backward`` skips gradient checks. Options
given in the call win over the command line.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import pytest

from peat_jax._src.check import VARIANTS
from peat_jax._src.detector import Diagnosis
from peat_jax._src.testing import assert_kernel_matches


def pytest_addoption(parser):
    group = parser.getgroup("peat_jax", "peat_jax kernel checks")
    group.addoption("--peat-variants", default=None,
                    help="comma-separated input variants for the peat_check fixture "
                         f"(default: all of {','.join(VARIANTS)})")
    group.addoption("--peat-no-backward", action="store_true", default=False,
                    help="peat_check: compare forward outputs only")


class PeatCheck:
    """Callable fixture object: ``peat_check(candidate, reference, *args, **options)`` asserts
    (`assert_kernel_matches`) and returns the passing `Diagnosis`; ``.diagnoses`` keeps every
    diagnosis made in the test."""

    def __init__(self, variants: Optional[Sequence[str]], backward: bool):
        self._defaults: dict[str, Any] = {}
        if variants is not None:
            self._defaults["variants"] = tuple(variants)
        if not backward:
            self._defaults["backward"] = False
        self.diagnoses: list[Diagnosis] = []

    def __call__(self, candidate: Callable, reference: Callable, *example_args,
                 **options) -> Diagnosis:
        opts = {**self._defaults, **options}
        d = assert_kernel_matches(candidate, reference, *example_args, **opts)
        self.diagnoses.append(d)
        return d


@pytest.fixture
def peat_check(request) -> PeatCheck:
    """Check a candidate kernel against its reference: ``peat_check(candidate, reference,
    *example_args, **options)`` (options as for `peat.check_kernel`)."""
    raw = request.config.getoption("--peat-variants", default=None)
    variants = [v.strip() for v in raw.split(",") if v.strip()] if raw else None
    backward = not request.config.getoption("--peat-no-backward", default=False)
    return PeatCheck(variants, backward)
