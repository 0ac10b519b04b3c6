"""peat_jax._src.promote.widened: a JAX function's float64 shadow (the float64 reference of a
reference that pins a narrower dtype)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peat_jax._src.errors import PeatError
from peat_jax._src.kernels import pallas_matmul
from peat_jax._src.promote import widened, widened_eqn

DIMS = (((1,), (0,)), ((), ()))


def _pinned_dot(a, b):
    return jax.lax.dot_general(a, b, DIMS, preferred_element_type=jnp.float32)


def _through_bf16(a, b):
    return (a.astype(jnp.bfloat16) * 3).astype(jnp.float32) @ b.astype(jnp.float32)


@jax.jit
def _jitted_relu_dot(a, b):
    return jax.nn.relu(_pinned_dot(a, b))      # relu: a custom_jvp call inside a jit


def _scaled_by_column(a, b):
    return _pinned_dot(a, b) * jnp.arange(b.shape[1]).astype(jnp.float32)   # int -> float


# (function, what it computes in float64)
CASES = [
    (_pinned_dot, lambda a, b: a @ b),
    (_through_bf16, lambda a, b: (a * 3) @ b),     # the casts widen: no rounding to bfloat16
    (_jitted_relu_dot, lambda a, b: np.maximum(a @ b, 0)),
    (_scaled_by_column, lambda a, b: (a @ b) * np.arange(b.shape[1])),
]


def _operands(shape_a, shape_b):
    rng = np.random.default_rng(0)
    return rng.standard_normal(shape_a), rng.standard_normal(shape_b)


@pytest.mark.parametrize("fn,exact", CASES, ids=["pinned_dot", "through_bf16", "jit_relu",
                                             "int_to_float"])
@pytest.mark.parametrize("shapes", [((5, 4), (4, 3)), ((1, 17), (17, 9))])
def test_the_shadow_computes_the_program_in_float64(fn, exact, shapes):
    a, b = _operands(*shapes)
    with jax.enable_x64(True):
        out = widened(fn)(jnp.asarray(a), jnp.asarray(b))
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), exact(a, b), rtol=1e-13, atol=1e-13)
        narrow = np.asarray(fn(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)),
                            np.float64)
    assert np.max(np.abs(narrow - exact(a, b))) > 1e-9   # the pinned program itself is narrow


def test_the_shadow_is_differentiable_in_float64():
    a, b = _operands((6, 5), (5, 4))
    ct = np.random.default_rng(1).standard_normal((6, 4))
    with jax.enable_x64(True):
        out, pullback = jax.vjp(widened(_pinned_dot), jnp.asarray(a), jnp.asarray(b))
        da, db = pullback(jnp.asarray(ct))
    assert da.dtype == db.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(da), ct @ b.T, rtol=1e-13)
    np.testing.assert_allclose(np.asarray(db), a.T @ ct, rtol=1e-13)


@pytest.mark.parametrize("fn", [
    lambda m: jnp.linalg.solve(m[:, :5] + 6 * jnp.eye(5), m[:, 5]),       # a linear solve
    lambda m: jnp.abs(jnp.fft.rfft(m, axis=1)) ** 2,                      # complex values
], ids=["solve", "rfft"])
def test_the_shadow_of_a_solve_and_of_complex_values_is_the_float64_program(fn):
    """Values and gradients equal the program run in float64: a solve's derivative is its
    implicit one (its solve jaxpr holds the factorisation behind a stop_gradient), and
    complex64 literals are widened beside complex128 values."""
    m = np.random.default_rng(2).standard_normal((5, 6))
    loss = lambda f: lambda x: jnp.sum(f(x) ** 2)   # noqa: E731
    with jax.enable_x64(True):
        x = jnp.asarray(m)
        np.testing.assert_allclose(widened(fn)(x), fn(x), rtol=1e-13)
        np.testing.assert_allclose(jax.grad(loss(widened(fn)))(x), jax.grad(loss(fn))(x),
                                   rtol=1e-12, atol=1e-12)
        shadow = widened(fn)(jnp.asarray(m, jnp.float32).astype(jnp.float64))
    assert shadow.dtype == jnp.float64


def test_constants_traced_in_the_narrow_dtype_keep_its_rounding():
    """A constant made while tracing (a float32 0.1) is widened, not recomputed: the shadow is
    as accurate as the program's constants."""
    x = np.linspace(-2.0, 2.0, 9)
    with jax.enable_x64(True):
        out = widened(lambda v: v * jnp.float32(0.1))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(out), x * float(np.float32(0.1)))


