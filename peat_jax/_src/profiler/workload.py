"""The workload contract (what the Profiler needs from a training flow) and the registry that
rebuilds a workload from the name and config in a run directory's manifest.

A workload is registered by name with a factory, `factory(**config) -> Workload`, such that
`factory(**workload.config)` rebuilds it. Two ways, both found by `workload_factory`:

* `register_workload(name, factory)` in the process (e.g. when the module defining the workload
  is imported: `peat_jax.models` registers the bundled ones this way);
* an entry point in the group `ENTRY_POINT_GROUP` of an installed package, loaded only when its
  name is looked up; in `pyproject.toml`::

      [project.entry-points."peat_jax.workloads"]
      my_workload = "my_package.workloads:make_my_workload"

  peat_jax declares its bundled workloads this way too (seen once the package is installed).
"""
from __future__ import annotations

import importlib.metadata
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src.errors import PeatError


ENTRY_POINT_GROUP = "peat_jax.workloads"


class Workload(NamedTuple):
    """A training flow the Profiler can run, replay and inject into.

    Attributes:
      name: short identifier, recorded in a run directory's manifest.
      init: ``init(key) -> state``; the full train state (params, optimizer state, step, RNG) as a
        pytree.
      train_step: ``train_step(state, batch) -> (state, metrics)``; pure and jittable; ``metrics``
        is a dict of scalars that contains ``"loss"``.
      batch: ``batch(step: int) -> pytree``; deterministic in ``step`` so that any step can be
        replayed without storing data.
      evaluate: optional ``evaluate(state) -> dict[str, float]`` (held-out metrics).
      config: the settings that built it (recorded in the manifest; JSON-serialisable).
    """

    name: str
    init: Callable[[Any], Any]
    train_step: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]]
    batch: Callable[[int], Any]
    evaluate: Optional[Callable[[Any], Mapping[str, float]]] = None
    config: Mapping[str, Any] = {}


WorkloadFactory = Callable[..., Workload]
"""``factory(**config) -> Workload``."""

_FACTORIES: dict[str, WorkloadFactory] = {}


def register_workload(name: str, factory: WorkloadFactory) -> WorkloadFactory:
    """Register `factory` as the way to build workload `name` from its config.

    Registering a name again replaces its factory; a name registered here takes precedence over
    an entry point of the same name.

    Returns:
      `factory`.
    """
    if not isinstance(name, str) or not name:
        raise PeatError(f"register_workload needs a non-empty name, got {name!r}")
    if not callable(factory):
        raise PeatError(f"register_workload({name!r}, factory): the factory must be callable, "
                        f"got {type(factory).__name__}")
    _FACTORIES[name] = factory
    return factory


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def registered_workloads() -> tuple[str, ...]:
    """The names `workload_factory` can resolve, sorted (entry points are listed, not loaded)."""
    return tuple(sorted(set(_FACTORIES) | set(_entry_points())))


def workload_factory(name: str) -> WorkloadFactory:
    """The factory registered for workload `name` (an entry point is loaded on first use).

    Raises:
      PeatError: no workload of that name is registered (the message lists the registered names
        and how to register one), or its entry point cannot be loaded.
    """
    factory = _FACTORIES.get(name)
    if factory is not None:
        return factory
    ep = _entry_points().get(name)
    if ep is None:
        raise PeatError(
            f"no workload named {name!r} is registered (registered: "
            f"{', '.join(registered_workloads()) or 'none'}); pass the workload object itself "
            f"(workload=), or register a factory that rebuilds it from its config: "
            f"peat.register_workload({name!r}, factory) in this process, or an entry point "
            f"{name} = \"module:factory\" under [project.entry-points.\"{ENTRY_POINT_GROUP}\"] "
            "in an installed package's pyproject.toml")
    try:
        factory = ep.load()
    except Exception as e:  # noqa: BLE001 - any failure to import a third-party module
        raise PeatError(f"the entry point {ep.value!r} of workload {name!r} cannot be loaded: "
                        f"{type(e).__name__}: {e}") from e
    return register_workload(name, factory)


def typed_key(key: Any) -> jax.Array:
    """`key` as a typed PRNG key (what a train state's "rng" holds): typed keys, raw uint32 keys
    and int seeds."""
    if isinstance(key, (int, np.integer)):
        return jax.random.key(int(key))
    key = jnp.asarray(key)
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)
