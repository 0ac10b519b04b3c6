"""`sums`: exact integer sums along the last axis without a full-size temporary (`row_sums`),
and whole arrays reduced together (`reduce_all`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peat_jax._src.analyzer.sample import bit_counts
from peat_jax._src.sums import reduce_all, row_sums


@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 96), (2, 5, 128), (4, 24 * 1024), (1 << 18,),
                                   (3, 1000)])
def test_row_sums_are_the_plain_sums_bit_for_bit(dtype, shape):
    """Every length (odd, a power of two, a multiple of three) and leading shape: each array's
    sum over its last axis in its own dtype, exactly (uint32 wrapping modulo 2**32)."""
    rng = np.random.default_rng(shape[-1])
    big = np.iinfo(dtype).max // 2
    xs = [rng.integers(0, big, shape, dtype=np.int64).astype(dtype),
          rng.integers(0, 2, shape).astype(dtype)]
    got = jax.jit(row_sums)([jnp.asarray(x) for x in xs])
    for g, x in zip(got, xs):
        want = np.sum(x.astype(np.uint64), axis=-1) % (1 << 32)
        assert g.dtype == x.dtype and g.shape == shape[:-1]
        np.testing.assert_array_equal(np.asarray(g).astype(np.uint64) % (1 << 32), want)


@pytest.mark.parametrize("shape", [(1 << 18,), (16, 1 << 14)])
def test_row_sums_write_nothing_of_the_inputs_size(shape):
    """The summands (a product, a mask) stay in one fused pass: scratch memory under half the
    input's bytes, where a plain integer `jnp.sum` writes them out at full size first."""
    x = jnp.ones(shape, jnp.uint32)
    compiled = jax.jit(lambda x: row_sums([x * x + jnp.uint32(3), (x > 0).astype(jnp.int32)])
                       ).lower(x).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < x.nbytes / 2


@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 96), (1 << 16,), (5, 4096), (3, 1000),
                                   (1 << 18,)])
def test_reduce_all_is_each_arrays_plain_reduction(dtype, shape):
    """Every size (odd, a power of two, a multiple of three), float32 and integer arrays in one
    pass: a maximum exactly `max` (NaN where the array holds a NaN, one array alone too), a
    float sum `sum`'s up to float32 rounding, an integer sum exactly (uint32 wrapping modulo
    2**32), each in its own dtype."""
    rng = np.random.default_rng(shape[-1])
    x = np.asarray(rng.standard_normal(shape) * 3).astype(np.float32)
    with_nan = x.copy()
    with_nan.reshape(-1)[-1] = np.nan
    words = rng.integers(0, np.iinfo(dtype).max, shape, dtype=np.int64).astype(dtype)
    counts = (x > 1).astype(dtype)
    xs = [jnp.asarray(a) for a in (x, x, with_nan, words, counts, words)]
    total, biggest, nan_max, word_sum, count, word_max = jax.jit(
        lambda xs: reduce_all(xs, ["sum", "max", "max", "sum", "sum", "max"]))(xs)
    v = x.astype(np.float64)
    np.testing.assert_allclose(float(total), v.sum(), rtol=1e-5, atol=1e-6 * np.abs(v).sum())
    assert float(biggest) == v.max() and np.isnan(float(nan_max))
    assert int(np.asarray(word_sum).view(np.uint32)) == int(
        words.astype(np.int64).sum() % (1 << 32))
    assert int(count) == int(counts.sum()) and int(word_max) == int(words.max())
    assert word_sum.dtype == dtype and count.dtype == dtype
    assert np.isnan(float(jax.jit(lambda a: reduce_all([a], ["max"])[0])(with_nan)))


@pytest.mark.parametrize("n", [1, 100, 128, 8192, 8193])
def test_bit_counts_count_each_bit_position(n):
    """The sample's histograms: for each row of words, how many have each bit set."""
    words = np.random.default_rng(n).integers(0, 1 << 32, (3, n), dtype=np.uint64).astype(
        np.uint32)
    want = ((words[..., None] >> np.arange(32, dtype=np.uint32)) & 1).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(jax.jit(bit_counts)(jnp.asarray(words))), want)
