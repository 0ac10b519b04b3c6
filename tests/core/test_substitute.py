"""Substitution: identity when empty, exact effect of kernels and faults, jit/grad/vmap, errors,
and switched execution (one compile for a sweep)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat
from conftest import bitwise_equal


def _leaves_changed(a, b) -> list[str]:
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree.leaves(b)
    return [jax.tree_util.keystr(p) for (p, x), y in zip(flat_a, flat_b)
            if not bool(jnp.array_equal(x, y))]


# ------------------------------------------------------------------ identity


@pytest.mark.slow
def test_empty_substitution_is_bitwise_identical_linen_train_step(linen_train, mlp_data):
    step, state = linen_train
    batch = mlp_data
    ref = jax.jit(step)(state, batch)
    got = jax.jit(peat.substitute(step, {}))(state, batch)
    assert bitwise_equal(ref, got)
    # eagerly (op by op) it computes the same values, to rounding: eager autodiff orders ops
    # differently from the traced program, so only the jitted comparison is bitwise
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(peat.substitute(step, {})(state, batch))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("framework", ["linen", "plain", "nnx", "equinox"])
def test_identity_and_backward_fault_in_every_framework(mlp_variants, mlp_data, framework):
    loss, params = mlp_variants[framework]
    vg = jax.value_and_grad(loss)
    ref = jax.jit(vg)(params, *mlp_data)
    assert bitwise_equal(ref, jax.jit(peat.substitute(vg, {}))(params, *mlp_data))
    # the last backward GEMM is the first layer's weight gradient: only that leaf changes
    last = [s for s in peat.list_sites(vg, params, *mlp_data) if s.primitive == "dot_general"][-1]
    doubled = peat.substitute(vg, {last.index: peat.faults.wrong_scale(2.0)})
    got = jax.jit(doubled)(params, *mlp_data)
    changed = _leaves_changed(ref, got)
    assert len(changed) == 1 and changed[0] != "[0]"
    w_ref = [x for x in jax.tree.leaves(ref[1]) if x.size == 128]
    w_got = [x for x in jax.tree.leaves(got[1]) if x.size == 128]
    # x2 exactly, but for XLA's fusion of the rest of the leaf's product (an element whose sum
    # cancels may move by rounding at the leaf's scale)
    np.testing.assert_allclose(w_got[0], 2.0 * w_ref[0], rtol=1e-6,
                               atol=1e-6 * float(np.abs(w_ref[0]).max()))


@pytest.mark.slow
def test_empty_substitution_is_bitwise_identical_scan_remat_transformer(gpt):
    loss, params, tokens = gpt
    vg = jax.value_and_grad(loss)
    assert bitwise_equal(jax.jit(vg)(params, tokens),
                         jax.jit(peat.substitute(vg, {}))(params, tokens))


@pytest.mark.slow
def test_empty_substitution_with_regions_matches_the_program_with_regions(gpt):
    loss, params, tokens = gpt
    vg = jax.value_and_grad(loss)
    regions = (nn.LayerNorm, nn.MultiHeadDotProductAttention)
    with peat.flax_regions(*regions):
        ref = jax.jit(vg)(params, tokens)
    got = jax.jit(peat.substitute(vg, {}, regions=regions))(params, tokens)
    assert bitwise_equal(ref, got)


# ------------------------------------------------------------------ faults at sites


def test_backward_site_fault_changes_exactly_the_leaves_that_depend_on_it(linen_mlp, mlp_data):
    loss, params = linen_mlp
    vg = jax.value_and_grad(loss)
    ref = jax.jit(vg)(params, *mlp_data)
    dots = [s for s in peat.list_sites(vg, params, *mlp_data) if s.primitive == "dot_general"]
    head_w_grad, head_in_grad, fc1_w_grad = dots[2:]
    assert head_w_grad.out_shapes == ((4, 16),) and fc1_w_grad.out_shapes == ((16, 8),)
    cases = {
        head_w_grad.index: ["[1]['params']['head']['kernel']"],
        head_in_grad.index: ["[1]['params']['fc1']['kernel']"],   # flows only into fc1's grad
        fc1_w_grad.index: ["[1]['params']['fc1']['kernel']"],
        dots[0].index: ["[0]", "[1]['params']['fc1']['kernel']", "[1]['params']['head']['kernel']"],
    }
    for index, expected in cases.items():
        got = jax.jit(peat.substitute(vg, {index: peat.faults.wrong_scale(3.0)}))(params, *mlp_data)
        assert _leaves_changed(ref, got) == expected, index


def test_fault_at_site_produces_exactly_its_pattern():
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 5))
    f = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
    ref_dot = x @ w
    flipped = jax.jit(peat.substitute(lambda x, w: x @ w,
                                      {0: peat.faults.bit_flip(bit=30, index=7)}))(x, w)
    bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint32)).ravel()  # noqa: E731
    diff = bits(flipped) ^ bits(ref_dot)
    assert np.flatnonzero(diff).tolist() == [7] and diff[7] == 1 << 30
    # the fault is on the dot inside f: tanh sees the flipped value at element 7 only
    out = jax.jit(peat.substitute(f, {"dot_general": peat.faults.zeroed()}))(x, w)
    assert bool(jnp.all(out == 0))
    out = jax.jit(peat.substitute(f, {"tanh": peat.faults.sign_flip()}))(x, w)
    assert bool(jnp.all(out == -jnp.tanh(ref_dot)))


# ------------------------------------------------------------------ kernels


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shapes,dims", [
    (((5, 7), (7, 3)), (((1,), (0,)), ((), ()))),
    (((7, 5), (7, 3)), (((0,), (0,)), ((), ()))),            # transposed lhs
    (((2, 5, 7), (2, 3, 7)), (((2,), (2,)), ((0,), (0,)))),  # batch dims, rhs transposed
    (((3, 4, 6), (6, 2, 5)), (((2,), (0,)), ((), ()))),      # several free dims
])
def test_matmul_adapter_serves_any_dot_general(dtype, shapes, dims):
    a = jax.random.normal(jax.random.key(0), shapes[0]).astype(dtype)
    b = jax.random.normal(jax.random.key(1), shapes[1]).astype(dtype)
    f = lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)  # noqa
    ref = f(a, b)
    for kernel in (peat.kernels.blocked_matmul(block_k=2), peat.kernels.xla_matmul()):
        got = jax.jit(peat.substitute(f, {"dot_general": kernel}))(a, b)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_kernel_in_training_step_under_jit_grad_and_vmap(linen_mlp, mlp_data):
    loss, params = linen_mlp
    x, y = mlp_data
    kernel = peat.kernels.blocked_matmul(block_k=4)
    sub = peat.substitute(loss, {"dot_general": kernel})
    g_ref = jax.grad(loss)(params, x, y)
    g = jax.jit(jax.grad(sub))(params, x, y)
    for u, v in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
    per_example = jax.vmap(sub, in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
    ref = jax.vmap(loss, in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
    np.testing.assert_allclose(per_example, ref, rtol=1e-5)


def test_region_kernel_replaces_forward_and_backward():
    softmax = peat.region("softmax")(jax.nn.softmax)

    def loss(w, x):
        return jnp.sum(softmax(x @ w) ** 3)

    def my_softmax(z):  # a different but correct implementation
        e = jnp.exp(z - z.max(-1, keepdims=True))
        return e * (1.0 / e.sum(-1, keepdims=True))

    w = jax.random.normal(jax.random.key(0), (8, 8))
    x = jax.random.normal(jax.random.key(1), (3, 8))
    vg = jax.value_and_grad(loss)
    ref = vg(w, x)
    good = peat.substitute(vg, {"softmax": peat.Kernel("my_softmax", my_softmax)})
    got = jax.jit(good)(w, x)
    assert len(good.selected(w, x)) == 2
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-4, atol=1e-6)
    bad = peat.Kernel("bad_softmax", lambda z: jax.nn.softmax(z * 1.5))
    v, g = jax.jit(peat.substitute(vg, {"fwd:softmax": bad}))(w, x)
    assert abs(float(v - ref[0])) > 1e-3 and bool(jnp.array_equal(g, ref[1])) is False
    # only the backward region faulted: the loss is untouched, the gradient is not
    v, g = jax.jit(peat.substitute(vg, {"bwd:softmax": peat.faults.wrong_scale(2.0)}))(w, x)
    assert float(v) == float(ref[0])
    np.testing.assert_allclose(g, 2.0 * ref[1], rtol=1e-5)


# ------------------------------------------------------------------ errors


def test_wrong_shape_kernel_fails_clearly(linen_mlp, mlp_data):
    loss, params = linen_mlp
    bad = peat.Kernel("transposed", lambda a, b, **kw: (a @ b).T)
    with pytest.raises(peat.PeatError, match=r"returned \(float32\[16, 6\]\) at site #0"
                                             r".*needs \(float32\[6, 16\]\)"):
        peat.substitute(loss, {0: bad})(params, *mlp_data)
    bad_dtype = peat.Kernel("f16", lambda a, b, **kw: (a @ b).astype(jnp.float16))
    with pytest.raises(peat.PeatError, match="float16"):
        jax.jit(peat.substitute(loss, {0: bad_dtype}))(params, *mlp_data)


def test_kernel_for_another_primitive_fails_before_running(linen_mlp, mlp_data):
    loss, params = linen_mlp
    with pytest.raises(peat.PeatError, match="serves 'dot_general' sites, but site #1 is 'tanh'"):
        peat.substitute(loss, {"tanh": peat.kernels.blocked_matmul()})(params, *mlp_data)


def test_non_differentiable_kernel_under_grad_says_what_to_do(linen_mlp, mlp_data):
    loss, params = linen_mlp

    def host_matmul(a, b):
        return jax.pure_callback(lambda a, b: np.asarray(a) @ np.asarray(b),
                                 jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), a.dtype), a, b)

    k = peat.kernels.dot_general(host_matmul)
    sub = peat.substitute(loss, {"dot_general": k})
    np.testing.assert_allclose(sub(params, *mlp_data), loss(params, *mlp_data), rtol=1e-5)
    with pytest.raises(peat.PeatError, match="custom_vjp"):
        jax.grad(sub)(params, *mlp_data)
    # with a vjp it trains
    def vjp(ops, out, g, **_):
        a, b = ops
        return g @ b.T, a.T @ g
    k2 = peat.kernels.dot_general(host_matmul, vjp=vjp)
    g = jax.grad(peat.substitute(loss, {"dot_general": k2}))(params, *mlp_data)
    for u, v in zip(jax.tree.leaves(g), jax.tree.leaves(jax.grad(loss)(params, *mlp_data))):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def test_bad_substitution_values(linen_mlp, mlp_data):
    loss, params = linen_mlp
    with pytest.raises(peat.PeatError, match="peat.Kernel"):
        peat.substitute(loss, {0: lambda a, b: a @ b})
    with pytest.raises(peat.PeatError, match="mapping"):
        peat.substitute(loss, [0])
    with pytest.raises(peat.PeatError, match="matches no site"):
        peat.substitute(loss, {"conv_general_dilated": peat.faults.zeroed()})(params, *mlp_data)


# ------------------------------------------------------------------ switched execution


def test_switched_sweep_compiles_once_and_matches_static_substitution(linen_mlp, mlp_data):
    loss, params = linen_mlp
    vg = jax.value_and_grad(loss)
    fault = peat.faults.wrong_scale(1.5)
    sw = jax.jit(peat.switched(vg, {"dot_general": fault}))
    sites = [s.index for s in peat.list_sites(vg, params, *mlp_data)
             if s.primitive == "dot_general"]
    golden = sw(-1, params, *mlp_data)
    plain = jax.jit(vg)(params, *mlp_data)
    for a, b in zip(jax.tree.leaves(golden), jax.tree.leaves(plain)):
        # the switches change XLA's fusion: an element whose sum cancels moves by rounding at
        # the leaf's scale
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))
    for i in sites:
        got = sw(i, params, *mlp_data)
        static = jax.jit(peat.substitute(vg, {i: fault}))(params, *mlp_data)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(static)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert _leaves_changed(golden, got), i
    assert sw._cache_size() == 1


@pytest.mark.slow
def test_switched_sweep_over_transformer_one_compile(gpt):
    loss, params, tokens = gpt
    vg = jax.value_and_grad(loss)
    sw = jax.jit(peat.switched(vg, {"dot_general": peat.faults.wrong_scale(2.0)}))
    dots = [s.index for s in peat.list_sites(vg, params, tokens) if s.primitive == "dot_general"]
    golden_loss = sw(-1, params, tokens)[0]
    fwd_changed = 0
    for i in dots[:12]:
        fwd_changed += int(float(sw(i, params, tokens)[0]) != float(golden_loss))
    assert fwd_changed >= 8  # forward GEMMs change the loss
    assert sw._cache_size() == 1


@pytest.mark.slow
def test_flax_attention_region_outside_scan_can_be_replaced():
    class Attn(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            return nn.MultiHeadDotProductAttention(num_heads=2)(x, x, mask=mask)

    model = Attn()
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    params = model.init(jax.random.key(1), x)
    vg = jax.value_and_grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2))
    regions = (nn.MultiHeadDotProductAttention,)
    sites = [s for s in peat.list_sites(vg, params, x, regions=regions) if s.composite]
    assert [(s.primitive, s.phase) for s in sites] == [
        ("MultiHeadDotProductAttention", "fwd"), ("MultiHeadDotProductAttention", "bwd")]
    with peat.flax_regions(*regions):
        ref = jax.jit(vg)(params, x)
    same = jax.jit(peat.substitute(vg, {}, regions=regions))(params, x)
    assert bitwise_equal(ref, same)
    # a fused-kernel stand-in: the module's own math, with the output doubled
    def doubled(variables, x, x2, mask):
        inner = {"MultiHeadDotProductAttention_0": variables["params"]}
        return 2.0 * Attn().apply({"params": inner}, x)
    v, g = jax.jit(peat.substitute(vg, {"fwd:MultiHeadDotProductAttention":
                                        peat.Kernel("doubled", doubled)},
                                   regions=regions))(params, x)
    np.testing.assert_allclose(v, 4.0 * ref[0], rtol=1e-5)


def test_a_selector_skips_the_sites_its_kernel_cannot_serve_and_says_so():
    """{"dot_general": pallas_matmul} over a step with an int32 einsum (an attention mask):
    the float sites are substituted, the int32 one runs the reference with a one-line warning;
    a selector left with no site it can serve is an error."""
    k = peat.kernels.pallas_matmul()
    x, m = jnp.ones((4, 4)), jnp.ones((4, 4), jnp.int32)
    f = peat.substitute(lambda x, m: (x @ x).sum() + (m @ m).sum(), {"dot_general": k})
    with pytest.warns(UserWarning, match=r"skips 1 site\(s\) it cannot serve.*got int32"):
        chosen = f.selected(x, m)
    assert [s.in_dtypes[0] for s in chosen] == [jnp.float32]
    assert float(f(x, m)) == 128.0
    with pytest.raises(peat.PeatError, match="leaves it no site to serve"):
        peat.substitute(lambda m: m @ m, {"dot_general": k}).selected(m)
