"""The one exception type peat_jax raises for user errors."""
from __future__ import annotations


class PeatError(ValueError):
    """A usage error: the message says what was wrong and what to do."""
