"""Float formats: how each float dtype lays out its bits, stated once.

A `FloatFormat` gives a float dtype's sign, exponent and mantissa fields, its exponent range, and
the integer and float types that carry its bit patterns and its arithmetic. The analyzer, the
faults, the detector and `check_kernel` read the layout from here. Bit positions count from 0, the
least significant bit of the pattern (float32: 31 sign, 23..30 exponent, 0..22 mantissa).

The ULP helpers are integer-only (built from exponent bits, never `log2` / `ldexp`): exact for
subnormals, and fast on XLA:CPU.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax.errors import PeatError

__all__ = [
    "BIT_CLASSES",
    "FloatFormat",
    "TF32",
    "bit_class",
    "bit_classes",
    "float_format",
    "from_bits",
    "to_bits",
    "ulp_at",
    "ulp_of_magnitude",
    "ulp_of_value",
]

BIT_CLASSES: tuple[str, ...] = ("sign", "exponent", "mantissa")
"""The fields of a float's bit pattern, most significant first."""

_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}


class FloatFormat(NamedTuple):
    """The bit layout of a float format.

    Attributes:
      name: the dtype's name ("float32", "bfloat16", ...).
      bits: width of the bit pattern.
      exponent_bits / mantissa_bits: widths of the exponent and (stored) mantissa fields.
      max_exponent: largest unbiased exponent of a finite value.
      min_exponent: smallest unbiased exponent of a normal value.
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max_exponent: int
    min_exponent: int

    @property
    def dtype(self) -> np.dtype:
        return jnp.dtype(self.name)

    @property
    def scalar(self) -> type:
        """The NumPy scalar type (``ml_dtypes.bfloat16`` for bfloat16)."""
        return self.dtype.type

    @property
    def uint(self) -> type:
        """The unsigned integer type of the same width (NumPy scalar type)."""
        return _UINT[self.bits]

    @property
    def wide_uint(self) -> type:
        """Unsigned integer type of at least 32 bits that holds a pattern (uint32 or uint64)."""
        return np.uint64 if self.bits == 64 else np.uint32

    @property
    def wide_int(self) -> type:
        """Signed integer type of at least 32 bits that holds a pattern (int32 or int64)."""
        return np.int64 if self.bits == 64 else np.int32

    @property
    def wide_bits(self) -> int:
        """Width of `wide_uint` / `wide_int`."""
        return 64 if self.bits == 64 else 32

    @property
    def compute_dtype(self) -> type:
        """The float type arithmetic on values of this format is done in (float32, or float64
        for 64-bit formats)."""
        return np.float64 if self.bits == 64 else np.float32

    @property
    def bias(self) -> int:
        """The exponent bias, ``2**(exponent_bits - 1) - 1``."""
        return (1 << (self.exponent_bits - 1)) - 1

    @property
    def sign_bit(self) -> int:
        return self.bits - 1

    @property
    def exponent_mask(self) -> int:
        """The exponent field's bits set (also the pattern of +inf)."""
        return ((1 << self.exponent_bits) - 1) << self.mantissa_bits

    @property
    def mantissa_mask(self) -> int:
        return (1 << self.mantissa_bits) - 1

    @property
    def eps(self) -> float:
        """Machine epsilon, ``2**-mantissa_bits``."""
        return 2.0 ** -self.mantissa_bits

    def bit_range(self, bit_class: Optional[str]) -> tuple[int, int]:
        """Half-open ``(lo, hi)`` bit positions of a field of `BIT_CLASSES` (None: the whole
        pattern)."""
        m, e = self.mantissa_bits, self.exponent_bits
        return {"mantissa": (0, m), "exponent": (m, m + e), "sign": (self.bits - 1, self.bits),
                None: (0, self.bits)}[bit_class]

    def bit_class(self, bit: int) -> str:
        """The field bit position `bit` belongs to: "sign", "exponent" or "mantissa"."""
        if bit == self.sign_bit:
            return "sign"
        return "exponent" if bit >= self.mantissa_bits else "mantissa"


TF32 = FloatFormat("tensorfloat32", bits=19, exponent_bits=8, mantissa_bits=10,
                   max_exponent=127, min_exponent=-126)
