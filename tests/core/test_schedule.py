"""Schedules and frequency-based runtime injection on a traced step counter."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat


def _fires(schedule, n=40):
    return [s for s in range(n) if bool(jax.jit(schedule)(s))]


def test_every_at_steps_with_probability_fire_where_they_should():
    assert _fires(peat.every(10)) == [0, 10, 20, 30]
    assert _fires(peat.every(7, offset=3)) == [3, 10, 17, 24, 31, 38]
    assert _fires(peat.at_steps([5, 1, 33, 5])) == [1, 5, 33]
    assert _fires(peat.at_steps([])) == []
    p = peat.with_probability(0.25, seed=1)
    drawn = p.fired_steps(range(4000))
    assert 850 < len(drawn) < 1150
    assert drawn == peat.with_probability(0.25, seed=1).fired_steps(range(4000))
    assert drawn != peat.with_probability(0.25, seed=2).fired_steps(range(4000))
    assert _fires(peat.with_probability(0.0)) == []
    assert len(_fires(peat.with_probability(1.0))) == 40
    assert peat.every(5, 2).fired_steps(range(12)) == [2, 7]


@pytest.mark.parametrize("make,match", [
    (lambda: peat.every(0), "n must be >= 1"),
    (lambda: peat.every(-3), "n must be >= 1"),
    (lambda: peat.every(4, offset=4), r"offset must be in \[0, 4\)"),
    (lambda: peat.every(2.5), "must be an int"),
    (lambda: peat.with_probability(1.5), r"p must be in \[0, 1\]"),
    (lambda: peat.with_probability(-0.1), r"p must be in \[0, 1\]"),
    (lambda: peat.with_probability(float("nan")), r"p must be in \[0, 1\]"),
    (lambda: peat.at_steps([1, -2]), "steps must be >= 0"),
    (lambda: peat.at_steps(3), "iterable of ints"),
])
def test_bad_schedules_are_clear_errors(make, match):
    with pytest.raises(peat.PeatError, match=match):
        make()


def _run(step_fn, state, batch, steps):
    losses = []
    for s in range(steps):
        state, metrics = step_fn(state, batch, jnp.int32(s))
        losses.append(float(metrics["loss"]))
    return state, losses


def test_inject_fires_only_on_scheduled_steps_with_one_compile(linen_train, mlp_data):
    train_step, state = linen_train
    plain = jax.jit(train_step)
    ref_losses, s = [], state
    for _ in range(25):
        s, m = plain(s, mlp_data)
        ref_losses.append(float(m["loss"]))

    injected = jax.jit(peat.inject(train_step, {"bwd:dot_general": peat.faults.wrong_scale(-4.0)},
                                   peat.every(10, offset=7)))
    _, losses = _run(injected, state, mlp_data, 25)
    assert injected._cache_size() == 1
    # the plain run until the first firing step (7) updates the params: to an ULP or two (XLA
    # may fuse around the switches differently: jax 0.12, and 0.10 on some CPUs)
    np.testing.assert_allclose(losses[:8], ref_losses[:8], rtol=1e-6)
    assert abs(losses[8] - ref_losses[8]) > 1e-3 * abs(ref_losses[8])

    # a schedule that never fires in range keeps the whole run identical
    never = jax.jit(peat.inject(train_step, {"dot_general": peat.faults.zeroed()},
                                peat.at_steps([999])))
    final, losses = _run(never, state, mlp_data, 25)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_inject_fault_pattern_is_reproducible_and_varies_by_step(linen_train, mlp_data):
    train_step, state = linen_train
    fault = peat.faults.bit_flip(bit_class="exponent", seed=3)
    f = jax.jit(peat.inject(train_step, {"fwd:dot_general": fault}, peat.every(1)))
    a = [float(f(state, mlp_data, s)[1]["loss"]) for s in range(6)]
    b = [float(f(state, mlp_data, s)[1]["loss"]) for s in range(6)]
    assert a == b
    assert len(set(a)) > 1  # a fresh pattern per step (fold_in(seed, site, step))


def test_inject_rejects_bad_arguments(linen_train, mlp_data):
    train_step, state = linen_train
    with pytest.raises(peat.PeatError, match="schedule"):
        peat.inject(train_step, {"dot_general": peat.faults.zeroed()}, 10)
    f = peat.inject(train_step, {"dot_general": peat.faults.zeroed()}, peat.every(2))
    with pytest.raises(peat.PeatError, match="scalar"):
        f(state, mlp_data, jnp.arange(3))


def _leaves_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("switch,compiles", [("site", 1), ("host", 2)])
def test_injected_step_fires_on_schedule_under_either_switch(linen_train, mlp_data, switch,
                                                             compiles):
    from peat_jax._src.schedule import InjectedStep
    train_step, state = linen_train
    plain = jax.jit(train_step)
    step = InjectedStep(train_step, {"bwd:dot_general": peat.faults.wrong_scale(-4.0)},
                        peat.every(3, offset=1), switch=switch)
    for i in range(5):
        new, metrics = step(state, mlp_data, i)
        ref, ref_metrics = plain(state, mlp_data)
        moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)))
        if i % 3 == 1:
            assert moved > 1e-3, (switch, i)  # the fault changed the update
        elif switch == "host":
            assert _leaves_equal(new, ref)  # the plain step's own executable: bitwise
        else:
            assert moved < 1e-4, (switch, i)  # the switches in place: to an ULP or so
    assert step.compiles() == compiles


def test_host_and_site_switches_agree_on_firing_steps(linen_train, mlp_data):
    from peat_jax._src.schedule import InjectedStep
    train_step, state = linen_train
    fault = peat.faults.bit_flip(bit_class="exponent", seed=3)
    host, site = (InjectedStep(train_step, {"fwd:dot_general": fault}, peat.every(1),
                               switch=s) for s in ("host", "site"))
    a = [float(host(state, mlp_data, s)[1]["loss"]) for s in range(4)]
    b = [float(site(state, mlp_data, s)[1]["loss"]) for s in range(4)]
    np.testing.assert_allclose(a, b, rtol=1e-5)  # the same fault pattern at each step
    assert len(set(a)) > 1
    assert host.compiles() == 1  # every step fired: the plain step's program was never needed


def test_the_switch_is_chosen_per_backend_and_checked(linen_train):
    from peat_jax._src.schedule import InjectedStep, default_switch
    assert default_switch("cpu") == "site"
    assert default_switch("gpu") == "host" and default_switch("rocm") == "host"
    with pytest.raises(peat.PeatError, match="switch must be one of site, host"):
        InjectedStep(linen_train[0], {}, peat.every(2), switch="both")
