"""Site enumeration on known programs: counts, phases, paths, containers, regions, selectors."""
from __future__ import annotations

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl

import peat_jax as peat


def _dots(sites):
    return [s for s in sites if s.primitive == "dot_general"]


def _phases(sites):
    return collections.Counter(s.phase for s in sites)


def test_linen_mlp_value_and_grad_has_2_fwd_and_3_bwd_dots(linen_mlp, mlp_data):
    loss, params = linen_mlp
    sites = peat.list_sites(jax.value_and_grad(loss), params, *mlp_data)
    dots = _dots(sites)
    assert _phases(dots) == {"fwd": 2, "bwd": 3}
    assert [(s.phase, s.path) for s in dots] == [
        ("fwd", "LinenMLP/fc1"), ("fwd", "LinenMLP/head"),
        ("bwd", "LinenMLP/head"), ("bwd", "LinenMLP/head"), ("bwd", "LinenMLP/fc1")]
    assert [s.index for s in sites] == list(range(len(sites)))
    fc1 = dots[0]
    assert fc1.in_shapes == ((6, 8), (8, 16)) and fc1.out_shapes == ((6, 16),)
    assert fc1.out_dtypes == (jnp.dtype("float32"),)
    assert fc1.params["dimension_numbers"] == (((1,), (0,)), ((), ()))
    # the weight gradient of fc1 contracts over the batch
    assert dots[-1].out_shapes == ((16, 8),)
    assert [s.primitive for s in sites if s.primitive != "dot_general"] == [
        "tanh", "reduce_sum"]


@pytest.mark.parametrize("framework", ["linen", "plain", "nnx", "equinox"])
def test_same_mlp_in_every_framework_has_2_fwd_and_3_bwd_dots(mlp_variants, mlp_data, framework):
    loss, params = mlp_variants[framework]
    dots = _dots(peat.list_sites(jax.value_and_grad(loss), params, *mlp_data))
    assert _phases(dots) == {"fwd": 2, "bwd": 3}
    assert [s.phase for s in dots] == ["fwd", "fwd", "bwd", "bwd", "bwd"]


def test_scan_remat_transformer_sites_inside_scan_and_remat(gpt):
    loss, params, tokens = gpt
    sites = peat.list_sites(jax.value_and_grad(loss), params, tokens)
    dots = _dots(sites)
    # per block: q, k, v, scores, weighted sum, out, 2 MLP = 8 fwd; head 1 fwd
    assert sum(s.phase == "fwd" for s in dots) == 9
    in_scan = [s for s in dots if "scan" in s.scope]
    # fwd; remat recompute (all but the block's last GEMM, whose output the backward never needs);
    # two GEMMs (input and weight gradient) per fwd GEMM
    assert len(in_scan) == 8 + 7 + 16
    assert all("remat2" in s.scope for s in in_scan if s.phase == "bwd")
    assert {s.repeats for s in in_scan} == {2}  # one site, run once per layer
    assert {s.repeats for s in dots if "scan" not in s.scope} == {1}
    assert {s.path for s in in_scan} >= {"TinyGPT/blocks/Dense_0",
                                         "TinyGPT/blocks/MultiHeadDotProductAttention_0/query"}
    assert len(sites) >= 30


