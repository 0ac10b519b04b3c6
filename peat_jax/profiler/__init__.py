"""The Profiler: golden runs on Orbax, playback and frequency-based runtime injection.

`peat_jax.profiler.playback` and `peat_jax.profiler.runtime` are the modules; their functions
are `peat.playback` and `peat.runtime`.
"""
from peat_jax.profiler.golden import GoldenRun, profile, restore
from peat_jax.profiler.runtime import OUTCOMES, RuntimeResult, classify_outcome
from peat_jax.profiler.workload import (Workload, register_workload, registered_workloads,
                                        workload_factory)

__all__ = [
    "GoldenRun",
    "OUTCOMES",
    "RuntimeResult",
    "Workload",
    "classify_outcome",
    "profile",
    "register_workload",
    "registered_workloads",
    "restore",
    "workload_factory",
]
