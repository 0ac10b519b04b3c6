"""Reductions in the forms XLA:CPU runs fast: exact integer sums along an array's last axis
(`row_sums`), several reductions in one pass (`vreduce`), and whole arrays to scalars
(`reduce_all`).

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

`reduce_all` takes the same view a step further for whole arrays: one variadic reduction of the
groups (`vreduce`, every array in one pass), twice, then one of the partials, 64 times fewer.
The site statistics of a float32 output (sum, sum of squares, abs-max, two counts and the
checksum; ten outputs in one program, medians of 300) take 0.15-0.16 ms that way at 262,144
elements against 0.20-0.21 ms as six reductions of their own (XLA:CPU turns each into a tree of
two or three kernels), 0.078-0.080 against 0.084-0.086 ms at 65,536: a `scan` body pays that per
site per iteration.
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


def vreduce(ops: Sequence, kinds: Sequence[str], axes):
    """One variadic reduction ("sum" / "max" / "min" per operand, each in its own dtype) of
    `ops` (all of one shape) over `axes`: a single pass over the data (XLA:CPU vectorises
    multi-operand integer reductions much better than separate ones)."""
    inits = []
    for o, k in zip(ops, kinds):
        dt = o.dtype
        if k == "sum":
            inits.append(jnp.zeros((), dt))
        elif jnp.issubdtype(dt, jnp.floating):
            inits.append(jnp.asarray(-jnp.inf if k == "max" else jnp.inf, dt))
        else:
            ii = jnp.iinfo(dt)
            inits.append(jnp.asarray(ii.min if k == "max" else ii.max, dt))

    def comb(x, y):
        return tuple(a + b if k == "sum" else (jnp.maximum(a, b) if k == "max" else
                                               jnp.minimum(a, b))
                     for a, b, k in zip(x, y, kinds))

    return lax.reduce(tuple(ops), tuple(inits), comb, axes)


def reduce_all(xs: Sequence[jax.Array], kinds: Sequence[str]) -> list[jax.Array]:
    """Each array of `xs` (all of one size; float ones of one dtype) reduced to a scalar in its
    own dtype, "sum" or "max" as `kinds` says: the arrays viewed as [n // (G * W), G, W]
    (`_grouped`) and their groups reduced together in one pass (`vreduce`), twice, then the
    partials, 64 times fewer, in one more. A float maximum is NaN where the array holds a NaN
    (XLA:CPU's single-operand float max, on jax 0.10 and 0.11, skips NaNs from 4096 elements up,
    and can return -inf; its variadic reductions do not). Float sums add in another order than
    `jnp.sum` (equal up to float rounding); integer sums are exact, as `row_sums`'."""
    if len(xs) == 1 and jnp.issubdtype(xs[0].dtype, jnp.floating):
        # alone, XLA:CPU reduces it as one operand (see above): its NaNs counted beside it
        x, k = xs[0], kinds[0]
        out, nans = reduce_all([x, jnp.isnan(x).astype(jnp.int32)], [k, "sum"])
        return [jnp.where(nans > 0, jnp.asarray(jnp.nan, x.dtype), out)]
    parts = [x.reshape(-1) for x in xs]
    for _ in range(2):
        r, g, w = _grouped(parts[0].size)
        if g == 1:
            break
        parts = [p.reshape(-1) for p in lax.optimization_barrier(
            tuple(vreduce([p.reshape(r, g, w) for p in parts], kinds, (1,))))]
    return list(vreduce(parts, kinds, (0,)))


def _grouped(n: int) -> tuple[int, int, int]:
    """(n // (G * W), G, W): G the largest power of two up to `GROUP` that divides `n`, W the
    largest up to `LANES` that divides n // G."""
    g = power_of_two_dividing(n, GROUP)
    w = power_of_two_dividing(n // g, LANES)
    return n // (g * w), g, w


def row_sums(xs: Sequence[jax.Array]) -> list[jax.Array]:
    """Each integer array of `xs` (all of one shape [..., L]) summed over its last axis, in its
    own dtype: [...]."""
    *lead, n = xs[0].shape
    shape = (*lead, *_grouped(n))
    parts = lax.optimization_barrier(
        tuple(jnp.sum(x.reshape(shape), axis=-2, dtype=x.dtype) for x in xs))
    return [jnp.sum(p, axis=(-2, -1), dtype=p.dtype) for p in parts]


def power_of_two_dividing(n: int, most: int) -> int:
    """The largest power of two <= `most` that divides `n` (1 for odd n)."""
    p = most
    while n % p:
        p //= 2
    return p
