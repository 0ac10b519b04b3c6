"""`sums.row_sums`: exact integer sums along the last axis, without a full-size temporary."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peat_jax._src.analyzer.sample import bit_counts
from peat_jax._src.sums import row_sums


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


@pytest.mark.parametrize("n", [1, 100, 128, 8192, 8193])
def test_bit_counts_count_each_bit_position(n):
    """The sample's histograms: for each row of words, how many have each bit set."""
    words = np.random.default_rng(n).integers(0, 1 << 32, (3, n), dtype=np.uint64).astype(
        np.uint32)
    want = ((words[..., None] >> np.arange(32, dtype=np.uint32)) & 1).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(jax.jit(bit_counts)(jnp.asarray(words))), want)
