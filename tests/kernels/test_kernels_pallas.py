"""Bundled Pallas kernels (and jax's shipped ones) against their XLA references, forward and
backward, over float32/bfloat16/float16 and divisible/non-divisible shapes; shape errors at
substitution time.

Errors are measured relative to the reference's scale: max|candidate - reference| / max|reference|
(for the backward, over every operand cotangent under one random cotangent). Tolerances per dtype:
float32 1e-5 (reduction order only); float16 1e-2 and bfloat16 6e-2, about 10 and 8 ULPs (2^-10,
2^-7): the kernels keep float32 statistics while the XLA references round intermediates to the
low-precision dtype, so most of the difference is the reference's own error (measured against
float64 by benchmarks/bench_kernels.py: e.g. softmax bfloat16 backward 2.6e-2 for the reference,
2.9e-3 for the Pallas kernel).
"""
from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import needs
import numpy as np
import pytest

import peat_jax as peat
from peat_jax._src.kernels import pallas as pk
from peat_jax._src.kernels import references

TOL = {jnp.float32: 1e-5, jnp.float16: 1e-2, jnp.bfloat16: 6e-2}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _rel_err(got, ref) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    assert got.shape == ref.shape
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def _fwd_bwd_errors(candidate, reference, args, seed=7) -> tuple[float, float]:
    """(forward error, worst backward error) under one random cotangent, both jitted."""
    def both(fn, g, *a):
        y, vjp = jax.vjp(fn, *a)
        return y, vjp(g)

    out = jax.eval_shape(reference, *args)
    g = jax.random.normal(jax.random.key(seed), out.shape, jnp.float32).astype(out.dtype)
    y_c, g_c = jax.jit(functools.partial(both, candidate))(g, *args)
    y_r, g_r = jax.jit(functools.partial(both, reference))(g, *args)
    assert y_c.dtype == y_r.dtype and y_c.shape == y_r.shape
    for a, b in zip(g_c, g_r):
        assert a.dtype == b.dtype and a.shape == b.shape
    return _rel_err(y_c, y_r), max(_rel_err(a, b) for a, b in zip(g_c, g_r))


def _normal(seed, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


# ------------------------------------------------------------------ matmul at dot_general sites

MATMUL_CASES = {
    # name: (lhs shape, rhs shape, dimension numbers)
    "divisible": ((32, 48), (48, 32), (((1,), (0,)), ((), ()))),
    "ragged": ((30, 45), (45, 29), (((1,), (0,)), ((), ()))),
    "batch_transposed_rhs": ((2, 17, 33), (2, 18, 33), (((2,), (2,)), ((0,), (0,)))),
}


def _dt(dtype) -> str:
    return jnp.dtype(dtype).name


def _cases(*pairs):
    """pytest params `(case, dtype)` with readable ids."""
    return [pytest.param(c, d, id=f"{c}-{_dt(d)}") for c, d in pairs]


# every layout in float32, the low-precision dtypes on the ragged layout (the harder one)
@pytest.mark.parametrize("case,dtype", _cases(
    *[(c, jnp.float32) for c in MATMUL_CASES],
    *[("ragged", d) for d in (jnp.bfloat16, jnp.float16)]))
def test_pallas_matmul_matches_xla_forward_and_backward(case, dtype):
    ls, rs, dims = MATMUL_CASES[case]
    a, b = _normal(0, ls, dtype), _normal(1, rs, dtype)
    ref = lambda a, b: jax.lax.dot_general(a, b, dims)  # noqa: E731
    cand = peat.substitute(ref, {"dot_general": pk.pallas_matmul(16, 16, 16)})
    fwd, bwd = _fwd_bwd_errors(cand, ref, (a, b))
    assert fwd <= TOL[dtype] and bwd <= TOL[dtype], (fwd, bwd)


def test_pallas_matmul_casts_to_preferred_element_type_and_vmaps():
    a, b = _normal(0, (5, 7), jnp.bfloat16), _normal(1, (7, 3), jnp.bfloat16)
    ref = lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),  # noqa: E731
                                           preferred_element_type=jnp.float32)
    cand = peat.substitute(ref, {"dot_general": pk.pallas_matmul()})
    got = jax.jit(cand)(a, b)
    assert got.dtype == jnp.float32
    assert _rel_err(got, ref(a, b)) <= 1e-6  # bf16 products are exact in float32
    # the substituted function under vmap: pallas_call batches into its grid
    batched = jax.vmap(cand, in_axes=(0, None))(jnp.stack([a, 2 * a]), b)
    assert _rel_err(batched[1], 2 * ref(a, b)) <= 1e-6


# ------------------------------------------------------------------ regions

# x shapes: 32 rows of 16 (multiples of the 8-row block and a power-of-two row) or 21 rows of 13
ROWS = {"divisible": (4, 8, 16), "ragged": (3, 7, 13)}

# every dtype on the ragged shape, the divisible one in float32
ROW_CASES = _cases(*[("ragged", d) for d in DTYPES], ("divisible", jnp.float32))


