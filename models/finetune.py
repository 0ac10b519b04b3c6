"""Finetuning workloads: a model pretrained on one task, then trained on a related one.

``vision_finetune``
  The vision CNN with a 5-way head is pretrained on digits 0-4; finetuning trains it on digits 5-9
  (labels 5..9 mapped to 0..4) with a freshly initialised head. Held-out: digits 5-9 of the vision
  held-out split.
``language_finetune``
  The character GPT is pretrained on one genre of plays (``pretrain_genre``) and finetuned on
  another (``genre``); all params carry over (the vocabulary is the same for every genre). Held-out:
  the finetuning genre's held-out text.

Where the pretrained params come from:

* By default ``init(key)`` pretrains: ``pretrain_steps`` jitted adam steps from ``key`` on
  deterministic batches. ``init`` is a deterministic function of ``key`` (same key, same state) but,
  being a Python loop over steps, it is not itself jittable, and every call pays the pretraining
  time. The pretraining step is the finetuning ``train_step`` itself where possible (language;
  vision without ``freeze_trunk``), so ``jax.jit(workload.train_step)`` reuses its compilation.
* Or pass ``pretrained_params=`` (a params pytree of the matching model, e.g. from a longer run) to
  ``get``: ``init`` then only initialises the new head (vision) and the optimizer. Such params are
  not JSON: the recorded config says ``"pretrained_params": "external"``, and rebuilding from that
  config raises until the params are passed again.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
import optax

from peat_jax._src.profiler.workload import Workload, typed_key

from . import _common, language, vision

__all__ = ["LANGUAGE_DEFAULTS", "VISION_DEFAULTS", "make_language", "make_vision"]

VISION_DEFAULTS: dict[str, Any] = {
    **vision.DEFAULTS,
    "pretrain_steps": 200,   # steps on digits 0-4 inside init (0: no pretraining, a baseline)
    "freeze_trunk": False,   # True: only the new head is trained (optax.multi_transform)
    "steps": 200,
}

LANGUAGE_DEFAULTS: dict[str, Any] = {
    **language.DEFAULTS,
    "pretrain_genre": "tragedies",
    "genre": "comedies",     # the finetuning genre
    "pretrain_steps": 500,   # steps on pretrain_genre inside init (0: no pretraining, a baseline)
    "steps": 500,
}

_EXTERNAL = "external"


def _make_pretrain(train_step: Callable, batch: Callable[[int], Any], steps: int) -> Callable:
    """``pretrain(state) -> state``: ``steps`` jitted train steps on
    ``batch(0) .. batch(steps - 1)``.

    ``jax.jit(train_step)`` shares its compiled executable with any other ``jax.jit`` of the same
    function, so when pretraining and finetuning use the same step function it is compiled once.
    """
    step_fn = jax.jit(train_step)

    def pretrain(state: _common.State) -> _common.State:
        for i in range(steps):
            state, _ = step_fn(state, batch(i))
        return state

    return pretrain


def _external(name: str, cfg: dict[str, Any], pretrained_params: Any) -> bool:
    """Validates ``pretrained_params`` and records it in ``cfg``; True if params were given."""
    if isinstance(pretrained_params, str):
        raise ValueError(
            f"workload {name!r} was built with externally supplied pretrained params "
            f"(config pretrained_params={pretrained_params!r}); pass the params pytree again as "
            "pretrained_params=...")
    if pretrained_params is None:
        return False
    cfg["pretrained_params"] = _EXTERNAL
    return True


def _signature(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    return tuple(np.shape(x)), np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def _check_params(name: str, expected: Any, given: Any) -> None:
    """Raises ValueError unless ``given`` has the structure, shapes and dtypes of ``expected``."""
    want, got = jax.tree.map(_signature, expected), jax.tree.map(_signature, given)
    if (jax.tree.structure(want) != jax.tree.structure(got)
            or jax.tree.leaves(want) != jax.tree.leaves(got)):
        raise ValueError(f"pretrained_params do not match the {name!r} model built from this "
                         "config (different structure, shapes or dtypes)")


def make_vision(*, pretrained_params: Any = None, **config: Any) -> Workload:
    """Builds ``"vision_finetune"``; ``config`` overrides :data:`VISION_DEFAULTS`.

    ``pretrained_params``: params of a vision CNN with the same ``width``/``hidden`` (any head; the
    head is replaced). Without it, ``init`` pretrains on digits 0-4 for ``pretrain_steps``.
    """
    name = "vision_finetune"
    cfg = _common.resolve_config(name, VISION_DEFAULTS, config, vision.SIZES)
    vision.check_config(name, cfg)
    if cfg["pretrain_steps"] != 0:
        _common.check_positive(name, cfg, "pretrain_steps")
    external = _external(name, cfg, pretrained_params)

    x_train, y_train, x_test, y_test = vision.load_digits_split(cfg["seed"],
                                                                cfg["holdout_fraction"])
    low, high = y_train < 5, y_train >= 5
    test_high = y_test >= 5
    model, tx_pre, apply = vision.build(cfg, num_classes=5)
    pre_step = _common.make_train_step(apply, tx_pre)
    if cfg["freeze_trunk"]:
        tx = optax.multi_transform(
            {"train": optax.adam(cfg["learning_rate"]), "freeze": optax.set_to_zero()},
            lambda params: {k: jax.tree.map(lambda _: "train" if k == "head" else "freeze", v)
                            for k, v in params.items()})
        train_step = _common.make_train_step(apply, tx)
    else:
        tx, train_step = tx_pre, pre_step
    pretrain = _make_pretrain(
        pre_step, vision.make_batch_fn(x_train[low], y_train[low], cfg["batch_size"], cfg["seed"]),
        0 if external else cfg["pretrain_steps"])

    @jax.jit
    def pretrain_start(key: jax.Array) -> _common.State:
        params_key, rng = jax.random.split(key)
        return _common.new_state(vision.init_params(model, params_key), tx_pre, rng)

    @jax.jit
    def finetune_start(trunk: Any, key: jax.Array) -> _common.State:
        head_key, rng = jax.random.split(key)
        params = {**{k: v for k, v in trunk.items() if k != "head"},
                  "head": vision.init_params(model, head_key)["head"]}
        return _common.new_state(params, tx, rng)

    def init(key: Any) -> _common.State:
        pre_key, key = jax.random.split(typed_key(key))
        if external:
            trunk = {k: v for k, v in dict(pretrained_params).items() if k != "head"}
            expected = jax.eval_shape(lambda k: vision.init_params(model, k), key)
            _check_params(name, {k: v for k, v in expected.items() if k != "head"}, trunk)
        else:
            trunk = pretrain(pretrain_start(pre_key))["params"]
        return finetune_start(trunk, key)

    return Workload(
        name=name,
        init=init,
        train_step=train_step,
        batch=vision.make_batch_fn(x_train[high], y_train[high] - 5, cfg["batch_size"],
                                   cfg["seed"]),
        evaluate=_common.make_evaluate(
            apply, [{"image": x_test[test_high], "label": y_test[test_high] - 5}]),
        config=cfg,
    )


def make_language(*, pretrained_params: Any = None, **config: Any) -> Workload:
    """Builds ``"language_finetune"``; ``config`` overrides :data:`LANGUAGE_DEFAULTS`.

    ``pretrained_params``: params of the ``"language"`` model with the same architecture config
    (``n_layers``, ``d_model``, ``n_heads``, ``mlp_ratio``, ``seq_len``, ``scan``). Without it,
    ``init`` pretrains on ``pretrain_genre`` for ``pretrain_steps``.
    """
    name = "language_finetune"
    cfg = _common.resolve_config(name, LANGUAGE_DEFAULTS, config, language.SIZES)
    language.check_config(name, cfg)
    language.parse_genres(cfg["pretrain_genre"])
    if cfg["pretrain_steps"] != 0:
        _common.check_positive(name, cfg, "pretrain_steps")
    external = _external(name, cfg, pretrained_params)

    source = language.load_corpus(cfg["pretrain_genre"], cfg["holdout_fraction"])
    target = language.load_corpus(cfg["genre"], cfg["holdout_fraction"])
    model, tx, apply = language.build(cfg)
    train_step = _common.make_train_step(apply, tx)
    pretrain = _make_pretrain(
        train_step,
        language.make_batch_fn(source.train, cfg["batch_size"], cfg["seq_len"], cfg["seed"]),
        0 if external else cfg["pretrain_steps"])

    @jax.jit
    def start(params: Any, key: jax.Array) -> _common.State:
        if params is None:
            params_key, key = jax.random.split(key)
            params = language.init_params(model, params_key)
        return _common.new_state(params, tx, key)

    def init(key: Any) -> _common.State:
        pre_key, rng = jax.random.split(typed_key(key))
        if external:
            _check_params(name, jax.eval_shape(lambda k: language.init_params(model, k), pre_key),
                          pretrained_params)
            return start(pretrained_params, rng)
        params = pretrain(start(None, pre_key))["params"]
        return start(params, rng)

    return Workload(
        name=name,
        init=init,
        train_step=train_step,
        batch=language.make_batch_fn(target.train, cfg["batch_size"], cfg["seq_len"], cfg["seed"]),
        evaluate=_common.make_evaluate(
            apply, language.eval_batches(target.test, cfg["eval_windows"], cfg["seq_len"])),
        config=cfg,
    )
