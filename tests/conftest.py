"""Small models shared by the core tests: the same 2-layer bias-free MLP in Flax linen, Flax nnx,
Equinox and plain jax, and a 2-layer transformer with nn.scan + nn.remat."""
from __future__ import annotations

import os
import shutil

# XLA:CPU's backend (LLVM) compiles the suite's programs at optimisation level 0 unless
# $PEAT_TEST_XLA_OPT says another (e.g. 3, XLA's default, what users and the benchmarks get): a
# leg spends about half its time compiling, and level 0 takes a fifth off a leg (16:52 -> 13:30
# on 2 cores) at the tests' small shapes. Set before jax starts its backend; the `peat` commands
# and examples the tests run as subprocesses inherit it. Numerics may differ from level 3 in the
# last bit (FMA contraction); each test compares programs compiled alike.
_LEVEL = "--xla_backend_optimization_level"
if _LEVEL not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" {_LEVEL}={os.environ.get('PEAT_TEST_XLA_OPT', '0')}").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _shared_compilation_cache(tmp_path_factory):
    """jax's persistent compilation cache of one test run, shared by its xdist workers (beside
    their base temporary directories, in the run's own; $PEAT_TEST_CACHE_DIR instead, "off"
    for none; pytest keeps the last three runs' directories). Most
    of the suite's time is XLA compiling, and the same programs (the analyzer's per-shape
    programs, the bundled workloads' steps) are compiled again in each test module after
    `_fresh_jax_caches` drops the in-memory executables: from disk they load in milliseconds.
    Every program is kept, however quick its compile: ~2,100 compiles under 0.2 s (51 CPU-s of a
    full leg) repeated ones another module or worker had made. A user's own
    `jax_compilation_cache_dir` is left as it is."""
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):   # a worker's gw<i> directory: its run's is above
        run_dir = run_dir.parent
    path = os.environ.get("PEAT_TEST_CACHE_DIR") or str(run_dir / "xla-cache")
    if path == "off" or jax.config.jax_compilation_cache_dir:
        yield
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    # the `peat` commands and examples the tests run as subprocesses share it too
    was = os.environ.get("PEAT_CACHE_DIR")
    os.environ["PEAT_CACHE_DIR"] = was or path
    yield
    if was is None:
        os.environ.pop("PEAT_CACHE_DIR", None)


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Drop jax's compiled executables after each test module. XLA:CPU maps each executable's
    code into memory; one pytest process compiles thousands of programs, and at Linux's default
    limit of 65530 mappings per process the compiler crashed (SIGSEGV / abort) deep into the full
    suite on jax 0.10.2 and 0.11.2 (in test_precision, whose tests pass on their own)."""
    yield
    jax.clear_caches()


@pytest.fixture
def x64():
    """jax's global x64 flag on for one test (check_kernel's analysis threads read the global
    flag, not a calling thread's ``jax.enable_x64`` context)."""
    was = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", was)


class LinenMLP(nn.Module):
    hidden: int = 16
    out: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.hidden, use_bias=False, name="fc1")(x)
        x = jnp.tanh(x)
        return nn.Dense(self.out, use_bias=False, name="head")(x)


@pytest.fixture(scope="session")
def mlp_data():
    x = jax.random.normal(jax.random.key(1), (6, 8))
    y = jax.random.normal(jax.random.key(2), (6, 4))
    return x, y


@pytest.fixture(scope="session")
def linen_mlp(mlp_data):
    """(loss_fn(params, x, y), params)."""
    x, _ = mlp_data
    model = LinenMLP()
    params = model.init(jax.random.key(0), x)

    def loss(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    return loss, params


def make_train_step(loss, tx):
    def train_step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    return train_step


@pytest.fixture(scope="session")
def linen_train(linen_mlp):
    """(train_step(state, batch) -> (state, metrics), state) with adam."""
    loss, params = linen_mlp
    tx = optax.adam(1e-2)
    return make_train_step(loss, tx), (params, tx.init(params))


class Block(nn.Module):
    d: int = 32
    heads: int = 4

    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(h)))
        return x, None


