"""`peat.workload_from`, `peat.from_flax` and `peat.from_equinox`: a model wrapped in one call
trains, checkpoints and replays as the bundled workloads do (a restored checkpoint steps bitwise
to the next one), playback and runtime work on it, `peat profile MOD:FACTORY` takes its factory,
and a wrong input is a one-line PeatError."""
from __future__ import annotations

import json
import os
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import peat_jax as peat
from conftest import bitwise_equal
from peat_jax._src import cli
from peat_jax._src.profiler.golden import restore
from peat_jax._src.profiler.rundir import RunDir

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def regression_data(step):
    """A deterministic function of the step: a seeded regression batch."""
    x = np.random.default_rng(step).standard_normal((8, 4)).astype(np.float32)
    return {"x": x, "y": np.sin(x).sum(axis=1, keepdims=True)}


def mlp_init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": 0.5 * jax.random.normal(k1, (4, 16)), "w2": 0.5 * jax.random.normal(k2, (16, 1))}


def mlp_loss(params, batch):
    err = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]
    return jnp.mean(err ** 2), {"max_err": jnp.max(jnp.abs(err))}


def _replays_bitwise(wl, run, step):
    """The checkpoint of `step`, stepped once, is bitwise the checkpoint of `step + 1`."""
    before = restore(run, step, workload=wl)
    after, metrics = jax.jit(wl.train_step)(before, jax.tree.map(jnp.asarray, wl.batch(step)))
    assert bitwise_equal(after, restore(run, step + 1, workload=wl))
    return float(metrics["loss"])


def _dot_sites(wl, state, step=0):
    batch = jax.tree.map(jnp.asarray, wl.batch(step))
    return [s.index for s in peat.list_sites(wl.train_step, state, batch)
            if s.primitive == "dot_general"]


@pytest.mark.slow
def test_plain_jax_mlp_with_a_data_function_profiles_replays_plays_back_and_injects(tmp_path):
    wl = peat.workload_from(mlp_loss, mlp_init, optax.adamw(1e-2), regression_data,
                            name="wf_mlp", has_aux=True, config={"width": 16})
    assert wl.name == "wf_mlp" and wl.config == {"width": 16} and wl.evaluate is None
    state = wl.init(jax.random.key(3))
    assert set(state) == {"params", "opt_state", "step", "rng"}
    assert state["step"].dtype == jnp.int32 and int(state["step"]) == 0
    assert jax.dtypes.issubdtype(state["rng"].dtype, jax.dtypes.prng_key)
    assert bitwise_equal(wl.init(jax.random.key(3)), state)  # init is a function of the key
    assert bitwise_equal(wl.batch(5), regression_data(5))

    run = tmp_path / "run"
    g = peat.profile(wl, run, steps=3, checkpoint_every=1)
    assert g.checkpoints == (0, 1, 2, 3) and len(g.losses) == 3
    assert [_replays_bitwise(wl, run, c) for c in (0, 1, 2)] == list(g.losses)
    assert all("max_err" in m for m in RunDir(run).golden_metrics())  # the aux metrics

    dots = _dot_sites(wl, state)
    res = peat.playback(run, {"dot_general": peat.kernels.pallas_matmul()}, workload=wl,
                        checkpoints=[1], sites=dots[:2], name="pallas")
    assert len(res.cells) == 2 and res.compiles == 1
    assert all(c.status == "ok" and c.local.passed and c.effect.passed for c in res.cells), [
        (c.status, c.local.summary, c.effect.summary) for c in res.cells]

    rt = peat.runtime(run, {"dot_general": peat.faults.wrong_scale(4.0)}, peat.every(1), steps=3,
                      workload=wl)
    assert rt.golden_losses == g.losses and rt.losses != rt.golden_losses


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dropout(0.2, deterministic=not train)(nn.tanh(nn.Dense(16)(x)))
        return nn.Dense(3)(h)


