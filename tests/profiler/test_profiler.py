"""Golden runs on Orbax, resume, restore, runtime injection and outcome classification."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat
from conftest import bitwise_equal
from peat_jax import models
from peat_jax._src.profiler.golden import profile, restore
from peat_jax._src.profiler.runtime import classify_outcome, runtime
from peat_jax._src import taxonomy


@pytest.fixture(scope="module")
def vision():
    return models.get("vision", batch_size=16, width=8, hidden=32)


@pytest.fixture(scope="module")
def golden(vision, tmp_path_factory):
    run = tmp_path_factory.mktemp("golden") / "run"
    return profile(vision, run, steps=30, checkpoint_every=10), run


def test_profile_writes_manifest_checkpoints_and_metrics(golden, vision):
    g, run = golden
    assert g.checkpoints == (0, 10, 20, 30) and g.steps == 30 and len(g.losses) == 30
    m = json.loads((run / "manifest.json").read_text())
    assert m["workload"] == "vision" and m["config"]["width"] == 8 and m["seed"] == 0
    assert m["backend"] == jax.default_backend() and m["versions"]["jax"] == jax.__version__
    lines = (run / "golden" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(30))
    assert g.losses[-1] < g.losses[0]
    assert set(g.eval) >= {"loss", "accuracy"}


@pytest.mark.slow
def test_golden_run_is_bitwise_reproducible_and_resumes(golden, vision, tmp_path):
    g, _ = golden
    again = profile(vision, tmp_path / "a", steps=30, checkpoint_every=10)
    assert again.losses == g.losses
    # a shorter run extended later resumes from its last checkpoint and matches the long run
    part = profile(vision, tmp_path / "b", steps=20, checkpoint_every=10)
    assert part.resumed_from is None
    full = profile(vision, tmp_path / "b", steps=30, checkpoint_every=10)
    assert full.resumed_from == 20 and full.losses == g.losses
    final_a = restore(tmp_path / "a", 30)
    final_b = restore(tmp_path / "b", 30)
    assert bitwise_equal(final_a["params"], final_b["params"])


def test_restored_state_steps_exactly_like_the_state_in_memory(golden, vision):
    _, run = golden
    state = vision.init(jax.random.key(0))
    step = jax.jit(vision.train_step)
    batch = jax.tree.map(jnp.asarray, vision.batch(0))
    restored = restore(run, 0)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert restored["rng"].dtype == state["rng"].dtype
    assert bitwise_equal(step(restored, batch)[0]["params"], step(state, batch)[0]["params"])


def test_other_run_in_directory_is_refused_and_left_alone(golden, vision):
    _, run = golden
    before = (run / "manifest.json").read_text()
    with pytest.raises(peat.PeatError, match="belongs to another golden run: seed differs"):
        profile(vision, run, steps=30, checkpoint_every=10, seed=1)
    other = models.get("vision", batch_size=8, width=8, hidden=32)
    with pytest.raises(peat.PeatError, match="config differs"):
        profile(other, run, steps=30, checkpoint_every=10)
    assert (run / "manifest.json").read_text() == before


@pytest.mark.parametrize("kwargs,match", [
    ({"steps": 0, "checkpoint_every": 5}, "steps must be a positive int"),
    ({"steps": 10, "checkpoint_every": -1}, "checkpoint_every must be a positive int"),
])
def test_profile_bad_arguments(vision, tmp_path, kwargs, match):
    with pytest.raises(peat.PeatError, match=match):
        profile(vision, tmp_path / "r", **kwargs)


@pytest.mark.parametrize("switch,compiles", [(None, 1), ("host", 2)])
def test_runtime_exponent_bit_flip_every_10th_step_is_classified(golden, switch, compiles):
    _, run = golden
    fault = peat.faults.bit_flip(bit=30)  # the top exponent bit: x * 2**128 or a tiny value
    r = runtime(run, {"fwd:dot_general": fault}, peat.every(10, offset=4), steps=30,
                switch=switch)
    assert r.fired_steps == (4, 14, 24)
    assert r.outcome != "masked" and r.outcome in taxonomy.OUTCOMES
    assert r.losses[:4] == r.golden_losses[:4]  # identical before the first firing step
    assert r.evidence["compiles"] == compiles
    assert r.evidence["switch"] == (switch or "site")  # XLA:CPU's default: one executable


def test_runtime_correct_kernel_is_masked(golden):
    _, run = golden
    r = runtime(run, {"dot_general": peat.kernels.blocked_matmul(block_k=8)}, peat.every(1),
                steps=30, name="blocked")
    assert r.outcome == "masked"
    assert max(abs(a - b) for a, b in zip(r.losses, r.golden_losses)) < 1e-4
    stored = json.loads((run / "campaigns" / "blocked" / "runtime.json").read_text())
    assert stored["outcome"] == "masked"


@pytest.mark.slow
def test_runtime_nan_at_a_step_is_immediate(golden):
    _, run = golden
    r = runtime(run, {"fwd:dot_general": peat.faults.nan_inf()}, peat.at_steps([7]), steps=12)
    assert r.outcome == "immediate_nan_inf" and r.evidence["first_non_finite_step"] == 7


def test_runtime_bad_arguments(golden, tmp_path):
    _, run = golden
    sub = {"dot_general": peat.faults.zeroed()}
    with pytest.raises(peat.PeatError, match="beyond the golden run"):
        runtime(run, sub, peat.every(2), steps=31)
    with pytest.raises(peat.PeatError, match="does not exist"):
        runtime(tmp_path / "nope", sub, peat.every(2), steps=3)
    with pytest.raises(peat.PeatError, match="schedule"):
        runtime(run, sub, 5, steps=3)
    with pytest.raises(peat.PeatError, match="switch must be one of"):
        runtime(run, sub, peat.every(2), steps=3, switch="per-step")


def _curve(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return 2.0 * np.exp(-np.arange(n) / 20) + 0.3 + 0.02 * rng.standard_normal(n)


@pytest.mark.parametrize("name,make", [
    ("masked", lambda g: g + 0.001),
    ("immediate_nan_inf", lambda g: np.where(np.arange(g.size) >= 10, np.nan, g)),
    ("diverged", lambda g: np.where(np.arange(g.size) >= 30, np.inf, g)),
    ("diverged", lambda g: np.where(np.arange(g.size) >= 20, g + 5.0, g)),
    ("spike_and_recover",
     lambda g: g + np.where((np.arange(g.size) >= 10) & (np.arange(g.size) < 14), 1.0, 0)),
    ("sharp_degrade", lambda g: g + np.where(np.arange(g.size) >= 10, 0.5, 0)),
    ("slow_degrade", lambda g: g + np.clip((np.arange(g.size) - 10) * 0.02, 0, None)),
])
def test_classify_outcome_rules(name, make):
    g = _curve()
    outcome, band, ev = classify_outcome(make(g), g, fired=[10])
    assert outcome == name, ev
    assert 0 < band < 0.2


def test_compare_runs_names_first_diverging_step_and_metric(golden, vision, tmp_path):
    from peat_jax._src.profiler.run_metrics import compare_runs
    _, run = golden
    twin = tmp_path / "twin"
    profile(vision, twin, steps=30, checkpoint_every=10)
    same = compare_runs(run, twin)
    assert same.first_step is None and same.first_difference_step is None
    # another backend's run: emulate by perturbing the recorded metrics from step 12 on
    lines = [json.loads(x) for x in (twin / "golden" / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        if r["step"] >= 12:
            r["loss"] *= 1.01
        if r["step"] >= 20:
            r["accuracy"] = r["accuracy"] * 0.5
    (twin / "golden" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    diff = compare_runs(run, twin)
    assert diff.first_step == 12 and diff.metric == "loss" and diff.first_difference_step == 12
    assert "diverge at step 12 on 'loss'" in diff.summary()
    other = tmp_path / "other"
    profile(vision, other, steps=10, checkpoint_every=10, seed=3)
    with pytest.raises(peat.PeatError, match="seed differs"):
        compare_runs(run, other)
