"""The Pallas interpreter's checks as kernel options: a data race, an out-of-bounds read and
uninitialised memory are surfaced as such, and the bundled kernels pass the checks.

Checked interpretation simulates cores and memory in Python callbacks (about 1000x slower than
the plain interpreter per grid point): shapes here are tiny.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import peat_jax as peat
from peat_jax._src.kernels import pallas as pk
from peat_jax._src.kernels import references


@pytest.fixture(autouse=True)
def _fresh_interpreter_state():
    pk.reset_interpret_state()
    yield
    pk.reset_interpret_state()  # a checked kernel that raised leaves the state dirty


def _ksplit_matmul(dimension_semantics, checks=True):
    """A matmul split over K on the grid, accumulating into the revisited output block: correct
    when K is "arbitrary" (in order on one core), a race when K is marked "parallel"."""
    def body(a_ref, b_ref, o_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    def matmul(a, b):
        (m, k), n = a.shape, b.shape[1]
        return pk.call(body, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
                       grid=(m // 16, n // 16, k // 16),
                       in_specs=[pl.BlockSpec((16, 16), lambda i, j, kk: (i, kk)),
                                 pl.BlockSpec((16, 16), lambda i, j, kk: (kk, j))],
                       out_specs=pl.BlockSpec((16, 16), lambda i, j, kk: (i, j)),
                       dimension_semantics=dimension_semantics, name="ksplit_matmul",
                       checks=checks)(a, b)

    return peat.kernels.dot_general(matmul, name=f"ksplit{dimension_semantics}")


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


A = jax.random.normal(jax.random.key(0), (16, 64))
B = jax.random.normal(jax.random.key(1), (64, 16))


def test_race_between_parallel_grid_points_is_reported(caplog):
    ok = jax.jit(peat.substitute(_dot, {"dot_general": _ksplit_matmul(
        ("parallel", "parallel", "arbitrary"))}))(A, B)
    np.testing.assert_allclose(ok, A @ B, rtol=1e-5, atol=1e-5)
    assert not pk.races_found()
    racy = peat.substitute(_dot, {"dot_general": _ksplit_matmul(("parallel",) * 3)})
    with pytest.raises(Exception, match="data race detected in Pallas kernel 'ksplit_matmul'"):
        jax.block_until_ready(jax.jit(racy)(A, B))
    assert pk.races_found()
    # the error reaches the caller; jax's log of it (a traceback on stderr) is dropped
    assert not [r for r in caplog.records if "callback failed" in r.getMessage()]
    # without checks the same racy kernel runs in order and its bug goes unnoticed
    quiet = peat.substitute(_dot, {"dot_general": _ksplit_matmul(("parallel",) * 3, checks=None)})
    np.testing.assert_allclose(jax.jit(quiet)(A, B), A @ B, rtol=1e-5, atol=1e-5)


def _shifted_softmax_rows(x, checks):
    """Each program reads its 8 rows starting one row too late: the last read runs off the end."""
    def body(x_ref, o_ref):
        start = pl.program_id(0) * 8 + 1
        rows = x_ref[pl.ds(start, 8), :]
        o_ref[...] = jnp.exp(rows - rows.max(axis=1, keepdims=True))

    return pk.call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
                   in_specs=[pl.BlockSpec(x.shape, lambda i: (0, 0))],
                   out_specs=pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0)),
                   dimension_semantics=("parallel",), name="shifted", checks=checks)(x)


def test_out_of_bounds_read_raises_under_checks_and_is_silent_without():
    x = jax.random.normal(jax.random.key(2), (16, 16))
    with pytest.raises(Exception, match="Out-of-bounds read"):
        jax.block_until_ready(_shifted_softmax_rows(x, checks=True))
    pk.reset_interpret_state()
    quiet = _shifted_softmax_rows(x, checks=None)  # the plain interpreter clamps the read
    assert bool(jnp.all(jnp.isfinite(quiet)))
    as_nan = _shifted_softmax_rows(x, checks=pk.InterpretChecks(out_of_bounds="nan"))
    # exactly the row read past the end (row 16, written as the last output row) is NaN
    assert bool(jnp.all(jnp.isnan(as_nan[-1]))) and bool(jnp.all(jnp.isfinite(as_nan[:-1])))


def _unpadded_matmul(a, b, checks):
    """A tile_boundary bug: K is not a multiple of the block and the kernel does not pad."""
    def body(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    m, n = a.shape[0], b.shape[1]
    return pk.call(body, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32), grid=(m // 16,),
                   in_specs=[pl.BlockSpec((16, 32), lambda i: (i, 0)),
                             pl.BlockSpec((32, n), lambda i: (0, 0))],
                   out_specs=pl.BlockSpec((16, n), lambda i: (i, 0)),
                   dimension_semantics=("parallel",), name="unpadded", checks=checks)(a, b)


def test_uninitialised_memory_is_nan_so_a_missing_pad_shows():
    a = jax.random.normal(jax.random.key(3), (16, 24))
    b = jax.random.normal(jax.random.key(4), (24, 16))
    got = _unpadded_matmul(a, b, checks=True)  # uninitialized="nan"
    assert bool(jnp.all(jnp.isnan(got)))
    # with memory zero-filled the bug would hide: the result is right by accident
    hidden = _unpadded_matmul(a, b, checks=pk.InterpretChecks(uninitialized="zero"))
    np.testing.assert_allclose(hidden, a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bundled_kernels_pass_the_checks_forward_and_backward():
    """Two cores, parallel grid points in random order: no race, no out-of-bounds read, nothing
    uninitialised (NaN) in the matmul's and the softmax's forward and backward kernels."""
    checks = pk.InterpretChecks(num_cores=2, seed=0)

    def fwd_bwd(fn, g, *args):
        y, vjp = jax.vjp(fn, *args)
        return (y, *vjp(g))

    a = jax.random.normal(jax.random.key(0), (32, 12))
    b = jax.random.normal(jax.random.key(1), (12, 10))
    g = jax.random.normal(jax.random.key(2), (32, 10))
    mm = peat.substitute(_dot, {"dot_general": pk.pallas_matmul(16, 16, 16, checks=checks)})
    for u, v in zip(jax.jit(functools.partial(fwd_bwd, mm))(g, a, b), fwd_bwd(_dot, g, a, b)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)
    x = jax.random.normal(jax.random.key(3), (16, 13))
    sm = functools.partial(pk.softmax, block_rows=8, checks=checks)
    ref = fwd_bwd(references.softmax, x, x)
    for u, v in zip(jax.jit(functools.partial(fwd_bwd, sm))(x, x), ref):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
    assert not pk.races_found()
