"""A `Workload` from what a user has: a loss, params, an optax optimizer and data, in one call.

``workload_from(loss_fn, params, optimizer, data, name=...)`` builds the state, the train step
and the batch function that the bundled workloads have (`peat_jax.models`), so that the
checkpoints of `peat.profile` restore, a replayed step is bitwise the golden step, and
`peat.playback` and `peat.runtime` work as for the bundled ones. `from_flax` (a Flax linen or nnx
module, or a transformers Flax model) and `from_equinox` (an Equinox module) do the params part
for the model libraries.

The train state is the bundled workloads' layout::

    {"params": params, "opt_state": optimizer.init(params), "step": int32 scalar,
     "rng": typed PRNG key}

and a step is one ``jax.value_and_grad`` of the loss, then ``optimizer.update`` and
``optax.apply_updates``; its metrics are ``{"loss": loss, **aux}``.

Every input is checked when the workload is built (one step is traced, nothing is compiled), and
a wrong one is a one-line `PeatError`: a loss that does not return a float scalar, params that
are not float arrays, an optimizer that is not an optax `GradientTransformation`, data that is
not a function of the step or stacked batches, a data function that returns different batches
for one step, a config that is not JSON.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from peat_jax._src.errors import PeatError
from peat_jax._src.profiler.workload import Workload, typed_key


def workload_from(loss_fn: Callable[..., Any], params: Any,
                  optimizer: optax.GradientTransformation, data: Any, *, name: str,
                  has_aux: bool = False, takes_key: bool = False, eval_data: Any = None,
                  config: Optional[Mapping[str, Any]] = None) -> Workload:
    """A `peat.Workload` that trains `params` on `loss_fn` with `optimizer` over `data`.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (``loss_fn(params, batch, key)`` with
        `takes_key`), pure and jittable; the loss is a float scalar. With `has_aux` it returns
        ``(loss, metrics)``, `metrics` a dict of arrays (scalars are recorded per step) that
        goes into the step's metrics beside ``"loss"``.
      params: the trainable parameters, a pytree of float arrays (Flax linen
        ``variables["params"]``, the ``nnx.Param`` state of ``nnx.split``, the array part of
        ``eqx.partition``, a dict of arrays), used as given for every seed; or an init function
        ``init_params(key) -> pytree``, called with a key drawn from `peat.profile`'s seed.
      optimizer: an optax ``GradientTransformation`` (``optax.adamw(1e-3)``); a
        ``GradientTransformationExtraArgs`` (what optax's optimizers are) also gets
        ``value=loss`` in its update, for those that use it.
      data: the batches: a function ``data(step: int) -> batch``, deterministic in the step
        (seed any randomness with it: ``np.random.default_rng(step)``), or stacked batches: an
        array or a pytree (dict, tuple) of arrays with one leading axis of N batches, step `s`
        training on batch ``s % N``. A batch is a pytree of arrays of the same shapes at every
        step.
      name: the workload's name, recorded in a run directory's manifest.
      has_aux: `loss_fn` returns ``(loss, metrics dict)``.
      takes_key: `loss_fn` takes a third argument, a fresh PRNG key each step (dropout), split
        from the state's ``"rng"`` (so a replayed step draws the key the golden step drew).
      eval_data: optional stacked batches (as for `data`) of held-out data; the workload's
        `evaluate(state)` is then the mean over them of the loss and of the metrics' scalars
        (with `takes_key`, every batch gets the same fixed key).
      config: the settings that built the workload, recorded in the manifest (JSON); a factory
        registered with `peat.register_workload(name, factory)` rebuilds it as
        ``factory(**config)``. Default: none.

    Returns:
      A `peat.Workload` named `name`: ``init(key)`` returns the state above (its ``"rng"`` from
      the key), ``train_step(state, batch)`` the new state and ``{"loss", **metrics}``,
      ``batch(step)`` the step's batch, ``evaluate`` the held-out means (None without
      `eval_data`), ``config`` the `config`.

    Raises:
      PeatError: a wrong input (one line saying which and what to give instead), or a loss
        that cannot be traced on the params and the first batch.
    """
    name = _checked_name(name, "workload_from")
    _checked_loss_fn(loss_fn, has_aux, takes_key, name)
    _checked_optimizer(optimizer, name)
    config = _checked_config(config, name)
    batch = _batch_fn(data, name)
    init_params, given = _params(params, name)
    objective = _objective(loss_fn, has_aux, name)
    init = _init_fn(init_params, given, optimizer)
    train_step = _train_step_fn(objective, optimizer, takes_key)
    evaluate = None if eval_data is None else _evaluate(objective, eval_data, takes_key, name)
    _trial_step(name, init, train_step, batch)
    return Workload(name=name, init=init, train_step=train_step, batch=batch,
                    evaluate=evaluate, config=config)


def from_flax(module: Any, loss: Callable[..., Any], optimizer: optax.GradientTransformation,
              data: Any, *, name: Optional[str] = None, inputs: Any = None,
              has_aux: bool = False, rngs: Sequence[str] = (),
              apply_kwargs: Optional[Mapping[str, Any]] = None, params: Any = None,
              eval_data: Any = None, config: Optional[Mapping[str, Any]] = None) -> Workload:
    """A `peat.Workload` that trains a Flax model: `workload_from` with the params from the
    model and ``loss(outputs, batch)``.

    Args:
      module: a Flax linen ``nn.Module`` (its params are ``module.init(key, *inputs(batch 0))``
        with the key from `peat.profile`'s seed, unless `params` is given), an ``nnx.Module``
        (its ``nnx.Param`` state is trained; its other state, such as rng counters and batch
        statistics, is held as it is), or a transformers Flax model (``FlaxGPT2LMHeadModel(cfg,
        _do_init=False)``: its linen ``.module``).
      loss: ``loss(outputs, batch) -> loss`` (or ``(loss, metrics)`` with `has_aux`), where
        `outputs` is what the model returns on ``inputs(batch)``.
      optimizer, data, has_aux, eval_data, config: as for `workload_from`.
      name: the workload's name (default: the model's class name).
      inputs: the model's arguments from a batch: a function ``inputs(batch)`` returning one
        argument or a tuple of positional arguments, or a key (``"x"``) or index of the batch.
        Default: the batch's first element for a tuple or list batch, the batch itself for an
        array; a dict batch needs `inputs`.
      rngs: linen rng streams the model draws from in training (``("dropout",)``): each step
        gets fresh keys split from the state's rng. nnx modules keep their own ``nnx.Rngs``.
      apply_kwargs: keyword arguments of every call of the model, in init and training
        (``{"deterministic": False}``, ``{"train": True}``).
      params: the starting params (pretrained ones: a transformers model's ``.params``, or a
        linen ``variables`` dict, whose ``"params"`` are taken) instead of the model's init.

    Returns:
      The `peat.Workload` of `workload_from`; ``state["params"]`` is the linen params dict (or
      the nnx ``Param`` state).

    Raises:
      PeatError: a wrong input, or a linen model with collections besides ``"params"`` (batch
        statistics: write the step yourself, as a `peat.Workload`).
    """
    import flax.linen as nn
    from flax import nnx

    apply_kwargs = dict(apply_kwargs or {})
    name = _checked_name(type(module).__name__ if name is None else name, "from_flax")
    inner = getattr(module, "module", None)
    if not isinstance(module, (nn.Module, nnx.Module)) and isinstance(inner, nn.Module):
        module = inner  # a transformers Flax model: its linen module
    if isinstance(rngs, str) or not all(isinstance(r, str) for r in rngs):
        raise PeatError(f"from_flax(name={name!r}): rngs must be a sequence of rng stream names "
                        f"such as ('dropout',), got {rngs!r}")
    rngs = tuple(rngs)
    first = _batch_fn(data, name)(0)
    args_of = _inputs(inputs, first, name)

    if isinstance(module, nnx.Module):
        if rngs:
            raise PeatError(f"from_flax(name={name!r}): an nnx module draws from its own "
                            "nnx.Rngs; rngs= is for linen modules")
        objective, start = _nnx_objective(module, loss, args_of, apply_kwargs, params)
        return workload_from(objective, start, optimizer, data, name=name, has_aux=has_aux,
                             eval_data=eval_data, config=config)
    if not isinstance(module, nn.Module):
        raise PeatError(f"from_flax(name={name!r}): module must be a Flax linen or nnx module or "
                        f"a transformers Flax model, got {type(module).__name__}; for other "
                        "models use peat.workload_from(loss_fn, params, optimizer, data)")
    objective, start = _linen_objective(module, loss, args_of, first, apply_kwargs, rngs, params,
                                        name)
    return workload_from(objective, start, optimizer, data, name=name, has_aux=has_aux,
                         takes_key=bool(rngs), eval_data=eval_data, config=config)


def _nnx_objective(module: Any, loss: Callable, args_of: Callable, apply_kwargs: dict,
                   params: Any) -> tuple[Callable, Any]:
    """(``objective(params, batch)``, the params to start from) of an nnx module: its
    ``nnx.Param`` state is trained, its other state held as it is."""
    from flax import nnx

    graphdef, nnx_params, *rest = nnx.split(module, nnx.Param, ...)  # rest: one State

    def nnx_loss(p: Any, batch: Any) -> Any:
        model = nnx.merge(graphdef, p, *rest)
        return loss(model(*args_of(batch), **apply_kwargs), batch)

    return nnx_loss, nnx_params if params is None else params


def _linen_objective(module: Any, loss: Callable, args_of: Callable, first: Any,
                     apply_kwargs: dict, rngs: tuple[str, ...], params: Any, name: str
                     ) -> tuple[Callable, Any]:
    """(``objective(params, batch, *key)``, the given params or an init function of a key) of
    a linen module, drawing the `rngs` streams from the step's key."""
    def streams(key: jax.Array, names: Sequence[str]) -> dict[str, jax.Array]:
        return dict(zip(names, jax.random.split(key, len(names))))

    def init_params(key: jax.Array) -> Any:
        variables = module.init(streams(key, ("params", *rngs)), *args_of(first),
                                **apply_kwargs)
        others = sorted(set(variables) - {"params"})
        if others:
            raise PeatError(f"from_flax(name={name!r}): the model has variable collections "
                            f"{others} besides 'params', which its training would update; "
                            "from_flax trains 'params' only: write the step as a peat.Workload")
        if "params" not in variables:
            raise PeatError(f"from_flax(name={name!r}): the model has no params to train")
        return variables["params"]

    if params is not None and isinstance(params, Mapping) and set(params) == {"params"}:
        params = params["params"]  # a variables dict
    start: Any = params if params is not None else init_params

    def linen_loss(p: Any, batch: Any, *key: jax.Array) -> Any:
        kw: dict[str, Any] = {"rngs": streams(key[0], rngs)} if rngs else {}
        outputs = module.apply({"params": p}, *args_of(batch), **kw, **apply_kwargs)
        return loss(outputs, batch)

    return linen_loss, start


