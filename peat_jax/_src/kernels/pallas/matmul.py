"""A blocked Pallas matmul for any `dot_general` site, forward and backward in Pallas.

The kernel computes a batched `[B, M, K] x [B, K, N] -> float32 [B, M, N]`: a grid over
(batch, M blocks, N blocks), each program looping over K in blocks of `block_k` and
accumulating in float32. The `peat.kernels.dot_general` adapter maps any `dot_general` site
(batch, contracting and free dims, transposes) onto it and casts to the site's
`preferred_element_type`. Shapes that are not multiples of the blocks are zero-padded by the
wrapper. The backward pass is the same Pallas matmul on the transposed problems
(`dA = G @ B^T`, `dB = A^T @ G`), via a `jax.custom_vjp`.

Where it runs: the Pallas interpreter on the CPU; compiled through Triton (asked for explicitly,
`jax.experimental.pallas.triton.CompilerParams`) on NVIDIA (CUDA) and AMD (ROCm) GPUs alike;
`peat.lowers_for` checks on a CPU machine that it lowers for both.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from peat_jax._src.kernels._support import (check_block, dot_general_float_support, dot_precision,
                                            fit_block, precision_suffix)
from peat_jax._src.kernels.base import Kernel
from peat_jax._src.kernels.matmul import dot_general
from peat_jax._src.kernels.pallas import interpret as _interp
from peat_jax._src.kernels.pallas.interpret import Checks


@dataclasses.dataclass(frozen=True)
class _Config:
    block_m: int
    block_n: int
    block_k: int
    interpret: Optional[bool]
    checks: Optional[_interp.InterpretChecks]
    precision: lax.Precision = lax.Precision.HIGHEST


def _body(a_ref, b_ref, o_ref, *, block_k: int, k_steps: int, precision: lax.Precision):
    def step(kk, acc):
        start = pl.multiple_of(kk * block_k, block_k)
        a = a_ref[:, pl.ds(start, block_k)]
        b = b_ref[pl.ds(start, block_k), :]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)

    acc = lax.fori_loop(0, k_steps, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _pad_to(x: jax.Array, shape) -> jax.Array:
    pads = [(0, int(t) - int(s)) for s, t in zip(x.shape, shape)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def _round_up(n: int, block: int) -> int:
    return -(-int(n) // block) * block


@_interp.lowered_once
def _matmul3(a: jax.Array, b: jax.Array, cfg: _Config) -> jax.Array:
    """The Pallas call on `[B, M, K] x [B, K, N]`; returns float32 `[B, M, N]`."""
    nb, m, k = a.shape
    n = b.shape[2]
    dtype = jnp.promote_types(a.dtype, b.dtype)
    if m == 0 or n == 0 or k == 0 or nb == 0:
        return jnp.zeros((nb, m, n), jnp.float32)
    bm, bn, bk = fit_block(cfg.block_m, m), fit_block(cfg.block_n, n), fit_block(cfg.block_k, k)
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
    a = _pad_to(a.astype(dtype), (nb, mp, kp))
    b = _pad_to(b.astype(dtype), (nb, kp, np_))
    run = _interp.call(
        functools.partial(_body, block_k=bk, k_steps=kp // bk, precision=cfg.precision),
        out_shape=jax.ShapeDtypeStruct((nb, mp, np_), jnp.float32),
        grid=(nb, mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((None, bm, kp), lambda g, i, j: (g, i, 0)),
                  pl.BlockSpec((None, kp, bn), lambda g, i, j: (g, 0, j))],
        out_specs=pl.BlockSpec((None, bm, bn), lambda g, i, j: (g, i, j)),
        dimension_semantics=("parallel", "parallel", "parallel"),
        name="peat_pallas_matmul", interpret=cfg.interpret, checks=cfg.checks)
    out = run(a, b)
    return out[:, :m, :n] if (mp, np_) != (m, n) else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(a, b, cfg):
    return _matmul3(a, b, cfg)


def _matmul_fwd(a, b, cfg):
    return _matmul3(a, b, cfg), (a, b)


def _matmul_bwd(cfg, res, g):
    a, b = res
    da = _matmul(g, jnp.swapaxes(b, 1, 2), cfg)   # [B, M, N] x [B, N, K]
    db = _matmul(jnp.swapaxes(a, 1, 2), g, cfg)   # [B, K, M] x [B, M, N]
    return da.astype(a.dtype), db.astype(b.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(a: jax.Array, b: jax.Array, *, block_m: int = 32, block_n: int = 32, block_k: int = 32,
           interpret: Optional[bool] = None, checks: Checks = None,
           precision: Any = "highest") -> jax.Array:
    """Differentiable Pallas matmul of `a[..., M, K]` and `b[..., K, N]` (equal leading batch
    dims, or none), its dots at `precision` (as for `pallas_matmul`). Returns float32
    `[..., M, N]` (accumulated in float32)."""
    cfg = _config(block_m, block_n, block_k, interpret, checks, precision)
    if a.ndim == 2:
        return _matmul(a[None], b[None], cfg)[0]
    lead = a.shape[:-2]
    out = _matmul(a.reshape((-1,) + a.shape[-2:]), b.reshape((-1,) + b.shape[-2:]), cfg)
    return out.reshape(lead + out.shape[-2:])


def _config(block_m, block_n, block_k, interpret, checks, precision) -> _Config:
    _interp.validate_interpret(interpret, checks)
    return _Config(check_block("block_m", block_m), check_block("block_n", block_n),
                   check_block("block_k", block_k), interpret, _interp.normalize_checks(checks),
                   dot_precision(precision))


def pallas_matmul(block_m: int = 32, block_n: int = 32, block_k: int = 32, *,
                  interpret: Optional[bool] = None, checks: Checks = None,
                  precision: Any = "highest") -> Kernel:
    """A `peat.Kernel` for any floating-point `dot_general` site: the blocked Pallas matmul.

    Args:
      block_m, block_n, block_k: block sizes (powers of two; 16 or more for GPU `dot`), each
        shrunk to the next power of two of a smaller dimension so that small operands are not
        padded up to a large block.
      interpret: None (the interpreter on CPU; compiled through Triton on a GPU, CUDA or ROCm,
        and inside `peat_jax._src.kernels.pallas.compiling()`), True or False.
      checks: interpreter checks (`True` or `peat.kernels.InterpretChecks`); see
        `peat_jax._src.kernels.pallas.interpret`.
      precision: the precision of the dots inside the kernel, forward and backward: "highest"
        (default: full float32, so the kernel matches a full-float32 reference on a GPU too),
        "high" or "default" (Triton's default: TF32 for float32 operands on recent NVIDIA GPUs,
        which `peat.check_kernel` names ``reduced_precision``), jax's other names for them or
        a `jax.lax.Precision`. Nothing changes in interpret mode on CPU. On a GPU a full-float32
        dot in Triton is slower and needs more registers and shared memory per block: with large
        blocks, a smaller `block_k` (e.g. 16) may be needed.

    Returns:
      A Kernel for `dot_general` sites with float32, bfloat16 or float16 operands; forward and
      backward (the same Pallas matmul on the transposed problems) accumulate in float32, and the
      result is cast to the site's `preferred_element_type`.
    """
    cfg = _config(block_m, block_n, block_k, interpret, checks, precision)
    name = (f"pallas_matmul(block_m={cfg.block_m}, block_n={cfg.block_n}, "
            f"block_k={cfg.block_k}{precision_suffix(cfg.precision)}"
            f"{', checked' if cfg.checks else ''})")
    kernel = dot_general(lambda a, b: _matmul(a, b, cfg), name=name, batched=True)
    return dataclasses.replace(kernel, supports=dot_general_float_support(name))
