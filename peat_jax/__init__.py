"""peat_jax: pseudo-error assessment for GPU kernels in JAX training.

Find the op sites of any JAX function (forward and backward), put a candidate kernel or a
modelled fault at chosen sites, switch it by a traced site index or a step schedule.
"""
from peat_jax import faults, kernels
from peat_jax.errors import PeatError
from peat_jax.faults import Fault
from peat_jax.kernels import Kernel
from peat_jax.profiler import GoldenRun, RuntimeResult, Workload, profile, runtime
from peat_jax.regions import flax_regions, region
from peat_jax.schedule import Schedule, at_steps, every, inject, with_probability
from peat_jax.sites import Site, format_sites, list_sites, select
from peat_jax.substitute import substitute, switched

__version__ = "0.1.0"

__all__ = [
    "Fault",
    "GoldenRun",
    "Kernel",
    "PeatError",
    "RuntimeResult",
    "Schedule",
    "Site",
    "Workload",
    "at_steps",
    "every",
    "faults",
    "flax_regions",
    "format_sites",
    "inject",
    "kernels",
    "list_sites",
    "profile",
    "region",
    "runtime",
    "select",
    "substitute",
    "switched",
    "with_probability",
]