def from_equinox(model: Any, loss: Callable[..., Any], optimizer: optax.GradientTransformation,
                 data: Any, *, name: Optional[str] = None, has_aux: bool = False,
                 takes_key: bool = False, eval_data: Any = None,
                 config: Optional[Mapping[str, Any]] = None) -> Workload:
    """A `peat.Workload` that trains an Equinox module: `workload_from` with the module's float
    arrays as the params (``eqx.partition(model, eqx.is_inexact_array)``) and
    ``loss(model, batch)``.

    Args:
      model: an ``eqx.Module``; its float arrays are trained, the rest (integer arrays,
        functions, static fields) is held as it is.
      loss: ``loss(model, batch) -> loss`` (``loss(model, batch, key)`` with `takes_key`; or
        ``(loss, metrics)`` with `has_aux`), called with the model rebuilt from the trained
        params (``eqx.combine``).
      optimizer, data, has_aux, takes_key, eval_data, config: as for `workload_from`.
      name: the workload's name (default: the model's class name).

    Returns:
      The `peat.Workload` of `workload_from`; ``state["params"]`` is the float part of the
      module (a module with None where the rest was).

    Raises:
      PeatError: a wrong input, or equinox is not installed.
    """
    try:
        import equinox as eqx
    except ImportError:
        raise PeatError("from_equinox needs equinox: pip install equinox") from None
    name = _checked_name(type(model).__name__ if name is None else name, "from_equinox")
    if not isinstance(model, eqx.Module):
        raise PeatError(f"from_equinox(name={name!r}): model must be an eqx.Module, got "
                        f"{type(model).__name__}")
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def eqx_loss(p: Any, batch: Any, *key: jax.Array) -> Any:
        return loss(eqx.combine(p, static), batch, *key)

    return workload_from(eqx_loss, params, optimizer, data, name=name, has_aux=has_aux,
                         takes_key=takes_key, eval_data=eval_data, config=config)


