"""Shared pieces of the corpus: inputs, a Pallas matmul skeleton, the references."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from peat_jax._src.kernels import references

__all__ = ["f32", "matmul", "pallas_matmul", "row_call", "layer_norm", "softmax"]

softmax = references.softmax
layer_norm = references.layer_norm


def f32(*shape, seed=0, mean=0.0):
    """Standard normal float32 of `shape` (plus `mean`)."""
    return mean + jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def matmul(a, b):
    return jnp.dot(a, b, precision="highest")


def pallas_matmul(body, a, b, *, bm=8, bn=8, grid=None, lhs_map=None, full_k=False):
    """`body(a_ref, b_ref, o_ref)` over (bm, bn) output blocks of a @ b, interpreted on CPU: the
    lhs block is (bm, K) and the rhs block (K, bn) (the whole K) when `full_k`, else the
    default ceil grid over (M, N) with full-K blocks as well; `grid` and `lhs_map` override the
    grid and the lhs index map (where the corpus plants its bugs)."""
    (m, k), n = a.shape, b.shape[1]
    grid = grid or (math.ceil(m / bm), math.ceil(n / bn))
    lhs_map = lhs_map or (lambda i, j: (i, 0))
    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct((m, n), a.dtype), grid=grid,
        in_specs=[pl.BlockSpec((bm, k), lhs_map), pl.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)), interpret=True)(a, b)


def row_call(body, x, *extra, br=8, out_dtype=None):
    """`body(x_ref, *extra_refs, o_ref)` over blocks of `br` whole rows of the 2-D `x` (extra
    operands passed whole), interpreted on CPU, on a ceil grid."""
    m, n = x.shape
    specs = [pl.BlockSpec((br, n), lambda i: (i, 0))] + [
        pl.BlockSpec(e.shape, lambda i, nd=e.ndim: (0,) * nd) for e in extra]
    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or x.dtype),
        grid=(math.ceil(m / br),), in_specs=specs,
        out_specs=pl.BlockSpec((br, n), lambda i: (i, 0)), interpret=True)(x, *extra)
