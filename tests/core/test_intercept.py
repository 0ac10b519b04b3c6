"""Library functions replaced by name in models nobody edits (`peat.intercept`, `regions=` names):
listed as composite sites, substituted forward and backward, restored after tracing, and driven
from the shell (`peat sites --intercept`, `peat playback --kernel MOD:ATTR`)."""
from __future__ import annotations

import json
import threading
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import attention as flax_attention
from flax.linen.attention import dot_product_attention_weights   # as model libraries import it

import peat_jax as peat
from peat_jax._src import cli

DPA = "jax.nn.dot_product_attention"
FLAX_DPA = "flax.linen.dot_product_attention"
XENT = "optax.softmax_cross_entropy"
ORIGINAL_DPA = jax.nn.dot_product_attention
ORIGINAL_FLAX_DPA = flax_attention.dot_product_attention
ORIGINAL_XENT = optax.softmax_cross_entropy
ORIGINAL_WEIGHTS = dot_product_attention_weights


# --------------------------------------------------------------------------------------------
# Kernels (named from the shell as test_intercept:NAME)

def _attention(q, k, v, mask=None, causal=False, scale_by=1.0):
    """softmax(q k^T / sqrt(d)) v in jnp, q/k/v [batch, length, heads, head_dim]."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if causal:
        mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    if mask is not None:
        s = jnp.where(mask.astype(bool), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v) * scale_by


def _flax_attention(q, k, v, mask=None, **unused):   # flax.linen.dot_product_attention's call
    return _attention(q, k, v, mask)


def _flax_attention_no_mask(q, k, v, mask=None, **unused):
    return _attention(q, k, v)


def _flax_attention_scaled(q, k, v, mask=None, **unused):
    return _attention(q, k, v, mask, scale_by=1.01)


flax_attention_kernel = peat.Kernel("jnp_attention", _flax_attention, primitive=FLAX_DPA)
flax_attention_no_mask = peat.Kernel("no_mask", _flax_attention_no_mask, primitive=FLAX_DPA)
flax_attention_x1_01 = peat.Kernel("x1.01", _flax_attention_scaled, primitive=FLAX_DPA)


def _dpa(q, k, v, bias=None, mask=None, *, is_causal=False, scale=None):
    return _attention(q, k, v, mask, causal=is_causal)


def _dpa_ignoring_causal(q, k, v, bias=None, mask=None, *, is_causal=False, scale=None):
    return _attention(q, k, v, mask)


def _dpa_plain(q, k, v):
    return _attention(q, k, v)


dpa_kernel = peat.Kernel("jnp_dpa", _dpa, primitive=DPA)
dpa_no_causal_mask = peat.Kernel("no_causal_mask", _dpa_ignoring_causal, primitive=DPA)


# --------------------------------------------------------------------------------------------
# Models we do not edit: a Flax linen layer, and a function calling jax.nn by name

class Model(nn.Module):
    """Dense -> nn.MultiHeadDotProductAttention (causal) -> LayerNorm -> Dense; its attention
    calls flax.linen.dot_product_attention through the `attention_fn` field."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(
            h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
        return nn.Dense(5)(nn.LayerNorm()(h))


MODEL = Model()
TX = optax.adam(1e-2)


def _data(step: int):
    rng = np.random.RandomState(step)
    return (rng.standard_normal((2, 6, 4)).astype(np.float32),
            rng.randint(0, 5, (2, 6)).astype(np.int32))


def _loss(params, x, y):
    return optax.softmax_cross_entropy(MODEL.apply(params, x), jax.nn.one_hot(y, 5)).mean()


def _init(key):
    params = MODEL.init(key, _data(0)[0])
    return params, TX.init(params)


def _train_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(_loss)(params, *batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}


def make_workload():
    return peat.Workload("intercept_mha", _init, _train_step, _data)


peat.register_workload("intercept_mha", lambda **_: make_workload())


@jax.jit   # jitted and traced before peat sees it: the interception must trace it again
def library_attention(w, x):
    q = x @ w
    causal = jax.nn.dot_product_attention(q, x, x, is_causal=True)
    full = jax.nn.dot_product_attention(q, x, x)
    return (causal * full).sum()


def library_weights(q, k):
    """A model library's module calling a function it imported by name (transformers' Flax
    GPT-2, BERT and Llama do exactly this)."""
    return dot_product_attention_weights(q, k).sum()


