"""Bundled Pallas kernels inside a substituted training step: a tiny causal transformer block
(Flax linen: nn.LayerNorm, a layer_norm region, an attention region, a softmax region, Dense
GEMMs) trained 20 steps with Adam reaches the same losses as the same program without
substitution, to float32 noise."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import needs
import numpy as np
import optax
import pytest

import peat_jax as peat
from peat_jax._src.kernels import pallas as pk
from peat_jax._src.kernels import references

VOCAB, D, HEADS, B, T, STEPS = 13, 16, 2, 4, 8, 20

softmax = peat.region("softmax")(references.softmax)
layer_norm = peat.region("layer_norm")(references.layer_norm)
attention = peat.region("attention")(functools.partial(references.attention, causal=True))


class Block(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        h = nn.LayerNorm()(x)
        qkv = nn.Dense(3 * D, use_bias=False)(h).reshape(B, T, 3, HEADS, D // HEADS)
        a = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(B, T, D)
        x = x + nn.Dense(D)(a)
        x = layer_norm(x, self.param("ln_scale", nn.initializers.ones, (D,)),
                       self.param("ln_bias", nn.initializers.zeros, (D,)))
        return softmax(nn.Dense(VOCAB)(x))


@pytest.fixture(scope="module")
def setup():
    model = Block()
    seq = (jnp.arange(B * (T + 1)).reshape(B, T + 1) * 5 + 3) % VOCAB  # a learnable rule
    tokens, targets = seq[:, :-1], seq[:, 1:]
    params = model.init(jax.random.key(0), tokens)
    tx = optax.adam(1e-2)

    def loss(params, tokens, targets):
        probs = model.apply(params, tokens)
        picked = jnp.take_along_axis(probs, targets[..., None], axis=-1)
        return -jnp.mean(jnp.log(picked + 1e-9))

    def train_step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    state = (params, tx.init(params))
    regions = (nn.LayerNorm,)
    ref = _losses(jax.jit(peat.substitute(train_step, {}, regions=regions)), state,
                  (tokens, targets))
    return train_step, state, (tokens, targets), regions, ref


def _losses(step, state, batch) -> np.ndarray:
    out = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return np.asarray(out)


SUBSTITUTIONS = {
    "pallas_matmul": lambda: {"dot_general": pk.pallas_matmul(16, 16, 16)},
    "pallas_regions": lambda: {"softmax": pk.pallas_softmax(),
                               "layer_norm": pk.pallas_layer_norm(),
                               "LayerNorm": pk.flax_layer_norm(),
                               "attention": pk.pallas_attention(causal=True, block_q=16,
                                                                block_k=16)},
    "jax_pallas_ops": lambda: {"attention": pk.jax_pallas_mha(causal=True, block_q=8, block_k=8),
                               "LayerNorm": pk.flax_layer_norm(pk.jax_pallas_layer_norm()),
                               "layer_norm": pk.jax_pallas_layer_norm()},
}


@pytest.mark.slow
@pytest.mark.parametrize("which", [
    pytest.param(w, marks=needs.skip_unless(needs.pallas_op("attention"),
                                            needs.pallas_op("layer_norm")))
    if w == "jax_pallas_ops" else w for w in SUBSTITUTIONS])
def test_substituted_training_reaches_the_reference_losses(setup, which):
    train_step, state, batch, regions, ref = setup
    subs = SUBSTITUTIONS[which]()
    sub = peat.substitute(train_step, subs, regions=regions)
    replaced = {(s.primitive, s.phase) for s in sub.selected(state, batch)}
    assert replaced == {(n, p) for n in subs for p in ("fwd", "bwd")}  # every kernel, both phases
    got = _losses(jax.jit(sub), state, batch)
    assert ref[-1] < 0.5 * ref[0]  # it learns
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=1e-5)
