"""peat_jax: pseudo-error assessment for GPU kernels in JAX training.

Sites and substitution: find the op sites of any JAX function (forward and backward), put a
candidate kernel or a modelled fault at chosen sites, switch it by a traced site index or a step
schedule. Analyzer and Detector: characterise a candidate's error against the XLA reference and
name its error model. Profiler: golden runs on Orbax, playback of checkpointed steps with the
candidate at one site, frequency-based runtime injection. See README.md; the reference is
docs/api.md.
"""
# The public face: every name is re-exported from the implementation in peat_jax._src.
from peat_jax import faults as faults
from peat_jax import kernels as kernels
from peat_jax import report as report
from peat_jax import testing as testing
from peat_jax._src.analyzer import Signature as Signature
from peat_jax._src.analyzer import analyze as analyze
from peat_jax._src.cache import enable_compilation_cache as enable_compilation_cache
from peat_jax._src.check import check_kernel as check_kernel
from peat_jax._src.detector import Diagnosis as Diagnosis
from peat_jax._src.detector import detect as detect
from peat_jax._src.errors import PeatError as PeatError
from peat_jax._src.faults import Fault as Fault
from peat_jax._src.kernels import Kernel as Kernel
from peat_jax._src.lowering import lowers_for as lowers_for
from peat_jax._src.profiler.compare import Comparison as Comparison
from peat_jax._src.profiler.compare import compare as compare
from peat_jax._src.profiler.distributed import Processes as Processes
from peat_jax._src.profiler.distributed import start as start_distributed
from peat_jax._src.profiler.effect import Effect as Effect
from peat_jax._src.profiler.from_model import from_equinox as from_equinox
from peat_jax._src.profiler.from_model import from_flax as from_flax
from peat_jax._src.profiler.from_model import workload_from as workload_from
from peat_jax._src.profiler.golden import GoldenRun as GoldenRun
from peat_jax._src.profiler.golden import profile as profile
from peat_jax._src.profiler.golden import restore as restore
from peat_jax._src.profiler.nan_origin import NanOrigin as NanOrigin
from peat_jax._src.profiler.nan_origin import golden_absmax as golden_absmax
from peat_jax._src.profiler.nan_origin import golden_nan_origin as golden_nan_origin
from peat_jax._src.profiler.playback import CellTimeout as CellTimeout
from peat_jax._src.profiler.playback import PlaybackResult as PlaybackResult
from peat_jax._src.profiler.playback import playback as playback
from peat_jax._src.profiler.run_metrics import RunComparison as RunComparison
from peat_jax._src.profiler.run_metrics import compare_runs as compare_runs
from peat_jax._src.profiler.runtime import RuntimeResult as RuntimeResult
from peat_jax._src.profiler.runtime import runtime as runtime
from peat_jax._src.profiler.workload import Workload as Workload
from peat_jax._src.profiler.workload import register_workload as register_workload
from peat_jax._src.profiler.workload import registered_workloads as registered_workloads
from peat_jax._src.regions import flax_regions as flax_regions
from peat_jax._src.regions import intercept as intercept
from peat_jax._src.regions import region as region
from peat_jax._src.schedule import Schedule as Schedule
from peat_jax._src.schedule import at_steps as at_steps
from peat_jax._src.schedule import every as every
from peat_jax._src.schedule import inject as inject
from peat_jax._src.schedule import with_probability as with_probability
from peat_jax._src.sites import Selector as Selector
from peat_jax._src.sites import Site as Site
from peat_jax._src.sites import format_sites as format_sites
from peat_jax._src.sites import list_sites as list_sites
from peat_jax._src.sites import select as select
from peat_jax._src.substitute import Candidate as Candidate
from peat_jax._src.substitute import Substitution as Substitution
from peat_jax._src.substitute import substitute as substitute
from peat_jax._src.substitute import switched as switched

__version__ = "0.1.0"

__all__ = [
    "Candidate",
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
    "Processes",
    "RunComparison",
    "RuntimeResult",
    "Schedule",
    "Selector",
    "Signature",
    "Site",
    "Substitution",
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
    "golden_absmax",
    "golden_nan_origin",
    "inject",
    "intercept",
    "kernels",
    "list_sites",
    "lowers_for",
    "playback",
    "profile",
    "region",
    "register_workload",
    "registered_workloads",
    "report",
    "restore",
    "runtime",
    "select",
    "start_distributed",
    "substitute",
    "switched",
    "testing",
    "with_probability",
    "workload_from",
]
