"""Layer norm over the last axis in Pallas, forward and backward, for a `layer_norm(x, scale,
bias)` region, and an adapter for Flax `nn.LayerNorm` regions.

`y = (x - mean) / sqrt(var + eps) * scale + bias`, statistics in float32 (two-pass variance).
The forward kernel also writes each row's mean and reciprocal standard deviation, which the
backward kernel uses to compute `dx` and per-block partial sums of `dscale`/`dbias`; the final
sum of those partials over row blocks is one `jnp.sum`.

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
from jax.experimental import pallas as pl

from peat_jax._src.errors import PeatError
from peat_jax._src.kernels._support import (check_block, fit_block, float_reason, next_pow2,
                                            region_args)
from peat_jax._src.kernels.base import Kernel
from peat_jax._src.kernels.pallas import interpret as _interp
from peat_jax._src.kernels.pallas.interpret import Checks


MAX_ROW = 1 << 16  # features of one row held by one program


@dataclasses.dataclass(frozen=True)
class _Config:
    eps: float
    block_rows: int
    interpret: Optional[bool]
    checks: Optional[_interp.InterpretChecks]


def _fwd_body(x_ref, s_ref, b_ref, y_ref, mean_ref, rstd_ref, *, n: int, eps: float):
    x = x_ref[...].astype(jnp.float32)
    valid = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < n
    x = jnp.where(valid, x, 0.0)
    mean = jnp.sum(x, axis=1) / n
    xc = jnp.where(valid, x - mean[:, None], 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(xc * xc, axis=1) / n + eps)
    scale = s_ref[...].astype(jnp.float32)
    bias = b_ref[...].astype(jnp.float32)
    y_ref[...] = (xc * rstd[:, None] * scale[None, :] + bias[None, :]).astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _bwd_body(x_ref, s_ref, g_ref, mean_ref, rstd_ref, dx_ref, ds_ref, db_ref, *, n: int):
    x = x_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    valid = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < n
    rstd = rstd_ref[...][:, None]
    xhat = jnp.where(valid, (x - mean_ref[...][:, None]) * rstd, 0.0)
    g = jnp.where(valid, g, 0.0)
    wg = g * s_ref[...].astype(jnp.float32)[None, :]
    c1 = jnp.sum(xhat * wg, axis=1, keepdims=True) / n
    c2 = jnp.sum(wg, axis=1, keepdims=True) / n
    dx_ref[...] = jnp.where(valid, (wg - (xhat * c1 + c2)) * rstd, 0.0).astype(dx_ref.dtype)
    ds_ref[...] = jnp.sum(g * xhat, axis=0)
    db_ref[...] = jnp.sum(g, axis=0)


def _geometry(x: jax.Array, cfg: _Config):
    if x.ndim < 1 or x.shape[-1] == 0:
        raise PeatError(f"layer norm needs x with a non-empty last axis, got shape {x.shape}")
    n = x.shape[-1]
    rows = x.size // n
    br = fit_block(cfg.block_rows, rows, minimum=1)
    return n, rows, br, -(-rows // br) * br, next_pow2(n)


def _pad2(x2: jax.Array, rows_p: int, n_p: int) -> jax.Array:
    return jnp.pad(x2, ((0, rows_p - x2.shape[0]), (0, n_p - x2.shape[1])))


def _pad1(v: jax.Array, n_p: int) -> jax.Array:
    return jnp.pad(v, (0, n_p - v.shape[0]))


@_interp.lowered_once
def _forward(x, scale, bias, cfg: _Config):
    """(y, mean[rows_p], rstd[rows_p]); y has the promoted dtype of x, scale and bias."""
    n, rows, br, rows_p, n_p = _geometry(x, cfg)
    out_dtype = jnp.result_type(x.dtype, scale.dtype, bias.dtype)
    row_spec = pl.BlockSpec((br, n_p), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((n_p,), lambda i: (0,))
    stat_spec = pl.BlockSpec((br,), lambda i: (i,))
    y, mean, rstd = _interp.call(
        functools.partial(_fwd_body, n=n, eps=cfg.eps),
        out_shape=(jax.ShapeDtypeStruct((rows_p, n_p), out_dtype),
                   jax.ShapeDtypeStruct((rows_p,), jnp.float32),
                   jax.ShapeDtypeStruct((rows_p,), jnp.float32)),
        grid=(rows_p // br,), in_specs=[row_spec, vec_spec, vec_spec],
        out_specs=(row_spec, stat_spec, stat_spec), dimension_semantics=("parallel",),
        name="peat_pallas_layer_norm", interpret=cfg.interpret, checks=cfg.checks,
    )(_pad2(x.reshape(rows, n), rows_p, n_p), _pad1(scale, n_p), _pad1(bias, n_p))
    return y[:rows, :n].reshape(x.shape), mean, rstd


@_interp.lowered_once
def _backward(x, scale, g, mean, rstd, cfg: _Config):
    """(dx, dscale, dbias) in float32 partial sums reduced here."""
    n, rows, br, rows_p, n_p = _geometry(x, cfg)
    nblocks = rows_p // br
    row_spec = pl.BlockSpec((br, n_p), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((n_p,), lambda i: (0,))
    stat_spec = pl.BlockSpec((br,), lambda i: (i,))
    part_spec = pl.BlockSpec((None, n_p), lambda i: (i, 0))
    dx, ds, db = _interp.call(
        functools.partial(_bwd_body, n=n),
        out_shape=(jax.ShapeDtypeStruct((rows_p, n_p), x.dtype),
                   jax.ShapeDtypeStruct((nblocks, n_p), jnp.float32),
                   jax.ShapeDtypeStruct((nblocks, n_p), jnp.float32)),
        grid=(nblocks,), in_specs=[row_spec, vec_spec, row_spec, stat_spec, stat_spec],
        out_specs=(row_spec, part_spec, part_spec), dimension_semantics=("parallel",),
        name="peat_pallas_layer_norm_bwd", interpret=cfg.interpret, checks=cfg.checks,
    )(_pad2(x.reshape(rows, n), rows_p, n_p), _pad1(scale, n_p),
      _pad2(g.reshape(rows, n), rows_p, n_p), mean, rstd)
    return dx[:rows, :n].reshape(x.shape), jnp.sum(ds, axis=0)[:n], jnp.sum(db, axis=0)[:n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, cfg):
    return _forward(x, scale, bias, cfg)[0]


def _layer_norm_fwd(x, scale, bias, cfg):
    y, mean, rstd = _forward(x, scale, bias, cfg)
    return y, (x, scale, bias, mean, rstd)


def _layer_norm_bwd(cfg, res, g):
    x, scale, bias, mean, rstd = res
    dx, ds, db = _backward(x, scale, g, mean, rstd, cfg)
    return dx, ds.astype(scale.dtype), db.astype(bias.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def _config(eps, block_rows, interpret, checks) -> _Config:
    _interp.validate_interpret(interpret, checks)
    if not float(eps) > 0:
        raise PeatError(f"eps must be positive, got {eps!r}")
    return _Config(float(eps), check_block("block_rows", block_rows), interpret,
                   _interp.normalize_checks(checks))


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, *, eps: float = 1e-6,
               block_rows: int = 16, interpret: Optional[bool] = None,
               checks: Checks = None) -> jax.Array:
    """Differentiable Pallas layer norm over the last axis of x; scale and bias are `[n]`.
    Returns x's shape in the promoted dtype of x, scale and bias."""
    return _layer_norm(x, scale, bias, _config(eps, block_rows, interpret, checks))


