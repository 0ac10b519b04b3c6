"""The XLA references of the third-party corpus: the math, written out in plain jax.numpy.

Each is dtype-generic (no float32 constants, no casts), so `peat.check_kernel` evaluates it in
float64 for its noise floor. Layouts follow the candidate each one is checked against:
`[batch, heads, seq, head_dim]` for lucidrains' and PyTorch's attention, `[batch, seq, heads,
head_dim]` for jax's Pallas `mha` and Flax's `dot_product_attention`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["attention_bhsd", "attention_bshd", "binary_cross_entropy", "cross_entropy_dense",
           "cross_entropy_integer", "gelu_exact", "gelu_tanh", "layer_norm",
           "masked_attention_bhsd", "masked_cross_entropy", "mha_self_attention", "rms_norm",
           "rope_half_split", "rope_interleaved", "sigmoid_naive", "silu_naive",
           "softplus_naive"]


def _softmax_attention(logits, v_einsum, v, mask=None):
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    return jnp.einsum(v_einsum, jax.nn.softmax(logits, axis=-1), v)


def _causal(n, m):
    """Query i sees keys j <= i + (m - n) (the last query sees every key)."""
    return jnp.arange(n)[:, None] + (m - n) >= jnp.arange(m)[None, :]


def attention_bhsd(q, k, v, causal=False):
    """softmax(q k^T / sqrt(d)) v over `[batch, heads, seq, head_dim]`."""
    logits = jnp.einsum("bhid,bhjd->bhij", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    mask = _causal(q.shape[-2], k.shape[-2]) if causal else None
    return _softmax_attention(logits, "bhij,bhjd->bhid", v, mask)


def causal_attention_bhsd(q, k, v):
    return attention_bhsd(q, k, v, causal=True)


def masked_attention_bhsd(q, k, v, key_mask):
    """Attention over `[batch, heads, seq, head_dim]` with a `[batch, kv_len]` key mask (True:
    attend), as lucidrains' `flash_attention(q, k, v, key_mask)` takes it."""
    logits = jnp.einsum("bhid,bhjd->bhij", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    return _softmax_attention(logits, "bhij,bhjd->bhid", v, key_mask[:, None, None, :])


def attention_bshd(q, k, v, causal=False):
    """softmax(q k^T / sqrt(d)) v over `[batch, seq, heads, head_dim]`."""
    logits = jnp.einsum("bihd,bjhd->bhij", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    mask = _causal(q.shape[1], k.shape[1]) if causal else None
    return _softmax_attention(logits, "bhij,bjhd->bihd", v, mask)


def causal_attention_bshd(q, k, v):
    return attention_bshd(q, k, v, causal=True)


def mha_self_attention(x, wq, wk, wv, wo, heads):
    """Causal multi-head self-attention of `x` `[seq, dim]` with bias-free projections stored
    `[out, in]` (as `equinox.nn.Linear` keeps them)."""
    n = x.shape[0]
    split = lambda w: (x @ w.T).reshape(n, heads, -1)  # noqa: E731
    q, k, v = split(wq), split(wk), split(wv)
    out = attention_bshd(q[None], k[None], v[None], causal=True)[0]
    return out.reshape(n, -1) @ wo.T


def layer_norm(x, scale, bias, eps=1e-6):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis (1e-6: Flax's default
    `epsilon`; torch's and equinox's is 1e-5)."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * scale + bias


def layer_norm_eps5(x, scale, bias):
    return layer_norm(x, scale, bias, eps=1e-5)


def standardize(x, eps=1e-5):
    """(x - mean) / sqrt(var + eps) over the last axis: a layer norm without scale and bias."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps)


def rms_norm(x, scale, bias, eps=1e-5):
    """x / sqrt(mean(x^2) + eps) * scale + bias over the last axis."""
    return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale + bias


def gelu_exact(x):
    """x * Phi(x) with the error function (torch's `F.gelu` default)."""
    return 0.5 * x * (1 + jax.scipy.special.erf(x / jnp.sqrt(2).astype(x.dtype)))


def gelu_tanh(x):
    """The tanh approximation of GELU (Hendrycks & Gimpel)."""
    c = jnp.sqrt(2 / jnp.pi).astype(x.dtype)
    return 0.5 * x * (1 + jnp.tanh(c * (x + 0.044715 * x ** 3)))


def cross_entropy_integer(logits, labels):
    """Mean over the batch of -log softmax(logits)[label], via a one-hot of the labels."""
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return -(onehot * jax.nn.log_softmax(logits, axis=-1)).sum(-1).mean()


def cross_entropy_dense(logits, labels):
    """Mean over the batch of -sum(labels * log softmax(logits)) for label distributions, as
    logsumexp(logits) - <labels, logits> (labels sum to 1)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return (lse * labels.sum(-1) - (labels * logits).sum(-1)).mean()


def masked_cross_entropy(logits, labels, pad=0):
    """Mean over the tokens whose label is not `pad` of -log softmax(logits)[label]."""
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    nll = -(onehot * jax.nn.log_softmax(logits, axis=-1)).sum(-1)
    keep = (labels != pad).astype(logits.dtype)
    return (nll * keep).sum() / keep.sum()


def binary_cross_entropy(logits, targets):
    """Mean of -(y log sigmoid(x) + (1 - y) log(1 - sigmoid(x))), as softplus(x) - x y with
    softplus(x) = logaddexp(x, 0) (stable, and smooth at 0: the form max(x, 0) - x y +
    log1p(exp(-|x|)) has kinks there whose subgradients give a gradient of 0 at x = 0)."""
    return (jnp.logaddexp(logits, 0) - logits * targets).mean()


def _rope_angles(n, d, dtype, theta=10000.0):
    inv = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=dtype) / d)
    return jnp.arange(n, dtype=dtype)[:, None] * inv[None, :]      # [n, d/2]


def rope_half_split(x):
    """Rotary position embedding of `x` `[seq, dim]`, GPT-NeoX / Hugging Face Llama convention:
    dimension i is paired with i + dim/2 (rotate_half)."""
    n, d = x.shape
    ang = _rope_angles(n, d, x.dtype)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[:, : d // 2], x[:, d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_interleaved(x):
    """Rotary position embedding of `x` `[seq, dim]`, RoFormer / GPT-J / Meta's Llama convention:
    dimension 2i is paired with 2i + 1."""
    n, d = x.shape
    ang = _rope_angles(n, d, x.dtype)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[:, 0::2], x[:, 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(n, d)


# The activations as users write their references: the formulas, not the stable forms. Each is
# right where it is finite; past exp's range (|x| ~ 88 in float32, ~ 710 in float64) it is inf
# or NaN where the stable forms of jax.nn are finite and right, and its gradient has no
# cancellation where jax.nn.sigmoid's s * (1 - s) has.


def sigmoid_naive(x):
    return 1 / (1 + jnp.exp(-x))


def relu_naive(x):
    """max(x, 0): its gradient at 0 is 1/2 (jnp.maximum splits a tie), jax.nn.relu's is 0."""
    return jnp.maximum(x, 0)


def max_pool_2x2(x):
    """2x2 max pooling of `[batch, height, width, channels]` as a reshape and a max (a tie's
    gradient split among the tied elements)."""
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def softmax_naive(x):
    e = jnp.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def silu_naive(x):
    return x / (1 + jnp.exp(-x))


def softplus_naive(x):
    return jnp.log(1 + jnp.exp(x))


def grouped_matmul(lhs, rhs, group_sizes):
    """Row block i of `lhs` (`group_sizes[i]` rows, in order) times `rhs[i]`: `[m, k]` by
    `[groups, k, n]` to `[m, n]`."""
    group = jnp.repeat(jnp.arange(len(group_sizes)), jnp.asarray(group_sizes),
                       total_repeat_length=lhs.shape[0])
    return jnp.einsum("mk,mkn->mn", lhs, rhs[group])
