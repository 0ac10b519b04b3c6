"""The workload contract: what the Profiler needs from a training flow."""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

__all__ = ["Workload"]


class Workload(NamedTuple):
    """A training flow the Profiler can run, replay and inject into.

    Attributes:
      name: short identifier, recorded in a run directory's manifest.
      init: ``init(key) -> state``; the full train state (params, optimizer state, step, RNG) as a pytree.
      train_step: ``train_step(state, batch) -> (state, metrics)``; pure and jittable; ``metrics`` is a
        dict of scalars that contains ``"loss"``.
      batch: ``batch(step: int) -> pytree``; deterministic in ``step`` so that any step can be replayed
        without storing data.
      evaluate: optional ``evaluate(state) -> dict[str, float]`` (held-out metrics).
      config: the settings that built it (recorded in the manifest; JSON-serialisable).
    """

    name: str
    init: Callable[[Any], Any]
    train_step: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]]
    batch: Callable[[int], Any]
    evaluate: Optional[Callable[[Any], Mapping[str, float]]] = None
    config: Mapping[str, Any] = {}