def _shape_reason(name: str, x, scale, bias) -> Optional[str]:
    for what, a in (("x", x), ("scale", scale), ("bias", bias)):
        if not isinstance(a, jax.ShapeDtypeStruct):
            return f"{name}: {what} must be one array"
    if len(x.shape) < 1 or x.shape[-1] == 0:
        return f"{name} needs x with a non-empty last axis, got shape {tuple(x.shape)}"
    n = x.shape[-1]
    for what, a in (("scale", scale), ("bias", bias)):
        if tuple(a.shape) != (n,):
            return (f"{name} normalises over the last axis only: {what} must have shape ({n},) "
                    f"like x's last axis, got {tuple(a.shape)}")
    if n > MAX_ROW:
        return f"{name} holds a whole row in one program: {n} features exceed {MAX_ROW}"
    return float_reason(name, [x.dtype, scale.dtype, bias.dtype])


def layer_norm_supports(name: str, site) -> Optional[str]:
    """None if `site` is a `layer_norm(x, scale, bias)` region this kernel serves (last axis,
    rows up to `MAX_ROW`), else the reason (naming the kernel `name`)."""
    args = region_args(site)
    if args is None:
        return (f"{name} replaces a layer_norm(x, scale, bias) region, not the primitive "
                f"site {site.primitive!r}")
    if len(args) != 3:
        return f"{name} needs a region layer_norm(x, scale, bias), got {len(args)} arguments"
    return _shape_reason(name, *args)


