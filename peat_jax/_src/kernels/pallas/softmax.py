"""A row softmax in Pallas (last axis), forward and backward, for a `softmax(x)` region.

The input is viewed as `[rows, n]`; a grid over blocks of `block_rows` rows, each program holding
whole rows (padded to a power of two and masked). Statistics in float32. The backward pass is a
second Pallas kernel, `dx = y * (g - sum(g * y))`, from the saved output `y`.

Where it runs: the Pallas interpreter on the CPU; compiled through Triton (asked for explicitly,
`jax.experimental.pallas.triton.CompilerParams`) on NVIDIA (CUDA) and AMD (ROCm) GPUs alike;
`peat.lowers_for` checks on a CPU machine that it lowers for both.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from peat_jax._src.kernels._support import (check_block, fit_block, float_reason, next_pow2,
                                            region_args)
from peat_jax._src.kernels.base import Kernel
from peat_jax._src.kernels.pallas import interpret as _interp
from peat_jax._src.kernels.pallas.interpret import Checks


MAX_ROW = 1 << 16  # elements of one row held by one program


@dataclasses.dataclass(frozen=True)
class _Config:
    block_rows: int
    interpret: Optional[bool]
    checks: Optional[_interp.InterpretChecks]


def _fwd_body(x_ref, o_ref, *, n: int):
    x = x_ref[...].astype(jnp.float32)
    valid = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < n
    x = jnp.where(valid, x, -jnp.inf)
    e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
    o_ref[...] = (e / jnp.sum(e, axis=1, keepdims=True)).astype(o_ref.dtype)


def _bwd_body(y_ref, g_ref, dx_ref, *, n: int):
    y = y_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    valid = jax.lax.broadcasted_iota(jnp.int32, y.shape, 1) < n
    yg = jnp.where(valid, y * g, 0.0)
    dx = y * g - y * jnp.sum(yg, axis=1, keepdims=True)
    dx_ref[...] = jnp.where(valid, dx, 0.0).astype(dx_ref.dtype)


def _rows(x: jax.Array, cfg: _Config):
    """x as padded `[rows_p, n_p]` and the launch geometry."""
    n = x.shape[-1]
    rows = x.size // n if n else 0
    br = fit_block(cfg.block_rows, rows, minimum=1)
    rows_p = -(-rows // br) * br
    n_p = next_pow2(n)
    x2 = x.reshape(rows, n)
    x2 = jnp.pad(x2, ((0, rows_p - rows), (0, n_p - n)))
    return x2, rows, n, rows_p, n_p, br


def _call(body, n_in: int, x2, others, dtype, rows_p, n_p, br, n, cfg: _Config, name: str):
    spec = pl.BlockSpec((br, n_p), lambda i: (i, 0))
    return _interp.call(
        functools.partial(body, n=n), out_shape=jax.ShapeDtypeStruct((rows_p, n_p), dtype),
        grid=(rows_p // br,), in_specs=[spec] * n_in, out_specs=spec,
        dimension_semantics=("parallel",), name=name, interpret=cfg.interpret,
        checks=cfg.checks)(x2, *others)


@_interp.lowered_once
def _forward(x: jax.Array, cfg: _Config) -> jax.Array:
    if x.size == 0:
        return x
    x2, rows, n, rows_p, n_p, br = _rows(x, cfg)
    y = _call(_fwd_body, 1, x2, (), x.dtype, rows_p, n_p, br, n, cfg, "peat_pallas_softmax")
    return y[:rows, :n].reshape(x.shape)


@_interp.lowered_once
def _backward(y: jax.Array, g: jax.Array, cfg: _Config) -> jax.Array:
    if y.size == 0:
        return jnp.zeros_like(y)
    y2, rows, n, rows_p, n_p, br = _rows(y, cfg)
    g2 = _rows(g, cfg)[0]
    dx = _call(_bwd_body, 2, y2, (g2,), y.dtype, rows_p, n_p, br, n, cfg,
               "peat_pallas_softmax_bwd")
    return dx[:rows, :n].reshape(y.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softmax(x, cfg):
    return _forward(x, cfg)


def _softmax_fwd(x, cfg):
    y = _forward(x, cfg)
    return y, y


def _softmax_bwd(cfg, y, g):
    return (_backward(y, g.astype(y.dtype), cfg),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _config(block_rows, interpret, checks) -> _Config:
    _interp.validate_interpret(interpret, checks)
    return _Config(check_block("block_rows", block_rows), interpret,
                   _interp.normalize_checks(checks))


def softmax(x: jax.Array, *, block_rows: int = 16, interpret: Optional[bool] = None,
            checks: Checks = None) -> jax.Array:
    """Differentiable Pallas softmax over the last axis; returns x's shape and dtype."""
    return _softmax(x, _config(block_rows, interpret, checks))


def softmax_supports(name: str, site) -> Optional[str]:
    """None if `site` is a `softmax(x)` region this kernel serves (last axis, rows up to
    `MAX_ROW`), else the reason (naming the kernel `name`)."""
    args = region_args(site)
    if args is None:
        return (f"{name} replaces a softmax region (a function marked with "
                f"peat.region), not the primitive site {site.primitive!r}")
    if len(args) != 1 or not isinstance(args[0], jax.ShapeDtypeStruct):
        return f"{name} needs a region softmax(x) of one array, got {len(args)} arguments"
    x = args[0]
    if len(x.shape) < 1:
        return f"{name} needs x with at least one axis, got a scalar"
    if x.shape[-1] > MAX_ROW:
        return (f"{name} holds a whole row in one program: rows of {x.shape[-1]} elements "
                f"exceed {MAX_ROW}")
    return float_reason(name, [x.dtype])


def pallas_softmax(block_rows: int = 16, *, interpret: Optional[bool] = None,
                   checks: Checks = None) -> Kernel:
    """A `peat.Kernel` for a region `softmax(x)` over the last axis (e.g.
    `peat.region("softmax")(jax.nn.softmax)`).

    Args:
      block_rows: rows per program (a power of two).
      interpret, checks: see `peat_jax._src.kernels.pallas.interpret` (None: the interpreter on CPU,
        compiled through Triton on a GPU, CUDA or ROCm).

    Returns:
      A Kernel whose output has x's shape and dtype (float32 statistics); forward and backward
      (`y * (g - sum(g * y))`) are Pallas kernels.
    """
    cfg = _config(block_rows, interpret, checks)
    name = f"pallas_softmax(block_rows={cfg.block_rows}{', checked' if cfg.checks else ''})"
    return Kernel(name, lambda x: _softmax(x, cfg),
                  supports=functools.partial(softmax_supports, name))
