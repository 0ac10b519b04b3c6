"""Playback's effect: what a candidate at one site did to the replayed step, in training terms."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import peat_jax as peat
from peat_jax._src import taxonomy
from peat_jax._src.profiler.effect import Effect, pseudo_error
from peat_jax._src.profiler.golden import profile
from peat_jax._src.profiler.playback import playback

_W2_GRAD = (3, 16)  # the head's weight gradient (transposed): one backward dot_general


def _mlp(optimizer: str) -> peat.Workload:
    tx = {"sgd": optax.sgd(0.1), "adam": optax.adam(1e-2)}[optimizer]

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {"w1": jax.random.normal(k1, (8, 16)) * 0.3,
                  "w2": jax.random.normal(k2, (16, 3)) * 0.3}
        return {"params": params, "opt": tx.init(params), "step": jnp.int32(0)}

    def loss_fn(params, batch):
        logits = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == batch["y"])

    def train_step(state, batch):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        upd, opt = tx.update(g, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], upd)
        return ({"params": params, "opt": opt, "step": state["step"] + 1},
                {"loss": loss, "accuracy": acc})

    def batch(step):
        r = np.random.default_rng(step)
        return {"x": r.normal(size=(32, 8)).astype(np.float32),
                "y": r.integers(0, 3, size=32).astype(np.int32)}

    return peat.Workload(f"mlp_{optimizer}", init, train_step, batch)


@pytest.fixture(scope="module", params=["sgd", "adam"])
def mlp_run(request, tmp_path_factory):
    wl = _mlp(request.param)
    path = tmp_path_factory.mktemp(request.param) / "run"
    profile(wl, path, steps=4, checkpoint_every=2)
    return request.param, wl, path


def _at_w2_grad(name, fn):
    def kernel(a, b, **params):
        out = jax.lax.dot_general(a, b, **params)
        return fn(out) if out.shape == _W2_GRAD else out
    return peat.Kernel(name, kernel)


def _cell(run, sub, name, site="bwd:dot_general"):
    _, wl, path = run
    res = playback(path, sub, workload=wl, checkpoints=[2], name=name, sites=site)
    hit = [c for c in res.cells if c.local is not None and not c.local.passed]
    return res, hit


def _split_k(a, b, **params):
    """A correct dot computed another way: the two halves of the contraction summed."""
    (ca, cb), _ = params["dimension_numbers"]
    h = a.shape[ca[0]] // 2
    (a1, a2), (b1, b2) = jnp.split(a, [h], axis=ca[0]), jnp.split(b, [h], axis=cb[0])
    return jax.lax.dot_general(a1, b1, **params) + jax.lax.dot_general(a2, b2, **params)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["exact", "split_k"])
def test_correct_kernels_are_masked_everywhere(mlp_run, kernel):
    _, wl, path = mlp_run
    impl = {"exact": lambda a, b, **p: jax.lax.dot_general(a, b, **p), "split_k": _split_k}[kernel]
    res = playback(path, {"dot_general": peat.Kernel(kernel, impl)}, workload=wl, name=kernel,
                   checkpoints=[0, 2] if kernel == "exact" else [2])
    assert len(res.cells) == len(res.reference_spread) * 5  # 2 fwd + 3 bwd dot_general sites
    for c in res.cells:
        e = c.effect
        assert isinstance(e, Effect) and (e.model, e.passed, e.moved) == ("masked", True, ())
        assert e.noise_ratio <= 1.0 and e.summary.startswith("masked"), e.summary
        if kernel == "exact":
            assert e.noise_ratio == 0.0 and e.loss[0] == e.loss[1] and "bitwise" in e.summary
    assert res.summary()["failed"] == 0


def test_tripled_weight_gradient_names_the_leaf_and_how_far_it_moved(mlp_run):
    optimizer = mlp_run[0]
    res, hit = _cell(mlp_run, {"dot_general": _at_w2_grad("x3_dW", lambda o: 3 * o)}, "x3")
    assert len(hit) == 1 and hit[0].local.model == "wrong_scale"
    e = hit[0].effect
    assert e.model in taxonomy.EFFECTS and e.model != "reduced_precision" and not e.passed
    # only the head's weights moved: the step's loss and metrics are computed before the update
    assert e.moved == ("params/w2",) and e.leaf == "params/w2" == hit[0].effect_leaf
    assert e.noise_ratio > 100 and e.loss[0] == e.loss[1]
    assert e.metrics["accuracy"][0] == e.metrics["accuracy"][1]
    if optimizer == "sgd":  # the update is the gradient times -lr: tripled with it
        assert e.model == "update_scaled" and e.update_factor == pytest.approx(3.0, rel=0.02)
        assert e.update_change == pytest.approx(2.0, rel=0.02)
        assert "update is 3x the golden's" in e.summary
    else:  # Adam normalises the gradient by its running moments: no constant factor
        assert e.model == "perturbed" and e.update_factor is None
        assert 0 < e.update_change < 2.0
        assert "% of the golden's" in e.summary
    assert f"params/w2 moved {e.noise_ratio:.3g}x its step noise" in e.summary
    assert e.short().startswith(f"{e.model}") and "params/w2" in e.short()  # the CLI's cell
    # every other backward site is untouched by this kernel
    others = [c.effect for c in res.cells if c is not hit[0]]
    assert others and all(o.model == "masked" for o in others)


def test_one_percent_weight_gradient_under_sgd_moves_past_the_rounding_pseudo_error(mlp_run):
    if mlp_run[0] != "sgd":
        pytest.skip("under Adam a leaf's gradient scaled by a constant is normalised away")
    _, hit = _cell(mlp_run, {"dot_general": _at_w2_grad("x1.01_dW", lambda o: 1.01 * o)},
                   "x1.01")
    e = hit[0].effect
    # within FIT_TOLERANCE of 1 the factor is not named: the step is perturbed, by 1%
    assert (e.model, e.passed, e.moved) == ("perturbed", False, ("params/w2",)), e.summary
    assert e.update_change == pytest.approx(0.01, rel=0.05)
    assert e.pseudo_samples >= 1 and e.change > 100 * e.pseudo_spread > 0
    assert "the rounding pseudo-error's spread" in e.summary


def test_a_pseudo_error_moves_cancelled_elements_at_their_rows_scale_and_keeps_zeros():
    x = jnp.array([[1000.0, -1e-3, 0.0, 500.0], [2.0, 2.0, 2.0, 2.0]], jnp.float32)
    rho = 1e-3
    moved = [np.asarray(pseudo_error(x, np.uint32(s), rho)) - np.asarray(x) for s in range(8)]
    spread = np.max(np.abs(moved), axis=0)
    rms0 = float(np.sqrt(np.mean(np.asarray(x[0]) ** 2)))
    assert spread[0, 1] > 0.1 * rho * rms0          # the cancelled element, at the row's scale
    assert np.all(spread <= rho * np.maximum(np.abs(np.asarray(x)), [[rms0], [2.0]]) * 1.0001)
    assert spread[0, 2] == 0.0                       # an exact zero stays exact
    assert np.all(spread[1] <= rho * 2.0 * 1.0001)   # a row of equal values: relative to them


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_pseudo_error_of_a_row_past_the_squares_range_is_finite_and_rounding_sized(dtype):
    # squares of 1e20 overflow float32; 1e-25 squared is below its smallest normal
    x = jnp.array([[1e20, 1.0, -3e19, 0.0], [1e-25, -2e-25, 1e-30, 3e-25]], dtype)
    rho = 1e-2
    xs = np.asarray(x, np.float64)
    rms = np.sqrt(np.mean(xs ** 2, axis=1, keepdims=True))
    for seed in range(4):
        got = np.asarray(pseudo_error(x, np.uint32(seed), rho), np.float64)
        assert np.isfinite(got).all()
        moved = np.abs(got - xs)
        ulp = np.abs(xs) * float(jnp.finfo(dtype).eps)        # the cast back to `dtype`
        assert np.all(moved <= rho * np.maximum(np.abs(xs), rms) * 1.001 + ulp)
        assert moved[0, 3] == 0.0                              # an exact zero stays exact
    assert np.abs(got[0, 1] - 1.0) > 1e15                     # moved at its row's scale


def test_sign_flipped_weight_gradient(mlp_run):
    optimizer = mlp_run[0]
    _, hit = _cell(mlp_run, {"dot_general": _at_w2_grad("neg_dW", jnp.negative)}, "neg")
    e = hit[0].effect
    assert e.moved == ("params/w2",) and not e.passed
    if optimizer == "sgd":
        assert e.model == "sign_reversed" and e.update_factor == pytest.approx(-1.0, abs=0.02)
        assert "negated" in e.summary
    else:
        # Adam at step 2: m = b1 m + (1 - b1) g, v unchanged; -g does not negate the update
        assert e.model == "perturbed"


def test_forward_fault_moves_the_loss(mlp_run):
    _, hit = _cell(mlp_run, {"dot_general": peat.faults.wrong_scale(1.5)}, "fwd", "fwd:dot_general")
    for c in hit:
        e = c.effect
        assert e.model == "perturbed" and "loss" in e.moved and e.loss[0] != e.loss[1]
        assert f"loss {e.loss[0]:.6g} -> {e.loss[1]:.6g}" in e.summary


def test_nan_producing_fault_is_nan_inf(mlp_run):
    _, hit = _cell(mlp_run, {"dot_general": peat.faults.nan_inf()}, "nan", "fwd:dot_general")
    assert hit
    for c in hit:
        e = c.effect
        assert (e.model, e.passed) == ("nan_inf", False) and math.isnan(e.loss[1])
        assert e.noise_ratio == math.inf and e.nonfinite[0] == "loss" and "loss" in e.summary


def test_effect_records_round_trip(mlp_run):
    _, wl, path = mlp_run
    sub = {"dot_general": _at_w2_grad("x3_dW", lambda o: 3 * o)}
    first = playback(path, sub, workload=wl, checkpoints=[2], name="old", sites="bwd:dot_general")
    again = playback(path, sub, workload=wl, checkpoints=[2], name="old", sites="bwd:dot_general")
    assert again.records() == first.records()
    assert [c.effect for c in again.cells] == [c.effect for c in first.cells]