# ------------------------------------------------------------------------------ the checks

def _checked_loss_fn(loss_fn: Any, has_aux: Any, takes_key: Any, name: str) -> None:
    if not callable(loss_fn):
        raise PeatError(f"workload_from(name={name!r}): loss_fn must be a function "
                        f"loss_fn(params, batch) -> scalar loss, got {type(loss_fn).__name__}")
    for flag, value in (("has_aux", has_aux), ("takes_key", takes_key)):
        if not isinstance(value, bool):
            raise PeatError(f"workload_from(name={name!r}): {flag} must be True or False, got "
                            f"{value!r}")


def _init_fn(init_params: Optional[Callable[[jax.Array], Any]], given: Any,
             optimizer: optax.GradientTransformation) -> Callable[[Any], dict[str, Any]]:
    """``init(key)``: the training state, ``{"params", "opt_state", "step", "rng"}``, its params
    from ``init_params`` (a key split from `key`) or the `given` ones."""
    @jax.jit
    def _init(key: jax.Array, given_params: Any) -> dict[str, Any]:
        params_key, rng = jax.random.split(key)
        p = init_params(params_key) if init_params is not None else given_params
        return {"params": p, "opt_state": optimizer.init(p), "step": jnp.zeros((), jnp.int32),
                "rng": rng}

    def init(key: Any) -> dict[str, Any]:
        return _init(typed_key(key), given)

    return init


