"""The Profiler: golden runs on Orbax, playback and frequency-based runtime injection.

Its public functions (`peat.profile`, `peat.playback`, `peat.runtime`, `peat.compare`, ...) are
re-exported by `peat_jax`.
"""
from peat_jax._src.profiler.golden import GoldenRun, profile, restore
from peat_jax._src.profiler.runtime import OUTCOMES, RuntimeResult, classify_outcome
from peat_jax._src.profiler.workload import (Workload, register_workload, registered_workloads,
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
