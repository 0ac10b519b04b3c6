"""Foreign callables as kernels: NumPy and PyTorch functions through jax.pure_callback, forward
and backward (torch's from torch.autograd), dtype round trips, pytree operands, training."""
from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import needs
import numpy as np
import pytest

import peat_jax as peat
from compile_log import compiles
from peat_jax._src.kernels import foreign

try:
    import torch
except ImportError:  # the [torch] extra is left out where torch would be a multi-GB CUDA download
    torch = None

# Marks a test (or a parameter) that needs PyTorch; the skip says why it is missing.
needs_torch = needs.skip_unless("torch")
WHICH = ["numpy", pytest.param("torch", marks=needs_torch)]

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 1e-5, jnp.float16: 1e-2, jnp.bfloat16: 6e-2}  # as in test_kernels_pallas


def _rel_err(got, ref) -> float:
    got, ref = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (got, ref))
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def _numpy_matmul_vjp(ops, out, g):
    a, b = ops
    return g @ np.swapaxes(b, -1, -2), np.swapaxes(a, -1, -2) @ g


def _matmul_kernels():
    return {
        "numpy": peat.kernels.dot_general(foreign.numpy_kernel(np.matmul, vjp=_numpy_matmul_vjp),
                                          name="numpy_matmul", batched=True),
        **({} if torch is None else {
            "torch": peat.kernels.dot_general(foreign.torch_kernel(torch.matmul),
                                              name="torch_matmul", batched=True)}),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("which", WHICH)
def test_foreign_matmul_matches_xla_forward_and_backward(which, dtype):
    dims = (((2,), (2,)), ((0,), (0,)))  # batch dims, rhs transposed
    a = jax.random.normal(jax.random.key(0), (2, 5, 7)).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (2, 3, 7)).astype(dtype)
    ref = lambda a, b: jax.lax.dot_general(a, b, dims)  # noqa: E731
    sub = peat.substitute(ref, {"dot_general": _matmul_kernels()[which]})
    y, vjp = jax.vjp(jax.jit(sub), a, b)
    y_r, vjp_r = jax.vjp(ref, a, b)
    g = jax.random.normal(jax.random.key(2), y_r.shape).astype(dtype)
    assert y.dtype == y_r.dtype and _rel_err(y, y_r) <= TOL[dtype]
    for u, v in zip(vjp(g), vjp_r(g)):
        assert u.dtype == v.dtype and _rel_err(u, v) <= TOL[dtype]


@pytest.mark.parametrize("which", WHICH)
def test_an_eager_kernel_compiles_its_callback_once_per_signature(which):
    """Called eagerly (check_kernel runs candidates as given), forward and backward compile
    one callback program each per shapes, not one per call; a new shape compiles again."""
    kernel = {"numpy": foreign.numpy_kernel(np.matmul, vjp=_numpy_matmul_vjp),
              "torch": foreign.torch_kernel(torch.matmul) if torch else None}[which]
    with compiles() as names:
        for shape in ((5, 7), (5, 7), (5, 7), (6, 7)):
            a = jnp.ones(shape, jnp.float32)
            b = jnp.ones((7, 3), jnp.float32)
            y, vjp = jax.vjp(kernel, a, b)
            vjp(jnp.ones_like(y))
    assert names.count("pure_callback") == 4, names   # (forward, backward) x 2 shapes


@needs_torch
def test_bfloat16_round_trips_exactly_through_torch_and_via_float32_through_numpy():
    x = jax.random.normal(jax.random.key(0), (64,)).astype(jnp.bfloat16)
    seen = {}

    def np_identity(a):
        seen["numpy"] = a.dtype
        return a

    def torch_identity(t):
        seen["torch"] = t.dtype
        return t * 1

    for k in (foreign.numpy_kernel(np_identity), foreign.torch_kernel(torch_identity)):
        y = jax.jit(k)(x)
        assert y.dtype == jnp.bfloat16 and bool(jnp.all(y == x)), k.name
    assert seen == {"numpy": np.float32, "torch": torch.bfloat16}


@needs_torch
def test_torch_backward_comes_from_autograd_on_a_region_with_pytree_operands():
    """A Flax nn.LayerNorm region (operands: variables dict, x) replaced by torch's layer_norm;
    its gradients (x, scale, bias) come from torch.autograd."""
    calls = []

    def torch_ln(variables, x):
        calls.append(torch.is_grad_enabled())
        p = variables["params"]
        return torch.nn.functional.layer_norm(x, x.shape[-1:], p["scale"], p["bias"], eps=1e-6)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.LayerNorm()(x) ** 2

    x = 2.0 * jax.random.normal(jax.random.key(0), (3, 10)) + 1.0
    params = Net().init(jax.random.key(1), x)
    params = jax.tree.map(lambda p: p + 0.2 * jax.random.normal(jax.random.key(2), p.shape), params)
    vg = jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(Net().apply(p, x))), argnums=(0, 1))
    regions = (nn.LayerNorm,)
    with peat.flax_regions(*regions):
        ref = jax.jit(vg)(params, x)
    kernel = foreign.torch_kernel(torch_ln, name="torch_layer_norm")
    got = jax.jit(peat.substitute(vg, {"LayerNorm": kernel}, regions=regions))(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert _rel_err(a, b) <= 1e-5
    assert True in calls  # the backward ran torch with autograd enabled


@pytest.mark.parametrize("which", WHICH)
def test_foreign_matmul_trains_a_model(which, linen_train, mlp_data):
    step, state = linen_train
    sub = jax.jit(peat.substitute(step, {"dot_general": _matmul_kernels()[which]}))
    ref = jax.jit(step)
    s1 = s2 = state
    for _ in range(20):
        s1, m1 = ref(s1, mlp_data)
        s2, m2 = sub(s2, mlp_data)
        np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-4, atol=1e-6)
    # and under vmap (per-example losses): the callback runs sequentially
    loss_fn = lambda p, x, y: jnp.mean((x @ p - y) ** 2)  # noqa: E731
    w = jax.random.normal(jax.random.key(3), (8, 4))
    per = jax.vmap(peat.substitute(loss_fn, {"dot_general": _matmul_kernels()[which]}),
                   in_axes=(None, 0, 0))(w, mlp_data[0][:, None], mlp_data[1][:, None])
    ref_per = jax.vmap(loss_fn, in_axes=(None, 0, 0))(w, mlp_data[0][:, None], mlp_data[1][:, None])
    np.testing.assert_allclose(per, ref_per, rtol=1e-5)


def test_numpy_kernel_without_vjp_is_forward_only_with_a_clear_error(linen_mlp, mlp_data):
    loss, params = linen_mlp
    k = peat.kernels.dot_general(foreign.numpy_kernel(np.matmul), batched=True)
    sub = peat.substitute(loss, {"dot_general": k})
    np.testing.assert_allclose(sub(params, *mlp_data), loss(params, *mlp_data), rtol=1e-5)
    with pytest.raises(peat.PeatError, match="custom_vjp"):
        jax.grad(sub)(params, *mlp_data)


def test_missing_torch_is_a_clear_error(monkeypatch):
    k = foreign.torch_kernel(lambda t: t * 2)
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(peat.PeatError, match=r"needs PyTorch: pip install 'peat_jax\[torch\]'"):
        k(jnp.ones(3))


def test_wrong_foreign_output_shape_is_reported():
    k = foreign.numpy_kernel(lambda a: a.T, result=lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype))
    with pytest.raises(Exception, match=r"returned shape \(3, 2\), expected \(2, 3\)"):
        jax.block_until_ready(k(jnp.ones((2, 3))))
