"""Flash attention in Pallas, forward and backward, for an `attention(q, k, v)` region.

Layout as Flax's `nn.dot_product_attention`: q `[batch, q_len, heads, dim]`, k and v
`[batch, kv_len, heads, dim]`, output like q; `softmax(q k^T * sm_scale) v` with
`sm_scale = 1/sqrt(dim)` by default, optionally causal (query i sees keys j <= i).

Forward: a grid over (batch, heads, query blocks); each program streams key/value blocks with an
online softmax in float32 and writes the output and each row's max m and sum l (kept apart:
the backward recomputes ``P = exp(s - m) / l`` as XLA's softmax does). Backward: two Pallas
kernels, one for dq (grid over query blocks, streaming keys twice: first `delta = rowsum(P *
dP)`, the softmax VJP's own sum, then dq) and one for dk/dv (grid over key blocks, streaming
queries, reading delta). Sequence
lengths are padded to the blocks and masked; the head dim is zero-padded to a power of two.

Where it runs: the Pallas interpreter on the CPU; compiled through Triton (asked for explicitly,
`jax.experimental.pallas.triton.CompilerParams`) on NVIDIA (CUDA) and AMD (ROCm) GPUs alike;
`peat.lowers_for` checks on a CPU machine that it lowers for both.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from peat_jax._src.kernels._support import (check_block, dot_precision, fit_block, float_reason,
                                            next_pow2, precision_suffix, region_args)
from peat_jax._src.kernels.base import Kernel
from peat_jax._src.kernels.pallas import interpret as _interp
from peat_jax._src.kernels.pallas.interpret import Checks


_MASKED = -0.7 * float(np.finfo(np.float32).max)
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    sm_scale: Optional[float]
    block_q: int
    block_k: int
    interpret: Optional[bool]
    checks: Optional[_interp.InterpretChecks]
    precision: lax.Precision = lax.Precision.HIGHEST


def _dot(a, b, precision: lax.Precision, trans_a: bool = False, trans_b: bool = False):
    """2-D `a @ b` (optionally transposed operands) at `precision`, accumulated in float32."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _mask(qi, kj, kv_len: int, causal: bool):
    m = kj[None, :] < kv_len
    if causal:
        m = m & (qi[:, None] >= kj[None, :])
    return m


