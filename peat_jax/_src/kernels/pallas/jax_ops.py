"""jax's own shipped GPU Pallas kernels as candidates for the matching regions.

* `jax.experimental.pallas.ops.gpu.layer_norm.layer_norm(x, weight, bias, num_warps,
  num_stages, eps, backward_pass_impl, interpret)`: x `[batch, seq, n]`, one program per row,
  its own `custom_vjp` (Pallas backward kernels for dx and dweight/dbias);
* `jax.experimental.pallas.ops.gpu.attention.mha(q, k, v, segment_ids, sm_scale, causal,
  block_sizes, ...)`: q/k/v `[batch, seq, heads, head_dim]`, sequence lengths must be multiples of
  the (clamped) block sizes, its own `custom_vjp` (Pallas dq and dk/dv kernels).

Both carry Triton compiler params, so they run compiled on GPU or in the plain interpreter on CPU;
the checked interpreter (`checks=`) cannot run them (see `peat_jax._src.kernels.pallas.interpret`).

jax 0.11 deprecated both modules in favour of tokamax (not a dependency here: nothing is
downloaded) and 0.12.1 dropped them. Up to 0.12.0.1 the factories import them with that
DeprecationWarning silenced (it would point at peat's line, where a user can do nothing about
it); on 0.12.1 a factory raises a `PeatError` saying so and naming peat's own kernel for the
region.
"""
from __future__ import annotations

import functools
import importlib
import math
import re
import warnings
from typing import Optional

import jax
import jax.numpy as jnp

from peat_jax._src.errors import PeatError
from peat_jax._src.kernels._support import check_block, region_args
from peat_jax._src.kernels.base import Kernel
from peat_jax._src.kernels.pallas import interpret as _interp
from peat_jax._src.kernels.pallas.attention import attention_supports
from peat_jax._src.kernels.pallas.layer_norm import layer_norm_supports


def _shipped(module: str, instead: str):
    """jax's `jax.experimental.pallas.ops.gpu.<module>` (its deprecation warning silenced); a
    PeatError naming `instead` (peat's own kernel for the region) when this jax has none."""
    path = f"jax.experimental.pallas.ops.gpu.{module}"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning,
                                    message=rf"{re.escape(path)} is deprecated")
            return importlib.import_module(path)
    except ImportError as e:
        raise PeatError(f"jax {jax.__version__} does not ship {path} (deprecated since jax "
                        f"0.11 in favour of tokamax): use {instead}, or wrap tokamax's kernel "
                        f"in a peat.Kernel") from e


def jax_pallas_layer_norm(eps: float = 1e-6, *, interpret: Optional[bool] = None) -> Kernel:
    """A `peat.Kernel` for a region `layer_norm(x, scale, bias)` (last axis) running jax's
    `pallas.ops.gpu.layer_norm.layer_norm`.

    Args:
      eps: added to the variance (jax's kernel defaults to 1e-5; this factory to Flax's 1e-6).
      interpret: None (interpret on CPU), True or False.

    Returns:
      A Kernel returning x's shape in the promoted dtype of (x, scale, bias); forward and
      backward are jax's Pallas kernels (rows of x are viewed as `[rows, 1, n]`).
    """
    _ln = _shipped("layer_norm", "peat.kernels.pallas_layer_norm()")
    _interp.validate_interpret(interpret, None)
    eps = float(eps)
    if not eps > 0:
        raise PeatError(f"eps must be positive, got {eps!r}")
    name = f"jax_pallas_layer_norm(eps={eps:g})"

    def impl(x, scale, bias):
        n = x.shape[-1]
        out_dtype = jnp.result_type(x.dtype, scale.dtype, bias.dtype)
        mode = _interp.interpret_mode(interpret)
        x3 = x.reshape(-1, 1, n)
        y = _ln.layer_norm(x3, scale, bias, None, 3, eps, "triton", mode)
        return y.reshape(x.shape).astype(out_dtype)

    return Kernel(name, impl, supports=functools.partial(layer_norm_supports, name))


def jax_pallas_mha(causal: bool = False, *, sm_scale: Optional[float] = None, block_q: int = 32,
                   block_k: int = 32, interpret: Optional[bool] = None) -> Kernel:
    """A `peat.Kernel` for a region `attention(q, k, v)` (`[batch, seq, heads, head_dim]`, like
    Flax's `nn.dot_product_attention`) running jax's `pallas.ops.gpu.attention.mha`.

    Args:
      causal: query i attends to keys j <= i.
      sm_scale: logits scale; None for `1/sqrt(head_dim)` (Flax's; jax's kernel defaults to 1).
      block_q, block_k: forward block sizes; the backward blocks use the same. Each is clamped to
        the sequence length, which must then be a multiple of it (checked at substitution).
      interpret: None (interpret on CPU), True or False.

    Returns:
      A Kernel returning q's shape and dtype; forward and backward are jax's Pallas kernels.
    """
    _att = _shipped("attention", "peat.kernels.pallas_attention()")
    _interp.validate_interpret(interpret, None)
    block_q, block_k = check_block("block_q", block_q), check_block("block_k", block_k)
    causal = bool(causal)
    name = f"jax_pallas_mha(causal={causal}, block_q={block_q}, block_k={block_k})"

    def impl(q, k, v):
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        sizes = _att.BlockSizes(block_q=block_q, block_k=block_k, block_q_dkv=block_q,
                                block_kv_dkv=block_k, block_q_dq=block_q, block_kv_dq=block_k)
        return _att.mha(q, k, v, None, sm_scale=float(scale), causal=causal, block_sizes=sizes,
                        interpret=_interp.interpret_mode(interpret))

    def supports(site) -> Optional[str]:
        reason = attention_supports(name, site, causal=causal)
        if reason:
            return reason
        args = region_args(site)
        assert args is not None  # attention_supports has checked the region's args
        q, k, _ = args
        tq, tk = q.shape[1], k.shape[1]
        bq, bk = min(block_q, tq), min(block_k, tk)
        if tq % bq or tk % bk:
            return (f"{name}: jax's mha needs sequence lengths that are multiples of the blocks, "
                    f"got q_len={tq} (block {bq}) and kv_len={tk} (block {bk}); pad the "
                    "sequence or use peat.kernels.pallas_attention, which pads")
        if tq // bq != tk // bk:
            return (f"{name}: jax's mha backward needs as many query blocks as key blocks, got "
                    f"{tq // bq} and {tk // bk}")
        return None

    return Kernel(name, impl, supports=supports)
