"""Kernels with the bugs their authors write (each one small, as found in the wild)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from peat_jax._src.kernels import pallas as pk

from . import Entry
from ._common import f32, layer_norm, matmul, pallas_matmul, row_call, softmax

__all__ = ["ENTRIES"]


def _dot_body(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], precision="highest")


def index_map_off_by_one(a, b):
    """The lhs index map reads block i + 1 (wrapping): every output row block holds its
    neighbour's rows."""
    gi = math.ceil(a.shape[0] / 8)
    return pallas_matmul(_dot_body, a, b, lhs_map=lambda i, j: ((i + 1) % gi, 0))


def floor_grid(a, b):
    """grid = M // bm: the last partial row block is never written."""
    return pallas_matmul(_dot_body, a, b, grid=(a.shape[0] // 8, math.ceil(b.shape[1] / 8)))


def masked_softmax_off_by_one(x):
    """Rows padded to a multiple of 8 columns and masked with ``col <= n`` instead of
    ``col < n``: one zero-padded column joins every row's normaliser."""
    m, n = x.shape
    width = 8 * math.ceil((n + 1) / 8)
    xp = jnp.pad(x, ((0, 0), (0, width - n)))

    def body(x_ref, o_ref):
        v = x_ref[...]
        col = jax.lax.broadcasted_iota(jnp.int32, v.shape, 1)
        v = jnp.where(col <= n, v, -jnp.inf)                    # bug: <= n
        e = jnp.exp(v - v.max(-1, keepdims=True))
        o_ref[...] = e / e.sum(-1, keepdims=True)

    return row_call(body, xp)[:, :n]


def skip_last_partial_k(a, b):
    """The K loop runs K // bk times: the last partial K block is never accumulated."""
    k = a.shape[1]

    def body(a_ref, b_ref, o_ref):
        acc = jnp.zeros(o_ref.shape, jnp.float32)
        for kb in range(k // 8):                                  # bug: floor
            sl = pl.ds(kb * 8, 8)
            acc += jnp.dot(a_ref[:, sl], b_ref[sl, :], precision="highest")
        o_ref[...] = acc

    return pallas_matmul(body, a, b)


def row_sum_reference(x):
    return x / jnp.abs(x).sum(-1, keepdims=True)


def wrong_axis_normalise(x):
    """x / sum|x| per row, the sum taken over the block's rows (axis 0) instead of its
    columns."""
    def body(x_ref, o_ref):
        v = x_ref[...]
        o_ref[...] = v / jnp.abs(v).sum(0, keepdims=True)        # bug: axis 0
    return row_call(body, x)


def naive_softmax(x):
    """exp(x) / sum(exp(x)) without subtracting the row max."""
    e = jnp.exp(x)
    return e / e.sum(-1, keepdims=True)


def one_pass_layer_norm(x, scale, bias, eps=1e-6):
    """var = E[x^2] - E[x]^2: cancels when |mean| >> std."""
    mean = x.mean(-1, keepdims=True)
    var = (x * x).mean(-1, keepdims=True) - mean * mean
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def eps_outside_sqrt(x, scale, bias, eps=1e-6):
    """(x - mean) / (sqrt(var) + eps) for a reference with rsqrt(var + eps)."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / (jnp.sqrt(var) + eps) * scale + bias


def _narrow_accumulation(dtype):
    def mm(a, b):
        """Partial products of 8 K-columns summed into an accumulator kept in `dtype`."""
        acc = jnp.zeros((a.shape[0], b.shape[1]), dtype)
        for k0 in range(0, a.shape[1], 8):
            part = jnp.dot(a[:, k0:k0 + 8], b[k0:k0 + 8], precision="highest")
            acc = (acc.astype(jnp.float32) + part).astype(dtype)
        return acc.astype(a.dtype)
    mm.__name__ = f"{jnp.dtype(dtype).name}_accumulation"
    return mm


def race_split_k(a, b):
    """Split-K with the K grid dimension marked "parallel": two programs accumulate into one
    output block."""
    def body(a_ref, b_ref, o_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)
        o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    (m, k), n = a.shape, b.shape[1]
    return pk.call(body, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
                   grid=(m // 8, n // 8, k // 8),
                   in_specs=[pl.BlockSpec((8, 8), lambda i, j, kk: (i, kk)),
                             pl.BlockSpec((8, 8), lambda i, j, kk: (kk, j))],
                   out_specs=pl.BlockSpec((8, 8), lambda i, j, kk: (i, j)),
                   dimension_semantics=("parallel",) * 3, name="race_split_k",
                   checks=True)(a, b)


@jax.custom_vjp
def softmax_bad_backward(x):
    """Forward right; the backward forgets the -y * sum(g * y) term."""
    return softmax(x)


def _sbb_fwd(x):
    y = softmax(x)
    return y, y


def _sbb_bwd(y, g):
    return (g * y,)                                               # bug: missing term


softmax_bad_backward.defvjp(_sbb_fwd, _sbb_bwd)


def gelu_exact(x):
    return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x):
    """The tanh approximation where the exact (erf) GELU is the reference."""
    return jax.nn.gelu(x, approximate=True)


_EX = ("example",)
_LN = lambda mean=0.0: (lambda: (f32(16, 32, mean=mean), f32(32, seed=1), f32(32, seed=2)))  # noqa: E731

ENTRIES: tuple[Entry, ...] = (
    Entry("index_map_off_by_one", "bug", index_map_off_by_one, matmul,
          lambda: (f32(32, 16), f32(16, 16, seed=1)), "permuted_layout",
          "Pallas matmul whose lhs index map reads block i + 1", variants=_EX),
    Entry("floor_grid", "bug", floor_grid, matmul, lambda: (f32(20, 16), f32(16, 16, seed=1)),
          "tile_boundary", "Pallas matmul on a grid of M // bm: last partial block unwritten",
          variants=_EX),
    Entry("mask_off_by_one", "bug", masked_softmax_off_by_one, softmax, lambda: (f32(16, 20),),
          "wrong_scale", "Pallas softmax masking padded columns with col <= n", variants=_EX),
    Entry("skip_last_partial_k", "bug", skip_last_partial_k, matmul,
          lambda: (f32(16, 16), f32(16, 16, seed=1)), "tile_boundary",
          "Pallas matmul whose K loop skips the last partial K block (example K divides)",
          variants=("example", "odd_shape")),
    Entry("wrong_axis_in_block", "bug", wrong_axis_normalise, row_sum_reference,
          lambda: (f32(16, 8),), "random_value",
          "Pallas row normalisation summing over the block's rows", variants=_EX),
    Entry("softmax_without_max", "bug", naive_softmax, softmax, lambda: (f32(16, 24),),
          "nan_inf", "softmax without subtracting the row max (exp overflows)",
          variants=("example", "large")),
    Entry("one_pass_variance", "bug", one_pass_layer_norm, layer_norm, _LN(1e4),
          "unstable_algorithm", "layer norm with var = E[x^2] - E[x]^2, inputs with mean 1e4",
          variants=_EX),
    Entry("eps_outside_sqrt", "bug", eps_outside_sqrt, layer_norm,
          lambda: (1e-3 * f32(16, 32), f32(32, seed=1), jnp.zeros(32)), "wrong_scale",
          "layer norm with 1/(sqrt(var) + eps) for rsqrt(var + eps), activations of std 1e-3",
          variants=_EX),
    Entry("bf16_accumulation", "bug", _narrow_accumulation(jnp.bfloat16), matmul,
          lambda: (f32(16, 64), f32(64, 16, seed=1)), "low_precision_accumulation",
          "matmul accumulating its K partial sums in bfloat16", variants=_EX),
    Entry("fp16_accumulation", "bug", _narrow_accumulation(jnp.float16), matmul,
          lambda: (f32(16, 64), f32(64, 16, seed=1)), "low_precision_accumulation",
          "matmul accumulating its K partial sums in float16", variants=_EX),
    Entry("race_two_writers", "bug", race_split_k, matmul,
          lambda: (f32(8, 16), f32(16, 8, seed=1)), "data_race",
          "Pallas split-K whose K grid axis is 'parallel': two programs write one block",
          variants=_EX, race=True),
    Entry("backward_wrong", "bug", softmax_bad_backward, softmax, lambda: (f32(16, 24),),
          "random_value", "custom_vjp softmax whose backward drops -y * sum(g * y)",
          variants=_EX, backward=True),
    Entry("gelu_tanh_for_exact", "bug", gelu_tanh, gelu_exact, lambda: (f32(32, 32),),
          "approximation", "GELU's tanh approximation where the exact GELU is the reference",
          variants=_EX),
)