def _kv_blocks(q_block: int, bq: int, bk: int, nk: int, causal: bool):
    """Number of key blocks a query block has to visit (fewer when causal)."""
    if not causal:
        return nk
    return jnp.minimum(nk, ((q_block + 1) * bq + bk - 1) // bk)


def _fwd_body(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, scale, causal, kv_len, bq, bk, nk,
              precision):
    i = pl.program_id(2)
    q = q_ref[...]
    qi = i * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)

    def step(j, carry):
        m, l, acc = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s = _dot(q, k, precision, trans_b=True) * scale
        kj = start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
        s = jnp.where(_mask(qi, kj, kv_len, causal), s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, precision)
        return m_new, l, acc

    init = (jnp.full((bq,), _MASKED, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros(o_ref.shape, jnp.float32))
    m, l, acc = lax.fori_loop(0, _kv_blocks(i, bq, bk, nk, causal), step, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


def _probs_and_dp(q, k, v, do, m, l, qi, kj, *, scale, causal, kv_len, precision):
    """(P, dP) of one (query block, key block): ``P = exp(s - m) / l`` from the forward's row
    max m and sum l, kept apart (as XLA's softmax does): a log-sum-exp ``m + log(l)`` rounded
    to float32 moves every probability of a row with large logits by up to ulp(m) relative.
    ``dP = dO v^T``. Masked entries of P are 0."""
    s = _dot(q, k, precision, trans_b=True) * scale
    # s - m <= 0 in exact terms; a recomputed logit may round an ULP above the forward's max,
    # and at |s| ~ 1e18 one ULP of s is ~1e11: exp would overflow.
    p = jnp.exp(jnp.minimum(s - m[:, None], 0.0)) / l[:, None]
    return jnp.where(_mask(qi, kj, kv_len, causal), p, 0.0), _dot(do, v, precision, trans_b=True)


def _dq_body(q_ref, k_ref, v_ref, do_ref, m_ref, l_ref, dq_ref, delta_ref, *, scale, causal,
             kv_len, bq, bk, nk, precision):
    """dq of one query block, and the row sums ``delta = rowsum(P * dP)`` the dk/dv kernel
    reuses. delta is the softmax VJP's own sum (XLA's), accumulated over the key blocks in a
    first pass, not FlashAttention's ``rowsum(dO * O)``: the two are equal in exact arithmetic,
    but only this one cancels ``dP - delta`` exactly where a row's softmax saturates to one
    key (a rounding difference times |k| would otherwise reach ~eps * |dO| |v| |k|)."""
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    m, l = m_ref[...], l_ref[...]
    qi = i * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)
    n_blocks = _kv_blocks(i, bq, bk, nk, causal)
    probs = functools.partial(_probs_and_dp, m=m, l=l, qi=qi, scale=scale, causal=causal,
                              kv_len=kv_len, precision=precision)

    def block(j):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        kj = start + lax.broadcasted_iota(jnp.int32, (bk,), 0)
        return k, probs(q, k, v, do, kj=kj)

    def row_sum(j, delta):
        _, (p, dp) = block(j)
        return delta + jnp.sum(p * dp, axis=1)

    delta = lax.fori_loop(0, n_blocks, row_sum, jnp.zeros((bq,), jnp.float32))

    def step(j, dq):
        k, (p, dp) = block(j)
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k, precision)

    dq = lax.fori_loop(0, n_blocks, step, jnp.zeros(dq_ref.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    delta_ref[...] = delta


def _dkv_body(q_ref, k_ref, v_ref, do_ref, m_ref, l_ref, delta_ref, dk_ref, dv_ref, *, scale,
              causal, kv_len, bq, bk, nq, precision):
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    kj = j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)

    def step(i, carry):
        dk, dv = carry
        start = pl.multiple_of(i * bq, bq)
        q = q_ref[pl.ds(start, bq), :]
        do = do_ref[pl.ds(start, bq), :]
        m, l = m_ref[pl.ds(start, bq)], l_ref[pl.ds(start, bq)]
        delta = delta_ref[pl.ds(start, bq)]
        qi = start + lax.broadcasted_iota(jnp.int32, (bq,), 0)
        p, dp = _probs_and_dp(q, k, v, do, m, l, qi, kj, scale=scale, causal=causal,
                              kv_len=kv_len, precision=precision)
        dv = dv + _dot(p.astype(do.dtype), do, precision, trans_a=True)
        ds = p * (dp - delta[:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, precision, trans_a=True)
        return dk, dv

    first = (j * bk) // bq if causal else 0
    zeros = jnp.zeros(dk_ref.shape, jnp.float32)
    dk, dv = lax.fori_loop(first, nq, step, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    batch: int
    heads: int
    q_len: int
    kv_len: int
    dim: int
    bq: int
    bk: int
    q_pad: int
    kv_pad: int
    d_pad: int
    scale: float


def _geometry(q, k, cfg: _Config) -> _Geometry:
    b, tq, h, d = q.shape
    tk = k.shape[1]
    bq, bk = fit_block(cfg.block_q, tq), fit_block(cfg.block_k, tk)
    scale = cfg.sm_scale if cfg.sm_scale is not None else 1.0 / math.sqrt(d)
    return _Geometry(b, h, tq, tk, d, bq, bk, -(-tq // bq) * bq, -(-tk // bk) * bk,
                     max(16, next_pow2(d)), float(scale))


def _pad(x, seq: int, dim: int):
    return jnp.pad(x, ((0, 0), (0, seq - x.shape[1]), (0, 0), (0, dim - x.shape[3])))


def _specs(g: _Geometry):
    blk = lambda n, f: pl.BlockSpec((None, n, None, g.d_pad), f)  # noqa: E731
    return blk, (lambda n, f: pl.BlockSpec((None, None, n), f))


@_interp.lowered_once
def _forward(q, k, v, cfg: _Config):
    g = _geometry(q, k, cfg)
    blk, row = _specs(g)
    nq, nk = g.q_pad // g.bq, g.kv_pad // g.bk
    o, m, l = _interp.call(
        functools.partial(_fwd_body, scale=g.scale, causal=cfg.causal, kv_len=g.kv_len,
                          bq=g.bq, bk=g.bk, nk=nk, precision=cfg.precision),
        out_shape=(jax.ShapeDtypeStruct((g.batch, g.q_pad, g.heads, g.d_pad), q.dtype),
                   jax.ShapeDtypeStruct((g.batch, g.heads, g.q_pad), jnp.float32),
                   jax.ShapeDtypeStruct((g.batch, g.heads, g.q_pad), jnp.float32)),
        grid=(g.batch, g.heads, nq),
        in_specs=[blk(g.bq, lambda b, h, i: (b, i, h, 0)),
                  blk(g.kv_pad, lambda b, h, i: (b, 0, h, 0)),
                  blk(g.kv_pad, lambda b, h, i: (b, 0, h, 0))],
        out_specs=(blk(g.bq, lambda b, h, i: (b, i, h, 0)), row(g.bq, lambda b, h, i: (b, h, i)),
                   row(g.bq, lambda b, h, i: (b, h, i))),
        dimension_semantics=("parallel", "parallel", "parallel"), name="peat_pallas_attention",
        interpret=cfg.interpret, checks=cfg.checks,
    )(_pad(q, g.q_pad, g.d_pad), _pad(k, g.kv_pad, g.d_pad), _pad(v, g.kv_pad, g.d_pad))
    return o[:, :g.q_len, :, :g.dim], m, l


@_interp.lowered_once
def _backward(q, k, v, m, l, do, cfg: _Config):
    g = _geometry(q, k, cfg)
    blk, row = _specs(g)
    nq, nk = g.q_pad // g.bq, g.kv_pad // g.bk
    qp, kp, vp = _pad(q, g.q_pad, g.d_pad), _pad(k, g.kv_pad, g.d_pad), _pad(v, g.kv_pad, g.d_pad)
    dop = _pad(do.astype(q.dtype), g.q_pad, g.d_pad)
    common = dict(scale=g.scale, causal=cfg.causal, kv_len=g.kv_len, bq=g.bq, bk=g.bk,
                  precision=cfg.precision)
    sem: tuple[_interp.DimensionSemantics, ...] = ("parallel", "parallel", "parallel")
    dq, delta = _interp.call(
        functools.partial(_dq_body, nk=nk, **common),
        out_shape=(jax.ShapeDtypeStruct(qp.shape, q.dtype),
                   jax.ShapeDtypeStruct((g.batch, g.heads, g.q_pad), jnp.float32)),
        grid=(g.batch, g.heads, nq),
        in_specs=[blk(g.bq, lambda b, h, i: (b, i, h, 0)),
                  blk(g.kv_pad, lambda b, h, i: (b, 0, h, 0)),
                  blk(g.kv_pad, lambda b, h, i: (b, 0, h, 0)),
                  blk(g.bq, lambda b, h, i: (b, i, h, 0)),
                  row(g.bq, lambda b, h, i: (b, h, i)), row(g.bq, lambda b, h, i: (b, h, i))],
        out_specs=(blk(g.bq, lambda b, h, i: (b, i, h, 0)), row(g.bq, lambda b, h, i: (b, h, i))),
        dimension_semantics=sem,
        name="peat_pallas_attention_dq", interpret=cfg.interpret, checks=cfg.checks,
    )(qp, kp, vp, dop, m, l)
    dk, dv = _interp.call(
        functools.partial(_dkv_body, nq=nq, **common),
        out_shape=(jax.ShapeDtypeStruct(kp.shape, k.dtype),
                   jax.ShapeDtypeStruct(vp.shape, v.dtype)),
        grid=(g.batch, g.heads, nk),
        in_specs=[blk(g.q_pad, lambda b, h, j: (b, 0, h, 0)),
                  blk(g.bk, lambda b, h, j: (b, j, h, 0)),
                  blk(g.bk, lambda b, h, j: (b, j, h, 0)),
                  blk(g.q_pad, lambda b, h, j: (b, 0, h, 0)),
                  row(g.q_pad, lambda b, h, j: (b, h, 0)), row(g.q_pad, lambda b, h, j: (b, h, 0)),
                  row(g.q_pad, lambda b, h, j: (b, h, 0))],
        out_specs=(blk(g.bk, lambda b, h, j: (b, j, h, 0)),
                   blk(g.bk, lambda b, h, j: (b, j, h, 0))),
        dimension_semantics=sem, name="peat_pallas_attention_dkv", interpret=cfg.interpret,
        checks=cfg.checks,
    )(qp, kp, vp, dop, m, l, delta)
    cut = lambda x, t: x[:, :t, :, :g.dim]  # noqa: E731
    return cut(dq, g.q_len), cut(dk, g.kv_len), cut(dv, g.kv_len)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg):
    return _forward(q, k, v, cfg)[0]


def _attention_fwd(q, k, v, cfg):
    o, m, l = _forward(q, k, v, cfg)
    return o, (q, k, v, m, l)


def _attention_bwd(cfg, res, do):
    q, k, v, m, l = res
    return _backward(q, k, v, m, l, do, cfg)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _config(causal, sm_scale, block_q, block_k, interpret, checks, precision) -> _Config:
    _interp.validate_interpret(interpret, checks)
    return _Config(bool(causal), None if sm_scale is None else float(sm_scale),
                   check_block("block_q", block_q), check_block("block_k", block_k), interpret,
                   _interp.normalize_checks(checks), dot_precision(precision))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              sm_scale: Optional[float] = None, block_q: int = 32, block_k: int = 32,
              interpret: Optional[bool] = None, checks: Checks = None,
              precision: Any = "highest") -> jax.Array:
    """Differentiable Pallas flash attention; q `[B, Tq, H, D]`, k/v `[B, Tk, H, D]`, its dots
    at `precision` (as for `pallas_attention`). Returns `[B, Tq, H, D]` in q's dtype."""
    return _attention(q, k, v, _config(causal, sm_scale, block_q, block_k, interpret, checks,
                                       precision))


def attention_supports(name: str, site, *, causal: bool) -> Optional[str]:
    """None if `site` is an `attention(q, k, v)` region this layout serves, else the reason."""
    args = region_args(site)
    if args is None:
        return (f"{name} replaces an attention(q, k, v) region, not the primitive site "
                f"{site.primitive!r}")
    if len(args) != 3 or not all(isinstance(a, jax.ShapeDtypeStruct) for a in args):
        return (f"{name} needs a region attention(q, k, v) of three arrays, got {len(args)} "
                "arguments")
    q, k, v = args
    if any(len(a.shape) != 4 for a in args):
        return (f"{name} needs q, k, v as [batch, seq, heads, head_dim], got shapes "
                f"{[tuple(a.shape) for a in args]}")
    if tuple(k.shape) != tuple(v.shape):
        return f"{name} needs k and v of the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        return (f"{name} needs q and k with equal batch, heads and head_dim, got {tuple(q.shape)} "
                f"and {tuple(k.shape)}")
    if q.shape[3] > MAX_HEAD_DIM:
        return f"{name} holds a head in one block: head_dim {q.shape[3]} exceeds {MAX_HEAD_DIM}"
    if causal and q.shape[1] != k.shape[1]:
        return (f"{name} with causal=True needs equal query and key lengths, got {q.shape[1]} "
                f"and {k.shape[1]}")
    return float_reason(name, [q.dtype, k.dtype, v.dtype])


def pallas_attention(causal: bool = False, *, sm_scale: Optional[float] = None,
                     block_q: int = 32, block_k: int = 32, interpret: Optional[bool] = None,
                     checks: Checks = None, precision: Any = "highest") -> Kernel:
    """A `peat.Kernel` for a region `attention(q, k, v)` laid out like Flax's
    `nn.dot_product_attention` (`[batch, seq, heads, head_dim]`, no mask argument).

    Args:
      causal: query i attends to keys j <= i (equal lengths required).
      sm_scale: logits scale; None for `1/sqrt(head_dim)` (Flax's).
      block_q, block_k: query/key block sizes (powers of two).
      interpret, checks: see `peat_jax._src.kernels.pallas.interpret` (None: the interpreter on CPU,
        compiled through Triton on a GPU, CUDA or ROCm).
      precision: the precision of every dot (q k^T, p v and the backward's), as for
        `pallas_matmul`: "highest" (default, full float32), "high" or "default" (Triton's
        default: TF32 on recent NVIDIA GPUs). On a GPU a full-float32 dot may need smaller
        blocks.

    Returns:
      A Kernel returning q's shape and dtype; forward (online softmax, float32 statistics) and
      backward (dq kernel, dk/dv kernel) in Pallas.
    """
    cfg = _config(causal, sm_scale, block_q, block_k, interpret, checks, precision)
    name = (f"pallas_attention(causal={cfg.causal}, block_q={cfg.block_q}, "
            f"block_k={cfg.block_k}{precision_suffix(cfg.precision)}"
            f"{', checked' if cfg.checks else ''})")
    return Kernel(name, lambda q, k, v: _attention(q, k, v, cfg),
                  supports=lambda site: attention_supports(name, site, causal=cfg.causal))
