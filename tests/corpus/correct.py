"""Correct kernels computed another way than their reference: each must pass."""
from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import needs
import numpy as np

import peat_jax as peat
from peat_jax._src.kernels import references

from . import Entry
from ._common import f32, layer_norm, matmul, pallas_matmul, row_call, softmax

__all__ = ["ENTRIES"]


def online_softmax(x, bn=8):
    """Pallas softmax streaming over column blocks of `bn`: a running max and a running sum
    rescaled when the max grows (the FlashAttention recurrence), then a second pass."""
    m, n = x.shape
    width = bn * math.ceil(n / bn)
    xp = jnp.pad(x, ((0, 0), (0, width - n)), constant_values=-jnp.inf)

    def body(x_ref, o_ref):
        mx = jnp.full((x_ref.shape[0], 1), -jnp.inf, jnp.float32)
        s = jnp.zeros((x_ref.shape[0], 1), jnp.float32)
        for c in range(0, width, bn):
            v = x_ref[:, c:c + bn]
            new = jnp.maximum(mx, v.max(-1, keepdims=True))
            s = s * jnp.exp(mx - new) + jnp.exp(v - new).sum(-1, keepdims=True)
            mx = new
        o_ref[...] = jnp.exp(x_ref[...] - mx) / s

    return row_call(body, xp)[:, :n]


def _affine(x, mean, var, scale, bias, eps):
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def welford_layer_norm(x, scale, bias, eps=1e-6, bn=8):
    """Layer norm with mean and variance merged block by block (Chan et al.'s parallel
    Welford update)."""
    n_a = 0
    mean = jnp.zeros(x.shape[:-1] + (1,), x.dtype)
    m2 = jnp.zeros_like(mean)
    for c in range(0, x.shape[-1], bn):
        blk = x[..., c:c + bn]
        n_b = blk.shape[-1]
        mean_b = blk.mean(-1, keepdims=True)
        m2_b = ((blk - mean_b) ** 2).sum(-1, keepdims=True)
        delta, n = mean_b - mean, n_a + n_b
        mean = mean + delta * (n_b / n)
        m2 = m2 + m2_b + delta * delta * (n_a * n_b / n)
        n_a = n
    return _affine(x, mean, m2 / n_a, scale, bias, eps)


def two_pass_layer_norm(x, scale, bias, eps=1e-6):
    """Pallas layer norm over row blocks: the mean first, then the variance of x - mean."""
    def body(x_ref, s_ref, b_ref, o_ref):
        v = x_ref[...]
        mean = v.mean(-1, keepdims=True)
        var = ((v - mean) ** 2).mean(-1, keepdims=True)
        o_ref[...] = _affine(v, mean, var, s_ref[...], b_ref[...], eps)
    return row_call(body, x, scale, bias)


def split_k_matmul(a, b, splits=3):
    """K cut into `splits` chunks, each a dot, the partial products summed."""
    cuts = np.linspace(0, a.shape[1], splits + 1).astype(int)
    return sum(matmul(a[:, i:j], b[i:j]) for i, j in zip(cuts[:-1], cuts[1:]))


def kahan_row_sum(x):
    """Row sums with Kahan compensation, one column at a time: more accurate than the
    reference's pairwise sum."""
    def step(carry, col):
        s, c = carry
        y = col - c
        t = s + y
        return (t, (t - s) - y), None
    zero = jnp.zeros(x.shape[0], x.dtype)
    (s, _), _ = jax.lax.scan(step, (zero, zero), x.T)
    return s


def row_sum(x):
    return x.sum(-1)


def _ceil_dot_body(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], precision="highest")


def padded_ceil_grid_matmul(a, b):
    """Pallas matmul on a ceil grid: the partial last blocks are padded on read and clipped on
    write."""
    return pallas_matmul(_ceil_dot_body, a, b)


def numpy_matmul():
    return peat.kernels.numpy_kernel(lambda a, b: a @ b, name="numpy_matmul")