def test_containers_are_descended_and_kernels_are_opaque():
    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.exp(x_ref[...]) * 2.0

    def pallas_exp(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=True)(x)

    @jax.jit
    def inner(x):
        return jnp.sin(x)

    def f(x):
        x = inner(x)
        x = lax.cond(x.sum() > 0, jnp.cos, jnp.tanh, x)
        x, _ = lax.scan(lambda c, _: (jnp.log1p(c * c), None), x, None, length=3)
        x = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.sqrt(c[1] + 1)), (0, x))[1]
        x = jax.nn.relu(x) + jax.checkpoint(jnp.exp)(x)
        return pallas_exp(x).sum()

    sites = peat.list_sites(f, jnp.ones((4,)))
    prims = [(s.primitive, s.scope) for s in sites]
    assert ("sin", ("jit",)) in prims
    assert ("cos", ("cond",)) in prims and ("tanh", ("cond",)) in prims
    assert ("log1p", ("scan",)) in prims
    assert ("sqrt", ("while",)) in prims
    assert ("exp", ("remat2",)) in prims
    pallas = [s for s in sites if s.primitive == "pallas_call"]
    assert len(pallas) == 1 and pallas[0].out_shapes == ((4,),)
    # the kernel body's exp is not a site: only the checkpointed exp is
    assert sum(p == "exp" for p, _ in prims) == 1


def test_region_sites_fwd_and_bwd():
    softmax = peat.region("softmax")(jax.nn.softmax)

    def loss(w, x):
        return jnp.sum(softmax(x @ w) ** 2)

    sites = peat.list_sites(jax.value_and_grad(loss), jnp.ones((8, 8)), jnp.ones((3, 8)))
    regions = [s for s in sites if s.composite]
    assert [(s.primitive, s.phase) for s in regions] == [("softmax", "fwd"), ("softmax", "bwd")]
    assert regions[0].in_shapes == ((3, 8),) and regions[0].out_shapes == ((3, 8),)
    assert regions[1].in_shapes == ((3, 8), (3, 8))  # input residual and cotangent
    inner = [s for s in sites if s.path == "softmax"]
    assert {"exp", "reduce_sum", "reduce_max"} <= {s.primitive for s in inner}
    # a marked region computes what the function computes, forward and backward
    w = jax.random.normal(jax.random.key(0), (8, 8))
    x = jax.random.normal(jax.random.key(1), (3, 8))
    ref = jax.grad(lambda w: jnp.sum(jax.nn.softmax(x @ w) ** 2))(w)
    assert jnp.allclose(jax.grad(loss)(w, x), ref, rtol=1e-6, atol=1e-7)


def test_flax_module_regions_in_scan_remat_transformer(gpt):
    loss, params, tokens = gpt
    sites = peat.list_sites(jax.value_and_grad(loss), params, tokens, regions=(nn.LayerNorm,))
    ln = [s for s in sites if s.composite]
    assert {s.primitive for s in ln} == {"LayerNorm"}
    fwd = [s.path for s in ln if s.phase == "fwd"]
    assert fwd == ["TinyGPT/blocks/LayerNorm_0", "TinyGPT/blocks/LayerNorm_1",
                   "TinyGPT/LayerNorm_0"]
    # LayerNorm inputs: scale, bias (variables) and x
    assert ln[0].in_shapes == ((32,), (32,), (2, 8, 32))
    assert sum(s.phase == "bwd" and len(s.out_shapes) == 3 for s in ln) == 3
    without = peat.list_sites(jax.value_and_grad(loss), params, tokens)
    assert not any(s.composite for s in without)
    # the class's dotted name, as it was intercepted, selects its regions (named by the class)
    assert peat.select(sites, "flax.linen.LayerNorm") == ln
    assert peat.select(sites, "fwd:flax.linen.LayerNorm") == [s for s in ln if s.phase == "fwd"]
    with pytest.raises(peat.PeatError, match="matches no site"):
        peat.select(sites, "flax.linen.RMSNorm")


def test_selectors(linen_mlp, mlp_data):
    loss, params = linen_mlp
    sites = peat.list_sites(jax.value_and_grad(loss), params, *mlp_data)
    idx = lambda sel: [s.index for s in peat.select(sites, sel)]  # noqa: E731
    dots = [s.index for s in _dots(sites)]
    assert idx("dot_general") == dots
    assert idx("bwd:dot_general") == dots[2:]
    assert idx("fwd:dot_general") == dots[:2]
    assert idx("head") == [dots[1], dots[2], dots[3]]
    assert idx("LinenMLP/*") == [s.index for s in sites if s.path.startswith("LinenMLP")]
    assert idx("fc1/*") == [dots[0], dots[4]]
    assert idx(3) == [3]
    assert idx([0, "tanh"]) == sorted({0, next(s.index for s in sites if s.primitive == "tanh")})
    assert idx(lambda s: s.out_shapes == ((16, 8),)) == [dots[4]]


