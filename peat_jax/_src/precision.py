"""Matmul precision: which precision XLA computes float32 dots and convolutions in.

On GPUs XLA computes float32 dots in TF32 unless told otherwise (jax's default matmul precision),
so an XLA reference evaluated at the default precision is itself a reduced-precision kernel
there. `check_kernel` evaluates its reference at an explicit precision (default: the highest), and
a golden run records (and its replays reuse) the precision it trained at. The names are jax's
(`jax.default_matmul_precision`); this module only validates and canonicalises them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import jax

from peat_jax._src.errors import PeatError


MATMUL_PRECISIONS: dict[str, str] = {
    "highest": "highest", "float32": "highest",
    "high": "high", "tensorfloat32": "high",
    "default": "default", "bfloat16": "default",
}
"""Accepted names (jax's legacy names for `jax.default_matmul_precision`) -> the canonical one:
"highest" (full float32), "high" (TF32 or bf16x3 where the hardware has it), "default" (what
the program would do: TF32 for float32 dots on recent NVIDIA GPUs)."""


def matmul_precision(value: Any, what: str = "precision") -> str:
    """The canonical name ("highest", "high" or "default") of a matmul precision given as a
    `jax.lax.Precision` or one of jax's names (`MATMUL_PRECISIONS`, any case).

    Raises:
      PeatError: anything else; the message lists the accepted values.
    """
    if isinstance(value, jax.lax.Precision):
        return value.name.lower()
    if isinstance(value, str) and value.strip().lower() in MATMUL_PRECISIONS:
        return MATMUL_PRECISIONS[value.strip().lower()]
    accepted = ", ".join(repr(k) for k in MATMUL_PRECISIONS)
    raise PeatError(f"{what}={value!r} is not a matmul precision; pass one of {accepted} or a "
                    "jax.lax.Precision (HIGHEST, HIGH, DEFAULT)")


def at_matmul_precision(precision: Optional[str]) -> contextlib.AbstractContextManager:
    """A context in which jax traces dots and convolutions at `precision` (a name
    `matmul_precision` accepts), or a context that changes nothing for None. jax keys its jit
    caches on the setting, so a function traced outside the context is traced again inside."""
    if precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(matmul_precision(precision))


def current_matmul_precision() -> Optional[str]:
    """jax's matmul precision in force (`jax_default_matmul_precision`, as set by the config,
    the environment or an enclosing `jax.default_matmul_precision`), canonicalised where it is a
    legacy name (an algorithm preset is returned as it is); None when unset."""
    # jax.config's flags are attributes set at runtime: mypy cannot see them
    value = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]
    if value is None:
        return None
    return MATMUL_PRECISIONS.get(str(value).lower(), str(value))


def with_callers_precision(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn`, to be run in another thread, wrapped to run at the matmul precision in force in
    the calling thread (jax's settings are per thread: a jitted function called from a thread
    without it would be traced and compiled again at the default)."""
    # jax.config's flags are attributes set at runtime: mypy cannot see them
    value = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]

    def run():
        if value is None:
            return fn()
        with jax.default_matmul_precision(value):
            return fn()

    return run