def pallas_layer_norm(eps: float = 1e-6, *, block_rows: int = 16,
                      interpret: Optional[bool] = None, checks: Checks = None) -> Kernel:
    """A `peat.Kernel` for a region `layer_norm(x, scale, bias)` over x's last axis.

    Args:
      eps: added to the variance (1e-6 is Flax's `nn.LayerNorm` default).
      block_rows: rows per program (a power of two).
      interpret, checks: see `peat_jax._src.kernels.pallas.interpret` (None: the interpreter on CPU,
        compiled through Triton on a GPU, CUDA or ROCm).

    Returns:
      A Kernel returning x's shape in the promoted dtype of (x, scale, bias); forward and
      backward are Pallas kernels (the `dscale`/`dbias` block partials are summed with jnp).
    """
    cfg = _config(eps, block_rows, interpret, checks)
    name = (f"pallas_layer_norm(eps={cfg.eps:g}, block_rows={cfg.block_rows}"
            f"{', checked' if cfg.checks else ''})")
    return Kernel(name, lambda x, scale, bias: _layer_norm(x, scale, bias, cfg),
                  supports=functools.partial(layer_norm_supports, name))


# --------------------------------------------------------------------------------------------
# Flax nn.LayerNorm regions


def _flax_params(variables: Any):
    params = variables.get("params", {}) if hasattr(variables, "get") else {}
    return params.get("scale"), params.get("bias")


def flax_layer_norm(kernel: Optional[Kernel] = None) -> Kernel:
    """Adapt a `layer_norm(x, scale, bias)` kernel to a Flax `nn.LayerNorm` region.

    The region's arguments are `(variables, x)` (see `peat.flax_regions`); the module's
    parameters are `variables["params"]["scale"]` and `["bias"]` (a missing one, from
    `use_scale=False` / `use_bias=False`, becomes ones / zeros). The kernel's own `eps` must
    match the module's `epsilon` (Flax's default is 1e-6, as is `pallas_layer_norm`'s); only
    the default `reduction_axes=-1` with `feature_axes=-1` is served.

    Args:
      kernel: a layer-norm Kernel (default `pallas_layer_norm()`).

    Returns:
      A Kernel for `LayerNorm` region sites (forward and backward).
    """
    kernel = pallas_layer_norm() if kernel is None else kernel
    if not isinstance(kernel, Kernel):
        raise PeatError(f"flax_layer_norm needs a peat.Kernel for layer_norm(x, scale, bias), "
                        f"got {type(kernel).__name__}")
    name = f"flax_layer_norm({kernel.name})"

    def impl(variables, x, *rest):
        scale, bias = _flax_params(variables)
        n = x.shape[-1]
        scale = jnp.ones((n,), x.dtype) if scale is None else scale
        bias = jnp.zeros((n,), x.dtype) if bias is None else bias
        return kernel(x, scale, bias)

    def supports(site) -> Optional[str]:
        args = region_args(site)
        if args is None:
            return f"{name} replaces a Flax nn.LayerNorm region, not the primitive site " \
                   f"{site.primitive!r}"
        if len(args) != 2 or not isinstance(args[1], jax.ShapeDtypeStruct):
            return (f"{name} needs a Flax LayerNorm region with arguments (variables, x), got "
                    f"{len(args)} arguments")
        variables, x = args
        scale, bias = _flax_params(variables)
        n = x.shape[-1] if len(x.shape) else 0
        scale = scale if scale is not None else jax.ShapeDtypeStruct((n,), x.dtype)
        bias = bias if bias is not None else jax.ShapeDtypeStruct((n,), x.dtype)
        return _shape_reason(name, x, scale, bias)

    return Kernel(name, impl, supports=supports, region="flax.linen.LayerNorm")