def _wx():
    return jnp.eye(4) * 1.5, jax.random.normal(jax.random.key(0), (2, 5, 2, 4))


def _passes(candidate, golden) -> bool:
    return peat.detect(peat.analyze(candidate, golden)).passed


# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_flax_attention_layer_is_a_site_and_a_kernel_replaces_it_forward_and_backward():
    state, batch = _init(jax.random.key(0)), _data(0)
    sites = peat.list_sites(_train_step, state, batch, regions=(FLAX_DPA,))
    mine = [s for s in sites if s.primitive == FLAX_DPA]
    assert [s.phase for s in mine] == ["fwd", "bwd"]
    assert mine[0].composite and mine[0].path.endswith("MultiHeadDotProductAttention_0")
    assert mine[0].params["arguments"]["dropout_rate"] == 0.0   # what a kernel's supports reads
    assert mine[0].in_shapes[3] == (2, 1, 6, 6)                  # the mask is an input
    assert flax_attention.dot_product_attention is ORIGINAL_FLAX_DPA
    assert nn.MultiHeadDotProductAttention.attention_fn is ORIGINAL_FLAX_DPA

    golden = jax.jit(_train_step)(state, batch)
    outs = {}
    for kernel in (flax_attention_kernel, flax_attention_no_mask, flax_attention_x1_01):
        step = peat.substitute(_train_step, {FLAX_DPA: kernel}, regions=(FLAX_DPA,))
        outs[kernel.name] = jax.jit(step)(state, batch)
    assert _passes(outs["jnp_attention"], golden)
    assert not _passes(outs["no_mask"], golden)
    assert not _passes(outs["x1.01"], golden)


@pytest.mark.slow
def test_jax_attention_with_is_causal_reaches_the_kernel_and_a_kernel_without_it_skips():
    w, x = _wx()
    step = jax.grad(library_attention)
    golden = step(w, x)
    with peat.intercept(DPA):
        sites = peat.list_sites(step, w, x)
    mine = [s for s in sites if s.primitive == DPA]
    assert [(s.phase, s.params["arguments"]["is_causal"]) for s in mine] == [
        ("fwd", True), ("fwd", False), ("bwd", False), ("bwd", True)]

    def run(kernel, selector=DPA):
        return jax.jit(peat.substitute(step, {selector: kernel}, regions=(DPA,)))(w, x)

    assert _passes(run(dpa_kernel), golden)
    assert not _passes(run(dpa_no_causal_mask), golden)
    plain = peat.Kernel("plain", _dpa_plain, primitive=DPA)
    with pytest.warns(UserWarning, match=r"skips 2 site\(s\).*is_causal=True") as rec:
        assert _passes(run(plain), golden)   # the non-causal calls only: the same attention
    assert len(rec) == 1 and "\n" not in str(rec[0].message)
    with pytest.raises(peat.PeatError, match="is_causal=True, which its impl does not take"):
        run(plain, selector=(mine[0].index, mine[3].index))


def test_a_function_a_module_imported_by_name_is_intercepted_there_too():
    name = "flax.linen.dot_product_attention_weights"
    q = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
    sites = peat.list_sites(jax.grad(library_weights), q, q, regions=(name,))
    assert [s.phase for s in sites if s.primitive == name] == ["fwd", "bwd"]
    assert dot_product_attention_weights is ORIGINAL_WEIGHTS   # this module's binding restored
    assert flax_attention.dot_product_attention_weights is ORIGINAL_WEIGHTS


@pytest.mark.slow
def test_an_optax_loss_is_replaced_forward_and_backward():
    params, batch = _init(jax.random.key(0))[0], _data(0)
    xent = peat.Kernel("xent_x1.01", lambda logits, labels, axis=-1, where=None: 1.01 * -(
        labels * jax.nn.log_softmax(logits, axis)).sum(axis), primitive=XENT)
    loss = peat.substitute(_loss, {XENT: xent}, regions=(XENT,))
    assert float(loss(params, *batch)) == pytest.approx(1.01 * float(_loss(params, *batch)),
                                                         rel=1e-5)
    got, want = jax.grad(loss)(params, *batch), jax.grad(_loss)(params, *batch)
    assert np.allclose(jax.tree.leaves(got)[0], 1.01 * jax.tree.leaves(want)[0], rtol=1e-4,
                       atol=1e-7)
    assert optax.softmax_cross_entropy is ORIGINAL_XENT


