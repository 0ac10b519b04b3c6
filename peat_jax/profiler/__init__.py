"""The Profiler: golden runs on Orbax, playback and frequency-based runtime injection."""
from peat_jax.profiler.golden import GoldenRun, profile, restore
from peat_jax.profiler.runtime import OUTCOMES, RuntimeResult, classify_outcome, runtime
from peat_jax.profiler.workload import Workload

__all__ = ["GoldenRun", "OUTCOMES", "RuntimeResult", "Workload", "classify_outcome", "profile",
           "restore", "runtime"]
