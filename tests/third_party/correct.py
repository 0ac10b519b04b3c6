"""Correct third-party kernels: each computes its reference's function and must pass on every
seed. The candidates are the packages' code, called as their users call it; nothing here patches
them."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import needs

import peat_jax as peat

from . import Entry
from . import references as ref
from ._inputs import causal_mask, class_labels, key_mask, normal, padded_labels, uniform

__all__ = ["ENTRIES"]

# Small shapes: CI runs the corpus on 2 cores, 5 seeds per entry.
B, H, S, D = 1, 2, 32, 16          # attention: batch, heads, sequence, head_dim
ROWS, N = 16, 64                   # norms: rows x features
BATCH, CLASSES = 32, 10            # losses

# ------------------------------------------------------------------------------------------
# flash-attention-jax (lucidrains): FlashAttention in JAX, lax.scan over chunks, custom_vjp
# ------------------------------------------------------------------------------------------


@jax.jit
def faj_flash_attention(q, k, v, mask):
    """lucidrains' `flash_attention(q, k, v, key_mask)`: online softmax over key chunks, the
    backward recomputes P from the saved log-sum-exp (lse = log(l) + m) and forms
    dS = P * (dP - rowsum(dO * O))."""
    from flash_attention_jax import flash_attention
    return flash_attention(q, k, v, mask)


@jax.jit
def faj_causal_flash_attention(q, k, v):
    """lucidrains' `causal_flash_attention(q, k, v)` (saves the row sum l and max m)."""
    from flash_attention_jax import causal_flash_attention
    return causal_flash_attention(q, k, v)


def _qkv_bhsd(seed):
    return tuple(normal(seed, i, B, H, S, D) for i in range(3))


def _qkv_mask(seed):
    return _qkv_bhsd(seed) + (key_mask(seed, 3, B, S),)


# ------------------------------------------------------------------------------------------
# jax's own shipped Pallas ops (jax.experimental.pallas.ops.gpu), interpreted on CPU
# ------------------------------------------------------------------------------------------


@jax.jit
def jax_pallas_mha_causal(q, k, v):
    """jax's `pallas.ops.gpu.attention.mha`, causal, blocks of 16 (a 2 x 2 block grid per head),
    `[batch, seq, heads, head_dim]`, its own Pallas backward."""
    from jax.experimental.pallas.ops.gpu import attention
    sizes = attention.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_kv_dkv=16,
                                 block_q_dq=16, block_kv_dq=16)
    return attention.mha(q, k, v, None, sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=True,
                         block_sizes=sizes, interpret=True)


@jax.jit
def jax_pallas_layer_norm(x, scale, bias):
    """jax's `pallas.ops.gpu.layer_norm.layer_norm` (its default eps 1e-5) over `[a, b, n]`."""
    from jax.experimental.pallas.ops.gpu import layer_norm
    return layer_norm.layer_norm(x, scale, bias, eps=1e-5, interpret=True)


@jax.jit
def jax_pallas_rms_norm(x, scale, bias):
    """jax's `pallas.ops.gpu.rms_norm.rms_norm` (eps 1e-5) over `[a, b, n]`."""
    from jax.experimental.pallas.ops.gpu import rms_norm
    return rms_norm.rms_norm(x, scale, bias, eps=1e-5, interpret=True)


# ------------------------------------------------------------------------------------------
# jax's own shipped TPU Pallas ops (jax.experimental.pallas.ops.tpu), in pltpu's interpret mode
# ------------------------------------------------------------------------------------------


def tpu_interpreted(fn):
    """`fn`, which calls TPU Pallas kernels, with its forward and its backward traced in
    pltpu's interpret mode (which runs them on a CPU): a context around the call alone would
    leave the kernels of the backward, traced later, compiled for a TPU."""
    from jax.experimental.pallas import tpu as pltpu

    @jax.custom_vjp
    def interpreted(*args):
        with pltpu.force_tpu_interpret_mode():
            return fn(*args)

    def forward(*args):
        with pltpu.force_tpu_interpret_mode():
            return jax.vjp(fn, *args)    # the vjp function is a pytree: the residual

    def backward(vjp, ct):
        with pltpu.force_tpu_interpret_mode():
            return vjp(ct)

    interpreted.defvjp(forward, backward)
    return interpreted


