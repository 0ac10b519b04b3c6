"""A small training step with a site of every kind the corpus has, for playback.

Every reference of the corpus is a region (`peat.region`) of one step of a small two-headed
network trained with Adam: a classifier (matmul, layer norm, GELU, matmul, softmax; its first
matmul contracts K = 20, not a multiple of the corpus kernels' 8-blocks, over M = 20 rows, not
one either), a row normalisation of its hidden features, 256-wide row sums (the Kahan entry's
width) and a self-attention head on a [1, 16, 2, 8] sequence. Each corpus entry then replays at
its reference's sites on the activations training produced (`playback` at a checkpoint), which
is where a kernel meets inputs nobody chose for it.
"""
from __future__ import annotations

import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import peat_jax as peat
from peat_jax._src.kernels import references
from peat_jax._src.profiler.golden import profile
from peat_jax._src.profiler.workload import Workload

from . import Entry, bugs, correct
from ._common import layer_norm, matmul, softmax

__all__ = ["IN_STEP", "REGION_OF", "Played", "golden_run", "play", "workload"]

M, K, HIDDEN, CLASSES, SUM_WIDTH, T, HEADS, HEAD_DIM = 20, 20, 24, 12, 256, 16, 2, 8

REGION_OF = {matmul: "matmul", softmax: "softmax", layer_norm: "layer_norm",
             bugs.gelu_exact: "gelu", bugs.row_sum_reference: "row_normalise",
             correct.row_sum: "row_sum", references.attention: "attention"}
"""The region (site name in the step) of each corpus reference."""

_mm, _softmax, _ln, _gelu, _normalise, _sum, _attention = (
    peat.region(REGION_OF[f])(f) for f in (matmul, softmax, layer_norm, bugs.gelu_exact,
                                          bugs.row_sum_reference, correct.row_sum,
                                          references.attention))


_TX = optax.adam(3e-3)


def _init(key):
    ks = jax.random.split(key, 6)

    def w(k, shape):
        return jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])

    params = {"w1": w(ks[0], (K, HIDDEN)), "w2": w(ks[1], (HIDDEN, CLASSES)),
              "w_sum": w(ks[2], (K, SUM_WIDTH)), "ln_scale": jnp.ones(HIDDEN),
              "ln_bias": jnp.zeros(HIDDEN), "wq": w(ks[3], (T, T)), "wk": w(ks[4], (T, T)),
              "wv": w(ks[5], (T, T))}
    return params, _TX.init(params)


def _loss(params, batch):
    x, y, seq = batch["x"], batch["y"], batch["seq"]
    h = _gelu(_ln(_mm(x, params["w1"]), params["ln_scale"], params["ln_bias"]))
    probs = _softmax(_mm(h, params["w2"]))
    nll = -jnp.mean(jnp.log(jnp.take_along_axis(probs, y[:, None], axis=-1) + 1e-9))
    shares = _normalise(h)                        # each row's |h| shares, summing to 1
    spread = jnp.mean(_sum(_mm(x, params["w_sum"])) ** 2) / SUM_WIDTH
    qkv = [_mm(seq, params[w]).reshape(1, T, HEADS, HEAD_DIM) for w in ("wq", "wk", "wv")]
    attended = _attention(*qkv)
    return nll + 1e-2 * jnp.mean(shares ** 2) + 1e-3 * spread + 1e-2 * jnp.mean(attended ** 2)


def _train_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, opt_state = _TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}


def _batch(step: int):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((M, K)).astype(np.float32)
    y = (np.argmax(x[:, :CLASSES], axis=1)).astype(np.int32)          # a learnable rule
    seq = rng.standard_normal((T, T)).astype(np.float32)
    return {"x": x, "y": y, "seq": seq}


def workload() -> Workload:
    """The step as a `Workload` (deterministic batches by step)."""
    return Workload(name="corpus_step", init=_init, train_step=_train_step, batch=_batch,
                    config={"m": M, "k": K})


STEPS, CHECKPOINT = 20, 10
"""The golden run's length and the checkpoint each entry replays."""

IN_STEP: dict[str, frozenset] = {
    # the buggy kernels: the models playback names at the sites where they fail
    "index_map_off_by_one": frozenset({"permuted_layout", "nan_inf"}),  # nan_inf where M = 20:
    # the wrapped index reads the last, partial block's padding (NaN in interpret mode)
    "floor_grid": frozenset({"tile_boundary"}),        # exact where M = 16 divides
    "mask_off_by_one": frozenset({"wrong_scale"}),
    "skip_last_partial_k": frozenset({"random_value"}),  # exact where K = 16 or 24 divides
    "wrong_axis_in_block": frozenset({"nan_inf"}),     # M = 20: the padded rows join the sums
    "bf16_accumulation": frozenset({"low_precision_accumulation"}),
    "fp16_accumulation": frozenset({"low_precision_accumulation"}),
    "race_two_writers": frozenset({"nan_inf", "random_value"}),  # no race detector here
    # at the backward site only (its 20 x 12 output holds 22 values with |g| >= rms(g): a row
    # of one such value shows no constant ratio)
    "backward_wrong": frozenset({"random_value"}),
    # named by the candidate's float64 run at the site, as by the check (the signature alone
    # says low_precision_accumulation: an error growing with the value)
    "gelu_tanh_for_exact": frozenset({"approximation"}),
    # the bug needs inputs this step does not make (check_kernel's variants make them): no
    # row here is large enough to overflow exp, no layer norm input has a mean far from 0, and
    # eps = 1e-6 against a standard deviation ~1 moves the output by ~1e-6 relative
    "softmax_without_max": frozenset(),
    "one_pass_variance": frozenset(),
    "eps_outside_sqrt": frozenset(),
}
"""What playback of each buggy entry in this step finds (the correct ones pass everywhere)."""


class Played(NamedTuple):
    """One entry replayed at its reference's sites (forward; backward too where the entry
    checks gradients) at checkpoint `CHECKPOINT`."""

    cells: int                 # sites replayed
    failing: int               # cells whose local diagnosis fails, or that crashed
    models: frozenset          # the failing cells' models ("crashed" for a crash)
    diagnoses: tuple           # the failing cells' local diagnoses (records' dicts)


def golden_run(path: pathlib.Path) -> pathlib.Path:
    """`path`, holding a golden run of `STEPS` steps of the step (a checkpoint every
    `CHECKPOINT` steps)."""
    profile(workload(), path, steps=STEPS, checkpoint_every=CHECKPOINT)
    return path


def play(entry: Entry, run_dir: pathlib.Path) -> Played:
    """`entry`'s candidate replayed in the golden run at its reference's region."""
    region = REGION_OF[entry.reference]
    kernel = entry.candidate if isinstance(entry.candidate, peat.Kernel) else \
        peat.Kernel(entry.name, entry.candidate)

    def chosen(site) -> bool:
        return site.primitive == region and (entry.backward or site.phase == "fwd")

    res = peat.playback(run_dir, {region: kernel}, sites=chosen, checkpoints=[CHECKPOINT],
                        workload=workload(), name=entry.name)
    failed = res.failing("local")
    return Played(cells=len(res.records()), failing=len(failed), models=frozenset(
        r["local"]["model"] if r["local"] is not None else r["status"] for r in failed),
        diagnoses=tuple(r["local"] for r in failed if r["local"] is not None))
