"""Device side: integer-only views of float arrays (bit fields, the monotonic line, sort keys).

Every bit test of the analyzer is an integer operation on bit patterns, never a float compare: on
XLA:CPU a jitted float compare treats subnormals as zero. The **monotonic line** maps ``+x`` to
its magnitude bits and ``-x`` to minus them (``+0`` and ``-0`` both map to 0); the ULP distance
of two floats is the distance of their points on it.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax._src.formats import FloatFormat, float_format, to_bits


F32 = float_format(np.float32)


class Operand(NamedTuple):
    """An input seen two ways: its values (for float arithmetic) and its bit patterns (native
    unsigned, exact, for every bit test).

    The analyzer bitcasts where bits are used, so each fused computation reads the input once
    (bits materialized as a separate array cost two extra passes on XLA:CPU), except after a
    gather, where the gathered bits are kept: XLA:CPU gathers and selects bfloat16 values through
    float32, which quiets signalling NaNs (changing their bits).
    """

    vals: Any
    gathered_bits: Any = None
    fmt: Any = None

    @property
    def bits(self):
        if self.gathered_bits is not None:
            return self.gathered_bits
        return to_bits(self.vals)

    @property
    def shape(self):
        return self.vals.shape

    @property
    def size(self):
        return self.vals.size

    @property
    def ndim(self):
        return self.vals.ndim

    def reshape(self, *shape) -> "Operand":
        gb = None if self.gathered_bits is None else self.gathered_bits.reshape(*shape)
        return Operand(self.vals.reshape(*shape), gb, self.fmt)

    def swapaxes(self, a: int, b: int) -> "Operand":
        gb = None if self.gathered_bits is None else jnp.swapaxes(self.gathered_bits, a, b)
        return Operand(jnp.swapaxes(self.vals, a, b), gb, self.fmt)

    def take(self, idx) -> "Operand":
        """Flat elements `idx` (all of them when idx is None)."""
        return Operand(take(self.vals, idx), take(self.bits, idx), self.fmt)

    def sub(self, index) -> "Operand":
        """The elements at basic index `index` (slices), values and bits alike."""
        gb = None if self.gathered_bits is None else self.gathered_bits[index]
        return Operand(self.vals[index], gb, self.fmt)

    def rows(self, rows) -> "Operand":
        """Rows `rows` of a 2-D operand."""
        return Operand(self.vals[rows], self.bits[rows], self.fmt)


def take(x, idx):
    """Flat elements `idx` of an array or `Operand` (all of them when idx is None)."""
    if isinstance(x, Operand):
        return x.take(idx)
    flat = x.reshape(-1)
    return flat if idx is None else flat[jnp.asarray(idx, jnp.int32)]


def operand_of_bits(u, f: FloatFormat) -> Operand:
    """The `Operand` of native unsigned bit patterns `u`."""
    return Operand(lax.bitcast_convert_type(u, f.dtype), u, f)


def values(x, f: FloatFormat):
    """Float values (compute dtype) of an `Operand` or of native unsigned bit patterns."""
    if isinstance(x, Operand):
        return x.vals.astype(f.compute_dtype)
    return lax.bitcast_convert_type(x, f.dtype).astype(f.compute_dtype)


class Decoded(NamedTuple):
    """Bit fields of an array (all integer; patterns widened to `FloatFormat.wide_uint`)."""

    pattern: Any
    negative: Any       # sign bit set
    exponent: Any       # biased exponent field
    mantissa: Any       # mantissa field
    mono: Any           # position on the monotonic line
    nonfinite: Any
    nan: Any
    zero: Any           # +0 or -0
    subnormal: Any


def decode(x, f: FloatFormat) -> Decoded:
    """Bit fields of `x`: an `Operand`, native unsigned bit patterns, or floats of format `f`."""
    if isinstance(x, Operand):
        x = x.bits
    if not jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        x = to_bits(x)
    ut, it = f.wide_uint, f.wide_int
    u = x.astype(ut)
    mag = (u & ut((1 << f.sign_bit) - 1)).astype(it)
    negative = (u >> ut(f.sign_bit)) != ut(0)
    zero = mag == it(0)
    # Class tests as magnitude compares (fewer operations per element than field extraction).
    inf_bits = it(f.exponent_mask)
    return Decoded(pattern=u, negative=negative, exponent=mag >> it(f.mantissa_bits),
                   mantissa=mag & it(f.mantissa_mask), mono=jnp.where(negative, -mag, mag),
                   nonfinite=mag >= inf_bits, nan=mag > inf_bits, zero=zero,
                   subnormal=(mag < it(1 << f.mantissa_bits)) & ~zero)


def ulp_distance(dc: Decoded, dg: Decoded, f: FloatFormat):
    """|mono_c - mono_g| on the monotonic line, unsigned (`wide_uint`): the difference of the
    magnitudes for equal signs, their sum for opposite signs (fits: each magnitude is below
    2**(bits-1))."""
    mc, mg = jnp.abs(dc.mono), jnp.abs(dg.mono)
    ut = f.wide_uint
    same = dc.negative == dg.negative
    return jnp.where(same, jnp.abs(mc - mg).astype(ut), mc.astype(ut) + mg.astype(ut))


def bit_length(d, f: FloatFormat):
    """Number of significant bits of unsigned integers `d` (0 for 0): the log2 ULP bucket."""
    return (f.wide_bits - lax.clz(d)).astype(jnp.int32)


def from_monotonic(mono, f: FloatFormat):
    """Inverse of the monotonic map: native unsigned bit patterns."""
    ut = f.wide_uint
    mag = jnp.abs(mono).astype(ut)
    return jnp.where(mono < 0, mag | ut(1 << f.sign_bit), mag).astype(f.uint)


def nonneg_key(v, valid):
    """int32 sort key of non-negative floats (their float32 bit patterns are monotonic); invalid
    and NaN values sort last."""
    v32 = jnp.where(valid, v.astype(jnp.float32), jnp.inf)
    v32 = jnp.where(jnp.isnan(v32), jnp.inf, v32)
    return lax.bitcast_convert_type(v32, jnp.int32)


def signed_key(v, valid):
    """int32 sort key of float32 values on the monotonic line; invalid and NaN sort last."""
    d = decode(v.astype(jnp.float32), F32)
    return jnp.where(valid & ~d.nan, d.mono, jnp.iinfo(jnp.int32).max)


def ranks(n, qs, size: int, xp: Any = jnp):
    """Nearest-rank positions (int32) of quantiles `qs` among `n` sorted valid values (of
    `size`), in float32 arithmetic: `xp` is `jax.numpy` on the device (`n` may be traced) or
    `numpy` on the host (`quantiles`), which then give the same positions."""
    pos = xp.ceil(xp.asarray(qs, xp.float32) * xp.asarray(n).astype(xp.float32)).astype(xp.int32)
    return xp.clip(pos - 1, 0, size - 1)
