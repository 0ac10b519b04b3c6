"""Pieces shared by the bundled workloads: config resolution, keys, the train step.

Every bundled workload keeps its train state as a plain dict::

    {"params": ..., "opt_state": ..., "step": int32 scalar, "rng": typed PRNG key}

and builds its ``train_step`` from :func:`make_train_step`, so the traced programs of all of them
have the same shape: one ``jax.value_and_grad`` of a cross-entropy loss, then an optax update.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from peat_jax._src.profiler.workload import typed_key

State = dict[str, Any]
Batch = dict[str, Any]
Metrics = dict[str, jax.Array]
# apply(params, batch, *, train, rng) -> (logits, labels)
ApplyFn = Callable[..., tuple[jax.Array, jax.Array]]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_config(
    workload: str,
    defaults: Mapping[str, Any],
    config: Mapping[str, Any],
    sizes: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Merges ``config`` over ``defaults`` (and over the preset named by ``config["size"]``).

    Raises:
      ValueError: for a key that is not in ``defaults`` (the message lists the valid keys) or for an
        unknown ``size`` preset.
    """
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError(
            f"unknown config key(s) {unknown} for workload {workload!r}; "
            f"valid keys: {sorted(defaults)}"
        )
    resolved = dict(defaults)
    if sizes is not None:
        size = config.get("size", defaults["size"])
        if size not in sizes:
            raise ValueError(
                f"unknown size {size!r} for workload {workload!r}; valid sizes: {sorted(sizes)}"
            )
        resolved.update(sizes[size])
    resolved.update(config)
    if "dtype" in resolved and resolved["dtype"] not in DTYPES:
        raise ValueError(
            f"unknown dtype {resolved['dtype']!r} for workload {workload!r}; "
            f"valid dtypes: {sorted(DTYPES)}"
        )
    return resolved


def check_positive(workload: str, config: Mapping[str, Any], *keys: str) -> None:
    """Raises ValueError unless every ``config[key]`` is a positive int."""
    for key in keys:
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"config {key!r} of workload {workload!r} must be a positive int, "
                             f"got {value!r}")


def step_index(step: Any) -> int:
    """Converts a concrete step (int, numpy or jax scalar) to a non-negative Python int."""
    index = int(step)
    if index < 0:
        raise ValueError(f"step must be >= 0, got {index}")
    return index


def cross_entropy(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean softmax cross-entropy and accuracy, computed in float32."""
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32).mean()
    return loss, accuracy


def new_state(params: Any, tx: optax.GradientTransformation, rng: jax.Array) -> State:
    """The train state at step 0."""
    return {
        "params": params,
        "opt_state": tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": rng,
    }


def make_train_step(apply: ApplyFn, tx: optax.GradientTransformation
                    ) -> Callable[[State, Batch], tuple[State, Metrics]]:
    """Builds a pure, jittable ``train_step(state, batch) -> (state, {"loss", "accuracy"})``.

    ``apply(params, batch, train=True, rng=key)`` must return ``(logits, integer labels)``.
    """

    def train_step(state: State, batch: Batch) -> tuple[State, Metrics]:
        rng, dropout_rng = jax.random.split(state["rng"])

        def loss_fn(params: Any) -> tuple[jax.Array, jax.Array]:
            logits, labels = apply(params, batch, train=True, rng=dropout_rng)
            return cross_entropy(logits, labels)

        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}
        return new, {"loss": loss, "accuracy": accuracy}

    return train_step


def make_evaluate(apply: ApplyFn, batches: list[Batch]) -> Callable[[State], dict[str, float]]:
    """Builds ``evaluate(state) -> {"loss", "accuracy"}``: example-weighted means over fixed
    batches."""

    @jax.jit
    def _metrics(params: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        logits, labels = apply(params, batch, train=False, rng=None)
        return cross_entropy(logits, labels)

    def evaluate(state: State) -> dict[str, float]:
        total_loss = total_acc = total_n = 0.0
        for batch in batches:
            n = float(np.prod(np.shape(jax.tree.leaves(batch)[0])[:1]))
            loss, accuracy = _metrics(state["params"], batch)
            total_loss += n * float(loss)
            total_acc += n * float(accuracy)
            total_n += n
        return {"loss": total_loss / total_n, "accuracy": total_acc / total_n}

    return evaluate


def train(train_step: Callable[[State, Batch], tuple[State, Metrics]], state: State,
          batch: Callable[[int], Batch], steps: int) -> tuple[State, list[float]]:
    """Runs ``steps`` jitted steps from ``state`` (whose step counter selects the batches).

    A small helper for examples, tests and the finetuning workloads' pretraining.
    """
    step_fn = jax.jit(train_step)
    start = int(state["step"])
    losses = []
    for i in range(start, start + steps):
        state, metrics = step_fn(state, batch(i))
        losses.append(metrics["loss"])
    return state, [float(x) for x in jax.device_get(losses)]


def make_workload(name: str, cfg: Mapping[str, Any], init_params: Callable[[jax.Array], Any],
                  tx: optax.GradientTransformation, apply: ApplyFn, batch: Callable[[int], Batch],
                  eval_batches: list[Batch]):
    """The `Workload` every bundled model shares: jitted init, adam train step, held-out
    evaluate."""
    from peat_jax._src.profiler.workload import Workload

    @jax.jit
    def _init(key: jax.Array) -> State:
        params_key, rng = jax.random.split(key)
        return new_state(init_params(params_key), tx, rng)

    def init(key: Any) -> State:
        return _init(typed_key(key))

    return Workload(name=name, init=init, train_step=make_train_step(apply, tx), batch=batch,
                    evaluate=make_evaluate(apply, eval_batches), config=cfg)
