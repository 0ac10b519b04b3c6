"""XLA FFI kernels: the bundled naive C++ matmul compiled from source by this test run (into a
fresh cache directory), its cache, compiler errors, accuracy at dot_general sites and training."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat
from peat_jax.kernels import ffi

TOL = {jnp.float32: 1e-5, jnp.float16: 1e-2, jnp.bfloat16: 6e-2}  # as in test_kernels_pallas


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ffi_cache")


@pytest.fixture(scope="module")
def kernel(cache_dir):
    return ffi.ffi_matmul(cache_dir=cache_dir)


def _rel_err(got, ref) -> float:
    got, ref = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (got, ref))
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def test_library_is_built_from_source_and_cached(kernel, cache_dir):
    libs = sorted(cache_dir.glob("libnaive_matmul-*.so"))
    assert len(libs) == 1  # built by this run (the fixture's fresh directory)
    mtime = libs[0].stat().st_mtime_ns
    src = ffi._CSRC / "naive_matmul.cc"
    again = ffi.build_ffi_library(src, "naive_matmul", cache_dir=cache_dir)
    assert again == libs[0] and again.stat().st_mtime_ns == mtime  # reused, not rebuilt
    other = ffi.build_ffi_library(src, "naive_matmul", cache_dir=cache_dir, extra_flags=["-DX=1"])
    assert other != again  # flags are part of the key


def test_compiler_errors_are_peat_errors_with_the_compiler_message(tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text("#include \"xla/ffi/api/ffi.h\"\nint broken( {\n")
    with pytest.raises(peat.PeatError, match=r"(?s)compiling bad.cc failed .*bad\.cc:2:.*error"):
        ffi.build_ffi_library(bad, "bad", cache_dir=tmp_path)
    with pytest.raises(peat.PeatError, match="not found on PATH"):
        ffi.build_ffi_library(bad, "bad", cache_dir=tmp_path, compiler="no-such-compiler-g++")
    with pytest.raises(peat.PeatError, match="does not exist"):
        ffi.build_ffi_library(tmp_path / "missing.cc", "missing", cache_dir=tmp_path)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".so")]  # no half-built library


PLAIN = (((30, 45), (45, 29)), (((1,), (0,)), ((), ())))
BATCHED = (((2, 17, 33), (2, 18, 33)), (((2,), (2,)), ((0,), (0,))))  # batch dims, rhs transposed


@pytest.mark.parametrize("shapes,dims,dtype", [
    pytest.param(*PLAIN, jnp.float32, id="plain-float32"),
    pytest.param(*PLAIN, jnp.bfloat16, id="plain-bfloat16"),
    pytest.param(*PLAIN, jnp.float16, id="plain-float16"),
    pytest.param(*BATCHED, jnp.float32, id="batched-float32"),
])
def test_ffi_matmul_matches_xla_forward_and_backward(kernel, shapes, dims, dtype):
    a = jax.random.normal(jax.random.key(0), shapes[0]).astype(dtype)
    b = jax.random.normal(jax.random.key(1), shapes[1]).astype(dtype)
    ref = lambda a, b: jax.lax.dot_general(a, b, dims)  # noqa: E731
    sub = peat.substitute(ref, {"dot_general": kernel})
    y, vjp = jax.vjp(jax.jit(sub), a, b)
    y_r, vjp_r = jax.vjp(ref, a, b)
    g = jax.random.normal(jax.random.key(2), y_r.shape).astype(dtype)
    assert y.dtype == y_r.dtype and _rel_err(y, y_r) <= TOL[dtype]
    for u, v in zip(vjp(g), vjp_r(g)):
        assert u.dtype == v.dtype and _rel_err(u, v) <= TOL[dtype]
    if dtype == jnp.float32:  # vmap of the substituted function: one FFI call per element
        yb = jax.vmap(sub, in_axes=(0, None))(jnp.stack([a, -a]), b)
        assert _rel_err(yb[1], -y_r) <= TOL[dtype]


def test_ffi_matmul_trains_a_model(kernel, linen_train, mlp_data):
    step, state = linen_train
    sub = jax.jit(peat.substitute(step, {"dot_general": kernel}))
    ref = jax.jit(step)
    s1 = s2 = state
    for _ in range(20):
        s1, m1 = ref(s1, mlp_data)
        s2, m2 = sub(s2, mlp_data)
        np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-4, atol=1e-6)
    assert "ffi_call" in str(jax.make_jaxpr(sub)(state, mlp_data))


def test_ffi_kernel_with_a_user_vjp(cache_dir):
    lib = ffi.build_ffi_library(ffi._CSRC / "naive_matmul.cc", "naive_matmul", cache_dir=cache_dir)
    k = ffi.ffi_kernel(lib, "NaiveMatmul",
                       lambda a, b: jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), jnp.float32),
                       name="mm", vjp=lambda ops, out, g: (g @ ops[1].T, ops[0].T @ g))
    a = jax.random.normal(jax.random.key(0), (4, 6))
    b = jax.random.normal(jax.random.key(1), (6, 3))
    np.testing.assert_allclose(k(a, b), a @ b, rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda a: jnp.sum(jnp.sin(k(a, b))))(a)
    np.testing.assert_allclose(g, jax.grad(lambda a: jnp.sum(jnp.sin(a @ b)))(a), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(peat.PeatError, match="has no symbol 'Nope'"):
        ffi.ffi_kernel(lib, "Nope")


def test_ffi_matmul_refuses_sites_it_cannot_serve(kernel):
    i = jnp.ones((3, 3), jnp.int32)
    with pytest.raises(peat.PeatError, match="cannot use kernel 'ffi_matmul'.*int32"):
        peat.substitute(lambda a: a @ a, {"dot_general": kernel}).selected(i)
