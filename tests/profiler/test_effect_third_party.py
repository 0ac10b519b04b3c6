"""Playback's step effect on models nobody here wrote: transformers' Flax GPT-2 and Llama (tiny
configs, random init, nothing downloaded), trained with optax.adamw.

A correct kernel (the bundled Pallas matmul at every dot_general) passes locally and on the step
in every cell: its 1-ULP differences, amplified by Adam's normalisation of near-zero gradients,
stay within the step's spread under a rounding pseudo-error at the same site. A x1.01 scale at
every backward dot_general fails locally in every cell, and its step moves past that spread.
"""
from __future__ import annotations

import contextlib
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import peat_jax as peat
from peat_jax._src.profiler.golden import profile
from peat_jax._src.profiler.playback import playback

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

T, B, V = 8, 4, 64  # tokens per sequence, sequences per batch, vocabulary


@contextlib.contextmanager
def _without_torch():
    """transformers imported without torch or TensorFlow (its Flax models need neither; torch,
    where installed, would cost seconds of import); the environment restored after."""
    saved = {k: os.environ.get(k) for k in ("USE_TORCH", "USE_TF")}
    os.environ.update(USE_TORCH="0", USE_TF="0")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _transformers():
    """The transformers module with its Flax models, or a skip saying why not."""
    try:
        with _without_torch():
            import transformers
            from transformers import FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installable on this leg, or no Flax models
        pytest.skip(f"transformers' Flax models are not available here ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); the test extra pins "
                    "transformers==4.57.6")
    return transformers


def _model(tf, kind: str):
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.FlaxGPT2LMHeadModel(cfg, input_shape=(1, T), _do_init=False)
    # max_position_embeddings >= 2 x the head dim: transformers' Flax rotary table is cut there
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return tf.FlaxLlamaForCausalLM(cfg, input_shape=(1, T), _do_init=False)


def _workload(kind: str) -> peat.Workload:
    """A next-token language model from transformers as a `peat.Workload`, AdamW, in one call."""
    mask = jnp.ones((B, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def loss(outputs, batch):
        return optax.softmax_cross_entropy_with_integer_labels(outputs[0], batch["y"]).mean()

    def batch(step):
        toks = np.random.default_rng(step).integers(0, V, size=(B, T + 1)).astype(np.int32)
        return {"x": toks[:, :-1], "y": toks[:, 1:]}

    return peat.from_flax(_model(_transformers(), kind), loss, optax.adamw(1e-3), batch,
                          name=f"transformers_{kind}", inputs=lambda b: (b["x"], mask, positions),
                          apply_kwargs={"return_dict": False})


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_third_party_model_correct_kernel_masked_and_scaled_gradient_caught(kind, tmp_path):
    wl = _workload(kind)
    run = tmp_path / "run"
    # checkpoint 1: Adam's moments already hold a step's history (at step 0 its update,
    # g / |g|, does not see a scaled gradient at all)
    profile(wl, run, steps=2, checkpoint_every=1)

    res = playback(run, {"dot_general": peat.kernels.pallas_matmul()}, workload=wl,
                   checkpoints=[1], name="pallas")
    cells = res.cells
    assert len(cells) > 10 and res.compiles == 1
    assert all(c.status == "ok" and c.local.passed for c in cells), [
        (c.site.index, c.status, c.error or c.local.summary) for c in cells if
        c.status != "ok" or not c.local.passed]
    bad = [(c.site.index, c.effect.summary) for c in cells if not c.effect.passed]
    assert not bad, bad
    # a correct kernel moves a step (its rounding differs): the pseudo-error is what excused it
    # (GPT-2's does; Llama's steps here stay within its dtype's rounding in every cell)
    moved = [c.effect for c in cells if c.effect.pseudo_samples]
    assert all(e.summary.startswith("masked") for e in moved)
    if kind == "gpt2":
        assert moved and any("rounding pseudo-error" in e.summary for e in moved)

    faulty = playback(run, {"bwd:dot_general": peat.faults.wrong_scale(1.01)}, workload=wl,
                      checkpoints=[1], name="x1.01")
    assert len(faulty.cells) > 5 and faulty.compiles == 1
    assert all(c.status == "ok" and not c.local.passed for c in faulty.cells)
    effects = [c.effect for c in faulty.cells]
    caught = [e for e in effects if not e.passed]
    # a gradient scaled by 1% changes the training: past the rounding pseudo-error's spread
    assert len(caught) == len(effects), [e.summary for e in effects if e.passed]
    assert all("the rounding pseudo-error" in e.summary for e in caught), [
        e.summary for e in caught]