def _train_step_fn(objective: Callable, optimizer: optax.GradientTransformation,
                   takes_key: bool) -> Callable:
    """``train_step(state, batch) -> (new state, {"loss", **metrics})``: one optimizer step on
    the gradient of `objective` (with a fresh key split from the state's ``"rng"`` when the
    loss `takes_key`; with ``value=loss`` for an optimizer that takes extra args)."""
    extra_args = isinstance(optimizer, optax.GradientTransformationExtraArgs)

    def train_step(state: Mapping[str, Any], batch: Any) -> tuple[dict[str, Any], dict]:
        rng = state["rng"]
        keys: tuple[jax.Array, ...] = ()
        if takes_key:
            rng, key = jax.random.split(rng)
            keys = (key,)
        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(
            state["params"], batch, *keys)
        kwargs = {"value": loss} if extra_args else {}
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"],
                                              **kwargs)
        params = optax.apply_updates(state["params"], updates)
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}
        return new, {"loss": loss, **aux}

    return train_step


def _checked_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise PeatError(f"{where} needs name=, a non-empty string naming the workload in the run "
                        f"directory's manifest, got {name!r}")
    return name


def _checked_optimizer(optimizer: Any, name: str) -> None:
    if not isinstance(optimizer, optax.GradientTransformation):
        raise PeatError(f"workload {name!r}: optimizer must be an optax GradientTransformation "
                        f"(e.g. optax.adamw(1e-3)), got {type(optimizer).__name__}")


