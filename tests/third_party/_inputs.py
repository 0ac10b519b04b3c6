"""Seeded inputs for the third-party corpus (each entry's `args(seed)`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["causal_mask", "class_labels", "key_mask", "normal", "padded_labels", "uniform"]


def _key(seed: int, stream: int):
    return jax.random.fold_in(jax.random.key(seed), stream)


def normal(seed: int, stream: int, *shape, scale: float = 1.0):
    """Standard normal float32 (times `scale`), one stream per argument."""
    return scale * jax.random.normal(_key(seed, stream), shape, jnp.float32)


def uniform(seed: int, stream: int, *shape):
    return jax.random.uniform(_key(seed, stream), shape, jnp.float32)


def key_mask(seed: int, stream: int, batch: int, kv_len: int, p: float = 0.75):
    """A `[batch, kv_len]` boolean key mask (True: attend), the first key always kept."""
    m = jax.random.bernoulli(_key(seed, stream), p, (batch, kv_len))
    return m.at[:, 0].set(True)


def class_labels(seed: int, stream: int, n: int, classes: int):
    return jax.random.randint(_key(seed, stream), (n,), 0, classes, jnp.int32)


def padded_labels(seed: int, stream: int, batch: int, seq: int, classes: int, pad: int = 0):
    """`[batch * seq]` token labels in 1..classes-1, each sequence ending in padding (label
    `pad`) after a random length of at least seq // 2."""
    k1, k2 = jax.random.split(_key(seed, stream))
    labels = jax.random.randint(k1, (batch, seq), 1, classes, jnp.int32)
    lengths = jax.random.randint(k2, (batch, 1), seq // 2, seq)
    return jnp.where(jnp.arange(seq)[None, :] < lengths, labels, pad).reshape(-1)


def causal_mask(n: int):
    return jnp.tril(jnp.ones((n, n), bool))