"""NVIDIA's TensorFloat-32 (a compute format only: no dtype carries it)."""


@functools.lru_cache(maxsize=None)
def _format_named(name: str) -> FloatFormat:
    dtype = jnp.dtype(name)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise PeatError(f"{name} is not a float dtype")
    fi = jnp.finfo(dtype)
    return FloatFormat(name, bits=int(fi.bits), exponent_bits=int(fi.nexp),
                       mantissa_bits=int(fi.nmant), max_exponent=int(fi.maxexp) - 1,
                       min_exponent=int(fi.minexp))


def float_format(dtype) -> FloatFormat:
    """The `FloatFormat` of a float dtype (a dtype, a dtype's name or a scalar type).

    Raises:
      PeatError: `dtype` is not a float dtype.
    """
    return _format_named(jnp.dtype(dtype).name)


def bit_class(bit: int, dtype) -> str:
    """The field of `dtype`'s bit pattern that position `bit` belongs to: "sign", "exponent" or
    "mantissa"."""
    return float_format(dtype).bit_class(bit)


def bit_classes(dtype) -> list[str]:
    """The field of every bit position of `dtype`'s pattern, position 0 (the LSB) first."""
    f = float_format(dtype)
    return [f.bit_class(b) for b in range(f.bits)]


def to_bits(x):
    """The bit patterns of float array `x`, as the unsigned integer of the same width (jittable)."""
    return lax.bitcast_convert_type(x, float_format(x.dtype).uint)


def from_bits(u, dtype):
    """The floats of `dtype` whose bit patterns are the unsigned integers `u` (jittable)."""
    return lax.bitcast_convert_type(u, dtype)


def ulp_of_magnitude(mag, fmt: FloatFormat):
    """The spacing of `fmt` at values whose magnitude bits (the pattern without its sign) are
    the integers `mag`.

    Returns:
      Floats of ``fmt.compute_dtype``. Spacings below that dtype's smallest normal are clamped to
      it (XLA:CPU treats subnormals as zero in arithmetic anyway).
    """
    cf = float_format(fmt.compute_dtype)
    it = cf.wide_int
    e = jnp.maximum(mag.astype(it) & it(fmt.exponent_mask), it(1 << fmt.mantissa_bits))
    # The compute dtype's exponent field is the value's exponent field shifted and offset.
    offset = (cf.bias - fmt.bias - fmt.mantissa_bits) << cf.mantissa_bits
    field = (e << it(cf.mantissa_bits - fmt.mantissa_bits)) + it(offset)
    field = jnp.clip(field, it(1 << cf.mantissa_bits), it((2 * cf.bias) << cf.mantissa_bits))
    return lax.bitcast_convert_type(field.astype(cf.wide_uint), cf.compute_dtype)


def ulp_at(x: float, fmt: FloatFormat) -> float:
    """The spacing of `fmt` at the (host) value `x`, like `ulp_of_value`: ``2**(max(floor(log2
    |x|), min_exponent) - mantissa_bits)``; the subnormal spacing for 0 and subnormal values.

    Returns:
      A Python float, in the units of `x`.
    """
    e = math.frexp(abs(float(x)))[1] - 1 if x and math.isfinite(x) else fmt.min_exponent
    return math.ldexp(1.0, max(e, fmt.min_exponent) - fmt.mantissa_bits)


def ulp_of_value(r, fmt: FloatFormat):
    """The spacing of `fmt` at the values `r`: ``2**(max(floor(log2|r|), min_exponent) -
    mantissa_bits)`` (the subnormal spacing below the smallest normal).

    Returns:
      float64 (computed from `r` cast to float64; needs `jax.enable_x64` inside jit).
    """
    f64 = float_format(np.float64)
    u = lax.bitcast_convert_type(r.astype(jnp.float64), jnp.uint64)
    mag = (u & np.uint64((1 << f64.sign_bit) - 1)).astype(jnp.int64)
    e = (mag >> np.int64(f64.mantissa_bits)) - f64.bias
    e = jnp.maximum(e, fmt.min_exponent) - fmt.mantissa_bits
    field = (e + f64.bias).astype(jnp.uint64) << np.uint64(f64.mantissa_bits)
    return lax.bitcast_convert_type(field, jnp.float64)
