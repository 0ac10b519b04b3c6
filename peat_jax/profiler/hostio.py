"""Between the host and a run: batches onto the device, Orbax's logging kept quiet."""
from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["quiet", "to_device"]


class quiet:
    """Context manager: Orbax/absl INFO logging silenced for its duration (the level before is
    put back on exit)."""

    def __enter__(self):
        self._lvl = logging.getLogger("absl").level
        logging.getLogger("absl").setLevel(logging.WARNING)

    def __exit__(self, *exc):
        logging.getLogger("absl").setLevel(self._lvl)


def to_device(batch: Any) -> Any:
    """`batch` (a pytree of host arrays) as jax arrays on the default device."""
    return jax.tree.map(jnp.asarray, batch)
