"""Counter-based uniforms: an integer hash of each element's flat index and a seed.

Jittable, the same draws on every backend, and a few integer operations per element, so cheap
to compile where a program draws many times (`jax.random`'s threefry is not: an attention
backward under Monte Carlo arithmetic draws a hundred-odd times per sample, and its threefry
rounds made that program 5x slower to compile and 3x slower to run on XLA:CPU).

Two widths, for two callers:

* 32 bits (`mix32`, `uniforms32`): MurmurHash3's finaliser, uniforms on a grid of 2^-23; no
  64-bit types, so it runs inside a training step traced without x64 (the rounding
  pseudo-errors of `profiler.effect`).
* 64 bits (`mix64`, `substream`, `uniforms64`): SplitMix64 (Steele, Lea and Flood 2014),
  float64 uniforms; needs x64 (the Monte Carlo arithmetic of `judge.rounding`, which
  evaluates in float64).
"""
from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
from jax import lax

_GOLDEN32 = 0x9E3779B1
_GOLDEN64 = 0x9E3779B97F4A7C15
"""2**32 and 2**64 over the golden ratio (odd): SplitMix64's increment and its 32-bit kin."""


def mix32(h) -> Any:
    """MurmurHash3's 32-bit finaliser (uint32 in, uint32 out)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def uniforms32(seed, shape, dtype) -> Any:
    """Uniforms in [-1, 1) on a grid of 2^-23, of `shape` and float `dtype` (float32 or
    wider), one per element: `mix32` of the element's flat index times `_GOLDEN32`, XOR the
    uint32 `seed` (may be traced)."""
    i = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
    h = mix32(i * jnp.uint32(_GOLDEN32) ^ jnp.asarray(seed).astype(jnp.uint32))
    return (h >> 8).astype(dtype) * jnp.asarray(2.0 ** -23, dtype) - jnp.asarray(1.0, dtype)


def mix64(z) -> Any:
    """SplitMix64's finaliser: a bijection of uint64 whose outputs on consecutive inputs pass
    BigCrush."""
    z = (z ^ (z >> jnp.uint64(30))) * jnp.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> jnp.uint64(27))) * jnp.uint64(0x94D049BB133111EB)
    return z ^ (z >> jnp.uint64(31))


def substream(stream, n) -> Any:
    """The uint64 stream numbered `n` (an int, or a traced non-negative integer: a loop's
    index) within the uint64 `stream`."""
    return mix64(stream + jnp.asarray(n).astype(jnp.uint64) * jnp.uint64(_GOLDEN64))


def uniforms64(stream, shape) -> Any:
    """float64 uniforms in [-1, 1) of `shape`, one per element, from the uint64 `stream`:
    SplitMix64 over the element's flat index."""
    index = lax.iota(jnp.uint64, math.prod(shape)).reshape(shape)
    z = mix64(stream + (index + jnp.uint64(1)) * jnp.uint64(_GOLDEN64))
    return (z >> jnp.uint64(11)).astype(jnp.float64) * 2.0 ** -52 - 1.0