def test_a_kernel_for_a_function_site_is_checked_against_the_library_function():
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 8, 1, 4)) for i in range(3))
    ref = jax.jit(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True))
    opts = dict(variants="example", repeats=1, conditioning=False)
    d = peat.check_kernel(jax.jit(lambda *a: dpa_kernel(*a, is_causal=True)), ref, q, k, v,
                          **opts)
    assert d.passed, d.summary   # (a failing kernel fails here as anywhere: test_check.py)


def test_the_function_is_restored_after_tracing_after_an_exception_and_in_other_threads():
    w, x = _wx()

    def broken(w, x):
        jax.nn.dot_product_attention(x @ w, x, x)
        raise RuntimeError("the model failed")

    with pytest.raises(RuntimeError, match="the model failed"):
        peat.list_sites(broken, w, x, regions=(DPA, FLAX_DPA))
    assert jax.nn.dot_product_attention is ORIGINAL_DPA
    assert flax_attention.dot_product_attention is ORIGINAL_FLAX_DPA
    assert nn.dot_product_attention is ORIGINAL_FLAX_DPA

    seen = {}
    with pytest.raises(KeyError):
        with peat.intercept(DPA):
            assert jax.nn.dot_product_attention is not ORIGINAL_DPA   # interposed ...

            def elsewhere():   # ... but another thread traces the original
                seen["sites"] = peat.list_sites(lambda x: jax.nn.dot_product_attention(x, x, x),
                                                x)
            t = threading.Thread(target=elsewhere)
            t.start()
            t.join()
            raise KeyError("inside")
    assert jax.nn.dot_product_attention is ORIGINAL_DPA
    assert not any(s.composite for s in seen["sites"])


@pytest.mark.parametrize("name, needle", [
    ("jax.nn.dot_product_atention", "has no attribute 'dot_product_atention' (did you mean "
                                    "'jax.nn.dot_product_attention'?)"),
    ("no_such_package.fn", "there is no module 'no_such_package'"),
    ("dot_product_attention", "give a dotted name"),
    ("optax.GradientTransformation", "it is a class"),
])
def test_a_name_that_does_not_resolve_is_a_one_line_error(name, needle):
    with pytest.raises(peat.PeatError) as e:
        peat.list_sites(lambda x: x * 2, jnp.ones(3), regions=(name,))
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(peat.PeatError, match="A library function is a site only while"):
        peat.substitute(library_attention, {DPA: dpa_kernel})(*_wx())


@pytest.mark.slow
def test_the_shell_lists_the_site_and_plays_back_a_kernel_named_mod_attr(tmp_path, capsys):
    assert cli.main(["sites", "test_intercept:make_workload", "--intercept", FLAX_DPA,
                     "--json"]) == 0
    listed = [s for s in json.loads(capsys.readouterr().out) if s["primitive"] == FLAX_DPA]
    assert [(s["phase"], s["composite"]) for s in listed] == [("fwd", True), ("bwd", True)]

    run = str(tmp_path / "run")
    peat.profile(make_workload(), run, steps=2, checkpoint_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ok = cli.main(["playback", run, "--kernel", "test_intercept:flax_attention_kernel",
                       "--checkpoints", "1", "--json"])
        records = json.loads(capsys.readouterr().out)
        rt = cli.main(["runtime", run, "--kernel", "test_intercept:flax_attention_x1_01",
                       "--every", "1", "--steps", "2", "--json"])
        runtime = json.loads(capsys.readouterr().out)
    assert ok == 0, records
    assert [(c["primitive"], c["phase"]) for c in records["cells"]] == [(FLAX_DPA, "fwd"),
                                                                      (FLAX_DPA, "bwd")]
    assert rt in (0, 1) and runtime["fired_steps"] == [0, 1]
    other = str(tmp_path / "with_kernel")
    assert cli.main(["profile", "test_intercept:make_workload", "--out", other, "--steps", "1",
                     "--kernel", "test_intercept:flax_attention_x1_01", "--json"]) == 0
    capsys.readouterr()
    manifest = json.loads((tmp_path / "with_kernel" / "manifest.json").read_text())
    [record] = manifest["substitution"]
    assert record["candidate"] == "x1.01" and len(record["sites"]) == 2, record
    assert runtime["losses"] != runtime["golden_losses"]   # the kernel was in the step
    assert flax_attention.dot_product_attention is ORIGINAL_FLAX_DPA
