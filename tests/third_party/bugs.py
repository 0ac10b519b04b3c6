"""Porting bugs people report, each a third-party function called the way the bug calls it, and
checked against what the ported model computes, and a public kernel's instability in a narrower
dtype: each must fail on every seed, with its error model where the taxonomy has one. The
porting bugs are in the forward pass, so the forward alone is checked there (a failing check
costs more than a passing one; CI runs this on 2 cores)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

import peat_jax as peat

from . import Entry
from . import references as ref
from .correct import (_norm2, _padded_ce_args, _qkv_bhsd, _qkv_bshd, _rope_args, _torch_layer_norm,
                      faj_causal_flash_attention, haiku_rms_norm, ROWS, N, PAD)
from ._inputs import normal

__all__ = ["ENTRIES"]


@jax.jit
def equinox_layer_norm_default_eps(x, scale, bias):
    """`equinox.nn.LayerNorm(n)` with its default eps 1e-5, where the model is Flax's
    (`nn.LayerNorm`, epsilon 1e-6)."""
    from .correct import equinox_layer_norm
    return equinox_layer_norm(x, scale, bias)


@jax.jit
def equinox_rope_for_interleaved(x):
    """Equinox's rotary embedding (half-split) in a port of a model whose checkpoint was trained
    with interleaved pairs (Meta's Llama, GPT-J), the weights not permuted."""
    from .correct import equinox_rope
    return equinox_rope(x)


@jax.jit
def flax_attention_no_mask(q, k, v):
    """`flax.linen.dot_product_attention(q, k, v)` in a decoder: the causal mask forgotten."""
    import flax.linen as nn
    return nn.dot_product_attention(q, k, v)


@jax.jit
def flax_gelu_default(x):
    """`flax.linen.gelu(x)` for torch's `F.gelu(x)`: Flax's default is the tanh approximation,
    torch's the exact erf."""
    import flax.linen as nn
    return nn.gelu(x)


@jax.jit
def optax_ce_mean_over_padding(logits, labels):
    """`optax.softmax_cross_entropy_with_integer_labels(...).mean()` over padded sequences: the
    padding tokens are averaged in (no `where=`, no mask)."""
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _torch_sdpa_default(q, k, v):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v)     # is_causal defaults to False


def _torch_rope_interleaved(x):
    from .correct import _torch_rope_interleaved as rope
    return rope(x)


torch_layer_norm_default_eps = peat.kernels.torch_kernel(_torch_layer_norm,
                                                         name="torch_layer_norm_default_eps")
torch_sdpa_no_causal = peat.kernels.torch_kernel(_torch_sdpa_default, name="torch_sdpa_default")
torch_rope_for_half_split = peat.kernels.torch_kernel(_torch_rope_interleaved,
                                                      name="rotary_embedding_torch")


def aqt_int8_matmul(a, b):
    """aqtp's int8 `dot_general` (`aqt.jax.v2.config.fully_quantized(fwd_bits=8, bwd_bits=8)`,
    round to nearest), the quantized training config left on where the model's matmul is
    float32."""
    from aqt.jax.v2 import config as aqt_config
    dot = aqt_config.fully_quantized(fwd_bits=8, bwd_bits=8, use_stochastic_rounding=False)
    return dot(a, b, (((1,), (0,)), ((), ())), precision=None)


def _matmul_args(seed):
    return normal(seed, 0, 67, 45), normal(seed, 1, 45, 33)


_FWD = dict(backward=False, variants=("example",))

def _small_float16_rows(seed):
    """`_norm2`'s rows at rms 0.01, in float16: activations a float16 model has."""
    x, scale, bias = _norm2(seed)
    return (0.01 * x).astype(jnp.float16), scale.astype(jnp.float16), bias.astype(jnp.float16)