def _checked_config(config: Optional[Mapping[str, Any]], name: str) -> dict[str, Any]:
    if config is None:
        return {}
    if not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config):
        raise PeatError(f"workload {name!r}: config must be a dict with string keys, got "
                        f"{type(config).__name__}")
    try:
        same = json.loads(json.dumps(dict(config))) == dict(config)
    except (TypeError, ValueError):
        same = False
    if not same:
        raise PeatError(f"workload {name!r}: config must hold JSON values only (str, numbers, "
                        f"bools, None, lists, dicts), as the manifest records it; got {config!r}")
    return dict(config)


def _is_init_function(params: Any) -> bool:
    """A callable that is no pytree of its own (a function, a jitted function), not a model."""
    return (callable(params) and jax.tree.leaves(params) == [params]
            and not (hasattr(params, "init") and hasattr(params, "apply")))


def _params(params: Any, name: str) -> tuple[Optional[Callable[[jax.Array], Any]], Any]:
    """(init function or None, the given params or None); PeatError for params that are not a
    pytree of float arrays."""
    if _is_init_function(params):
        init_params = params
        try:
            shapes = jax.eval_shape(init_params, jax.random.key(0))
        except PeatError as e:  # raised while tracing: without the note jax's traceback adds
            raise PeatError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the user's init function, any failure
            raise PeatError(f"workload {name!r}: the params init function failed on a key: "
                            f"{_one_line(e)}") from e
        _check_leaves(shapes, name, "params init function's result")
        return init_params, None
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(params, nnx.Module):
        raise PeatError(f"workload {name!r}: params is an nnx module: use peat.from_flax, or "
                        "the Param state of graphdef, params, rest = nnx.split(model, nnx.Param, "
                        "...)")
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in leaves:
        if not _array_like(leaf):
            hint = ("an Equinox module: use peat.from_equinox, or eqx.partition(model, "
                    "eqx.is_inexact_array)" if _is_equinox(params) else
                    "a Flax module: use peat.from_flax" if hasattr(params, "apply") else
                    "give a pytree of float arrays, or an init function init_params(key)")
            raise PeatError(f"workload {name!r}: params{jax.tree_util.keystr(path)} is a "
                            f"{type(leaf).__name__}, not an array: {hint}")
    _check_leaves(params, name, "params")
    return None, jax.tree.map(jnp.asarray, params)


def _is_equinox(obj: Any) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(obj, eqx.Module)


def _array_like(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, float))


def _check_leaves(tree: Any, name: str, what: str) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        raise PeatError(f"workload {name!r}: the {what} has no arrays to train")
    for path, leaf in leaves:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise PeatError(f"workload {name!r}: {what}{jax.tree_util.keystr(path)} is {dtype}; "
                            "only float arrays can be trained (keep integer arrays out of the "
                            "params, e.g. in the loss function's closure)")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


# ------------------------------------------------------------------------------- the loss

def _objective(loss_fn: Callable[..., Any], has_aux: bool, name: str
               ) -> Callable[..., tuple[jax.Array, dict]]:
    """`loss_fn` as ``(params, batch, *key) -> (loss, aux dict)``, its output checked."""

    def objective(params: Any, batch: Any, *key: jax.Array) -> tuple[jax.Array, dict]:
        out = loss_fn(params, batch, *key)
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise PeatError(f"workload {name!r}: with has_aux=True, loss_fn must return "
                                f"(loss, metrics dict), got {_kind(out)}")
            loss, aux = out
            if not isinstance(aux, Mapping) or not all(isinstance(k, str) for k in aux):
                raise PeatError(f"workload {name!r}: loss_fn's metrics (the second of (loss, "
                                f"metrics)) must be a dict with string keys, got {_kind(aux)}")
            if "loss" in aux:
                raise PeatError(f"workload {name!r}: loss_fn's metrics have a 'loss' entry; the "
                                "step's 'loss' is the first of (loss, metrics): rename it")
        else:
            if isinstance(out, (tuple, list)):
                raise PeatError(f"workload {name!r}: loss_fn returned a {type(out).__name__} "
                                f"of {len(out)}; pass has_aux=True if it returns (loss, metrics "
                                "dict), else return the scalar loss")
            loss, aux = out, {}
        _check_loss(loss, name)
        return loss, dict(aux)

    return objective