def torch_layer_norm():
    def ln(x, scale, bias):
        import torch
        return torch.nn.functional.layer_norm(x, x.shape[-1:], scale, bias, eps=1e-6)
    return peat.kernels.torch_kernel(ln, name="torch_layer_norm")


def jax_softmax(x):
    with warnings.catch_warnings():   # deprecated since jax 0.11 (for tokamax), still shipped
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import softmax as shipped
    return shipped.softmax(x, interpret=True)


def _shipped(op: str, factory):
    """`factory()` (a kernel running jax's shipped Pallas `op`), or None where this jax no longer
    ships it (the entry `needs` it, so it is skipped there)."""
    return None if needs.missing([needs.pallas_op(op)]) else factory()


_LN = lambda: (f32(16, 32), f32(32, seed=1), f32(32, seed=2))  # noqa: E731
_QKV = lambda: tuple(f32(1, 16, 2, 8, seed=s) for s in range(3))  # noqa: E731
_EX = ("example",)

ENTRIES: tuple[Entry, ...] = (
    Entry("online_softmax", "correct", online_softmax, softmax, lambda: (f32(16, 20),), "pass",
          "Pallas streaming softmax (running max and sum over column blocks)",
          variants=("example", "large")),
    Entry("welford_layer_norm", "correct", welford_layer_norm, layer_norm, _LN, "pass",
          "layer norm with blockwise Welford/Chan merging", backward=True,
          variants=("example", "outliers")),
    Entry("welford_layer_norm_large_mean", "correct", welford_layer_norm, layer_norm,
          lambda: (f32(16, 32, mean=1e4), f32(32, seed=1), f32(32, seed=2)), "pass",
          "the Welford layer norm on the inputs (mean 1e4) that break the one-pass variance",
          variants=_EX),
    Entry("two_pass_layer_norm", "correct", two_pass_layer_norm, layer_norm, _LN, "pass",
          "Pallas two-pass layer norm over row blocks", variants=("example", "large")),
    Entry("split_k_matmul", "correct", split_k_matmul, matmul,
          lambda: (f32(16, 48), f32(48, 16, seed=1)), "pass", "matmul as three K-chunk dots",
          backward=True, variants=_EX),
    Entry("kahan_sum", "correct", kahan_row_sum, row_sum, lambda: (f32(8, 256),), "pass",
          "Kahan-compensated row sums (more accurate than the reference)",
          variants=("example", "outliers")),
    Entry("padded_ceil_grid_matmul", "correct", padded_ceil_grid_matmul, matmul,
          lambda: (f32(20, 16), f32(16, 12, seed=1)), "pass",
          "Pallas matmul on a ceil grid with partial last blocks", variants=_EX),
    Entry("numpy_matmul", "correct", numpy_matmul(), matmul,
          lambda: (f32(16, 24), f32(24, 8, seed=1)), "pass", "the matmul ported to NumPy",
          variants=_EX),
    Entry("torch_layer_norm", "correct", torch_layer_norm(), layer_norm, _LN, "pass",
          "torch's layer_norm (forward and autograd backward)", backward=True,
          variants=("example", "outliers"), needs=("torch",)),
    Entry("jax_pallas_softmax", "correct", jax_softmax, softmax, lambda: (f32(16, 24),), "pass",
          "jax's shipped Pallas softmax (ops.gpu), interpreted",
          variants=("example", "large"), needs=(needs.pallas_op("softmax"),)),
    Entry("jax_pallas_layer_norm", "correct",
          _shipped("layer_norm", peat.kernels.jax_pallas_layer_norm), layer_norm,
          _LN, "pass", "jax's shipped Pallas layer norm (ops.gpu), interpreted", backward=True,
          variants=("example", "outliers"), needs=(needs.pallas_op("layer_norm"),)),
    Entry("jax_pallas_mha", "correct",
          _shipped("attention", lambda: peat.kernels.jax_pallas_mha(block_q=8, block_k=8)),
          references.attention, _QKV, "pass",
          "jax's shipped Pallas attention (ops.gpu.attention.mha), interpreted", backward=True,
          variants=_EX, needs=(needs.pallas_op("attention"),)),
)
