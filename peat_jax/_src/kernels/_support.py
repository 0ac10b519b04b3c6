"""What a bundled kernel can serve: site checks shared by the kernel factories.

Each helper returns None when the site can be served, else a one-line reason (the contract of
`peat.Kernel.supports`), so that an unsuitable site fails when the substitution is resolved.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src.errors import PeatError
from peat_jax._src.formats import is_floating
from peat_jax._src.precision import matmul_precision
from peat_jax._src.regions import region_info


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def fit_block(block: int, dim: int, minimum: int = 16) -> int:
    """`block` shrunk to the smallest power of two >= `dim` (at least `minimum`): small arrays are
    not padded up to a large default block. Returns elements."""
    return min(int(block), max(int(minimum), next_pow2(dim)))


def dot_precision(value: Any) -> jax.lax.Precision:
    """A kernel's `precision` argument as the `jax.lax.Precision` its dots pass explicitly (so
    jax's global setting does not change the kernel): HIGHEST (full float32; Triton's "ieee"),
    HIGH, or DEFAULT (Triton's default: TF32 for float32 operands on recent NVIDIA GPUs).
    Accepts what `peat_jax._src.precision.matmul_precision` accepts; a PeatError otherwise."""
    return jax.lax.Precision[matmul_precision(value).upper()]


def precision_suffix(precision: jax.lax.Precision) -> str:
    """What a kernel's name adds for its dot precision: nothing for the default, full float32
    (HIGHEST), else ", precision='default'" (or 'high')."""
    if precision == jax.lax.Precision.HIGHEST:
        return ""
    return f", precision={precision.name.lower()!r}"


def check_block(name: str, value: Any) -> int:
    """`value` as an int block size; a PeatError unless it is a positive power of two."""
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise PeatError(f"{name} must be a positive power of two, got {value!r}") from None
    if v <= 0 or v & (v - 1) or v != value:
        raise PeatError(f"{name} must be a positive power of two (Pallas GPU blocks are), "
                        f"got {value!r}")
    return v


def float_reason(what: str, dtypes: Sequence[Any],
                 allowed: Sequence[Any] = (jnp.float32, jnp.bfloat16, jnp.float16)
                 ) -> Optional[str]:
    """None if every dtype is one of `allowed`, else the reason naming the first that is not."""
    names = {np.dtype(d).name for d in allowed}
    for d in dtypes:
        if not is_floating(d) or np.dtype(d).name not in names:
            return (f"{what} supports {', '.join(sorted(names))} operands, got "
                    f"{np.dtype(d).name if d is not None else d}")
    return None


def region_args(site) -> Optional[tuple]:
    """The region's positional arguments as a tuple of `jax.ShapeDtypeStruct` pytrees, or None for
    a primitive site. For a backward region site the trailing cotangent operands are left out."""
    if not getattr(site, "composite", False):
        return None
    info = region_info(site.params["region_id"])
    n = info.in_tree.num_leaves
    leaves = [jax.ShapeDtypeStruct(s, d) for s, d in zip(site.in_shapes[:n], site.in_dtypes[:n])]
    return tuple(jax.tree.unflatten(info.in_tree, leaves))


def dot_general_float_support(what: str) -> Callable[[Any], Optional[str]]:
    """A `supports` for dot_general kernels that compute in float32/bfloat16/float16."""

    def supports(site) -> Optional[str]:
        return float_reason(what, site.in_dtypes)

    return supports
