"""Where a NaN is born: the first site whose output went non-finite, at the first step whose
loss or new state did, found by replaying that step with every site watched."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat
from peat_jax._src.profiler.golden import profile, restore
from peat_jax._src.profiler.nan_origin import (GOLDEN_FACTOR, STEP_FACTOR, BlowUp, NanOrigin,
                                               golden_absmax, golden_nan_origin, step_nan_origin)
from peat_jax._src.profiler.runtime import runtime

STEP = 4  # a checkpoint of the golden run: the state before it is restored exactly


def _mlp() -> peat.Workload:
    """A 2-layer tanh MLP with a summed squared error (gradients of order 1 to 10) and SGD."""

    def loss(p, x, y):
        return jnp.sum((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def train_step(p, batch):
        value, g = jax.value_and_grad(loss)(p, *batch)
        return jax.tree.map(lambda w, d: w - 1e-3 * d, p, g), {"loss": value}

    def init(key):
        k1, k2 = jax.random.split(key)
        return {"w1": 0.5 * jax.random.normal(k1, (8, 16)),
                "w2": 0.5 * jax.random.normal(k2, (16, 4))}

    def batch(step):
        rng = np.random.default_rng(step)
        return (rng.standard_normal((32, 8)).astype(np.float32),
                rng.standard_normal((32, 4)).astype(np.float32))

    return peat.Workload("mlp_sum", init=init, train_step=train_step, batch=batch)


@pytest.fixture(scope="module")
def mlp():
    return _mlp()


@pytest.fixture(scope="module")
def golden(mlp, tmp_path_factory):
    run = tmp_path_factory.mktemp("nan_origin") / "run"
    profile(mlp, run, steps=6, checkpoint_every=STEP)
    return run


def _site_output(wl, state, batch, site: int) -> np.ndarray:
    """The output of dot_general site `site` in the train step (through a probing kernel that
    computes the op with XLA's matmul and keeps what it returned)."""
    seen = []
    xla = peat.kernels.xla_matmul()

    def probe(*operands, **params):
        seen.append(xla.impl(*operands, **params))
        return seen[-1]

    peat.substitute(wl.train_step, {site: peat.Kernel("probe", probe)})(state, batch)
    return np.asarray(seen[0])


def _inf_making_flip(wl, run, site: int):
    """bit_flip(bit=30) at an element of `site`'s output at STEP that lies in [1, 2) in
    magnitude: setting the exponent's top bit there makes the exponent all ones (inf or NaN)."""
    out = _site_output(wl, restore(run, STEP, workload=wl), wl.batch(STEP), site)
    hits = np.flatnonzero((np.abs(out) > 1.05) & (np.abs(out) < 1.95))
    assert hits.size, f"no element of site #{site}'s output lies in [1, 2)"
    return peat.faults.bit_flip(bit=30, index=int(hits[0]))


@pytest.mark.parametrize("phase", ["fwd", "bwd"])
def test_bit_flip_at_a_known_site_is_named_as_the_nan_origin(mlp, golden, phase):
    state, batch = restore(golden, 0, workload=mlp), mlp.batch(0)
    dots = [s for s in peat.list_sites(mlp.train_step, state, batch)
            if s.primitive == "dot_general" and s.phase == phase]
    site = dots[0].index if phase == "fwd" else dots[-1].index  # x @ w1, or the gradient of w1
    fault = _inf_making_flip(mlp, golden, site)
    r = runtime(golden, {site: fault}, peat.at_steps([STEP]), steps=6, workload=mlp,
                name=f"flip{site}")
    o = r.nan_origin
    assert isinstance(o, NanOrigin)
    assert (o.step, o.site, o.phase, o.primitive, o.fired) == (STEP, site, phase, "dot_general",
                                                              True)
    assert o.iteration == () and o.blew_up is None  # the flip made inf itself: no blow-up before
    assert str(o).startswith(f"step {STEP}, site #{site} {phase} dot_general @ ")
    assert not np.isfinite(r.losses[STEP + (phase == "bwd")])
    stored = json.loads((golden / "campaigns" / f"flip{site}" / "runtime.json").read_text())
    assert NanOrigin.from_dict(stored["nan_origin"]) == o
    assert f"NaN born at step {STEP}, site #{site} {phase}" in peat.report.render_report(golden)


def test_no_nan_no_origin(mlp, golden):
    r = runtime(golden, {"dot_general": peat.faults.wrong_scale(1.0 + 2 ** -10)}, peat.every(2),
                steps=6, workload=mlp)
    assert all(np.isfinite(r.losses)) and r.nan_origin is None


@pytest.mark.parametrize("reverse", [False, True])
def test_nan_born_inside_a_scan_is_named_at_its_iteration(reverse):
    """Sites in a scanned stack are ordered by iteration first (in the order the scan runs,
    reversed or not): a NaN made at the second site of the first layer run is not blamed on the
    next layer's first site, which sees it next."""

    def layer(h, w):
        a = jnp.tanh(h @ w)             # sites #0 (dot_general), #1 (tanh)
        return jnp.exp(a) @ w, None     # sites #2 (exp), #3 (dot_general)

    def train_step(state, batch):
        h, _ = jax.lax.scan(layer, batch, state, reverse=reverse)
        return state, {"loss": jnp.sum(h)}

    ws = jnp.full((3, 4, 4), 0.1)
    x = jnp.ones((2, 4))
    fault = {3: peat.faults.nan_inf(index=0)}
    o = step_nan_origin(train_step, ws, x, 0, substitution=fault, schedule=peat.every(1))
    assert (o.site, o.iteration, o.fired) == (3, (0,), True)
    assert step_nan_origin(train_step, ws, x, 0) is None


def test_golden_run_with_a_non_finite_loss_names_its_origin(tmp_path):
    """A workload whose own step overflows at step 2 (exp of a growing parameter)."""

    def train_step(state, batch):
        y = jnp.exp(state["w"] * batch)         # site #0: inf once w * batch > 88.7
        return {"w": state["w"] * 10.0}, {"loss": jnp.sum(y)}

    wl = peat.Workload("overflowing", init=lambda key: {"w": jnp.ones((3,))},
                       train_step=train_step,
                       batch=lambda step: np.full((3,), 5.0, np.float32))
    profile(wl, tmp_path / "run", steps=4, checkpoint_every=2)
    o = golden_nan_origin(tmp_path / "run", workload=wl)
    assert (o.step, o.site, o.primitive, o.fired) == (2, 0, "exp", False)


def _ln_mlp() -> peat.Workload:
    """A matmul, then a residual layer norm (site #1 sums h for the mean, site #2 the squares
    for the variance), then a matmul, with a mean squared error and SGD."""

    def layer_norm(h):
        mu = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean((h - mu) ** 2, axis=-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(var + 1e-5)

    def loss(p, x, y):
        h = x @ p["w1"]
        return jnp.mean(((h + layer_norm(h)) @ p["w2"] - y) ** 2)

    def train_step(p, batch):
        value, g = jax.value_and_grad(loss)(p, *batch)
        return jax.tree.map(lambda w, d: w - 1e-2 * d, p, g), {"loss": value}

    def init(key):
        k1, k2 = jax.random.split(key)
        return {"w1": 0.5 * jax.random.normal(k1, (8, 16)),
                "w2": 0.5 * jax.random.normal(k2, (16, 4))}

    def batch(step):
        rng = np.random.default_rng(step)
        return (rng.standard_normal((4, 8)).astype(np.float32),
                rng.standard_normal((4, 4)).astype(np.float32))

    return peat.Workload("ln_mlp", init=init, train_step=train_step, batch=batch)


@pytest.fixture(scope="module")
def ln_mlp():
    return _ln_mlp()


@pytest.fixture(scope="module")
def ln_golden(ln_mlp, tmp_path_factory):
    """The layer-norm workload's golden run, with site statistics at every step."""
    run = tmp_path_factory.mktemp("nan_origin_ln") / "run"
    profile(ln_mlp, run, steps=6, checkpoint_every=STEP, stats_every=1)
    return run


def _huge_making_flip(state, batch, wl):
    """bit_flip(bit=30) at an element of site #0's (x @ w1) output at STEP that lies in
    [1/16, 1/2] in magnitude: setting the exponent's top bit multiplies it by 2^128, a huge
    but finite value (about 1e37), which the layer norm's squares after it overflow."""
    out = _site_output(wl, state, batch, 0)
    hits = np.flatnonzero((np.abs(out) > 1 / 16) & (np.abs(out) < 1 / 2))
    assert hits.size, "no element of site #0's output lies in [1/16, 1/2]"
    return peat.faults.bit_flip(bit=30, index=int(hits[0]))


def _assert_blew_up_at_the_matmul(o, against):
    assert (o.step, o.site, o.primitive, o.fired) == (STEP, 2, "reduce_sum", True)
    b = o.blew_up
    assert isinstance(b, BlowUp)
    assert (b.site, b.phase, b.primitive, b.iteration, b.against) == (0, "fwd", "dot_general",
                                                                      (), against)
    assert np.isfinite(b.absmax) and b.absmax > 1e36 and b.absmax > b.limit > b.reference > 0
    assert str(o).startswith(f"step {STEP}, site #2 fwd reduce_sum @ ")
    assert f"; blew up at site #0 fwd dot_general @ <top>: abs-max {b.absmax:.3g}" in str(o)


def test_a_huge_finite_value_is_named_where_it_blew_up_against_the_golden_run(ln_mlp,
                                                                             ln_golden):
    """The flipped matmul's output is huge but finite; the first non-finite output is the layer
    norm's sum of squares after it. Both are named: the blow-up against the golden run's site
    statistics at the matmul."""
    state, batch = restore(ln_golden, STEP, workload=ln_mlp), ln_mlp.batch(STEP)
    fault = _huge_making_flip(state, batch, ln_mlp)
    r = runtime(ln_golden, {0: fault}, peat.at_steps([STEP]), steps=6, workload=ln_mlp,
                name="huge")
    o = r.nan_origin
    _assert_blew_up_at_the_matmul(o, "golden")
    recorded = golden_absmax(ln_golden)
    assert o.blew_up.reference == recorded[0].absmax
    assert o.blew_up.limit == GOLDEN_FACTOR * recorded[0].absmax
    clean = np.abs(_site_output(ln_mlp, state, batch, 0)).max()
    assert clean <= recorded[0].absmax * 2  # the golden's range at the site, as recorded
    stored = json.loads((ln_golden / "campaigns" / "huge" / "runtime.json").read_text())
    assert NanOrigin.from_dict(stored["nan_origin"]) == o
    html = peat.report.render_report(ln_golden)
    assert f"NaN born at step {STEP}, site #2 fwd reduce_sum @ &lt;top&gt;: the first" in html
    assert "Values blew up at site #0 fwd dot_general" in html


def test_without_site_statistics_the_blow_up_is_judged_against_the_steps_earlier_sites(
        ln_mlp, ln_golden):
    """From a workload (no golden run, so no site statistics) the matmul's output is judged
    against the step's inputs: it is the first site, with nothing before it."""
    state0 = ln_mlp.init(jax.random.key(0))
    assert golden_absmax(ln_golden, before=0) == {}
    state = state0
    step = jax.jit(ln_mlp.train_step)
    for i in range(STEP):
        state, _ = step(state, ln_mlp.batch(i))
    fault = _huge_making_flip(state, ln_mlp.batch(STEP), ln_mlp)
    r = runtime(ln_mlp, {0: fault}, peat.at_steps([STEP]), steps=STEP + 1)
    _assert_blew_up_at_the_matmul(r.nan_origin, "step")
    b = r.nan_origin.blew_up
    inputs = max(float(np.abs(x).max()) for x in jax.tree.leaves((state, ln_mlp.batch(STEP))))
    assert b.reference == pytest.approx(inputs)
    assert b.limit == pytest.approx(STEP_FACTOR * 8 * inputs)  # 8: the matmul's K


def test_a_fault_writing_nan_directly_has_no_separate_blow_up(ln_mlp):
    """A NaN written at a site's output: nothing left its range before it, so `blew_up` is None
    and the site itself is where the values went non-finite (and blew up)."""
    state, batch = ln_mlp.init(jax.random.key(0)), ln_mlp.batch(0)
    o = step_nan_origin(ln_mlp.train_step, state, batch, 0,
                        substitution={4: peat.faults.nan_inf(index=0)}, schedule=peat.every(1))
    assert (o.site, o.primitive, o.blew_up) == (4, "dot_general", None)
    assert "blew up" not in str(o)


def test_records_made_before_blew_up_still_read():
    old = {"step": 3, "site": 5, "phase": "fwd", "primitive": "exp", "path": "m", "iteration": [],
           "fired": True}
    o = NanOrigin.from_dict(old)
    assert o.blew_up is None and str(o) == "step 3, site #5 fwd exp @ m"
    b = BlowUp(site=1, phase="bwd", primitive="dot_general", path="", iteration=(2,),
               absmax=1e30, reference=2.0, limit=512.0, against="golden")
    o2 = dataclasses.replace(o, blew_up=b)
    assert NanOrigin.from_dict(json.loads(json.dumps(dataclasses.asdict(o2)))) == o2
    assert str(o2) == ("step 3, site #5 fwd exp @ m; blew up at site #1 bwd dot_general @ <top> "
                       "(iteration 2): abs-max 1e+30, the golden run's 2")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bad", [None, jnp.nan, jnp.inf, -jnp.inf])
def test_tree_finite_inside_a_jitted_step_and_alone(dtype, bad):
    """The runtime reads "is the new state finite" from its step's own program: the same answer
    as all_finite, integer leaves ignored, an empty tree finite."""
    from peat_jax._src.profiler.nan_origin import all_finite, tree_finite
    w = jnp.ones((3, 4), dtype)
    if bad is not None:
        w = w.at[2, 1].set(bad)
    tree = {"w": w, "count": jnp.int32(7), "b": jnp.zeros((2,), jnp.float32)}
    folded = bool(jax.jit(tree_finite)(tree))
    assert folded == all_finite(tree) == (bad is None)
    assert bool(tree_finite({"count": jnp.int32(1)})) and bool(tree_finite({}))
