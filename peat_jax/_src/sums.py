"""Exact integer sums along an array's last axis, in the form XLA:CPU runs fast.

XLA:CPU turns a long integer reduction into a tree of windowed reductions over a full-size
temporary of what it sums (the masks, the weighted bit patterns): 0.13 ms for 262,144 elements,
about four float sums, and twice the input's bytes of scratch memory. `row_sums` views the last
axis as [L // (G * W), G, W] (G the largest power of two up to `GROUP` that divides L, W the
largest up to `LANES` that divides L // G), sums the G elements of each lane first (short
enough to stay one fused pass over the input, with nothing of its size written), and the
partials, G times fewer, after an optimization barrier, which keeps XLA from merging the two
sums back into one long reduction: 0.02 ms. Integer sums are exact in any order (unsigned ones
modulo 2**bits), so the result is the plain sum's, bit for bit. Used by the site statistics and
the analyzer's sample.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

LANES = 256
"""Widest minor axis of the view `row_sums` reduces in groups."""

GROUP = 8
"""Most elements per lane that each partial sum of `row_sums` adds."""


def row_sums(xs: Sequence[jax.Array]) -> list[jax.Array]:
    """Each integer array of `xs` (all of one shape [..., L]) summed over its last axis, in its
    own dtype: [...]."""
    *lead, n = xs[0].shape
    g = power_of_two_dividing(n, GROUP)
    w = power_of_two_dividing(n // g, LANES)
    shape = (*lead, n // (g * w), g, w)
    parts = lax.optimization_barrier(
        tuple(jnp.sum(x.reshape(shape), axis=-2, dtype=x.dtype) for x in xs))
    return [jnp.sum(p, axis=(-2, -1), dtype=p.dtype) for p in parts]


def power_of_two_dividing(n: int, most: int) -> int:
    """The largest power of two <= `most` that divides `n` (1 for odd n)."""
    p = most
    while n % p:
        p //= 2
    return p