@pytest.mark.parametrize("selector", ["conv_general_dilated", "NoSuchModule/*", 99,
                                      lambda s: False])
def test_selector_matching_nothing_lists_what_exists(linen_mlp, mlp_data, selector):
    loss, params = linen_mlp
    sites = peat.list_sites(jax.value_and_grad(loss), params, *mlp_data)
    with pytest.raises(peat.PeatError) as e:
        peat.select(sites, selector)
    msg = str(e.value)
    assert "dot_general" in msg and ("LinenMLP/fc1" in msg or "out of range" in msg)


def test_primitives_option_changes_what_counts(linen_mlp, mlp_data):
    loss, params = linen_mlp
    only = peat.list_sites(jax.value_and_grad(loss), params, *mlp_data, primitives=["dot_general"])
    assert [s.primitive for s in only] == ["dot_general"] * 5
    everything = peat.list_sites(jax.value_and_grad(loss), params, *mlp_data, primitives="all")
    assert {"mul", "sub", "transpose"} <= {s.primitive for s in everything}
    assert len(everything) > len(peat.list_sites(jax.value_and_grad(loss), params, *mlp_data))


def test_site_order_is_stable(gpt):
    loss, params, tokens = gpt
    a = peat.list_sites(jax.value_and_grad(loss), params, tokens)
    b = peat.list_sites(jax.value_and_grad(loss), params, tokens)
    assert a == b
    assert "bwd" in str(a[-1]) and "#%d" % a[-1].index in str(a[-1])


def test_reduction_length_is_what_one_output_element_sums():
    """A matmul's K, a sum's extent, a convolution's window times its input features; None for
    an op that sums nothing."""
    from peat_jax._src.sites import reduction_length

    def f(a, b, x, w):
        conv = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")     # NCHW, OIHW
        return jnp.sum(a @ b, axis=1), conv, jnp.tanh(a)

    a, b = jnp.ones((5, 7)), jnp.ones((7, 3))
    x, w = jnp.ones((1, 4, 6, 6)), jnp.ones((2, 4, 3, 3))
    k = {s.primitive: reduction_length(s) for s in peat.list_sites(f, a, b, x, w)}
    assert k["dot_general"] == 7 and k["reduce_sum"] == 3
    assert k["conv_general_dilated"] == 4 * 3 * 3 and k["tanh"] is None


def test_trace_key_is_what_a_trace_depends_on():
    """Equal for arguments a trace cannot tell apart (same structure, shapes, dtypes and weak
    types, same static leaves); different when any of those differs; None when a static leaf
    cannot be hashed."""
    from peat_jax._src.sites import trace_key
    x = jnp.ones((2, 3), jnp.float32)
    base = trace_key(((x, 1.0), "mode"))
    assert base == trace_key(((jnp.zeros((2, 3), jnp.float32), 2.0), "mode"))
    assert base != trace_key(((jnp.ones((3, 2), jnp.float32), 1.0), "mode"))
    assert base != trace_key(((jnp.ones((2, 3), jnp.bfloat16), 1.0), "mode"))
    assert base != trace_key(((x, 1.0), "other"))
    assert base != trace_key(((x, jnp.float32(1.0)), "mode"))      # weak type differs
    assert base != trace_key({"a": x, "b": 1.0, "c": "mode"})
    assert trace_key((x, ["unhashable"])) is not None               # a list is a pytree node
    assert trace_key((x, {1, 2})) is None                           # a set leaf is unhashable
