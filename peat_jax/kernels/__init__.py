"""Candidate kernels: the interface a candidate provides to plug into a site, and adapters.

A `Kernel` computes a site's outputs from its operands: `impl(*operands, **op_params)` for a
primitive site (the params are the op's, e.g. `dimension_numbers` for `dot_general`), or
`impl(*region_args)` for a composite site. Its reference is the XLA lowering of the same op.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from peat_jax.errors import PeatError

__all__ = ["Kernel", "dot_general", "blocked_matmul", "xla_matmul"]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A candidate implementation for a kind of site.

    Attributes:
      name: shown in reports and errors.
      impl: `impl(*operands, **op_params) -> output(s)` with the site's output shapes and dtypes
        (one array for a single-output op, a sequence otherwise).
      primitive: the primitive or region name it serves (e.g. `"dot_general"`), or None for any;
        substituting it elsewhere is an error.
      supports: optional `supports(site) -> None | str`: None if it can serve that site, else the
        reason it cannot (checked when the substitution is resolved, before anything runs).
      vjp: optional `vjp(operands, output, cotangent, **op_params) -> operand cotangents` for an
        `impl` that JAX cannot differentiate (a Pallas call, a callback, an FFI call); with it the
        kernel is wrapped in `jax.custom_vjp`. Without it, `impl` must be differentiable (or carry
        its own custom_vjp) wherever a gradient flows through the site.
    """

    name: str
    impl: Callable[..., Any]
    primitive: Optional[str] = None
    supports: Optional[Callable[[Any], Optional[str]]] = None
    vjp: Optional[Callable[..., Any]] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise PeatError("peat.Kernel needs a non-empty name")
        if not callable(self.impl):
            raise PeatError(f"peat.Kernel {self.name!r}: impl must be callable, "
                            f"got {type(self.impl).__name__}")
        if self.vjp is not None and not callable(self.vjp):
            raise PeatError(f"peat.Kernel {self.name!r}: vjp must be callable")

    def check_site(self, site) -> Optional[str]:
        """None if this kernel may be used at `site`, else a one-line reason."""
        if self.primitive is not None and site.primitive != self.primitive:
            return (f"kernel {self.name!r} serves {self.primitive!r} sites, but site #{site.index} "
                    f"is {site.primitive!r}")
        if self.supports is not None:
            return self.supports(site)
        return None

    def __call__(self, *operands, **params):
        if self.vjp is None:
            return self.impl(*operands, **params)
        impl, vjp = self.impl, self.vjp

        @jax.custom_vjp
        def f(*ops):
            return impl(*ops, **params)

        def f_fwd(*ops):
            out = impl(*ops, **params)
            return out, (ops, out)

        def f_bwd(res, g):
            ops, out = res
            return tuple(vjp(ops, out, g, **params))

        f.defvjp(f_fwd, f_bwd)
        return f(*operands)


# --------------------------------------------------------------------------------------------
# dot_general from a plain matmul

def _dims(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = map(lambda d: tuple(int(i) for i in d), (lc, rc, lb, rb))
    lf = tuple(d for d in range(lhs_ndim) if d not in lc and d not in lb)
    rf = tuple(d for d in range(rhs_ndim) if d not in rc and d not in rb)
    return lc, rc, lb, rb, lf, rf


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def dot_general(matmul: Callable[[jax.Array, jax.Array], jax.Array], name: Optional[str] = None,
                *, batched: bool = False, vjp: Optional[Callable] = None) -> Kernel:
    """A `Kernel` for any `dot_general` site from a plain `matmul(a[M, K], b[K, N]) -> [M, N]`.

    Operands are transposed and reshaped to (batch, M, K) x (batch, K, N), `matmul` is vmapped over
    the batch when there are batch dims (or called on 3-D operands directly if `batched=True`), and the result is reshaped
    to `dot_general`'s layout (batch dims, lhs free dims, rhs free dims) and cast to the site's
    `preferred_element_type`. `vjp` as in `Kernel`.
    """
    if not callable(matmul):
        raise PeatError(f"peat.kernels.dot_general needs a callable matmul, got {type(matmul).__name__}")
    kname = name or getattr(matmul, "__name__", "matmul")

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


# --------------------------------------------------------------------------------------------
# Bundled candidates (imported last: they build on Kernel and dot_general above)

from peat_jax.kernels import ffi, foreign, pallas  # noqa: E402
from peat_jax.kernels.ffi import build_ffi_library, ffi_kernel, ffi_matmul  # noqa: E402
from peat_jax.kernels.foreign import numpy_kernel, torch_kernel  # noqa: E402
from peat_jax.kernels.pallas import (InterpretChecks, flax_layer_norm, jax_pallas_layer_norm,  # noqa: E402
                                     jax_pallas_mha, pallas_attention, pallas_layer_norm,
                                     pallas_matmul, pallas_softmax)

__all__ += [
    "InterpretChecks",
    "build_ffi_library",
    "ffi",
    "ffi_kernel",
    "ffi_matmul",
    "flax_layer_norm",
    "foreign",
    "jax_pallas_layer_norm",
    "jax_pallas_mha",
    "numpy_kernel",
    "pallas",
    "pallas_attention",
    "pallas_layer_norm",
    "pallas_matmul",
    "pallas_softmax",
    "torch_kernel",
]
