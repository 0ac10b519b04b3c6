"""`dot_general` kernels from a plain `matmul(a[M, K], b[K, N])`: the adapter, and two candidates
built on XLA (a blocked sum and XLA's own matmul in the adapter's layout)."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from peat_jax._src.errors import PeatError
from peat_jax._src.kernels.base import Kernel


def _dims(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = map(lambda d: tuple(int(i) for i in d), (lc, rc, lb, rb))
    lf = tuple(d for d in range(lhs_ndim) if d not in lc and d not in lb)
    rf = tuple(d for d in range(rhs_ndim) if d not in rc and d not in rb)
    return lc, rc, lb, rb, lf, rf


def _prod(shape) -> int:
    return math.prod(int(s) for s in shape)


def dot_general(matmul: Callable[[jax.Array, jax.Array], jax.Array], name: Optional[str] = None,
                *, batched: bool = False, vjp: Optional[Callable] = None) -> Kernel:
    """A `Kernel` for any `dot_general` site from a plain `matmul(a[M, K], b[K, N]) -> [M, N]`.

    Operands are transposed and reshaped to (batch, M, K) x (batch, K, N), `matmul` is vmapped
    over the batch when there are batch dims (or called on 3-D operands directly if
    `batched=True`), and the result is reshaped to `dot_general`'s layout (batch dims, lhs free
    dims, rhs free dims) and cast to the site's `preferred_element_type`. `vjp` as in `Kernel`.
    """
    if not callable(matmul):
        raise PeatError(f"peat.kernels.dot_general needs a callable matmul, got "
                        f"{type(matmul).__name__}")
    kname = name if name else getattr(matmul, "__name__", "matmul")

    def impl(lhs, rhs, *, dimension_numbers, preferred_element_type=None, **_):
        lc, rc, lb, rb, lf, rf = _dims(dimension_numbers, lhs.ndim, rhs.ndim)
        bshape = tuple(lhs.shape[d] for d in lb)
        mshape = tuple(lhs.shape[d] for d in lf)
        nshape = tuple(rhs.shape[d] for d in rf)
        k = _prod(lhs.shape[d] for d in lc)
        a = jnp.transpose(lhs, lb + lf + lc).reshape(_prod(bshape), _prod(mshape), k)
        b = jnp.transpose(rhs, rb + rc + rf).reshape(_prod(bshape), k, _prod(nshape))
        if batched:
            out = matmul(a, b)
        elif a.shape[0] == 1:  # no batch dims: call the kernel directly, no vmap needed
            out = matmul(a[0], b[0])[None]
        else:
            out = jax.vmap(matmul)(a, b)
        dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
        return out.reshape(bshape + mshape + nshape).astype(dtype)

    return Kernel(kname, impl, primitive="dot_general", vjp=vjp)


def blocked_matmul(block_k: int = 32, accumulate_dtype: Any = jnp.float32) -> Kernel:
    """A simple correct `dot_general` kernel: sums partial products over blocks of `block_k`.

    It accumulates in `accumulate_dtype` in a different order from XLA's dot, so it differs from
    the reference only by rounding (a `numerical_noise` candidate). Differentiable by JAX.
    """
    if int(block_k) <= 0:
        raise PeatError(f"block_k must be positive, got {block_k}")
    block_k = int(block_k)

    def matmul(a, b):
        a, b = a.astype(accumulate_dtype), b.astype(accumulate_dtype)
        k = a.shape[-1]
        whole = k // block_k

        def block(acc, a_blk, b_blk):
            return acc + jnp.matmul(a_blk, b_blk, precision=jax.lax.Precision.HIGHEST)

        # A loop over the whole blocks (not an unrolled sum) keeps the program's size, and so its
        # compile time, independent of K / block_k; the last partial block is added after it.
        def body(i, acc):
            start = i * block_k
            a_blk = jax.lax.dynamic_slice_in_dim(a, start, block_k, axis=a.ndim - 1)
            b_blk = jax.lax.dynamic_slice_in_dim(b, start, block_k, axis=b.ndim - 2)
            return block(acc, a_blk, b_blk)

        acc = jnp.zeros(a.shape[:-1] + b.shape[-1:], accumulate_dtype)
        acc = jax.lax.fori_loop(0, whole, body, acc) if whole else acc
        if k % block_k:
            acc = block(acc, a[..., whole * block_k:], b[..., whole * block_k:, :])
        return acc

    return dot_general(matmul, name=f"blocked_matmul(block_k={block_k})", batched=True)


def xla_matmul() -> Kernel:
    """XLA's own matmul (`jnp.matmul` on the adapter's (batch, M, K) x (batch, K, N) layout) as a
    kernel: the same arithmetic as the reference in another layout, so it matches it exactly or to
    rounding (tests assert closeness, not bitwise equality)."""
    return dot_general(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32),
                       name="xla_matmul", batched=True)
