"""The XLA references of the bundled region kernels: what `pallas_softmax`, `pallas_layer_norm`
and `pallas_attention` (and jax's own Pallas kernels) are checked against.

Each is a plain JAX function with the region's signature, so it can be marked as the region
(`peat.region("layer_norm")(references.layer_norm)`) and passed to `peat.check_kernel` as the
reference. Under `jax.enable_x64` with float64 operands they compute in float64 (the noise floor
`check_kernel` measures).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def softmax(x: jax.Array) -> jax.Array:
    """`jax.nn.softmax` over the last axis; returns x's shape and dtype."""
    return jax.nn.softmax(x, axis=-1)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`(x - mean) / sqrt(var + eps) * scale + bias` over the last axis; scale and bias are `[n]`.

    Statistics in float32 for narrower inputs (as Flax's `nn.LayerNorm` and the bundled kernels
    compute them), in float64 for float64 inputs. 1e-6 is Flax's default `epsilon`.

    Returns:
      x's shape in the promoted dtype of x, scale and bias.
    """
    out_dtype = jnp.result_type(x.dtype, scale.dtype, bias.dtype)
    compute = jnp.promote_types(out_dtype, jnp.float32)
    x, scale, bias = (jnp.asarray(a, compute) for a in (x, scale, bias))
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return ((x - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(out_dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = False) -> jax.Array:
    """Flax's `nn.dot_product_attention`: `softmax(q k^T / sqrt(head_dim)) v`, q `[batch, q_len,
    heads, head_dim]`, k and v `[batch, kv_len, heads, head_dim]`; with `causal`, query i sees keys
    j <= i (equal lengths).

    Returns:
      q's shape and dtype.
    """
    from flax import linen as nn  # Flax is imported only where a reference needs it
    mask = nn.make_causal_mask(jnp.ones(q.shape[:2])) if causal else None
    return nn.dot_product_attention(q, k, v, mask=mask)