def test_the_shadow_is_cached_by_function():
    assert widened(_pinned_dot) is widened(_pinned_dot)


def _while_rows(a, b):
    def body(c):
        i, acc = c
        return i + 1, acc + _pinned_dot(a[i][None], b)[0]
    return jax.lax.while_loop(lambda c: c[0] < a.shape[0], body,
                              (0, jnp.zeros(b.shape[1], jnp.float32)))[1]


@pytest.mark.parametrize("fn,exact", [
    (lambda a, b: jax.lax.map(lambda r: _pinned_dot(r[None], b)[0], a), lambda a, b: a @ b),
    (_while_rows, lambda a, b: (a @ b).sum(0)),
    (lambda a, b: jax.lax.cond(a[0, 0] > 0, lambda: _pinned_dot(a, b), lambda: -_pinned_dot(a, b)),
     lambda a, b: np.sign(a[0, 0]) * (a @ b)),
], ids=["scan", "while", "cond"])
def test_loops_and_branches_are_widened_around_their_bodies(fn, exact):
    """A scan, a while loop and a cond whose bodies pin float32 are rebuilt around widened
    bodies: the result is the float64 one, and (but for the while loop, which jax does not
    reverse-differentiate) it differentiates."""
    a, b = _operands((8, 8), (8, 8))
    with jax.enable_x64(True):
        out = widened(fn)(jnp.asarray(a), jnp.asarray(b))
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), exact(a, b), rtol=1e-12, atol=1e-12)
        if fn is not _while_rows:
            g = jax.grad(lambda x: widened(fn)(x, jnp.asarray(b)).sum())(jnp.asarray(a))
            assert g.dtype == jnp.float64


@pytest.mark.parametrize("fn,primitive", [
    (lambda a, b: jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32), "bitcast"),
    (lambda a, b: pallas_matmul(8, 8, 8)(a.astype(jnp.float32), b.astype(jnp.float32),
                                         dimension_numbers=DIMS, precision=None,
                                         preferred_element_type=jnp.float32), "pallas_call"),
], ids=["bitcast", "pallas"])
def test_programs_whose_types_cannot_be_widened_are_refused(fn, primitive):
    a, b = _operands((8, 8), (8, 8))
    with jax.enable_x64(True), pytest.raises(PeatError, match=f"cannot widen a program with "
                                                             f"'{primitive}"):
        widened(fn)(jnp.asarray(a), jnp.asarray(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_equation_of_a_program_is_evaluated_in_float64(dtype):
    """A site's equation (here a dot_general pinned to float32 on narrower operands, and a
    region-like jitted call around a tanh) evaluated on float64 operands returns the float64
    result: what playback's float64 judgement of a site computes."""
    a, b = _operands((6, 5), (5, 4))
    closed = jax.make_jaxpr(lambda x, y: jax.jit(jnp.tanh)(jax.lax.dot_general(
        x, y, DIMS, preferred_element_type=jnp.float32)))(a.astype(dtype), b.astype(dtype))
    dot, call = closed.jaxpr.eqns
    with jax.enable_x64(True):
        (prod,) = widened_eqn(dot)(a, b)
        (out,) = widened_eqn(call)(np.asarray(prod))
    assert prod.dtype == out.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(prod), a @ b, rtol=0, atol=1e-14)   # float32: ~1e-7
    np.testing.assert_allclose(np.asarray(out), np.tanh(a @ b), rtol=0, atol=1e-14)