@pytest.mark.parametrize("shape,dtype", ROW_CASES)
def test_pallas_softmax_matches_xla(shape, dtype):
    x = _normal(0, ROWS[shape], dtype, scale=3.0)
    fwd, bwd = _fwd_bwd_errors(pk.pallas_softmax(block_rows=8), references.softmax, (x,))
    assert fwd <= TOL[dtype] and bwd <= TOL[dtype], (fwd, bwd)


# jax's kernel masks whole rows of any length (one program per row): ragged rows only
@pytest.mark.parametrize("which,shape,dtype", [
    *[pytest.param("pallas", c, d, id=f"pallas-{c}-{_dt(d)}") for c, d in
      [("ragged", d) for d in DTYPES] + [("divisible", jnp.float32)]],
    *[pytest.param("jax_pallas", "ragged", d, id=f"jax_pallas-ragged-{_dt(d)}",
                   marks=needs.skip_unless(needs.pallas_op("layer_norm")))
      for d in (jnp.float32, jnp.bfloat16)]])
def test_layer_norm_kernels_match_xla(which, shape, dtype):
    n = ROWS[shape][-1]
    x = _normal(0, ROWS[shape], dtype, scale=2.0) + 0.5
    scale = (1.0 + 0.1 * jax.random.normal(jax.random.key(1), (n,))).astype(dtype)
    bias = _normal(2, (n,), dtype, scale=0.1)
    kernel = pk.pallas_layer_norm(block_rows=8) if which == "pallas" else pk.jax_pallas_layer_norm()
    fwd, bwd = _fwd_bwd_errors(kernel, references.layer_norm, (x, scale, bias))
    assert fwd <= TOL[dtype] and bwd <= TOL[dtype], (fwd, bwd)


ATTENTION = {
    # name: (q shape, kv shape)
    "divisible": ((2, 32, 2, 16), (2, 32, 2, 16)),
    "ragged_cross": ((2, 9, 2, 12), (2, 11, 2, 12)),
    "ragged": ((1, 21, 2, 12), (1, 21, 2, 12)),
}


# causal on a ragged length in every dtype; non-causal on a divisible and a ragged
# cross-attention shape in float32
@pytest.mark.slow
@pytest.mark.parametrize("shape,dtype", _cases(
    *[("ragged", d) for d in DTYPES], ("divisible", jnp.float32), ("ragged_cross", jnp.float32)))
def test_pallas_attention_matches_flax_dot_product_attention(shape, dtype):
    causal = shape == "ragged"
    qs, ks = ATTENTION[shape]
    q, k, v = _normal(0, qs, dtype), _normal(1, ks, dtype), _normal(2, ks, dtype)
    kernel = pk.pallas_attention(causal=causal, block_q=16, block_k=16)
    reference = functools.partial(references.attention, causal=causal)
    fwd, bwd = _fwd_bwd_errors(kernel, reference, (q, k, v))
    assert fwd <= TOL[dtype] and bwd <= TOL[dtype], (fwd, bwd)


# jax's shipped kernels in float32 and bfloat16 here; float16 is measured by
# benchmarks/bench_kernels.py
@pytest.mark.slow
@needs.skip_unless(needs.pallas_op("attention"))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=_dt)
def test_jax_pallas_mha_matches_flax_dot_product_attention(dtype):
    q, k, v = (_normal(i, (1, 32, 2, 12), dtype) for i in range(3))
    kernel = pk.jax_pallas_mha(causal=True, block_q=16, block_k=16)
    fwd, bwd = _fwd_bwd_errors(kernel, functools.partial(references.attention, causal=True),
                               (q, k, v))
    assert fwd <= TOL[dtype] and bwd <= TOL[dtype], (fwd, bwd)


def test_flax_layer_norm_adapter_serves_nn_layer_norm_regions():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.LayerNorm()(x)                                   # scale and bias
            return nn.LayerNorm(use_bias=False)(jnp.tanh(x)) * 2.0   # scale only

    x = _normal(0, (3, 5, 12), jnp.float32, 2.0)
    params = Net().init(jax.random.key(1), x)
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape), params)
    vg = jax.value_and_grad(lambda p, x: jnp.sum(Net().apply(p, x) ** 3))
    regions = (nn.LayerNorm,)
    with peat.flax_regions(*regions):
        ref = jax.jit(vg)(params, x)
    sub = peat.substitute(vg, {"LayerNorm": pk.flax_layer_norm()}, regions=regions)
    assert len(sub.selected(params, x)) == 4  # two modules, fwd and bwd
    got = jax.jit(sub)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert _rel_err(a, b) <= 2e-5


# ------------------------------------------------------------------ errors at substitution time


def _selected_error(fn, subs, *args, **kw):
    with pytest.raises(peat.PeatError) as e:
        peat.substitute(fn, subs, **kw).selected(*args)  # resolves only: nothing runs
    return str(e.value)


_TWICE = {   # a bundled kernel's functional form, its arguments, its jitted Pallas function
    "matmul": (pk.matmul, ((8, 16), (16, 4)), "_matmul3"),
    "softmax": (pk.softmax, ((6, 10),), "_"),
    "layer_norm": (pk.layer_norm, ((6, 10), (10,), (10,)), "_"),
    "attention": (pk.attention, ((1, 8, 2, 4),) * 3, "_"),
}


