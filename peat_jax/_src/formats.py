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

from peat_jax._src.errors import PeatError


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

    def holds_magnitude(self, magnitude: float) -> bool:
        """True when a value of this magnitude is a normal number of the format (neither
        beyond its largest finite value nor below its smallest normal); 0 is held."""
        if magnitude == 0.0:
            return True
        return 2.0 ** self.min_exponent <= magnitude < 2.0 ** (self.max_exponent + 1)

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


def _dtype_of(x):
    """The dtype `x` names or carries: a dtype or scalar type, anything with a ``dtype`` (an
    array, an abstract value), or a Python number (NumPy's type for it)."""
    if isinstance(x, type):     # a scalar type: np.float32 has a `dtype` of its own, unbound
        return x
    if hasattr(x, "dtype"):
        return x.dtype
    if isinstance(x, (bool, int, float, complex)):
        return np.result_type(x)
    return x


def is_floating(x) -> bool:
    """Whether `x` (a dtype, or an array or value with one) is a real floating-point type,
    bfloat16 and the float8 formats included; False for anything else, None included."""
    try:
        return x is not None and bool(jnp.issubdtype(_dtype_of(x), jnp.floating))
    except TypeError:
        return False


def is_inexact(x) -> bool:
    """`is_floating`, complex types included."""
    try:
        return x is not None and bool(jnp.issubdtype(_dtype_of(x), jnp.inexact))
    except TypeError:
        return False


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


def unit_roundoff(dtype) -> float:
    """The unit roundoff u of `dtype`'s format: half an ULP at 1 (float32: 2**-24), relative."""
    return 2.0 ** -(float_format(dtype).mantissa_bits + 1)


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


# ----------------------------------------------------------------------------------------------
# Narrow formats a float32 kernel may compute in (faults emulate them, the detector names them)
# ----------------------------------------------------------------------------------------------

NARROW_FORMATS: dict[str, FloatFormat] = {"tf32": TF32, "bf16": float_format("bfloat16"),
                                          "fp16": float_format("float16")}
"""The narrow formats by short name: TF32 (10 mantissa bits, float32's exponent range),
bfloat16 (7 bits, float32's range) and float16 (10 bits, exponents -14..15)."""

NARROW_ALIASES: dict[str, str] = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                                  "tensorfloat32": "tf32"}
"""Other names accepted for the `NARROW_FORMATS`."""


def already_as_narrow(dtype, name: str) -> bool:
    """True when `dtype` is already as narrow as the narrow format `name`: no more mantissa bits
    and no wider exponent range (rounding to it is then a no-op)."""
    f, target = float_format(dtype), NARROW_FORMATS[name]
    return f.mantissa_bits <= target.mantissa_bits and f.exponent_bits <= target.exponent_bits


def _round_mantissa(x, keep: int):
    """`x` rounded to `keep` mantissa bits, round-to-nearest-even, in `x`'s own exponent range.

    Integer-only on the bit pattern: carries into the exponent (up to inf) as a narrower format
    would; NaN and inf are returned unchanged. Returns `x`'s dtype.
    """
    f = float_format(x.dtype)
    drop = f.mantissa_bits - keep
    if drop <= 0:
        return x
    u = to_bits(x)
    ut = f.uint
    lsb = (u >> ut(drop)) & ut(1)
    rounded = (u + ut((1 << (drop - 1)) - 1) + lsb) & ut(~((1 << drop) - 1) & ((1 << f.bits) - 1))
    special = (u & ut(f.exponent_mask)) == ut(f.exponent_mask)
    return from_bits(jnp.where(special, u, rounded), x.dtype)


ROUNDING_MODES = ("nearest", "toward_zero")
"""How `round_to_format` rounds: to nearest, ties to even (a cast), or toward zero (the
mantissa's low bits dropped: what some tensor-core input conversions do)."""


def round_to_format(x, name: str, mode: str = "nearest"):
    """`x` rounded to the narrow format `name` (a key of `NARROW_FORMATS`), to nearest even or,
    with ``mode="toward_zero"``, by dropping the low mantissa bits (tf32 and bf16 only; fp16
    rounds to nearest) (jittable; not differentiable: its gradient is zero).

    "tf32" / "bf16": mantissa rounded to 10 / 7 bits keeping `x`'s exponent range (for float32
    that is exactly the TF32 / bfloat16 range). "fp16": a round trip through float16 (its range
    too: overflow to inf, float16 subnormals).

    Returns:
      An array of `x`'s dtype; `x` itself when its dtype is already that narrow.
    """
    if already_as_narrow(x.dtype, name):
        return x
    if mode not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding mode {mode!r}; modes are {', '.join(ROUNDING_MODES)}")
    if name == "fp16":
        return x.astype(jnp.float16).astype(x.dtype)
    if mode == "toward_zero":
        return _truncate_mantissa(x, NARROW_FORMATS[name].mantissa_bits)
    return _round_mantissa(x, NARROW_FORMATS[name].mantissa_bits)


def _truncate_mantissa(x, keep: int):
    """`x` with its mantissa cut to `keep` bits (rounded toward zero); NaN and inf unchanged."""
    f = float_format(x.dtype)
    drop = f.mantissa_bits - keep
    if drop <= 0:
        return x
    u = to_bits(x)
    ut = f.uint
    cut = u & ut(~((1 << drop) - 1) & ((1 << f.bits) - 1))
    special = (u & ut(f.exponent_mask)) == ut(f.exponent_mask)
    return from_bits(jnp.where(special, u, cut), x.dtype)


def narrow_formats_like(mantissa_bits: float, *, tolerance: float = 1.0,
                        magnitudes: tuple[float, ...] = ()) -> tuple[str, ...]:
    """The `NARROW_FORMATS` a result with about `mantissa_bits` effective mantissa bits may have
    been computed in: those whose mantissa is within `tolerance` bits of it, and whose exponent
    range holds every one of `magnitudes` (values the narrow computation kept finite and
    accurate: a value float16 cannot hold rules float16 out).

    Returns:
      Short names, narrowest exponent range last ("tf32", "fp16"); empty when none fits.
    """
    return tuple(name for name, f in NARROW_FORMATS.items()
                 if abs(f.mantissa_bits - mantissa_bits) <= tolerance
                 and all(f.holds_magnitude(m) for m in magnitudes))
