"""Float formats: one layout per dtype, shared by the analyzer, faults, detector and check."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from peat_jax._src.errors import PeatError
from peat_jax._src.formats import (TF32, bit_class, bit_classes, float_format, from_bits, to_bits,
                                   ulp_of_magnitude, ulp_of_value)


@pytest.mark.parametrize("name, bits, nexp, nmant, uint, scalar", [
    ("float16", 16, 5, 10, np.uint16, np.float16),
    ("bfloat16", 16, 8, 7, np.uint16, ml_dtypes.bfloat16),
    ("float32", 32, 8, 23, np.uint32, np.float32),
    ("float64", 64, 11, 52, np.uint64, np.float64),
])
def test_layout_of_each_dtype(name, bits, nexp, nmant, uint, scalar):
    f = float_format(name)
    assert (f.bits, f.exponent_bits, f.mantissa_bits) == (bits, nexp, nmant)
    assert f.uint is uint and f.scalar is scalar and f.sign_bit == bits - 1
    assert f.bias == f.max_exponent == -f.min_exponent + 1
    assert f.exponent_mask == np.array(np.inf, scalar).view(uint)
    assert f.eps == float(jnp.finfo(name).eps)
    assert float_format(jnp.dtype(name)) is f


def test_bit_classes_cover_the_pattern():
    classes = bit_classes("bfloat16")
    assert classes == ["mantissa"] * 7 + ["exponent"] * 8 + ["sign"]
    assert bit_class(31, jnp.float32) == "sign" and bit_class(23, "float32") == "exponent"
    assert float_format("float32").bit_range("exponent") == (23, 31)
    assert float_format("float16").bit_range(None) == (0, 16)
    assert TF32.mantissa_bits == 10 and TF32.exponent_bits == 8


def test_non_float_dtypes_are_refused():
    with pytest.raises(PeatError, match="not a float"):
        float_format(np.int32)


def test_bits_round_trip_and_ulp_helpers():
    x = np.array([1.0, -2.5, 3e-39, 0.0], np.float32)
    u = to_bits(jnp.asarray(x))
    assert u.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(u), x.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(from_bits(u, jnp.float32)).view(np.uint32),
                                  x.view(np.uint32))
    f = float_format("float32")
    mag = (x.view(np.uint32) & np.uint32(0x7FFFFFFF)).astype(np.int32)
    spacing = np.asarray(ulp_of_magnitude(jnp.asarray(mag), f))
    np.testing.assert_array_equal(spacing[:2], np.spacing(np.abs(x[:2])))
    with jax.enable_x64(True):
        r = jnp.asarray([1.0, 1e-40, 3.0], jnp.float64)
        got = np.asarray(ulp_of_value(r, f))
    np.testing.assert_array_equal(got, [2.0 ** -23, 2.0 ** -149, 2.0 ** -22])


@pytest.mark.parametrize("x, floating, inexact", [
    (np.float32, True, True), ("bfloat16", True, True), (jnp.bfloat16, True, True),
    (ml_dtypes.float8_e4m3fn, True, True), (np.dtype("float64"), True, True),
    (np.complex64, False, True), (np.int32, False, False), (np.bool_, False, False),
    (jax.dtypes.float0, False, False), (None, False, False), ("no such type", False, False),
    (1.5, True, True), (3, False, False),
    (np.zeros((2, 3), np.float16), True, True), (jnp.zeros(2, jnp.int8), False, False),
    (jax.ShapeDtypeStruct((4,), jnp.bfloat16), True, True),
])
def test_is_floating_and_is_inexact_by_dtype_array_and_value(x, floating, inexact):
    from peat_jax._src.formats import is_floating, is_inexact
    assert is_floating(x) is floating and is_inexact(x) is inexact