class TinyGPT(nn.Module):
    vocab: int = 17
    d: int = 32
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d)(tokens)
        blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                         length=self.layers)
        x, _ = blocks(self.d, name="blocks")(x, None)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


@pytest.fixture(scope="session")
def gpt():
    """(loss_fn(params, tokens), params, tokens) for a 2-layer scan+remat transformer."""
    model = TinyGPT()
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 17)
    params = model.init(jax.random.key(0), tokens[:, :-1])

    def loss(params, tokens):
        logits = model.apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss, params, tokens


def bitwise_equal(a, b) -> bool:
    """True when two pytrees have the same structure and bitwise-equal leaves."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype and
               bool(jnp.all(jax.lax.bitcast_convert_type(x, jnp.uint32) ==
                            jax.lax.bitcast_convert_type(y, jnp.uint32)))
               if x.dtype == jnp.float32 else bool(jnp.all(x == y))
               for x, y in zip(la, lb))


@pytest.fixture(scope="session")
def mlp_variants(linen_mlp):
    """The same bias-free tanh MLP loss in Flax linen, Flax nnx, Equinox and plain jax:
    {name: (loss(params, x, y), params)}."""
    import equinox as eqx
    from flax import nnx

    w1 = jax.random.normal(jax.random.key(0), (8, 16))
    w2 = jax.random.normal(jax.random.key(1), (16, 4))

    def plain(ws, x, y):
        return jnp.mean((jnp.tanh(x @ ws[0]) @ ws[1] - y) ** 2)

    class M(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 16, use_bias=False, rngs=rngs)
            self.l2 = nnx.Linear(16, 4, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    graphdef, state = nnx.split(M(nnx.Rngs(0)))

    def nnx_loss(state, x, y):
        return jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)

    mlp = eqx.nn.MLP(8, 4, 16, 1, activation=jnp.tanh, use_bias=False, use_final_bias=False,
                     key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_array)

    def eqx_loss(params, x, y):
        return jnp.mean((jax.vmap(eqx.combine(params, static))(x) - y) ** 2)

    return {"linen": linen_mlp, "plain": (plain, (w1, w2)), "nnx": (nnx_loss, state),
            "equinox": (eqx_loss, params)}


@pytest.fixture(scope="session")
def small_vision_run(tmp_path_factory):
    """A 60-step golden run of the small vision workload (checkpoints 0, 20, 40, 60), shared by
    the playback test modules; each test names its own campaign."""
    from peat_jax._src.profiler.golden import profile
    path = tmp_path_factory.mktemp("vision") / "run"
    profile(_small_vision(), path, steps=60, checkpoint_every=20)
    return path


def _small_vision():
    from peat_jax import models
    return models.get("vision", batch_size=16, width=8, hidden=32)


@pytest.fixture(scope="session")
def vision_gemms():
    """The site indices of the six dot_generals of `small_vision_run`'s train step, by what each
    computes: `hidden`, `head` (forward), `head_w`, `head_x`, `hidden_w`, `hidden_x` (backward:
    the weight and the input gradients). Tests name sites this way because the numbering moves
    between jax releases (jax 0.12.1's logsumexp is a custom_jvp: two more sites before the
    backward)."""
    import types

    import peat_jax as peat
    wl = _small_vision()
    state = wl.init(jax.random.key(0))
    batch = jax.tree.map(jnp.asarray, wl.batch(0))
    by_type = {(s.phase, s.out_shapes[0]): s.index for s in peat.list_sites(
        wl.train_step, state, batch) if s.primitive == "dot_general"}
    return types.SimpleNamespace(
        hidden=by_type["fwd", (16, 32)], head=by_type["fwd", (16, 10)],
        head_w=by_type["bwd", (10, 32)], head_x=by_type["bwd", (16, 32)],
        hidden_w=by_type["bwd", (32, 64)], hidden_x=by_type["bwd", (16, 64)])


@pytest.fixture
def own_run(small_vision_run, tmp_path):
    """A copy of `small_vision_run` without its campaigns, for a test that writes into it."""
    dest = tmp_path / "run"
    shutil.copytree(small_vision_run, dest, ignore=shutil.ignore_patterns("campaigns",
                                                                          "report.html"))
    return dest