@pytest.mark.slow
def test_flax_linen_model_with_stacked_batches_and_dropout_replays_bitwise(tmp_path):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((5, 8, 4)).astype(np.float32)          # 5 batches of 8
    ys = rng.integers(0, 3, (5, 8)).astype(np.int32)

    def loss(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    wl = peat.from_flax(DropoutMLP(), loss, optax.adamw(1e-2), (xs, ys), rngs=("dropout",),
                        apply_kwargs={"train": True}, eval_data=(xs[:2], ys[:2]))
    assert wl.name == "DropoutMLP"
    assert bitwise_equal(wl.batch(7), (xs[2], ys[2]))           # step 7: batch 7 % 5
    state = wl.init(jax.random.key(0))
    assert set(state["params"]) == {"Dense_0", "Dense_1"}
    assert not bitwise_equal(wl.init(jax.random.key(1))["params"], state["params"])  # the seed

    run = tmp_path / "run"
    g = peat.profile(wl, run, steps=3, checkpoint_every=1, seed=1)
    assert [_replays_bitwise(wl, run, c) for c in (0, 1, 2)] == list(g.losses)
    # dropout draws a fresh key every step, from the state's rng, so each replay draws it too
    s1 = restore(run, 1, workload=wl)
    b1 = jax.tree.map(jnp.asarray, wl.batch(1))
    _, m_next = jax.jit(wl.train_step)({**s1, "rng": restore(run, 2, workload=wl)["rng"]}, b1)
    assert float(m_next["loss"]) != g.losses[1]
    assert set(g.eval) == {"loss"} and np.isfinite(g.eval["loss"])


@pytest.mark.slow
def test_flax_nnx_and_equinox_models_replay_bitwise(tmp_path):
    import equinox as eqx
    from flax import nnx

    class NnxMLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    mse = lambda pred, batch: jnp.mean((pred - batch["y"]) ** 2)
    nnx_wl = peat.from_flax(NnxMLP(nnx.Rngs(0)), mse, optax.adamw(1e-2), regression_data,
                            inputs="x")
    mlp = eqx.nn.MLP(4, 1, 16, 1, activation=jnp.tanh, key=jax.random.key(0))
    eqx_wl = peat.from_equinox(mlp, lambda m, b: mse(jax.vmap(m)(b["x"]), b),
                               optax.adamw(1e-2), regression_data, name="wf_eqx")
    for wl in (nnx_wl, eqx_wl):
        run = tmp_path / wl.name
        g = peat.profile(wl, run, steps=2, checkpoint_every=1)
        assert [_replays_bitwise(wl, run, c) for c in (0, 1)] == list(g.losses)
    assert isinstance(restore(tmp_path / "wf_eqx", 1, workload=eqx_wl)["params"], eqx.nn.MLP)


T, B, V = 8, 4, 64  # tokens per sequence, sequences per batch, vocabulary


def gpt2_workload():
    """transformers' Flax GPT-2 (a tiny config, random init) trained with AdamW, in one call."""
    os.environ.setdefault("USE_TORCH", "0")
    os.environ.setdefault("USE_TF", "0")
    tf = pytest.importorskip("transformers")
    cfg = tf.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = tf.FlaxGPT2LMHeadModel(cfg, input_shape=(1, T), _do_init=False)
    mask, positions = jnp.ones((B, T), jnp.int32), jnp.broadcast_to(jnp.arange(T), (B, T))

    def tokens(step):
        toks = np.random.default_rng(step).integers(0, V, size=(B, T + 1)).astype(np.int32)
        return {"x": toks[:, :-1], "y": toks[:, 1:]}

    def loss(outputs, batch):
        return optax.softmax_cross_entropy_with_integer_labels(outputs[0], batch["y"]).mean()

    return peat.from_flax(model, loss, optax.adamw(1e-3), tokens,
                          inputs=lambda b: (b["x"], mask, positions),
                          apply_kwargs={"return_dict": False})


@pytest.mark.slow
def test_transformers_gpt2_in_one_call_replays_bitwise_and_plays_back(tmp_path):
    wl = gpt2_workload()
    assert wl.name == "FlaxGPT2LMHeadModel"
    run = tmp_path / "run"
    g = peat.profile(wl, run, steps=2, checkpoint_every=1)
    assert _replays_bitwise(wl, run, 1) == g.losses[1]
    dots = _dot_sites(wl, restore(run, 1, workload=wl), 1)
    assert len(dots) > 10
    res = peat.playback(run, {"dot_general": peat.kernels.pallas_matmul()}, workload=wl,
                        checkpoints=[1], sites=[dots[0], dots[-1]], name="pallas")
    assert len(res.cells) == 2 and res.compiles == 1
    assert all(c.status == "ok" and c.local.passed and c.effect.passed for c in res.cells), [
        (c.status, c.local.summary, c.effect.summary) for c in res.cells]


FACTORY_MODULE = '''
import numpy as np, jax.numpy as jnp, optax
import peat_jax as peat

def data(step):
    x = np.random.default_rng(step).standard_normal((8, 3)).astype(np.float32)
    return x, x @ np.array([[1.0], [-2.0], [0.5]], np.float32)

def make():
    return peat.workload_from(lambda w, b: jnp.mean((b[0] @ w - b[1]) ** 2),
                              jnp.zeros((3, 1)), optax.adamw(0.1), data, name="wf_cli")

peat.register_workload("wf_cli", make)   # what an entry point gives a shell's playback
'''


def test_peat_profile_takes_a_factory_of_workload_from(tmp_path, monkeypatch, capsys):
    (tmp_path / "wf_factory_mod.py").write_text(textwrap.dedent(FACTORY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    rc = cli.main(["profile", "wf_factory_mod:make", "--out", str(run), "--steps", "3",
                   "--checkpoint-every", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["workload"] == "wf_cli" and out["checkpoints"] == [0, 1, 2, 3]
    assert np.isfinite(out["loss"]).all()
    import wf_factory_mod
    wl = wf_factory_mod.make()
    assert _replays_bitwise(wl, run, 2) == RunDir(run).golden_losses()[2]
    rc = cli.main(["playback", str(run), "--fault", "wrong_scale(2.0)", "--sites", "0",
                   "--checkpoints", "1", "--json"])
    cells = json.loads(capsys.readouterr().out)["cells"]
    assert rc == 1 and len(cells) == 1 and cells[0]["local"]["passed"] is False


def _nondeterministic():
    rng = np.random.default_rng(0)
    return lambda step: {"x": rng.standard_normal((8, 4)).astype(np.float32),
                         "y": np.zeros((8, 1), np.float32)}


def _eqx_model():
    import equinox as eqx
    return eqx.nn.MLP(4, 1, 8, 1, key=jax.random.key(0))


def _params():
    return mlp_init(jax.random.key(0))


def _sum_loss(p, b):
    return jnp.sum(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])


BAD = [
    ("vector loss", lambda: peat.workload_from(lambda p, b: (b["x"] @ p["w1"]).sum(1), _params(),
                                               optax.sgd(0.1), regression_data, name="w"),
     r"must return a scalar loss, got shape \(8,\)"),
    ("tuple without has_aux", lambda: peat.workload_from(mlp_loss, _params(), optax.sgd(0.1),
                                                         regression_data, name="w"),
     "pass has_aux=True"),
    ("has_aux without metrics", lambda: peat.workload_from(_sum_loss, _params(), optax.sgd(0.1),
                                                           regression_data, name="w",
                                                           has_aux=True),
     r"must return \(loss, metrics dict\)"),
    ("integer loss", lambda: peat.workload_from(lambda p, b: jnp.int32(1) + 0 * jnp.sum(
        p["w1"]).astype(jnp.int32), _params(), optax.sgd(0.1), regression_data, name="w"),
     "must return a float loss, got int32"),
    ("not an optimizer", lambda: peat.workload_from(_sum_loss, _params(), optax.adamw,
                                                    regression_data, name="w"),
     "optimizer must be an optax GradientTransformation .* got function"),
    ("data list", lambda: peat.workload_from(_sum_loss, _params(), optax.sgd(0.1),
                                             [regression_data(0)], name="w"),
     "data is a list"),
    ("data iterator", lambda: peat.workload_from(_sum_loss, _params(), optax.sgd(0.1),
                                                 iter([regression_data(0)]), name="w"),
     "data is an iterator"),
    ("data string", lambda: peat.workload_from(_sum_loss, _params(), optax.sgd(0.1), "train.npz",
                                               name="w"),
     "data must be a function step -> batch or stacked batches"),
    ("ragged stacks", lambda: peat.workload_from(_sum_loss, _params(), optax.sgd(0.1),
                                                 {"x": np.zeros((3, 8, 4)),
                                                  "y": np.zeros((2, 8, 1))}, name="w"),
     r"one leading axis of N >= 1 batches, got lengths \[2, 3\]"),
    ("random data", lambda: peat.workload_from(_sum_loss, _params(), optax.sgd(0.1),
                                               _nondeterministic(), name="w"),
     "data must be a deterministic function of the step"),
    ("shapes per step", lambda: peat.workload_from(
        _sum_loss, _params(), optax.sgd(0.1),
        lambda s: {"x": np.zeros((8 + s, 4), np.float32)}, name="w"),
     "other shapes or dtypes than data"),
    ("integer params", lambda: peat.workload_from(_sum_loss, {**_params(), "n": jnp.arange(3)},
                                                  optax.sgd(0.1), regression_data, name="w"),
     r"params\['n'\] is int32; only float arrays can be trained"),
    ("unpartitioned equinox", lambda: peat.workload_from(_sum_loss, _eqx_model(), optax.sgd(0.1),
                                                         regression_data, name="w"),
     "an Equinox module: use peat.from_equinox"),
    ("a linen module", lambda: peat.workload_from(_sum_loss, DropoutMLP(), optax.sgd(0.1),
                                                  regression_data, name="w"),
     "a Flax module: use peat.from_flax"),
    ("config", lambda: peat.workload_from(_sum_loss, _params(), optax.sgd(0.1), regression_data,
                                          name="w", config={"tx": optax.sgd(0.1)}),
     "config must hold JSON values only"),
    ("no name", lambda: peat.workload_from(_sum_loss, _params(), optax.sgd(0.1), regression_data,
                                           name=""),
     "needs name="),
    ("loss that fails", lambda: peat.workload_from(lambda p, b: _sum_loss(p, b) + b["z"],
                                                   _params(), optax.sgd(0.1), regression_data,
                                                   name="w"),
     "one training step cannot be traced .* KeyError: 'z'"),
    ("a dict batch without inputs", lambda: peat.from_flax(DropoutMLP(), lambda o, b: o.mean(),
                                                           optax.sgd(0.1), regression_data),
     "the batch is a dict; say what the model takes from it"),
    ("batch statistics", lambda: peat.from_flax(nn.BatchNorm(use_running_average=False),
                                                lambda o, b: o.mean(), optax.sgd(0.1),
                                                regression_data, inputs="x"),
     r"variable collections \['batch_stats'\] besides 'params'"),
    ("not an equinox module", lambda: peat.from_equinox(_params(), _sum_loss, optax.sgd(0.1),
                                                        regression_data),
     "model must be an eqx.Module, got dict"),
]


@pytest.mark.parametrize("make, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_are_one_line_errors(make, match):
    with pytest.raises(peat.PeatError, match=match) as e:
        make()
    assert "\n" not in str(e.value) and not getattr(e.value, "__notes__", None)


def test_peat_playback_takes_a_kernel_from_a_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "wf_factory_mod.py").write_text(textwrap.dedent(FACTORY_MODULE))
    (tmp_path / "my_kernels.py").write_text(
        "import peat_jax as peat\n\ndef blocked():\n    return peat.kernels.blocked_matmul(8)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    assert cli.main(["profile", "wf_factory_mod:make", "--out", str(run), "--steps", "2",
                     "--checkpoint-every", "1", "--json"]) == 0
    capsys.readouterr()
    rc = cli.main(["playback", str(run), "--kernel", f"{tmp_path / 'my_kernels.py'}:blocked",
                   "--checkpoints", "1", "--json"])
    cells = json.loads(capsys.readouterr().out)["cells"]
    assert rc == 0 and cells and all(c["local"]["passed"] for c in cells)


LAYER_NORM_MODULE = '''
import numpy as np, jax, jax.numpy as jnp, optax
import flax.linen as nn
import peat_jax as peat

class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.LayerNorm()(nn.Dense(16)(x)))

def data(step):
    x = np.random.default_rng(step).standard_normal((8, 3)).astype(np.float32)
    return x, x @ np.array([[1.0], [-2.0], [0.5]], np.float32)

def make():
    net = Net()
    params = net.init(jax.random.key(0), jnp.zeros((8, 3)))
    loss = lambda p, b: jnp.mean((net.apply(p, b[0]) - b[1]) ** 2)
    return peat.workload_from(loss, params, optax.adamw(0.01), data, name="wf_ln")

peat.register_workload("wf_ln", make)
'''


@pytest.mark.slow
def test_a_region_kernel_goes_to_its_regions_without_sites(tmp_path, monkeypatch, capsys):
    """`peat playback --kernel` of a kernel that declares its region (flax_layer_norm:
    flax.linen.LayerNorm) intercepts that class and plays back at its sites, forward and
    backward, without --sites."""
    (tmp_path / "wf_ln_mod.py").write_text(textwrap.dedent(LAYER_NORM_MODULE))
    (tmp_path / "ln_kernels.py").write_text(
        "import peat_jax as peat\n\ndef ln():\n    return peat.kernels.flax_layer_norm()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    assert cli.main(["profile", "wf_ln_mod:make", "--out", str(run), "--steps", "2",
                     "--checkpoint-every", "1", "--json"]) == 0
    capsys.readouterr()
    rc = cli.main(["playback", str(run), "--kernel", "ln_kernels:ln",
                   "--checkpoints", "1", "--json"])
    cells = json.loads(capsys.readouterr().out)["cells"]
    assert rc == 0 and len(cells) == 2, cells
    assert {c["phase"] for c in cells} == {"fwd", "bwd"}
    assert all(c["primitive"] == "LayerNorm" and c["local"]["passed"] for c in cells), cells
