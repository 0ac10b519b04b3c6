"""JAX's persistent compilation cache, for the analyzer's per-shape executables and the replays."""
from __future__ import annotations

import os
from typing import Optional

import jax


def enable_compilation_cache(path: Optional[str] = None) -> Optional[str]:
    """Keep compiled XLA executables on disk between processes.

    The analyzer compiles once per tensor shape and dtype (~1.5 s each on CPU), so a
    `check_kernel` or a playback campaign spends most of a first run compiling; with the cache, a
    rerun, another process or a restarted worker loads them instead. The `peat` command calls
    this itself.

    Args:
      path: the cache directory. Default: $PEAT_CACHE_DIR, else
        ``$XDG_CACHE_HOME/peat_jax/xla`` (``~/.cache/peat_jax/xla``). ``PEAT_CACHE_DIR=off``
        disables it.

    Returns:
      The directory in use, or None when disabled, not writable, or when the user has already
      configured `jax_compilation_cache_dir` (which is then left as it is).
    """
    env = os.environ.get("PEAT_CACHE_DIR")
    # jax.config's flags are attributes set at runtime: mypy cannot see them
    if env == "off" or jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined]
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = path or env or os.path.join(base, "peat_jax", "xla")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    if not os.access(path, os.W_OK):
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path