def _kind(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    shape = getattr(x, "shape", None)
    return f"an array of shape {tuple(shape)}" if shape is not None else type(x).__name__


def _check_loss(loss: Any, name: str) -> None:
    shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
    if shape is None or dtype is None:
        if isinstance(loss, float):
            return
        raise PeatError(f"workload {name!r}: loss_fn must return a scalar loss (a float array "
                        f"of shape ()), got {_kind(loss)}")
    if tuple(shape) != ():
        raise PeatError(f"workload {name!r}: loss_fn must return a scalar loss, got shape "
                        f"{tuple(shape)} (take the mean over the batch)")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise PeatError(f"workload {name!r}: loss_fn must return a float loss, got {dtype}")


def _trial_step(name: str, init: Callable, train_step: Callable, batch: Callable) -> None:
    """Trace one step (nothing runs): a loss, params, optimizer or batch that do not fit
    together is a PeatError now rather than in the golden run."""
    try:
        state = jax.eval_shape(init, jax.random.key(0))
        jax.eval_shape(train_step, state, batch(0))
    except PeatError as e:  # raised while tracing: without the note jax's traceback adds
        raise PeatError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - the user's loss, optimizer or data, any failure
        raise PeatError(f"workload {name!r}: one training step cannot be traced on the params "
                        f"and the batch of step 0: {_one_line(e)}") from e


def _evaluate(objective: Callable, eval_data: Any, takes_key: bool, name: str
              ) -> Callable[[Any], dict[str, float]]:
    batches, count = _stacked(eval_data, name, "eval_data")

    @jax.jit
    def _metrics(params: Any, batch: Any) -> dict[str, jax.Array]:
        keys = (jax.random.key(0),) if takes_key else ()
        loss, aux = objective(params, batch, *keys)
        return {"loss": loss, **{k: v for k, v in aux.items() if jnp.ndim(v) == 0}}

    def evaluate(state: Mapping[str, Any]) -> dict[str, float]:
        totals: dict[str, float] = {}
        for i in range(count):
            for k, v in jax.device_get(_metrics(state["params"], batches(i))).items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return {k: v / count for k, v in totals.items()}

    return evaluate


# ------------------------------------------------------------------------------- the data

def _batch_fn(data: Any, name: str) -> Callable[[int], Any]:
    """``batch(step)`` from a data function or stacked batches, checked."""
    if isinstance(data, list):
        raise PeatError(f"workload {name!r}: data is a list; give stacked batches (a tuple or "
                        "dict of arrays with a leading batch axis, e.g. np.stack(batches)) or a "
                        "function step -> batch")
    if hasattr(data, "__next__"):
        raise PeatError(f"workload {name!r}: data is an iterator ({type(data).__name__}), which "
                        "cannot replay a step from its number; give a function step -> batch "
                        "or stacked batches")
    if callable(data) and not _array_like(data):
        return _checked_function(data, name)
    batch, _ = _stacked(data, name, "data")
    return batch


def _stacked(data: Any, name: str, what: str) -> tuple[Callable[[int], Any], int]:
    """(``batch(step)`` indexing the leading axis modulo its length, the length)."""
    flat = jax.tree_util.tree_flatten_with_path(data)[0]
    if not flat:
        raise PeatError(f"workload {name!r}: {what} must be a function step -> batch or stacked "
                        f"batches (arrays with a leading batch axis), got {type(data).__name__}")
    lengths = set()
    for path, leaf in flat:
        if not isinstance(leaf, (jax.Array, np.ndarray)) or np.ndim(leaf) < 1:
            raise PeatError(f"workload {name!r}: {what}{jax.tree_util.keystr(path)} is "
                            f"{_kind(leaf)}; {what} must be a function step -> batch or stacked "
                            "batches (arrays with a leading axis of batches)")
        lengths.add(int(np.shape(leaf)[0]))
    if len(lengths) != 1 or 0 in lengths:
        raise PeatError(f"workload {name!r}: the arrays of {what} must have one leading axis of "
                        f"N >= 1 batches, got lengths {sorted(lengths)}")
    count = lengths.pop()

    def batch(step: int) -> Any:
        i = _step(step) % count
        return jax.tree.map(lambda a: a[i], data)

    return batch, count


def _step(step: Any) -> int:
    index = int(step)
    if index < 0:
        raise PeatError(f"step must be >= 0, got {index}")
    return index


def _checked_function(data: Callable[[int], Any], name: str) -> Callable[[int], Any]:
    """`data` as the batch function, once its batch 0 is a pytree of arrays that it returns
    bitwise again, and batch 1 has the same shapes."""

    def call(step: int) -> Any:
        try:
            return data(step)
        except PeatError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's data function, any failure
            raise PeatError(f"workload {name!r}: data({step}) failed: {_one_line(e)}") from e

    first = call(0)
    for path, leaf in jax.tree_util.tree_flatten_with_path(first)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool)):
            raise PeatError(f"workload {name!r}: data(0){jax.tree_util.keystr(path)} is a "
                            f"{type(leaf).__name__}; a batch is a pytree of arrays")
    if not _bitwise_same(first, call(0)):
        raise PeatError(f"workload {name!r}: data(0) returned different batches on two calls; "
                        "data must be a deterministic function of the step, so that a replayed "
                        "step sees the golden step's batch (seed with it: "
                        "np.random.default_rng(step))")
    if _layout(call(1)) != _layout(first):
        raise PeatError(f"workload {name!r}: data(1) has other shapes or dtypes than data(0); "
                        "every step's batch must have the same (one compiled step replays all)")

    def batch(step: int) -> Any:
        return data(_step(step))

    return batch


