"""Sharded train states: a workload whose state lives on a mesh of 4 emulated CPU devices
profiles to Orbax with its shardings, restores onto them, and plays back with a candidate at
each site, the sites inside `shard_map` bodies included; the golden replay is bitwise the golden
step, as on one device.

The device count is fixed when jax starts, and the rest of the suite runs on one device, so the
checks run in one child process (this file run as a script: jax starts and the analyzer compiles
once) with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``; each test reads its check's
result.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import emulated_devices
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import peat_jax as peat

ROOT = Path(__file__).resolve().parents[2]
DEVICES = 4
MODES = ("data", "fsdp", "shard_map")


def sharded_mlp(mode: str = "data", batch_size: int = 16, width: int = 16) -> peat.Workload:
    """A 2-layer MLP regression whose train state is laid out over a 1-D mesh `("data",)` of
    every device.

    Modes: "data": params and optimizer state replicated, the batch split over "data";
    "fsdp": every kernel (and its Adam moments) split along its first axis over "data" as
    well; "shard_map": data parallel with the loss and its gradient computed inside
    `jax.shard_map` (the gradient all-reduced by the shard_map's transpose).

    The layout is declared the way peat reads it: `init` is jitted with `out_shardings`, so
    `jax.eval_shape(init, key)` carries the shardings that checkpoints are restored onto, and
    `train_step` keeps its output state on them.
    """
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx = optax.adam(1e-2)

    def fresh(key):
        k1, k2 = jax.random.split(key)
        params = {"w1": jax.random.normal(k1, (8, width)) / 3.0, "b1": jnp.zeros((width,)),
                  "w2": jax.random.normal(k2, (width, 4)) / 4.0, "b2": jnp.zeros((4,))}
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def placement(leaf):
        return split if mode == "fsdp" and leaf.ndim == 2 else replicated

    shardings = jax.tree.map(placement, jax.eval_shape(fresh, jax.random.key(0)))
    init = jax.jit(fresh, out_shardings=shardings)

    def forward(params, x, y):
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)

    def loss(params, x, y):
        if mode != "shard_map":
            return forward(params, x, y)

        def per_shard(params, x, y):
            return jax.lax.pmean(forward(params, x, y), "data")

        return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                             out_specs=P())(params, x, y)

    def train_step(state, batch):
        x, y = jax.lax.with_sharding_constraint(batch, (split, split))
        value, grads = jax.value_and_grad(loss)(state["params"], x, y)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
               "step": state["step"] + 1}
        return jax.lax.with_sharding_constraint(new, shardings), {"loss": value}

    def batch(step):
        rng = np.random.default_rng(step)
        x = rng.standard_normal((batch_size, 8)).astype(np.float32)
        return x, np.tanh(x[:, :4] * 2.0).astype(np.float32)

    return peat.Workload(f"sharded_mlp_{mode}", init, train_step, batch,
                         config={"mode": mode, "batch_size": batch_size, "width": width})


# --------------------------------------------------------------------------------------------
# The checks, run in the child process (4 devices)

def _close(a, b) -> bool:
    """Bitwise, or to rounding where XLA fuses the two programs differently (a shard_map body
    on some CPUs)."""
    return _bitwise(a, b) or bool(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                                              atol=1e-7))


def _bitwise(a, b) -> bool:
    a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _spans(state) -> set:
    return {len(leaf.sharding.device_set) for leaf in jax.tree.leaves(state)}


def _check_stats_over_shards(wl: peat.Workload, directory: Path) -> None:
    """The step-0 statistics of the first forward GEMM (inside the shard_map): those of the
    whole batch's product, though each shard computed a quarter of it."""
    from peat_jax._src.profiler.site_stats import read_sites, read_step
    recorded = [s for s in read_sites(directory) if s.recorded]
    first = next(k for k, s in enumerate(recorded)
                 if s.primitive == "dot_general" and s.phase == "fwd")
    assert tuple(recorded[first].shape) == (16 // DEVICES, 16), recorded[first].shape
    x, _ = wl.batch(0)
    product = np.asarray(x @ jax.device_get(wl.init(jax.random.key(0))["params"]["w1"]))
    stats = read_step(directory, 0)
    np.testing.assert_allclose(stats["absmax"][first], np.abs(product).max(), rtol=1e-6)
    np.testing.assert_allclose(stats["mean"][first], product.mean(), rtol=1e-4, atol=1e-6)


def check_profile_restore_playback(mode: str, run_dir: str) -> dict:
    """Profile, restore with the saved shardings, replay: golden replay bitwise, every site's
    fault seen; runtime injection bitwise until it fires."""
    from peat_jax._src.profiler.golden import restore
    assert jax.device_count() == DEVICES, jax.devices()
    wl = sharded_mlp(mode)
    golden = peat.profile(wl, run_dir, steps=4, checkpoint_every=2,
                          stats_every=4 if mode == "shard_map" else None)
    assert golden.checkpoints == (0, 2, 4)
    if mode == "shard_map":   # statistics inside the body, folded over the shards
        _check_stats_over_shards(wl, Path(run_dir) / "golden" / "site_stats")

    # the state profile trained on, step by step, from the workload itself
    state = wl.init(jax.random.key(0))
    step = jax.jit(wl.train_step)
    live = {}
    for i in range(4):
        live[i] = state
        state, _ = step(state, wl.batch(i))
    live[4] = state
    for c in golden.checkpoints:
        got = restore(run_dir, c, workload=wl)
        for r, s in zip(jax.tree.leaves(got), jax.tree.leaves(live[c])):
            assert r.sharding == s.sharding, (c, r.sharding, s.sharding)
            # bitwise where XLA fuses the profiled and the test's step alike; to rounding
            # where it does not (a shard_map body on some CPUs)
            assert _bitwise(r, s) or np.allclose(np.asarray(r), np.asarray(s), rtol=1e-6,
                                                 atol=1e-7), c
    w1 = restore(run_dir, 2, workload=wl)["params"]["w1"]
    assert len(w1.sharding.device_set) == DEVICES
    if mode == "fsdp":
        assert w1.addressable_shards[0].data.shape == (8 // DEVICES, w1.shape[1])

    # the golden replay of step 2 is the golden step 2, bit for bit
    replayed = jax.jit(peat.switched(wl.train_step, {"dot_general": peat.faults.wrong_scale(2.0)}))
    new, metrics = replayed(-1, restore(run_dir, 2, workload=wl), wl.batch(2))
    assert all(_close(a, b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(live[3])))
    assert float(metrics["loss"]) == golden.losses[2]

    sites = peat.list_sites(wl.train_step, live[2], wl.batch(2))
    dots = [s for s in sites if s.primitive == "dot_general"]
    inside = [s for s in dots if "shard_map" in s.scope]
    assert len(inside) == (len(dots) if mode == "shard_map" else 0), [s.scope for s in dots]

    result = peat.playback(run_dir, {"dot_general": peat.faults.wrong_scale(2.0)}, checkpoints=[2],
                           workload=wl)
    assert result.compiles == 1, result.compiles
    assert len(result.cells) == len(dots)
    for cell in result.cells:
        assert cell.status == "ok", cell.error
        assert cell.local is not None and not cell.local.passed, (cell.site, cell.local)
        assert cell.local.model == "wrong_scale", cell.local
        assert not cell.effect.passed, (cell.site, cell.effect)
    same = peat.playback(run_dir, {"dot_general": peat.faults.wrong_scale(1.0)}, checkpoints=[2],
                         workload=wl, name="identity")
    assert all(c.effect.model == "masked" and c.local.model == "exact" for c in same.cells), \
        [(c.site.index, c.local.model, c.effect.model) for c in same.cells]

    # runtime injection on the sharded state: bitwise the golden run until the candidate fires
    r = peat.runtime(run_dir, {"dot_general": peat.faults.wrong_scale(2.0)}, peat.at_steps([2]),
                     steps=4, workload=wl)
    assert r.fired_steps == (2,) and r.losses[:2] == r.golden_losses[:2], r
    assert r.losses[2] != r.golden_losses[2], r
    return {"mode": mode, "sites": len(dots), "inside_shard_map": len(inside),
            "spans": sorted(_spans(live[4]))}


def check_shard_map_substitution() -> dict:
    """Sites inside a `shard_map` body, forward and backward, substituted there: the identity is
    bitwise, a fault changes the loss and the gradients."""
    wl = sharded_mlp("shard_map")
    args = (wl.init(jax.random.key(0)), wl.batch(0))
    sites = peat.list_sites(wl.train_step, *args)
    inside = [s for s in sites if s.primitive == "dot_general" and "shard_map" in s.scope]
    assert {s.phase for s in inside} == {"fwd", "bwd"}, [(s.index, s.phase) for s in inside]
    assert all(s.in_shapes[0][0] == 16 // DEVICES for s in inside if s.phase == "fwd"), \
        [s.in_shapes for s in inside]   # the body sees one shard of the batch
    plain = jax.tree.leaves(jax.jit(wl.train_step)(*args))
    same = jax.jit(peat.substitute(wl.train_step, {tuple(s.index for s in inside):
                                                   peat.faults.wrong_scale(1.0)}))(*args)
    assert all(_bitwise(a, b) or np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
               for a, b in zip(jax.tree.leaves(same), plain))
    flipped = jax.jit(peat.switched(wl.train_step, {"dot_general": peat.faults.sign_flip()}))
    golden = jax.tree.leaves(flipped(-1, *args))
    for site in inside:
        bad = jax.tree.leaves(flipped(site.index, *args))
        assert not all(_bitwise(a, b) for a, b in zip(bad, golden)), site
    return {"sites_inside": len(inside), "phases": sorted({s.phase for s in inside})}


def check_errors(run_dir: str) -> dict:
    """A step that moves the state off its declared shardings, and devices= for a sharded
    state: PeatErrors that say what to do."""
    wl = sharded_mlp("fsdp")
    mesh = Mesh(np.asarray(jax.devices()), ("data",))

    def drifting(state, batch):   # leaves the kernels replicated: another layout than init's
        new, metrics = wl.train_step(state, batch)
        return jax.lax.with_sharding_constraint(new, NamedSharding(mesh, P())), metrics

    with pytest.raises(peat.PeatError, match=r"after step 1 .*\['w1'\].*with_sharding_constraint"):
        peat.profile(wl._replace(train_step=drifting), run_dir + "/drift", steps=2,
                     checkpoint_every=2)
    assert sorted(os.listdir(run_dir + "/drift/checkpoints")) == ["0"]   # step 2's not saved
    peat.profile(wl, run_dir + "/ok", steps=2, checkpoint_every=2)
    with pytest.raises(peat.PeatError, match="sharded over 4 devices.*leave devices= out"):
        peat.playback(run_dir + "/ok", {"dot_general": peat.faults.wrong_scale(2.0)}, workload=wl,
                      devices=jax.devices())
    assert not os.path.exists(run_dir + "/ok/campaigns")   # refused before anything is written
    return {"errors": 2}


def _all(run_dir: str) -> dict:
    """Every check in one process (jax starts, and the analyzer compiles, once): name -> its
    result, or {"error": traceback}."""
    import traceback
    checks = {f"playback_{m}": (check_profile_restore_playback, (m, f"{run_dir}/{m}"))
              for m in MODES}
    checks["shard_map_substitution"] = (check_shard_map_substitution, ())
    checks["errors"] = (check_errors, (f"{run_dir}/errors",))
    out = {}
    for name, (fn, args) in checks.items():
        try:
            out[name] = fn(*args)
        except Exception:  # noqa: BLE001 - reported to the test of that check
            out[name] = {"error": traceback.format_exc()[-3000:]}
    return out


def test_shard_map_layout_is_read_and_rebuilt_on_this_release():
    """In this process (one device): the equation's layout as it was traced, and its body
    rebuilt with a site substituted."""
    from peat_jax._src import _jax
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))

    def f(w, x):
        body = jax.shard_map(lambda w, x: jnp.tanh(x @ w), mesh=mesh,
                             in_specs=(P(), P("data")), out_specs=P("data"))
        return jnp.sum(body(w, x) ** 2)

    w, x = jnp.full((3, 3), 0.5), jnp.arange(6.0).reshape(2, 3) / 6
    (eqn,) = [e for e in jax.make_jaxpr(f)(w, x).eqns if e.primitive.name == "shard_map"]
    layout = _jax.shard_map_layout(eqn)
    assert layout.mesh == mesh and layout.manual_axes == {"data"} and layout.check_vma
    assert layout.in_specs == (P(), P("data")) and layout.out_specs == (P("data"),)
    sites = peat.list_sites(jax.grad(f), w, x)
    dots = [s for s in sites if s.primitive == "dot_general"]
    assert all(s.scope == ("shard_map",) for s in dots) and {s.phase for s in dots} == {"fwd",
                                                                                         "bwd"}
    plain = jax.jit(jax.grad(f))(w, x)
    same = jax.jit(peat.substitute(jax.grad(f),
                                   {"dot_general": peat.faults.wrong_scale(1.0)}))(w, x)
    assert _bitwise(same, plain)
    for s in dots:
        bad = jax.jit(peat.substitute(jax.grad(f), {s.index: peat.faults.wrong_scale(2.0)}))(w, x)
        assert not _bitwise(bad, plain), s


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    """The checks' results from a child process with 4 emulated CPU devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path_factory.mktemp("sharded")
    proc = emulated_devices.run([__file__, str(run_dir)], devices=DEVICES, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _result(child: dict, name: str) -> dict:
    got = child[name]
    assert "error" not in got, got.get("error")
    return got


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_sharded_state_profiles_restores_and_plays_back(child, mode):
    got = _result(child, f"playback_{mode}")
    assert got["mode"] == mode and got["spans"] == [DEVICES]
    assert got["inside_shard_map"] == (got["sites"] if mode == "shard_map" else 0)


@pytest.mark.slow
def test_sites_inside_shard_map_are_found_and_substituted(child):
    got = _result(child, "shard_map_substitution")
    assert got["phases"] == ["bwd", "fwd"] and got["sites_inside"] >= 3


@pytest.mark.slow
def test_a_state_off_its_declared_shardings_and_devices_for_a_sharded_state_are_errors(child):
    assert _result(child, "errors") == {"errors": 2}


if __name__ == "__main__":
    print(json.dumps(_all(sys.argv[1])))