@pytest.mark.parametrize("name", sorted(_TWICE))
def test_a_program_lowers_a_bundled_kernel_once_per_shape(name):
    """A program that calls a kernel twice on one shape (a model's sites of one shape; a check's
    plain forward beside its VJP) lowers its Pallas calls once, a function called twice. (The
    plain and the VJP's forward share it where the forward returns nothing else: layer norm's
    and attention's also return their residuals, which the plain forward drops, and jax prunes
    that call apart.)"""
    fn, shapes, prefix = _TWICE[name]
    args = [_normal(i, s, jnp.float32) for i, s in enumerate(shapes)]

    def program(*args):
        out, vjp = jax.vjp(fn, *args)
        return fn(*args) + 2 * fn(*args), out, vjp(jnp.ones_like(out))

    text = jax.jit(program).lower(*args).as_text()
    pallas = r"(?:_matmul3|_forward|_backward)(?:_\d+)?"
    defined = re.findall(rf"func\.func private @({pallas})\(", text)
    called = re.findall(rf"call @({pallas})\(", text)
    assert defined and all(d.startswith(prefix) for d in defined), defined
    assert len(defined) < len(called) and set(defined) == set(called), (defined, called)


def test_sites_a_kernel_cannot_serve_fail_at_substitution():
    x = _normal(0, (4, 6), jnp.float32)
    ln = peat.region("layer_norm")(lambda x, s, b: x * s.sum(-1) + b)
    msg = _selected_error(lambda x: ln(x, jnp.ones((6, 2)), jnp.zeros(6)),
                          {"layer_norm": pk.pallas_layer_norm()}, x)
    assert "cannot use kernel 'pallas_layer_norm" in msg and "scale must have shape (6,)" in msg

    attn = peat.region("attention")(lambda q, k, v: q)
    msg = _selected_error(lambda x: attn(x, x, x), {"attention": pk.pallas_attention()}, x)
    assert "[batch, seq, heads, head_dim]" in msg

    q4, k4 = _normal(0, (1, 8, 2, 4), jnp.float32), _normal(1, (1, 6, 2, 4), jnp.float32)
    msg = _selected_error(lambda q, k: attn(q, k, k),
                          {"attention": pk.pallas_attention(causal=True)}, q4, k4)
    assert "equal query and key lengths" in msg

    msg = _selected_error(jnp.exp, {"exp": pk.pallas_softmax()}, x)
    assert "not the primitive site 'exp'" in msg

    i = jnp.ones((4, 6), jnp.int32)
    msg = _selected_error(lambda a: a @ a.T, {"dot_general": pk.pallas_matmul()}, i)
    assert "int32" in msg


@needs.skip_unless(needs.pallas_op("attention"))
def test_jax_mha_serves_only_sequences_in_whole_blocks():
    attn = peat.region("attention")(lambda q, k, v: q)
    q12 = _normal(0, (1, 24, 2, 4), jnp.float32)
    msg = _selected_error(lambda q: attn(q, q, q), {"attention": pk.jax_pallas_mha(block_q=16)},
                          q12)
    assert "multiples of the blocks" in msg and "q_len=24" in msg


def test_bad_options_fail_when_the_kernel_is_made():
    with pytest.raises(peat.PeatError, match="power of two"):
        pk.pallas_matmul(block_m=24)
    with pytest.raises(peat.PeatError, match="checks= needs the Pallas interpreter"):
        pk.pallas_softmax(interpret=False, checks=True)
    with pytest.raises(peat.PeatError, match="eps must be positive"):
        pk.pallas_layer_norm(eps=0.0)
    assert pk.interpret_mode() is (jax.default_backend() == "cpu")


@pytest.mark.parametrize("factory,op", [
    pytest.param(f, op, id=f, marks=needs.skip_unless(needs.pallas_op(op)))
    for f, op in [("jax_pallas_layer_norm", "layer_norm"), ("jax_pallas_mha", "attention")]])
def test_jax_shipped_kernels_import_without_a_deprecation_warning(factory, op):
    """jax 0.11+ deprecates its Pallas GPU ops (for tokamax); the factories silence that one
    warning (it would point at peat's import) and warn about nothing else."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(pk, factory)()


@pytest.mark.parametrize("factory,op,instead", [
    ("jax_pallas_layer_norm", "layer_norm", "pallas_layer_norm()"),
    ("jax_pallas_mha", "attention", "pallas_attention()")])
def test_a_jax_without_its_shipped_kernel_says_what_to_use_instead(monkeypatch, factory, op,
                                                                  instead):
    """jax 0.12.1 dropped its Triton Pallas ops; there (simulated on every leg by blocking the
    import) the factory says so in one line and names peat's own kernel for the region."""
    import sys
    monkeypatch.setitem(sys.modules, needs.pallas_op(op), None)  # import raises ImportError
    with pytest.raises(peat.PeatError, match="does not ship") as e:
        getattr(pk, factory)()
    assert instead in str(e.value) and "\n" not in str(e.value)
