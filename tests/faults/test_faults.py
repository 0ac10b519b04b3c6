"""Behaviour of the fault library: each fault produces exactly its pattern, seeded and jittable."""
from __future__ import annotations

import json
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from peat_jax._src import faults as F

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SHAPES = [(8,), (4, 6), (2, 3, 5), (33, 17)]
# every dtype and every shape, without the full product (each new (dtype, shape) costs compiles)
CASES = [(jnp.float32, (8,)), (jnp.bfloat16, (4, 6)), (jnp.float16, (2, 3, 5)),
         (jnp.float32, (33, 17)), (jnp.bfloat16, (33, 17)), (jnp.float16, (33, 17))]
# (sign, top exponent, lowest exponent, top mantissa, lowest mantissa) bit per dtype
BITS = {
    jnp.float32: (31, 30, 23, 22, 0),
    jnp.bfloat16: (15, 14, 7, 6, 0),
    jnp.float16: (15, 14, 10, 9, 0),
}
CLASS_RANGES = {
    jnp.float32: {"sign": (31, 32), "exponent": (23, 31), "mantissa": (0, 23)},
    jnp.bfloat16: {"sign": (15, 16), "exponent": (7, 15), "mantissa": (0, 7)},
    jnp.float16: {"sign": (15, 16), "exponent": (10, 15), "mantissa": (0, 10)},
}


class Site(NamedTuple):
    primitive: str
    params: dict
    out_shapes: tuple
    out_dtypes: tuple
    in_shapes: tuple
    in_dtypes: tuple


def ident(x):
    # no arithmetic: XLA:CPU flushes subnormals in an eager `x + 0`
    return jnp.asarray(x)


