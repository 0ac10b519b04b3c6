"""Workloads registered by name: a run directory rebuilds its workload from the manifest through
the registry (a factory registered in the process, or an entry point of an installed package),
and the core never imports the bundled models to do it."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat
from conftest import bitwise_equal
from peat_jax._src.profiler.golden import load_workload, profile, restore
from peat_jax._src.profiler.workload import ENTRY_POINT_GROUP, workload_factory
from peat_jax._src import taxonomy

ROOT = Path(__file__).resolve().parents[2]


def tiny_linear(scale: float = 1.0) -> peat.Workload:
    """A user's own workload: least squares on three weights, in plain jax."""
    def init(key):
        return {"w": jax.random.normal(key, (3,))}

    def train_step(state, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(state["w"])
        return {"w": state["w"] - 0.1 * g}, {"loss": loss}

    def batch(step):
        x = np.random.default_rng(step).standard_normal((8, 3)).astype(np.float32)
        return x, (x @ np.array([1.0, -2.0, 0.5], np.float32)) * np.float32(scale)

    return peat.Workload("tiny_linear", init, train_step, batch, config={"scale": scale})


def test_a_registered_workload_is_rebuilt_from_the_run_directory(tmp_path):
    wl = tiny_linear(scale=2.0)
    profile(wl, tmp_path / "run", steps=4, checkpoint_every=2)
    with pytest.raises(peat.PeatError, match="no workload named 'tiny_linear' is registered") as e:
        restore(tmp_path / "run", 2)
    assert "workload=" in str(e.value) and "register_workload" in str(e.value)
    assert bitwise_equal(restore(tmp_path / "run", 2, workload=wl)["w"],
                         restore(tmp_path / "run", 2, workload=tiny_linear(scale=2.0))["w"])

    peat.register_workload("tiny_linear", tiny_linear)
    assert "tiny_linear" in peat.registered_workloads()
    rebuilt = load_workload({"workload": "tiny_linear", "config": {"scale": 2.0}})
    assert rebuilt.config == {"scale": 2.0}
    assert bitwise_equal(restore(tmp_path / "run", 2)["w"],
                         restore(tmp_path / "run", 2, workload=wl)["w"])
    r = peat.runtime(tmp_path / "run", {"dot_general": peat.faults.wrong_scale(2.0)}, peat.every(2),
                     steps=4)
    assert r.outcome in taxonomy.OUTCOMES and len(r.losses) == 4


def test_a_factory_must_rebuild_a_workload_of_its_name():
    peat.register_workload("misnamed", lambda **config: tiny_linear(**config))
    with pytest.raises(peat.PeatError, match="returned 'tiny_linear', not a peat.Workload named "
                                             "'misnamed'"):
        load_workload({"workload": "misnamed", "config": {}})
    peat.register_workload("misconfigured", tiny_linear)
    with pytest.raises(peat.PeatError, match="cannot be built from its config"):
        load_workload({"workload": "misconfigured", "config": {"scale": 1.0, "width": 3}})
    with pytest.raises(peat.PeatError, match="factory must be callable"):
        peat.register_workload("bad", "not a function")


def test_entry_points_of_installed_packages_are_found_and_loaded_by_name(tmp_path, monkeypatch):
    # an installed package, as pip leaves it: a module and its dist-info with entry_points.txt
    (tmp_path / "third_party_workloads.py").write_text(textwrap.dedent("""
        import peat_jax as peat
        LOADED = True

        def make(**config):
            return peat.Workload("third_party", lambda key: {}, lambda s, b: (s, {"loss": 0.0}),
                                 lambda step: {}, config=config)
        """))
    info = tmp_path / "third_party_workloads-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: third-party-workloads\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nthird_party = third_party_workloads:make\n"
        "broken = no_such_module_anywhere:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    assert {"third_party", "broken"} <= set(peat.registered_workloads())
    assert "third_party_workloads" not in sys.modules  # listed, not imported
    wl = load_workload({"workload": "third_party", "config": {"size": 2}})
    assert wl.name == "third_party" and wl.config == {"size": 2}
    with pytest.raises(peat.PeatError, match="entry point 'no_such_module_anywhere:make' of "
                                             "workload 'broken' cannot be loaded"):
        workload_factory("broken")


def test_the_bundled_workloads_are_declared_as_entry_points_and_registered_on_import():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    from peat_jax import models
    group = declared[ENTRY_POINT_GROUP]
    assert sorted(group) == sorted(models.available())
    factories = {name: importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP).load()
                 for name, value in group.items()}
    assert all(callable(f) for f in factories.values())
    assert factories["vision"](**models.defaults("vision")).config == models.defaults("vision")
    assert set(models.available()) <= set(peat.registered_workloads())
    assert workload_factory("vision")().config == models.get("vision").config


def test_the_profiler_core_does_not_import_the_bundled_models():
    code = ("import sys, peat_jax, peat_jax._src.profiler.golden, peat_jax._src.profiler.playback, "
            "peat_jax._src.profiler.runtime; print('peat_jax.models' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
