"""A small CNN on scikit-learn's 8x8 handwritten digits (``load_digits``; no download).

Usage::

    from peat_jax import models
    wl = models.get("vision")                 # or models.get("vision", size="large")
    state = wl.init(jax.random.key(0))
    step = jax.jit(wl.train_step)
    for i in range(wl.config["steps"]):
        state, metrics = step(state, wl.batch(i))
    wl.evaluate(state)                        # {"loss": ..., "accuracy": ...} on the held-out split
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from peat_jax._src.profiler.workload import Workload

from . import _common

__all__ = ["CNN", "DEFAULTS", "SIZES", "load_digits_split", "make"]

NUM_CLASSES = 10

DEFAULTS: dict[str, Any] = {
    "size": "small",          # preset for width / hidden / batch_size / steps:
                              # "small" (CPU), "large" (GPU)
    "width": 16,              # features of the first conv; the second has 2 * width
    "hidden": 64,             # units of the dense layer before the head
    "batch_size": 32,
    "learning_rate": 3e-3,    # adam
    "dropout": 0.0,           # before the head; uses the state's rng
    "dtype": "float32",       # compute dtype of convs and dense layers (params stay float32)
    "holdout_fraction": 0.2,  # held-out share of the 1797 digits
    "seed": 0,                # data seed: held-out split and the per-epoch batch order
    "steps": 300,             # suggested training length (the workload itself does not use it)
}

SIZES: dict[str, dict[str, Any]] = {
    "small": {},
    "large": {"width": 128, "hidden": 1024, "batch_size": 256, "steps": 2000},
}


class CNN(nn.Module):
    """Two 3x3 convs (relu, 2x2 average pool after each), LayerNorm, a dense layer, a linear
    head."""

    width: int = 16
    hidden: int = 64
    num_classes: int = NUM_CLASSES
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        x = x.astype(self.dtype)
        x = nn.relu(nn.Conv(self.width, (3, 3), dtype=self.dtype, name="conv1")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))                      # 8x8 -> 4x4
        x = nn.relu(nn.Conv(2 * self.width, (3, 3), dtype=self.dtype, name="conv2")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))                      # 4x4 -> 2x2
        x = x.reshape(x.shape[0], -1)
        x = nn.LayerNorm(dtype=self.dtype, name="norm")(x)
        x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype, name="hidden")(x))
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


@functools.lru_cache(maxsize=8)
def load_digits_split(seed: int = 0, holdout_fraction: float = 0.2
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns ``(train_images, train_labels, test_images, test_labels)``.

    Images are float32 ``[N, 8, 8, 1]`` in [0, 1], labels int32 ``[N]``. The held-out split is a
    seeded permutation, the same for the same ``seed``. The arrays are cached: do not modify them.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = int(round(holdout_fraction * len(labels)))
    test, train = order[:n_test], order[n_test:]
    arrays = (images[train], labels[train], images[test], labels[test])
    for a in arrays:
        a.setflags(write=False)
    return arrays


def make_batch_fn(images: np.ndarray, labels: np.ndarray, batch_size: int, seed: int):
    """``batch(step)``: epoch ``step // steps_per_epoch`` is a permutation seeded by (seed, epoch).

    The last partial batch of an epoch is dropped, so every batch has ``batch_size`` examples.
    """
    n = len(labels)
    if batch_size > n:
        raise ValueError(f"batch_size {batch_size} is larger than the training split "
                         f"({n} examples)")
    steps_per_epoch = n // batch_size

    def batch(step: int) -> dict[str, np.ndarray]:
        step = _common.step_index(step)
        epoch, index = divmod(step, steps_per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        idx = order[index * batch_size:(index + 1) * batch_size]
        return {"image": images[idx], "label": labels[idx]}

    return batch


def build(cfg: Mapping[str, Any], num_classes: int = NUM_CLASSES
          ) -> tuple[CNN, optax.GradientTransformation, Any]:
    """The model, the optimizer and ``apply(params, batch, *, train, rng) -> (logits, labels)``."""
    model = CNN(width=cfg["width"], hidden=cfg["hidden"], num_classes=num_classes,
                dropout=cfg["dropout"], dtype=_common.DTYPES[cfg["dtype"]])
    tx = optax.adam(cfg["learning_rate"])

    def apply(params: Any, batch: Mapping[str, jax.Array], *, train: bool, rng: Any
              ) -> tuple[jax.Array, jax.Array]:
        rngs = {"dropout": rng} if rng is not None else {}
        logits = model.apply({"params": params}, batch["image"], train=train, rngs=rngs)
        return logits, batch["label"]

    return model, tx, apply


def init_params(model: CNN, key: jax.Array) -> Any:
    """Initialises the model's params from ``key``."""
    return model.init(key, jnp.zeros((1, 8, 8, 1), jnp.float32))["params"]


def check_config(name: str, cfg: Mapping[str, Any]) -> None:
    _common.check_positive(name, cfg, "width", "hidden", "batch_size", "steps")
    if not 0.0 < cfg["holdout_fraction"] < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {cfg['holdout_fraction']!r}")
    if not 0.0 <= cfg["dropout"] < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {cfg['dropout']!r}")


def make(**config: Any) -> Workload:
    """Builds the ``"vision"`` workload; ``config`` overrides :data:`DEFAULTS` (see there)."""
    cfg = _common.resolve_config("vision", DEFAULTS, config, SIZES)
    check_config("vision", cfg)
    x_train, y_train, x_test, y_test = load_digits_split(cfg["seed"], cfg["holdout_fraction"])
    model, tx, apply = build(cfg)

    return _common.make_workload(
        "vision", cfg, lambda key: init_params(model, key), tx, apply,
        make_batch_fn(x_train, y_train, cfg["batch_size"], cfg["seed"]),
        [{"image": x_test, "label": y_test}])