def jax_tpu_flash_attention_causal(q, k, v):
    """jax's `pallas.ops.tpu.flash_attention`, causal, blocks of 128 (the smallest it takes:
    a 2 x 2 block grid per head at 256 positions), `[batch, heads, seq, head_dim]`, its own
    Pallas backward."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa
    b = 128
    sizes = fa.BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1,
                          block_q_major_dkv=b, block_k_major_dkv=b, block_k_dkv=b,
                          block_q_dkv=b, block_k_major_dq=b, block_k_dq=b, block_q_dq=b)
    return tpu_interpreted(lambda q, k, v: fa.flash_attention(
        q, k, v, causal=True, sm_scale=1.0 / math.sqrt(q.shape[-1]), block_sizes=sizes))(q, k, v)


GROUP_SIZES = (40, 0, 88, 128)
"""Rows of `jax_tpu_megablox_gmm`'s lhs per group: an empty group, and groups that end inside
the kernel's 128-row tiles."""


def jax_tpu_megablox_gmm(lhs, rhs):
    """jax's `pallas.ops.tpu.megablox.gmm` (the grouped matmul of mixture-of-experts layers):
    row block i of `lhs` times `rhs[i]`, `GROUP_SIZES` rows each, tiles of 128, its own
    Pallas backward (`tgmm` for the rhs)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm
    # a NumPy constant: a jax array made here under a jit would be a tracer that the
    # custom_vjp's closure leaks
    sizes = np.asarray(GROUP_SIZES, np.int32)
    return tpu_interpreted(lambda a, b: gmm(a, b, sizes, tiling=(128, 128, 128)))(lhs, rhs)


def _qkv_bhsd_256(seed):
    return tuple(normal(seed, i, B, H, 256, D) for i in range(3))


def _gmm_args(seed):
    return normal(seed, 0, sum(GROUP_SIZES), 128), normal(seed, 1, len(GROUP_SIZES), 128, 128)


def _qkv_bshd(seed):
    return tuple(normal(seed, i, B, S, H, D) for i in range(3))


def _norm3(seed):
    return (normal(seed, 0, 2, ROWS // 2, N), 1 + 0.1 * normal(seed, 1, N),
            0.1 * normal(seed, 2, N))


def _norm2(seed):
    return (normal(seed, 0, ROWS, N), 1 + 0.1 * normal(seed, 1, N), 0.1 * normal(seed, 2, N))


# ------------------------------------------------------------------------------------------
# optax losses
# ------------------------------------------------------------------------------------------


@jax.jit
def optax_ce_integer(logits, labels):
    """`optax.softmax_cross_entropy_with_integer_labels(...).mean()`: logsumexp minus the label's
    logit (a fused cross-entropy: no log-softmax of the whole row)."""
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@jax.jit
def optax_ce_dense(logits, labels):
    """`optax.softmax_cross_entropy(...).mean()` on label distributions."""
    import optax
    return optax.softmax_cross_entropy(logits, labels).mean()


@jax.jit
def optax_sigmoid_bce(logits, targets):
    """`optax.sigmoid_binary_cross_entropy(...).mean()` (log_sigmoid based)."""
    import optax
    return optax.sigmoid_binary_cross_entropy(logits, targets).mean()


def _ce_integer_args(seed):
    return (2 * normal(seed, 0, BATCH, CLASSES), class_labels(seed, 1, BATCH, CLASSES))


def _ce_dense_args(seed):
    return (2 * normal(seed, 0, BATCH, CLASSES),
            jax.nn.softmax(normal(seed, 1, BATCH, CLASSES), axis=-1))


def _bce_args(seed):
    return (2 * normal(seed, 0, BATCH, CLASSES), uniform(seed, 1, BATCH, CLASSES))


# ------------------------------------------------------------------------------------------
# Flax and Equinox layers
# ------------------------------------------------------------------------------------------


@jax.jit
def flax_attention_causal(q, k, v):
    """`flax.linen.dot_product_attention` with `nn.make_causal_mask` (q scaled by 1/sqrt(d)
    first, masked logits set to the dtype's min)."""
    import flax.linen as nn
    mask = nn.make_causal_mask(jnp.ones(q.shape[:2]))
    return nn.dot_product_attention(q, k, v, mask=mask)


def _eqx_norm(cls, x, scale, bias):
    import equinox as eqx
    norm = cls(x.shape[-1])                   # the default eps, 1e-5
    norm = eqx.tree_at(lambda m: (m.weight, m.bias), norm, (scale, bias))
    return jax.vmap(norm)(x)


@jax.jit
def equinox_layer_norm(x, scale, bias):
    """`equinox.nn.LayerNorm(n)` (eps 1e-5) with the given weight and bias, vmapped over rows."""
    import equinox as eqx
    return _eqx_norm(eqx.nn.LayerNorm, x, scale, bias)


@jax.jit
def equinox_rms_norm(x, scale, bias):
    """`equinox.nn.RMSNorm(n)` (eps 1e-5), vmapped over rows."""
    import equinox as eqx
    return _eqx_norm(eqx.nn.RMSNorm, x, scale, bias)


@jax.jit
def haiku_rms_norm(x, scale, bias):
    """`haiku.RMSNorm(-1, eps=1e-5)` with the given scale (it has no offset: the bias is added
    after it, as a model does)."""
    import haiku as hk
    norm = hk.without_apply_rng(hk.transform(lambda v: hk.RMSNorm(-1, eps=1e-5)(v)))
    return norm.apply({"rms_norm": {"scale": scale}}, x) + bias


@jax.jit
def haiku_layer_norm(x, scale, bias):
    """`haiku.LayerNorm(-1, create_scale=True, create_offset=True, eps=1e-5)` (two-pass
    variance, its default) with the given scale and offset."""
    import haiku as hk
    norm = hk.without_apply_rng(hk.transform(
        lambda v: hk.LayerNorm(-1, create_scale=True, create_offset=True, eps=1e-5)(v)))
    return norm.apply({"layer_norm": {"scale": scale, "offset": bias}}, x)


@jax.jit
def flax_layer_norm(x, scale, bias):
    """`flax.linen.LayerNorm(epsilon=1e-5)` (its one-pass "fast variance", the default) with
    the given scale and bias."""
    import flax.linen as nn
    return nn.LayerNorm(epsilon=1e-5).apply({"params": {"scale": scale, "bias": bias}}, x)


def _norm1(seed):
    return (normal(seed, 0, ROWS, N),)


MHA_SEQ, MHA_DIM, MHA_HEADS = 16, 32, 2


@jax.jit
def equinox_mha_causal(x, wq, wk, wv, wo):
    """`equinox.nn.MultiheadAttention(2, 32)` (bias-free projections) with the given weights,
    self-attention with a causal mask."""
    import equinox as eqx
    mha = eqx.nn.MultiheadAttention(MHA_HEADS, x.shape[-1], key=jax.random.key(0))
    mha = eqx.tree_at(lambda m: (m.query_proj.weight, m.key_proj.weight, m.value_proj.weight,
                                 m.output_proj.weight), mha, (wq, wk, wv, wo))
    return mha(x, x, x, mask=causal_mask(x.shape[0]))


def _mha_args(seed):
    w = lambda i: normal(seed, i, MHA_DIM, MHA_DIM, scale=1 / math.sqrt(MHA_DIM))  # noqa: E731
    return (normal(seed, 0, MHA_SEQ, MHA_DIM), w(1), w(2), w(3), w(4))


@jax.jit
def equinox_rope(x):
    """`equinox.nn.RotaryPositionalEmbedding(d)` on `[seq, d]` (half-split: rotate_half)."""
    import equinox as eqx
    return eqx.nn.RotaryPositionalEmbedding(x.shape[-1])(x)


def _rope_args(seed):
    return (normal(seed, 0, S, MHA_DIM),)


# ------------------------------------------------------------------------------------------
# PyTorch functional ops (through peat.kernels.torch_kernel) and lucidrains' rotary embeddings
# ------------------------------------------------------------------------------------------


def _torch_sdpa_causal(q, k, v):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _torch_layer_norm(x, scale, bias):
    import torch.nn.functional as F
    return F.layer_norm(x, x.shape[-1:], scale, bias)          # torch's default eps, 1e-5


def _torch_gelu(x):
    import torch.nn.functional as F
    return F.gelu(x)                                           # exact (erf) by default


PAD = 0


def _torch_cross_entropy_ignore_pad(logits, labels):
    import torch.nn.functional as F
    return F.cross_entropy(logits, labels.long(), ignore_index=PAD)


def _torch_rope_interleaved(x):
    from rotary_embedding_torch import RotaryEmbedding
    return RotaryEmbedding(dim=x.shape[-1]).rotate_queries_or_keys(x, seq_dim=0)


def _padded_ce_args(seed):
    return (2 * normal(seed, 0, 2 * 12, CLASSES), padded_labels(seed, 1, 2, 12, CLASSES, PAD))


torch_sdpa_causal = peat.kernels.torch_kernel(_torch_sdpa_causal, name="torch_sdpa_causal")
torch_layer_norm = peat.kernels.torch_kernel(_torch_layer_norm, name="torch_layer_norm")
torch_gelu = peat.kernels.torch_kernel(_torch_gelu, name="torch_gelu")
torch_cross_entropy = peat.kernels.torch_kernel(_torch_cross_entropy_ignore_pad,
                                                name="torch_cross_entropy")
torch_rope_interleaved = peat.kernels.torch_kernel(_torch_rope_interleaved,
                                                   name="rotary_embedding_torch")

_NO_LARGE = ("example", "tiny", "subnormal", "zeros", "outliers")


def _activation_args(seed):
    return (2 * normal(seed, 0, ROWS, N),)


def _float16_logits(seed):
    return ((2 * normal(seed, 0, ROWS, 40)).astype(jnp.float16),)


def _images(seed):
    return (normal(seed, 0, 2, 8, 8, 3),)


@jax.jit
def flax_max_pool(x):
    """`flax.linen.max_pool(x, (2, 2), strides=(2, 2))` (lax.reduce_window: a tie's gradient
    goes to one element)."""
    import flax.linen as nn
    return nn.max_pool(x, (2, 2), strides=(2, 2))
_TORCH = ("torch",)
_FAJ = ("flash_attention_jax",)
_HAIKU = ("haiku",)

ENTRIES: tuple[Entry, ...] = (
    Entry("faj_flash_attention", "flash-attention-jax", "correct", faj_flash_attention,
          ref.masked_attention_bhsd, _qkv_mask, "passes",
          "lucidrains' FlashAttention in JAX with a key mask: online softmax, lse-based backward",
          variants=_NO_LARGE, needs=_FAJ,),   # 'large' logits (~1e19) pass its MASK_VALUE -1e10
    Entry("faj_causal_flash_attention", "flash-attention-jax", "correct",
          faj_causal_flash_attention, ref.causal_attention_bhsd, _qkv_bhsd, "passes",
          "lucidrains' causal FlashAttention in JAX (backward from the saved row sum and max)",
          variants=_NO_LARGE, needs=_FAJ),
    Entry("jax_pallas_mha_causal", "jax", "correct", jax_pallas_mha_causal,
          ref.causal_attention_bshd, _qkv_bshd, "passes",
          "jax's shipped Pallas mha (ops.gpu.attention), causal, blocks 16, interpreted",
          needs=(needs.pallas_op("attention"),)),
    Entry("jax_pallas_layer_norm", "jax", "correct", jax_pallas_layer_norm, ref.layer_norm_eps5,
          _norm3, "passes", "jax's shipped Pallas layer_norm (ops.gpu), interpreted",
          needs=(needs.pallas_op("layer_norm"),)),
    Entry("jax_pallas_rms_norm", "jax", "correct", jax_pallas_rms_norm, ref.rms_norm, _norm3,
          "passes", "jax's shipped Pallas rms_norm (ops.gpu), interpreted",
          needs=(needs.pallas_op("rms_norm"),)),
    Entry("jax_tpu_flash_attention_causal", "jax", "correct", jax_tpu_flash_attention_causal,
          ref.causal_attention_bhsd, _qkv_bhsd_256, "passes",
          "jax's shipped TPU Pallas flash_attention (ops.tpu), causal, blocks 128, interpreted"),
    Entry("jax_tpu_megablox_gmm", "jax", "correct", jax_tpu_megablox_gmm,
          lambda lhs, rhs: ref.grouped_matmul(lhs, rhs, GROUP_SIZES), _gmm_args, "passes",
          "jax's shipped TPU Pallas grouped matmul (ops.tpu.megablox.gmm), groups of 40, 0, "
          "88 and 128 rows, interpreted (XLA:CPU sums each 128-term tile in order: a false "
          "alarm on jax 0.12.1 before float32 sums had in-order rounding in the floor)"),
    Entry("jax_nn_sigmoid", "jax", "correct", jax.nn.sigmoid, ref.sigmoid_naive, _activation_args,
          "passes", "jax.nn.sigmoid against 1 / (1 + exp(-x)): its gradient s * (1 - s) is a "
          "few ULPs off at a few elements (cancellation), a right algorithm's rounding"),
    Entry("jax_nn_silu", "jax", "correct", jax.nn.silu, ref.silu_naive, _activation_args,
          "passes", "jax.nn.silu against x / (1 + exp(-x)), whose gradient is NaN (in float64 "
          "too) on large inputs: unjudged there"),
    Entry("jax_nn_softplus", "jax", "correct", jax.nn.softplus, ref.softplus_naive,
          _activation_args, "passes", "jax.nn.softplus against log(1 + exp(x)), inf (in float64 "
          "too) past x = 710: unjudged there"),
    Entry("jax_nn_relu", "jax", "correct", jax.nn.relu, ref.relu_naive, _activation_args,
          "passes", "jax.nn.relu against jnp.maximum(x, 0): at the all-zero inputs their "
          "gradients are 0 and 1/2, both subgradients of the kink"),
    Entry("jax_nn_softmax_float16", "jax", "correct", functools.partial(jax.nn.softmax, axis=-1),
          ref.softmax_naive, _float16_logits, "passes",
          "jax.nn.softmax in float16 against the formula: at logits near 90 a few of the "
          "gradient's subnormals round to 0, within the floor"),
    Entry("flax_max_pool", "flax", "correct", flax_max_pool, ref.max_pool_2x2, _images, "passes",
          "flax.linen.max_pool 2x2 against a reshape-max: on all-zero inputs every window ties, "
          "and each routes the gradient its own way"),
    Entry("optax_ce_integer_labels", "optax", "correct", optax_ce_integer,
          ref.cross_entropy_integer, _ce_integer_args, "passes",
          "optax.softmax_cross_entropy_with_integer_labels, mean: a fused cross-entropy"),
    Entry("optax_ce_dense_labels", "optax", "correct", optax_ce_dense, ref.cross_entropy_dense,
          _ce_dense_args, "passes", "optax.softmax_cross_entropy on label distributions, mean"),
    # the logits' gradient only, as training takes it: its targets' gradient, log_sigmoid(-x) -
    # log_sigmoid(x), cancels to 1 ULP of log 2 where the reference's, -x, is exact (a real
    # loss of precision at small logits, which check_kernel reports when asked to differentiate
    # the targets)
    Entry("optax_sigmoid_bce", "optax", "correct", optax_sigmoid_bce, ref.binary_cross_entropy,
          _bce_args, "passes", "optax.sigmoid_binary_cross_entropy, mean", backward=(0,)),
    Entry("flax_attention_causal", "flax", "correct", flax_attention_causal,
          ref.causal_attention_bshd, _qkv_bshd, "passes",
          "flax.linen.dot_product_attention with a causal mask"),
    Entry("equinox_layer_norm", "equinox", "correct", equinox_layer_norm, ref.layer_norm_eps5,
          _norm2, "passes", "equinox.nn.LayerNorm (eps 1e-5), vmapped over rows"),
    Entry("flax_layer_norm", "flax", "correct", flax_layer_norm, ref.layer_norm_eps5, _norm2,
          "passes", "flax.linen.LayerNorm (eps 1e-5; one-pass variance) with scale and bias: at "
          "inputs near 2**63 its gradient and the reference's lose float32's accuracy alike "
          "(the variance's power -3/2 underflows)"),
    Entry("jax_nn_standardize", "jax", "correct",
          functools.partial(jax.nn.standardize, epsilon=1e-5), ref.standardize, _norm1,
          "passes", "jax.nn.standardize (one-pass variance, rsqrt) against the two-pass "
          "formula: at inputs near 2**63 both gradients lose float32's accuracy, the "
          "reference's by 8% of its scale, jax's by 28%"),
    Entry("haiku_rms_norm", "dm-haiku", "correct", haiku_rms_norm, ref.rms_norm, _norm2,
          "passes", "haiku.RMSNorm (eps 1e-5, rsqrt) with a bias added after it", needs=_HAIKU),
    Entry("haiku_layer_norm", "dm-haiku", "correct", haiku_layer_norm, ref.layer_norm_eps5,
          _norm2, "passes", "haiku.LayerNorm (eps 1e-5, two-pass variance, rsqrt)",
          needs=_HAIKU),
    Entry("equinox_rms_norm", "equinox", "correct", equinox_rms_norm, ref.rms_norm, _norm2,
          "passes", "equinox.nn.RMSNorm (eps 1e-5), vmapped over rows"),
    Entry("equinox_mha_causal", "equinox", "correct", equinox_mha_causal,
          functools.partial(ref.mha_self_attention, heads=MHA_HEADS), _mha_args, "passes",
          "equinox.nn.MultiheadAttention, causal self-attention with its projections",
          variants=_NO_LARGE),   # 'large' x and weights (~4e9 each): logits overflow float32
    Entry("equinox_rope", "equinox", "correct", equinox_rope, ref.rope_half_split, _rope_args,
          "passes", "equinox.nn.RotaryPositionalEmbedding (half-split)"),
    Entry("torch_sdpa_causal", "torch", "correct", torch_sdpa_causal, ref.causal_attention_bhsd,
          _qkv_bhsd, "passes",
          "torch F.scaled_dot_product_attention(is_causal=True), autograd backward",
          needs=_TORCH),
    Entry("torch_layer_norm", "torch", "correct", torch_layer_norm, ref.layer_norm_eps5, _norm2,
          "passes", "torch F.layer_norm (its default eps 1e-5) against eps 1e-5", needs=_TORCH),
    Entry("torch_gelu", "torch", "correct", torch_gelu, ref.gelu_exact,
          lambda seed: (2 * normal(seed, 0, ROWS, N),), "passes", "torch F.gelu (exact, erf)",
          needs=_TORCH),
    Entry("torch_cross_entropy_ignore_pad", "torch", "correct", torch_cross_entropy,
          functools.partial(ref.masked_cross_entropy, pad=PAD), _padded_ce_args, "passes",
          "torch F.cross_entropy(ignore_index=pad), mean over the real tokens", needs=_TORCH),
    Entry("rotary_embedding_torch_interleaved", "rotary-embedding-torch", "correct",
          torch_rope_interleaved, ref.rope_interleaved, _rope_args, "passes",
          "lucidrains' rotary-embedding-torch (interleaved pairs) against interleaved RoPE",
          needs=("torch", "rotary_embedding_torch")),
)
