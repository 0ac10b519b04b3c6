"""peat_jax: pseudo-error assessment for GPU kernels in JAX training.

Sites and substitution: find the op sites of any JAX function (forward and backward), put a
candidate kernel or a modelled fault at chosen sites, switch it by a traced site index or a step
schedule. Analyzer and Detector: characterise a candidate's error against the XLA reference and
name its error model. Profiler: golden runs on Orbax, playback of checkpointed steps with the
candidate at one site, frequency-based runtime injection. See README.md.
"""
from peat_jax import faults, kernels, profiler, report, testing
from peat_jax.analyzer import Signature, analyze
from peat_jax.cache import enable_compilation_cache
from peat_jax.check import check_kernel
from peat_jax.detector import Diagnosis, detect
from peat_jax.errors import PeatError
from peat_jax.faults import Fault
from peat_jax.kernels import Kernel
from peat_jax.lowering import lowers_for
from peat_jax.profiler import (GoldenRun, RuntimeResult, Workload, profile, register_workload,
                               registered_workloads)
from peat_jax.profiler.compare import Comparison, RunComparison, compare, compare_runs
from peat_jax.profiler.effect import Effect
from peat_jax.profiler.from_model import from_equinox as from_equinox
from peat_jax.profiler.from_model import from_flax as from_flax
from peat_jax.profiler.from_model import workload_from as workload_from
from peat_jax.profiler.nan_origin import NanOrigin
from peat_jax.profiler.playback import CellTimeout, PlaybackResult, playback
from peat_jax.profiler.runtime import runtime
from peat_jax.regions import flax_regions, region
from peat_jax.regions import intercept as intercept
from peat_jax.schedule import Schedule, at_steps, every, inject, with_probability
from peat_jax.sites import Site, format_sites, list_sites, select
from peat_jax.substitute import substitute, switched

__version__ = "0.1.0"

__all__ = [
    "CellTimeout",
    "Comparison",
    "Diagnosis",
    "Effect",
    "Fault",
    "GoldenRun",
    "Kernel",
    "NanOrigin",
    "PeatError",
    "PlaybackResult",
    "RunComparison",
    "RuntimeResult",
    "Schedule",
    "Signature",
    "Site",
    "Workload",
    "analyze",
    "at_steps",
    "check_kernel",
    "compare",
    "compare_runs",
    "detect",
    "enable_compilation_cache",
    "every",
    "faults",
    "flax_regions",
    "format_sites",
    "from_equinox",
    "from_flax",
    "inject",
    "intercept",
    "kernels",
    "list_sites",
    "lowers_for",
    "playback",
    "profile",
    "profiler",
    "region",
    "register_workload",
    "registered_workloads",
    "report",
    "runtime",
    "select",
    "substitute",
    "switched",
    "testing",
    "with_probability",
    "workload_from",
]