def _layout(batch: Any) -> Any:
    leaves, tree = jax.tree.flatten(batch)
    return tree, [(np.shape(x), jnp.result_type(x)) for x in leaves]


def _bitwise_same(a: Any, b: Any) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    # jaxlib ships no stubs: mypy cannot see PyTreeDef's __eq__
    if ta != tb or len(la) != len(lb):  # type: ignore[operator]
        return False
    for x, y in zip(la, lb):
        x, y = np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))
        if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            return False
    return True


def _inputs(inputs: Any, first: Any, name: str) -> Callable[[Any], tuple]:
    """``args(batch)``: the model's positional arguments from a batch."""
    if inputs is None:
        if isinstance(first, (tuple, list)):
            pick = lambda b: b[0]
        elif _array_like(first):
            pick = lambda b: b
        else:
            raise PeatError(f"from_flax(name={name!r}): the batch is a "
                            f"{type(first).__name__}; say what the model takes from it: "
                            "inputs='x' (a key) or inputs=lambda batch: (batch['x'], ...)")
    elif callable(inputs):
        pick = inputs
    elif isinstance(inputs, (str, int)):
        pick = lambda b: b[inputs]
    else:
        raise PeatError(f"from_flax(name={name!r}): inputs must be a function of the batch, a "
                        f"key or an index, got {type(inputs).__name__}")

    def args(batch: Any) -> tuple:
        got = pick(batch)
        return got if isinstance(got, tuple) else (got,)

    try:
        args(first)
    except PeatError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's inputs function, any failure
        raise PeatError(f"from_flax(name={name!r}): inputs of the batch of step 0 failed: "
                        f"{_one_line(e)}") from e
    return args
