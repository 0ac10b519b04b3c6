"""Where a NaN is born: the first site whose output went non-finite, at the first step whose
loss or new state did, found by replaying that step with every site watched."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat
from peat_jax.profiler.golden import profile, restore
from peat_jax.profiler.nan_origin import NanOrigin, golden_nan_origin, step_nan_origin
from peat_jax.profiler.runtime import runtime

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
    assert o.iteration == ()
    assert str(o).startswith(f"step {STEP}, site #{site} {phase} dot_general @ ")
    assert not np.isfinite(r.losses[STEP + (phase == "bwd")])
    stored = json.loads((golden / "campaigns" / f"flip{site}" / "runtime.json").read_text())
    assert NanOrigin.from_dict(stored["nan_origin"]) == o
    assert f"NaN born at step {STEP}, site #{site} {phase}" in peat.report.render_report(golden)


def test_no_nan_no_origin(mlp, golden):
    r = runtime(golden, {"dot_general": peat.faults.scale(1.0 + 2 ** -10)}, peat.every(2),
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
