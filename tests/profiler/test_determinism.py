"""Nondeterminism of the reference itself is detected and reported, not blamed on the candidate."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import peat_jax as peat
from peat_jax._src.profiler.golden import profile
from peat_jax._src.profiler.playback import playback

_RNG = np.random.default_rng()  # unseeded on purpose: a reference that differs run to run


def _jitter(x, rel=1e-6):
    """x times (1 + rel * u), u ~ U(-1, 1) drawn afresh at every execution (like an
    atomics-based reduction whose order changes run to run)."""
    def host(v):
        v = np.asarray(v)
        return (v * (1 + rel * _RNG.uniform(-1, 1, v.shape))).astype(v.dtype)

    return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


@jax.custom_jvp
def _noisy_sum(x):
    return _jitter(jnp.sum(x, axis=-1))


@_noisy_sum.defjvp
def _noisy_sum_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _noisy_sum(x), jnp.sum(t, axis=-1)


@jax.custom_jvp
def _noisy_identity(x):
    return _jitter(x)


@_noisy_identity.defjvp
def _noisy_identity_jvp(primals, tangents):
    return _noisy_identity(primals[0]), tangents[0]


def _tanh_reference(x, w):
    return _noisy_sum(jnp.tanh(x @ w)[..., None] * jnp.ones(4, x.dtype))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(33, 20, 5)])
def test_check_kernel_does_not_blame_a_correct_candidate_for_a_nondeterministic_reference(shape):
    m, k, n = shape
    x = jax.random.normal(jax.random.key(0), (m, k))
    w = jax.random.normal(jax.random.key(1), (k, n))

    def correct(x, w):  # deterministic, and as exact as the reference's own arithmetic
        return jnp.sum(jnp.tanh(x @ w)[..., None] * jnp.ones(4, x.dtype), axis=-1)

    d = peat.check_kernel(correct, _tanh_reference, x, w, variants="example")
    assert d.passed, d.summary
    assert "reference itself is nondeterministic" in d.summary
    assert "forward on example" in d.evidence["reference_nondeterministic"]

    def wrong(x, w):  # a real bug is still found, with the reference's noise reported
        return correct(x, w) * 1.01

    d = peat.check_kernel(wrong, _tanh_reference, x, w, variants="example")
    assert not d.passed and d.model == "wrong_scale", d.summary
    assert "reference_nondeterministic" in d.evidence


def test_check_kernel_deterministic_reference_reports_nothing():
    x = jax.random.normal(jax.random.key(0), (16, 12))
    d = peat.check_kernel(lambda a: jnp.tanh(a), jnp.tanh, x, variants="example")
    assert d.passed and "reference_nondeterministic" not in d.evidence


def _mlp_workload():
    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"w1": jax.random.normal(k1, (8, 16)) * 0.3,
                  "w2": jax.random.normal(k2, (16, 3)) * 0.3}
        return {"params": params, "opt": optax.sgd(0.1).init(params), "step": jnp.int32(0)}

    def loss_fn(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"])
        h = _noisy_identity(h)  # the nondeterministic op of this "reference" model
        logits = h @ params["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def train_step(state, batch):
        loss, g = jax.value_and_grad(loss_fn)(state["params"], batch)
        upd, opt = optax.sgd(0.1).update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], upd)
        return {"params": params, "opt": opt, "step": state["step"] + 1}, {"loss": loss}

    def batch(step):
        r = np.random.default_rng(step)
        return {"x": r.normal(size=(32, 8)).astype(np.float32),
                "y": r.integers(0, 3, size=32).astype(np.int32)}

    return peat.Workload("noisy_mlp", init, train_step, batch)


@pytest.mark.slow
def test_playback_reports_a_nondeterministic_reference_and_does_not_blame_the_candidate(tmp_path):
    wl = _mlp_workload()
    profile(wl, tmp_path / "run", steps=6, checkpoint_every=3)
    ref = peat.Kernel("xla_dot", lambda a, b, **p: jax.lax.dot_general(a, b, **p))
    res = playback(tmp_path / "run", {"dot_general": ref}, workload=wl, name="ref")
    assert set(res.reference_spread) == {0, 3} and min(res.reference_spread.values()) > 0
    recs = res.records()
    assert recs and all(r["local"]["model"] == "exact" for r in recs)
    assert all(r["effect"]["model"] == "masked" for r in recs), [r["effect"]["summary"]
                                                                 for r in recs]
    # the candidate's changes are within the reference's own: its spread is what excused them
    # (a leaf the reference does not spread on may still move within the dtype's rounding)
    effects = [r["effect"] for r in recs]
    spread = [e for e in effects if e["reference_spread"] > 0 and e["noise_ratio"] > 0]
    assert spread and all("run-to-run" in e["summary"] for e in spread), effects
    assert all(e["change"] <= e["noise"] for e in effects), effects
    # a real bug at one site is still blamed
    bad = playback(tmp_path / "run", {"fwd:dot_general": peat.faults.wrong_scale(1.5)}, workload=wl,
                   name="bad", checkpoints=[3])
    assert all(not r["effect"]["passed"] and not r["local"]["passed"] for r in bad.records())
