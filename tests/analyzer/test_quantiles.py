"""The sample's quantiles, computed on the host from the keys `sample_program` returns unsorted
(`peat_jax._src.analyzer.quantiles`): the same nearest ranks and values as a sort on the device."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from peat_jax._src.analyzer import analyze, bits, quantiles
from peat_jax._src.analyzer.signature import QUANTILES

EVERY_QUANTILE = QUANTILES + quantiles.ULP_QUANTILES + (0.005, 0.995)


def test_host_ranks_are_the_devices_float32_ranks():
    """`bits.ranks` in NumPy (the host's quantiles) and in XLA (the device's 90th percentile
    of the reference's ULP error) give the same positions for every count and quantile."""
    n = np.arange(0, 8193, dtype=np.int32)[:, None]
    host = bits.ranks(n, EVERY_QUANTILE, 8192, np)
    device = np.asarray(bits.ranks(jnp.asarray(n), EVERY_QUANTILE, 8192))
    np.testing.assert_array_equal(host, device)


def test_signed_keys_decode_to_the_floats_they_encode():
    """(-0 is 0 on the monotonic line: it decodes to +0, as on the device.)"""
    x = np.concatenate([np.float32([0.0, 1e-45, -1e-45, np.inf, -np.inf]),
                        np.random.default_rng(0).standard_normal(1000).astype(np.float32)])
    keys = bits.signed_key(jnp.asarray(x), jnp.ones(x.shape, bool))
    decoded = quantiles.monotonic_to_float32(np.asarray(keys))
    np.testing.assert_array_equal(decoded.view(np.uint32), x.view(np.uint32))


def test_quantiles_are_the_nearest_ranks_of_the_errors():
    """Errors of exact sizes (k ULPs of golden values in [1, 2)) on a leaf its own sample: the
    reported quantiles of |c - g| are the sorted values at the nearest ranks, and the ratio's
    median is the median of c / g (every |g| here is within a factor 2 of the rms, but the
    ratio keeps only |g| >= rms)."""
    rng = np.random.default_rng(1)
    g = rng.uniform(1, 2, (40, 30)).astype(np.float32)
    k = rng.integers(0, 50, g.shape)
    c = (g + k * np.float32(2.0 ** -23)).astype(np.float32)
    s = analyze(c, g)
    assert not s.errors.sampled

    def nearest(sorted_values, q):
        n = np.float32(len(sorted_values))
        return float(sorted_values[int(np.ceil(np.float32(q) * n)) - 1])

    err = np.sort(np.abs(c - g).reshape(-1))
    assert s.errors.abs_quantiles == {f"p{100 * q:g}": nearest(err, q) for q in QUANTILES}
    kept = np.abs(g) >= np.sqrt(np.mean(np.square(g, dtype=np.float64)))
    assert s.ratio.n == kept.sum()
    assert s.ratio.median == nearest(np.sort((c / g)[kept]), 0.5)