ENTRIES: tuple[Entry, ...] = (
    Entry("torch_layer_norm_default_eps", "torch", "bug", torch_layer_norm_default_eps,
          ref.layer_norm, _norm2, ("wrong_scale",),
          "torch F.layer_norm's default eps 1e-5 in a port of a Flax model (epsilon 1e-6)",
          needs=("torch",), **_FWD),
    Entry("equinox_layer_norm_default_eps", "equinox", "bug", equinox_layer_norm_default_eps,
          ref.layer_norm, _norm2, ("wrong_scale",),
          "equinox.nn.LayerNorm's default eps 1e-5 in a port of a Flax model (epsilon 1e-6)",
          **_FWD),
    Entry("rope_interleaved_for_half_split", "rotary-embedding-torch", "bug",
          torch_rope_for_half_split, ref.rope_half_split, _rope_args, "fails",
          "lucidrains' interleaved rotary embedding where the model pairs i with i + d/2",
          needs=("torch", "rotary_embedding_torch"), **_FWD),
    Entry("rope_half_split_for_interleaved", "equinox", "bug", equinox_rope_for_interleaved,
          ref.rope_interleaved, _rope_args, "fails",
          "equinox's half-split rotary embedding where the checkpoint pairs 2i with 2i + 1",
          **_FWD),
    Entry("flax_attention_missing_causal_mask", "flax", "bug", flax_attention_no_mask,
          ref.causal_attention_bshd, _qkv_bshd, "fails",
          "flax.linen.dot_product_attention with the causal mask forgotten", **_FWD),
    Entry("torch_sdpa_missing_is_causal", "torch", "bug", torch_sdpa_no_causal,
          ref.causal_attention_bhsd, _qkv_bhsd, "fails",
          "torch F.scaled_dot_product_attention without is_causal=True (its default False)",
          needs=("torch",), **_FWD),
    Entry("flax_gelu_tanh_for_exact", "flax", "bug", flax_gelu_default, ref.gelu_exact,
          # its errors have the size of inputs rounded to ~10 bits, but rounding them to tf32
          # or fp16 does not reproduce them element by element (check.judging
          # .confirmed_formats), and run in float64 it is as far off: a different function
          lambda seed: (2 * normal(seed, 0, ROWS, N),), ("approximation",),
          "flax.linen.gelu (tanh approximation by default) for torch's exact F.gelu", **_FWD),
    Entry("optax_ce_mean_over_padding", "optax", "bug", optax_ce_mean_over_padding,
          lambda logits, labels: ref.masked_cross_entropy(logits, labels, pad=PAD),
          _padded_ce_args, "fails",
          "optax cross-entropy .mean() over padded sequences: padding tokens averaged in",
          **_FWD),
    Entry("faj_causal_flash_attention_large_logits", "flash-attention-jax", "bug",
          faj_causal_flash_attention, ref.causal_attention_bhsd, _qkv_bhsd, ("nan_inf",),
          "lucidrains' causal FlashAttention at logits ~1e19 (past its MASK_VALUE -1e10 and "
          "row-max init -1e6): NaN", backward=False, variants=("large",),
          needs=("flash_attention_jax",)),
    Entry("haiku_rms_norm_float16", "dm-haiku", "bug", haiku_rms_norm, ref.rms_norm,
          _small_float16_rows, ("unstable_algorithm",),
          "haiku.RMSNorm in float16 on rows of rms 0.01: its gradient overflows (rsqrt's "
          "derivative -ans / (2 v) is ~v**-1.5 = 1e6), where the formula's is finite",
          variants=("example",), needs=("haiku",)),
    # its few bits are its verdict: on the outliers inputs its gradients lose every value
    # (random_value there), which `swamped_by_outliers` tells apart from a fault
    Entry("aqt_int8_for_float32_matmul", "aqtp", "bug", aqt_int8_matmul,
          lambda a, b: a @ b, _matmul_args, ("reduced_precision",),
          "aqtp's int8 dot_general (its quantized training config) where the matmul is float32",
          variants=("example", "outliers"), needs=("aqt",)),
)