def data(shape, dtype=jnp.float32, seed=0):
    """Values with |x| in [0.5, 4) and random signs: no zeros, exactly representable after cast."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.5, 4.0, shape) * rng.choice([-1.0, 1.0], shape)
    return jnp.asarray(np.asarray(x, np.float32).astype(jnp.dtype(dtype)))


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]).astype(np.uint64)


def run(fault, x, seed=0, site=None, reference=ident):
    return fault(reference, (x,), jax.random.key(seed), site)


def dot_site(lhs, rhs, dn):
    out = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), lhs, rhs)
    return Site("dot_general", {"dimension_numbers": dn, "precision": None,
                                "preferred_element_type": None},
                (out.shape,), (out.dtype,), (lhs.shape, rhs.shape), (lhs.dtype, rhs.dtype))


MATMUL_DN = (((1,), (0,)), ((), ()))


def matmul(a, b):
    return lax.dot_general(a, b, MATMUL_DN)


# ----------------------------------------------------------------------------------------------
# bit flips
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bit_flip_flips_exactly_one_bit_of_one_element(dtype, shape):
    x = data(shape, dtype)
    n = math.prod(shape)
    for bit, index in zip(BITS[dtype], (0, n - 1, -1, n // 2, None)):
        out = run(F.bit_flip(bit, index=index, seed=bit), x, seed=bit)
        assert out.shape == x.shape and out.dtype == x.dtype
        diff = (bits(out) ^ bits(x)).reshape(-1)
        where = np.flatnonzero(diff)
        assert len(where) == 1
        assert diff[where[0]] == 1 << bit
        if index is not None:
            assert where[0] == index % n


def test_bit_flip_multi_dimensional_index():
    x = data((2, 3, 5))
    out = run(F.bit_flip(3, index=(1, 2, 4)), x)
    diff = bits(out) ^ bits(x)
    assert np.argwhere(diff).tolist() == [[1, 2, 4]]
    assert diff[1, 2, 4] == 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bit_class", ["sign", "exponent", "mantissa", None])
def test_bit_flip_class_picks_a_seeded_bit_of_that_class(dtype, bit_class):
    x = data((33, 17), dtype)
    lo, hi = CLASS_RANGES[dtype].get(bit_class, (0, 16 if dtype != jnp.float32 else 32))
    seen = set()
    for seed in range(8):
        diff = (bits(run(F.bit_flip(bit_class=bit_class), x, seed=seed)) ^ bits(x)).reshape(-1)
        (where,) = np.flatnonzero(diff)
        b = int(diff[where]).bit_length() - 1
        assert diff[where] == 1 << b and lo <= b < hi
        seen.add(b)
    if hi - lo > 4:
        assert len(seen) > 1


def test_bit_flip_bit_outside_dtype_is_a_clear_error():
    f = F.bit_flip(20)
    assert f.supports(Site("exp", {}, ((4,),), (jnp.float32,), ((4,),), (jnp.float32,))) is None
    reason = f.supports(Site("exp", {}, ((4,),), (jnp.bfloat16,), ((4,),), (jnp.bfloat16,)))
    assert "bit 20" in reason and "bfloat16" in reason
    with pytest.raises(ValueError, match="bit 20"):
        run(f, data((4,), jnp.bfloat16))
    with pytest.raises(ValueError, match="out of range"):
        run(F.bit_flip(1, index=8), data((8,)))
    with pytest.raises(ValueError, match="dims"):
        run(F.bit_flip(1, index=(0, 0)), data((8,)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_bit_flip_flips_n_distinct_bits_of_one_element(dtype):
    x = data((4, 6), dtype)
    for seed, n_bits in [(0, 2), (1, 3), (2, 5)]:
        diff = (bits(run(F.multi_bit_flip(n_bits=n_bits), x, seed=seed)) ^ bits(x)).reshape(-1)
        (where,) = np.flatnonzero(diff)
        assert bin(int(diff[where])).count("1") == n_bits
    diff = (bits(run(F.multi_bit_flip((0, 3, 9), index=5), x)) ^ bits(x)).reshape(-1)
    assert np.flatnonzero(diff).tolist() == [5] and diff[5] == 1 + 8 + 512


# ----------------------------------------------------------------------------------------------
# value faults
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8,), (33, 17)])
def test_random_value_replaces_exactly_count_elements(dtype, shape):
    x = data(shape, dtype)
    count = min(5, math.prod(shape))
    out = np.asarray(run(F.random_value(count=count), x), np.float32)
    ref = np.asarray(x, np.float32)
    changed = out != ref
    assert changed.sum() == count
    assert np.all(np.abs(out) <= 4 * np.abs(ref).max() * 1.01)
    small = np.asarray(run(F.random_value(count=count, scale=0.25), x, seed=1), np.float32)
    assert (small != ref).sum() == count and np.all(np.abs(small[small != ref]) <= 0.25)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_random_value_always_differs_even_where_draws_would_collide(dtype):
    x = jnp.zeros((64,), dtype)
    for scale in (None, 1e-30):  # float16 rounds every draw of +-1e-30 back to 0
        out = run(F.random_value(count=64, scale=scale), x)
        assert np.all(bits(out) != bits(x))
        if scale is None:
            assert np.all(np.asarray(out, np.float32) != 0)


@pytest.mark.parametrize("dtype,shape", CASES)
@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_zero_zeroes_exactly_round_fraction_n(dtype, shape, fraction):
    x = data(shape, dtype)
    out = run(F.zeroed(fraction), x)
    n = math.prod(shape)
    zeros = bits(out) == 0
    assert zeros.sum() == round(fraction * n)
    np.testing.assert_array_equal(bits(out)[~zeros], bits(x)[~zeros])


def test_zero_fraction_zero_is_a_noop_with_a_reason():
    x = data((4, 6))
    np.testing.assert_array_equal(bits(run(F.zeroed(0.0), x)), bits(x))
    assert "selects no element" in F.zeroed(0.0).supports(
        Site("exp", {}, ((4, 6),), (jnp.float32,), ((4, 6),), (jnp.float32,)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_stuck_at_forces_the_bit_in_the_selected_elements(dtype):
    rng = np.random.default_rng(0)
    # dyadic values: the lowest mantissa bit is 0 everywhere
    x = rng.choice([-3.0, -1.5, -0.75, 1.0, 2.0, 1.5], (33, 17))
    x = jnp.asarray(x.astype(jnp.dtype(dtype)))
    n = x.size
    out = run(F.stuck_at(0, 1, fraction=0.5), x)
    diff = bits(out) ^ bits(x)
    assert (diff != 0).sum() == round(0.5 * n) and set(np.unique(diff)) == {0, 1}
    sign = BITS[dtype][0]
    out = run(F.stuck_at(sign, 0), x)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.abs(np.asarray(x, np.float32)))


@pytest.mark.parametrize("dtype,shape", CASES)
def test_scale_is_an_exact_ratio(dtype, shape):
    x = data(shape, dtype)
    for factor in (2.0, 0.5, -4.0):
        out = run(F.wrong_scale(factor), x)
        assert out.dtype == x.dtype
        ratio = np.asarray(out, np.float32) / np.asarray(x, np.float32)
        np.testing.assert_array_equal(ratio, factor)
    out = run(F.wrong_scale(3.0), x)
    expect = np.asarray(x) * np.asarray(3.0, jnp.dtype(dtype))  # numpy product in the dtype
    np.testing.assert_array_equal(bits(out), bits(expect))


@pytest.mark.parametrize("dtype,shape", CASES)
@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_sign_flip_negates_exactly_that_many(dtype, shape, fraction):
    x = data(shape, dtype)
    out = run(F.sign_flip(fraction), x)
    diff = bits(out) ^ bits(x)
    sign = 1 << BITS[dtype][0]
    assert (diff == sign).sum() == round(fraction * x.size)
    assert set(np.unique(diff)) <= {0, sign}


def test_sign_flip_is_exact_on_subnormals():
    x = jnp.asarray(np.array([1e-40, -3e-42, 1e-45, 2.0], np.float32))
    for out in (run(F.sign_flip(), x), jax.jit(lambda a: run(F.sign_flip(), a))(x)):
        np.testing.assert_array_equal(bits(out) ^ bits(x), 1 << 31)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_counts(dtype):
    x = data((33, 17), dtype)
    out = np.asarray(run(F.nan_inf("nan", count=3), x), np.float32)
    keep = ~np.isnan(out)
    assert keep.sum() == x.size - 3 and np.all(out[keep] == np.asarray(x, np.float32)[keep])
    out = np.asarray(run(F.nan_inf("inf", count=4), x), np.float32)
    assert (out == np.inf).sum() == 4 and np.isfinite(out).sum() == x.size - 4
    out = np.asarray(run(F.nan_inf("-inf", index=(2, 3)), x), np.float32)
    assert np.argwhere(~np.isfinite(out)).tolist() == [[2, 3]] and out[2, 3] == -np.inf


# ----------------------------------------------------------------------------------------------
# precision
# ----------------------------------------------------------------------------------------------

def _awkward_f32():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(500) * np.exp2(rng.integers(-140, 120, 500))).astype(np.float32)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, -2.5e-39,
                         1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9], np.float32)
    return jnp.asarray(np.concatenate([x, specials]))


def test_truncate_bf16_output_rounds_every_element_like_bfloat16():
    x = _awkward_f32()
    f = F.reduced_precision("bf16", where="output")
    expect = np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)
    for out in (run(f, x), jax.jit(lambda v: run(f, v))(x)):
        assert out.dtype == jnp.float32
        np.testing.assert_array_equal(bits(out), bits(expect))


def test_truncate_tf32_output_rounds_to_11_significant_bits_half_to_even():
    x = np.asarray(data((200,)), np.float64) * np.exp2(np.arange(200) % 40 - 20)
    x = jnp.asarray(x.astype(np.float32))
    out = np.asarray(run(F.reduced_precision("tf32", where="output"), x), np.float64)
    xd = np.asarray(x, np.float64)
    q = np.exp2(np.floor(np.log2(np.abs(xd))) - 10)
    np.testing.assert_array_equal(out, np.round(xd / q) * q)


def test_truncate_fp16_output_rounds_through_float16():
    x = _awkward_f32()
    f = F.reduced_precision("fp16", where="output")
    with np.errstate(over="ignore"):
        expect = np.asarray(x).astype(np.float16).astype(np.float32)
    for out in (run(f, x), jax.jit(lambda v: run(f, v))(x)):
        np.testing.assert_array_equal(bits(out), bits(expect))


@pytest.mark.parametrize("precision,np_dtype", [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)])
def test_truncate_inputs_rounds_operands_before_the_op(precision, np_dtype):
    a, b = data((4, 6), seed=1) / 3, data((6, 3), seed=2) / 7
    out = F.reduced_precision(precision)(matmul, (a, b), jax.random.key(0))
    ra, rb = (jnp.asarray(np.asarray(v).astype(np_dtype).astype(np.float32)) for v in (a, b))
    np.testing.assert_array_equal(bits(out), bits(matmul(ra, rb)))
    assert not np.array_equal(bits(out), bits(matmul(a, b)))


def test_truncate_is_a_noop_when_already_narrow():
    x = data((4, 6), jnp.bfloat16) / 3
    site = Site("exp", {}, ((4, 6),), (jnp.bfloat16,), ((4, 6),), (jnp.bfloat16,))
    for precision in ("bf16", "tf32"):
        for where in ("inputs", "output"):
            f = F.reduced_precision(precision, where=where)
            np.testing.assert_array_equal(bits(run(f, x)), bits(x))
            assert "no-op" in f.supports(site)
    h = data((64,), jnp.float16) / 3
    out = run(F.reduced_precision("bf16", where="output"), h)
    assert np.all(bits(out) & 0b111 == 0) and not np.array_equal(bits(out), bits(h))


# ----------------------------------------------------------------------------------------------
# low-precision accumulation
# ----------------------------------------------------------------------------------------------

def test_low_precision_accumulation_on_a_long_dot_has_larger_error():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.uniform(0, 1, (4, 2048)).astype(np.float32))
    b = jnp.asarray(rng.uniform(0, 1, (2048, 3)).astype(np.float32))
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    site = dot_site(a, b, MATMUL_DN)
    ref = matmul(a, b)
    out = jax.jit(lambda a, b: F.low_precision_accumulation("bf16", chunk=8)(
        matmul, (a, b), jax.random.key(0), site))(a, b)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err_ref = np.max(np.abs(np.asarray(ref) - exact) / exact)
    err_lpa = np.max(np.abs(np.asarray(out) - exact) / exact)
    assert err_lpa > 100 * err_ref and err_lpa > 1e-3
    assert np.all(np.asarray(out) != np.asarray(ref))


def _simulate(partials, to):
    acc = np.float32(0)
    for p in partials:
        acc = np.float32(acc + p).astype(to).astype(np.float32)
    return acc


def test_low_precision_accumulation_reduce_sum_matches_a_sequential_simulation():
    rng = np.random.default_rng(1)
    x = rng.integers(1, 9, (3, 1003)).astype(np.float32)  # partial sums are exact integers
    site = Site("reduce_sum", {"axes": (1,), "out_sharding": None}, ((3,),), (jnp.float32,),
                ((3, 1003),), (jnp.float32,))
    ref = lambda v: jnp.sum(v, axis=1)
    out = F.low_precision_accumulation("bf16", chunk=16)(ref, (jnp.asarray(x),), None, site)
    expect = [_simulate([x[r, s:s + 16].sum() for s in range(0, 1003, 16)], ml_dtypes.bfloat16)
              for r in range(3)]
    np.testing.assert_array_equal(np.asarray(out), np.array(expect, np.float32))
    assert not np.array_equal(np.asarray(out), x.sum(axis=1))


def test_low_precision_accumulation_dot_uses_the_site_contracting_dims():
    rng = np.random.default_rng(2)
    a = rng.integers(0, 8, (203, 5)).astype(np.float32)   # contract lhs dim 0 with rhs dim 0
    b = rng.integers(0, 8, (203, 4)).astype(np.float32)
    dn = (((0,), (0,)), ((), ()))
    ref = lambda u, v: lax.dot_general(u, v, dn)
    site = dot_site(jnp.asarray(a), jnp.asarray(b), dn)
    out = F.low_precision_accumulation("fp16", chunk=10)(ref, (jnp.asarray(a), jnp.asarray(b)),
                                                         jax.random.key(0), site)
    expect = np.empty((5, 4), np.float32)
    for i in range(5):
        for j in range(4):
            expect[i, j] = _simulate([a[s:s + 10, i] @ b[s:s + 10, j] for s in range(0, 203, 10)],
                                     np.float16)
    np.testing.assert_array_equal(np.asarray(out), expect)
    assert not np.array_equal(expect, a.T @ b)


def test_low_precision_accumulation_supports_only_reductions_with_a_site():
    f = F.low_precision_accumulation()
    assert "site is None" in f.supports(None)
    assert "'exp'" in f.supports(Site("exp", {}, ((4,),), (jnp.float32,), ((4,),), (jnp.float32,)))
    a, b = data((4, 6)), data((6, 3))
    assert f.supports(dot_site(a, b, MATMUL_DN)) is None
    outer = (((), ()), ((), ()))
    assert "no contracting" in f.supports(dot_site(data((4,)), data((3,)), outer))
    with pytest.raises(ValueError, match="site is None"):
        f(matmul, (a, b), jax.random.key(0))


# ----------------------------------------------------------------------------------------------
# layout faults
# ----------------------------------------------------------------------------------------------

def _changed_along(out, ref, axis):
    diff = np.asarray(bits(out) != bits(ref))
    other = tuple(i for i in range(diff.ndim) if i != axis % diff.ndim)
    return diff, np.flatnonzero(diff.any(axis=other))


@pytest.mark.parametrize("dtype,shape,axis,mode,expected", [
    (jnp.float32, (3, 70), -1, "garbage", list(range(64, 70))),
    (jnp.bfloat16, (3, 70), -1, "garbage", list(range(64, 70))),
    (jnp.float16, (3, 70), -1, "zero", list(range(64, 70))),
    (jnp.float32, (3, 64), -1, "zero", list(range(32, 64))),
    (jnp.float32, (70, 2), 0, "garbage", list(range(64, 70))),
    (jnp.float16, (2, 20), 1, "garbage", list(range(20))),
])
def test_tile_boundary_last_partial_touches_only_those_indices(dtype, shape, axis, mode, expected):
    x = data(shape, dtype)
    out = run(F.tile_boundary(32, axis=axis, mode=mode), x)
    diff, idx = _changed_along(out, x, axis)
    assert idx.tolist() == expected
    assert np.take(diff, expected, axis=axis).all()  # every selected element is changed
    if mode == "zero":
        assert np.all(np.take(bits(out), expected, axis=axis) == 0)


def test_tile_boundary_edges_and_stale():
    x = data((3, 70))
    out = run(F.tile_boundary(32, where="edges"), x)
    assert _changed_along(out, x, -1)[1].tolist() == [0, 31, 32, 63, 64, 69]
    stale = run(F.tile_boundary(32, where="edges", mode="stale"), x)
    assert _changed_along(stale, x, -1)[1].tolist() == [32, 63, 64, 69]
    for i in (32, 63, 64, 69):
        np.testing.assert_array_equal(np.asarray(stale)[:, i], np.asarray(x)[:, i - 32])
    stale = run(F.tile_boundary(32, mode="stale"), x)
    np.testing.assert_array_equal(np.asarray(stale)[:, 64:], np.asarray(x)[:, 32:38])
    np.testing.assert_array_equal(np.asarray(stale)[:, :64], np.asarray(x)[:, :64])
    site = Site("exp", {}, ((3, 20),), (jnp.float32,), ((3, 20),), (jnp.float32,))
    assert "no-op" in F.tile_boundary(32, mode="stale").supports(site)
    assert "axis 2" in F.tile_boundary(32, axis=2).supports(site)


@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_transpose_and_tile_swap(dtype):
    x = data((2, 5, 5), dtype)
    expect = np.swapaxes(np.asarray(x), -1, -2)
    np.testing.assert_array_equal(bits(run(F.permuted_layout(), x)), bits(expect))
    site = Site("exp", {}, ((4, 6),), (dtype,), ((4, 6),), (dtype,))
    assert "equal size" in F.permuted_layout().supports(site)
    with pytest.raises(ValueError, match="equal size"):
        run(F.permuted_layout(), data((4, 6), dtype))
    y = data((9, 3), dtype)  # 4 full blocks of 2 rows and a partial one
    pairs = set()
    for seed in range(6):
        out = np.asarray(run(F.permuted_layout("tile_swap", block=2), y, seed=seed))
        yb = np.asarray(y)
        moved = [k for k in range(4)
                 if not np.array_equal(out[2 * k:2 * k + 2], yb[2 * k:2 * k + 2])]
        assert len(moved) == 2
        i, j = moved
        np.testing.assert_array_equal(out[2 * i:2 * i + 2], yb[2 * j:2 * j + 2])
        np.testing.assert_array_equal(out[2 * j:2 * j + 2], yb[2 * i:2 * i + 2])
        np.testing.assert_array_equal(out[8], yb[8])
        pairs.add((i, j))
    assert len(pairs) > 1
    assert "two full blocks" in F.permuted_layout("tile_swap", block=5).supports(
        Site("exp", {}, ((9, 3),), (dtype,), ((9, 3),), (dtype,)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_operand_corruption_changes_exactly_one_output_row_or_column(dtype):
    a, b = data((6, 5), dtype, seed=1), data((5, 4), dtype, seed=2)
    ref = matmul(a, b)
    out = F.operand_corruption(0, index=2)(matmul, (a, b), jax.random.key(0))
    diff = bits(out) != bits(ref)
    assert np.flatnonzero(diff.any(axis=1)).tolist() == [2] and diff[2].all()
    out = F.operand_corruption(1, axis=1)(matmul, (a, b), jax.random.key(3))
    diff = bits(out) != bits(ref)
    assert diff.any(axis=0).sum() == 1 and diff[:, diff.any(axis=0)].all()
    out = F.operand_corruption(0, index=-1, mode="zero")(matmul, (a, b), jax.random.key(0))
    assert np.all(np.asarray(out, np.float32)[5] == 0)
    np.testing.assert_array_equal(bits(out)[:5], bits(ref)[:5])
    site = dot_site(a, b, MATMUL_DN)
    assert F.operand_corruption(1, axis=1).supports(site) is None
    assert "operand 2" in F.operand_corruption(2).supports(site)
    assert "out of range" in F.operand_corruption(0, index=6).supports(site)


# ----------------------------------------------------------------------------------------------
# every fault: transforms, seeds, dtypes
# ----------------------------------------------------------------------------------------------

def _examples():
    """(fault, reference, per-example operands, site) for every constructor."""
    x = data((6, 6), seed=5)
    a, b = data((6, 40), seed=6), data((40, 6), seed=7)
    mm_site = dot_site(a, b, MATMUL_DN)
    ew = (ident, (x,), None)
    return {
        "bit_flip": (F.bit_flip(bit_class="exponent"), *ew),
        "multi_bit_flip": (F.multi_bit_flip(n_bits=3), *ew),
        "random_value": (F.random_value(count=3), *ew),
        "zeroed": (F.zeroed(0.5), *ew),
        "stuck_at": (F.stuck_at(1, fraction=0.5), *ew),
        "wrong_scale": (F.wrong_scale(-2.0), *ew),
        "sign_flip": (F.sign_flip(0.5), *ew),
        "reduced_precision": (F.reduced_precision("bf16"), matmul, (a, b), mm_site),
        "low_precision_accumulation": (F.low_precision_accumulation(chunk=8), matmul, (a, b),
                                       mm_site),
        "tile_boundary": (F.tile_boundary(4, where="edges"), *ew),
        "permuted_layout": (F.permuted_layout("tile_swap", block=2), *ew),
        "operand_corruption": (F.operand_corruption(1, axis=1), matmul, (a, b), mm_site),
        "nan_inf": (F.nan_inf("inf", count=2), *ew),
    }


EXAMPLES = _examples()


def test_all_lists_every_constructor():
    assert set(F.ALL) == set(EXAMPLES)
    assert all(callable(getattr(F, name)) for name in F.ALL)
    assert set(F.ALL) <= set(F.__all__)


@pytest.mark.parametrize("name", F.ALL)
def test_every_fault_under_jit_vmap_cond_and_scan(name):
    fault, ref, ops, site = EXAMPLES[name]
    key = jax.random.key(11)
    f = lambda *o: fault(ref, o, key, site)
    batch = tuple(jnp.stack([o, o * 2, -o]) for o in ops)

    @jax.jit
    def everything(p, ops, batch):  # one compile: plain, vmap, cond, scan
        cond = lax.cond(p, lambda: f(*ops), lambda: ref(*ops))
        _, scanned = lax.scan(lambda c, xs: (c, f(*xs)), 0, batch)
        return f(*ops), jax.vmap(f)(*batch), cond, scanned

    single, vm, cond, scanned = everything(True, ops, batch)
    golden = ref(*ops)
    assert single.shape == golden.shape and single.dtype == golden.dtype
    assert not np.array_equal(bits(single), bits(golden))
    np.testing.assert_array_equal(bits(vm[0]), bits(single))
    np.testing.assert_array_equal(bits(scanned), bits(vm))
    np.testing.assert_array_equal(bits(cond), bits(single))
    np.testing.assert_array_equal(bits(everything(False, ops, batch)[2]), bits(golden))


# the other faults have their own tests parametrised over dtypes
@pytest.mark.parametrize("name", ["reduced_precision", "low_precision_accumulation",
                                  "tile_boundary", "multi_bit_flip"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_dtypes_keep_their_dtype(name, dtype):
    fault, ref, ops, site = EXAMPLES[name]
    ops = tuple(o.astype(dtype) for o in ops)
    if site is not None:
        site = dot_site(*ops, MATMUL_DN)
    out = fault(ref, ops, jax.random.key(0), site)
    golden = ref(*ops)
    assert out.shape == golden.shape and out.dtype == dtype
    if name != "reduced_precision" or dtype != jnp.bfloat16:   # bf16 already that narrow: no-op
        assert not np.array_equal(bits(out), bits(golden))


@pytest.mark.parametrize("name", F.ALL)
def test_every_fault_leaves_integer_outputs_unchanged(name):
    fault = EXAMPLES[name][0]
    x = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    site = Site("reduce_sum", {"axes": (1,)}, ((3, 4),), (jnp.int32,), ((3, 4),), (jnp.int32,))
    np.testing.assert_array_equal(fault(ident, (x,), jax.random.key(0), site), x)
    assert "not floating" in fault.supports(site)


@pytest.mark.parametrize("make", [
    lambda s: F.bit_flip(seed=s), lambda s: F.random_value(seed=s), lambda s: F.zeroed(0.1, seed=s),
    lambda s: F.sign_flip(0.1, seed=s), lambda s: F.nan_inf(seed=s),
    lambda s: F.operand_corruption(seed=s), lambda s: F.tile_boundary(8, seed=s),
])
def test_same_seed_same_pattern_different_seed_different_pattern(make):
    x = data((33, 17))
    outs = [bits(run(make(s), x, seed=s)) for s in range(4)]
    np.testing.assert_array_equal(outs[0], bits(run(make(0), x, seed=0)))
    masks = {(o != bits(x)).tobytes() for o in outs}
    if make(0).name == "tile_boundary":  # fixed positions, seeded garbage
        assert len(masks) == 1 and len({o.tobytes() for o in outs}) == 4
    else:  # seeded positions
        assert len(masks) >= 3


def test_key_none_or_int_means_the_seed():
    x = data((33, 17))
    f = F.bit_flip(seed=7)
    expect = bits(f(ident, (x,), jax.random.key(7)))
    np.testing.assert_array_equal(bits(f(ident, (x,), None)), expect)
    np.testing.assert_array_equal(bits(f(ident, (x,), 7)), expect)


# ----------------------------------------------------------------------------------------------
# construction, params, describe
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make,match", [
    (lambda: F.bit_flip(-1), "bit"),
    (lambda: F.bit_flip(3, bit_class="sign"), "not both"),
    (lambda: F.bit_flip(bit_class="fraction"), "unknown bit_class"),
    (lambda: F.bit_flip(index=1.5), "index"),
    (lambda: F.multi_bit_flip((3, 3)), "distinct"),
    (lambda: F.multi_bit_flip(n_bits=1), "n_bits"),
    (lambda: F.random_value(count=0), "count"),
    (lambda: F.random_value(count=2, index=0), "count=1"),
    (lambda: F.random_value(scale=-1.0), "scale"),
    (lambda: F.zeroed(1.5), "fraction"),
    (lambda: F.sign_flip(-0.1), "fraction"),
    (lambda: F.stuck_at(3, 2), "value"),
    (lambda: F.wrong_scale(float("nan")), "factor"),
    (lambda: F.reduced_precision("fp8"), "unknown precision"),
    (lambda: F.reduced_precision(where="both"), "unknown where"),
    (lambda: F.low_precision_accumulation("int8"), "unknown dtype"),
    (lambda: F.low_precision_accumulation(chunk=0), "chunk"),
    (lambda: F.tile_boundary(0), "block"),
    (lambda: F.tile_boundary(mode="noise"), "unknown mode"),
    (lambda: F.permuted_layout("rows"), "unknown kind"),
    (lambda: F.permuted_layout("tile_swap"), "needs block"),
    (lambda: F.operand_corruption(mode="nan"), "unknown mode"),
    (lambda: F.nan_inf("zero"), "unknown value"),
])
def test_constructors_validate_eagerly(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_params_are_json_and_describe_prints_the_call():
    for fault, *_ in EXAMPLES.values():
        json.dumps(fault.params)
        assert fault.params["seed"] == 0
    assert F.describe(F.bit_flip(bit=30, index=0)) == "bit_flip(bit=30, index=0)"
    assert F.describe(F.zeroed(0.25)) == "zeroed(fraction=0.25)"
    assert F.describe(F.wrong_scale(2.0)) == "wrong_scale(factor=2.0)"
    assert (F.describe(F.permuted_layout("tile_swap", block=4, seed=3))
            == "permuted_layout(kind='tile_swap', block=4, seed=3)")
    assert F.describe(F.sign_flip()) == "sign_flip()"
    names = {EXAMPLES[k][0].name for k in EXAMPLES}
    assert names == {"bit_flip", "multi_bit_flip", "random_value", "zeroed", "stuck_at",
                     "wrong_scale", "sign_flip", "reduced_precision", "low_precision_accumulation",
                     "tile_boundary", "permuted_layout", "operand_corruption", "nan_inf"}
