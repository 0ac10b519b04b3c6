"""The one module that touches jax internals.

Everything peat_jax needs from jax beyond its documented API lives here: the jaxpr types, the
parameters of the container equations (`scan`, `while`, `cond`, `jit`/`pjit`, `remat`, the custom
derivative calls), name stacks and source info, tracer types, and the Pallas interpreter. Public
names (`jax.extend.core`) are used wherever they exist; where an equation's layout changed between
releases it is read through one small accessor here, and a layout that no accessor knows raises a
`PeatError` naming the primitive, the running jax and the tested range (never a bare KeyError).

Releases read before adapting: jax 0.10.2, 0.11.2, 0.12.0.1 (`jax/_src/core.py`,
`jax/_src/lax/control_flow/loops.py`, `jax/_src/flattree.py`). What changed among them:
- 0.11: `ClosedJaxpr` became an alias of `Jaxpr` (a jaxpr with its constants attached), and
  `jax.make_jaxpr` and the container params hold such jaxprs; `jaxpr.jaxpr` returns the jaxpr
  itself. 0.12 removed `jax._src.core.ClosedJaxpr` (the public alias `jax.extend.core.ClosedJaxpr`
  stays).
- 0.11: `scan` lost `num_consts` / `num_carry` (and `linear`, `_split_transpose`); its operands
  are described by `ft_in` (a FlatTree of (consts, carry, xs)) and its results by `ft_out`.
- `shard_map` (`jax/_src/shard_map.py`): the same params on all three (`mesh`, `in_specs`,
  `out_specs` as flat tuples of PartitionSpecs, `jaxpr` an open jaxpr, `check_vma`,
  `newly_manual_axes`) and the same public `jax.shard_map(f, mesh=, in_specs=, out_specs=,
  axis_names=, check_vma=)` (older releases' `jax.experimental.shard_map` with `check_rep`,
  `auto` and `in_names` / `out_names` params are below the tested range: `unsupported`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import warnings
from typing import Any, Iterator, Optional, Sequence

import jax
import jax.extend.core as jex
from jax import lax

from peat_jax._src.errors import PeatError


JAX_VERSION: str = jax.__version__
# Releases the test suite runs on: at least the first, below the second.
TESTED_RANGE: tuple[str, str] = ("0.10.2", "0.13")


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def is_tested_version(version: str = JAX_VERSION) -> bool:
    """True when `version` lies in TESTED_RANGE."""
    lo, hi = (_version_tuple(v) for v in TESTED_RANGE)
    return lo <= _version_tuple(version) < hi


def _range_text() -> str:
    return f">={TESTED_RANGE[0]},<{TESTED_RANGE[1]}"


if not is_tested_version():
    warnings.warn(
        f"peat_jax is tested with jax {_range_text()}; this is jax {JAX_VERSION}. It will work "
        "wherever the program's equations look as they did in the tested releases, and raise a "
        "PeatError naming the equation where they do not.", UserWarning, stacklevel=2)


def x64_enabled() -> bool:
    """Whether jax makes 64-bit types here: its `jax_enable_x64` flag, a ``jax.enable_x64``
    context of the calling thread included."""
    # jax.config's flags are attributes set at runtime: mypy cannot see them
    return bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]


def unsupported(primitive: str, what: str) -> PeatError:
    """The error for an equation layout that peat_jax does not know."""
    return PeatError(
        f"peat_jax cannot read the `{primitive}` equation on jax {JAX_VERSION}: {what}. "
        f"peat_jax is tested with jax {_range_text()}; install a release in that range, or report "
        "this message with your jax version.")


# --------------------------------------------------------------------------------------------
# Jaxpr types

Literal = jex.Literal
_MERGED_CLOSED = jex.ClosedJaxpr is jex.Jaxpr   # jax >= 0.11: one type for open and closed


def is_jaxpr(v: Any) -> bool:
    """True for a jaxpr, open or closed, on any supported release."""
    return isinstance(v, (jex.Jaxpr, jex.ClosedJaxpr))


def jaxpr_body(j: Any) -> Any:
    """The jaxpr whose `constvars`, `invars`, `eqns` and `outvars` are evaluated."""
    if not _MERGED_CLOSED and isinstance(j, jex.ClosedJaxpr):
        return j.jaxpr
    return j


def jaxpr_consts(j: Any) -> list:
    """The constant values attached to `j` (bound to its `constvars`); [] for an open jaxpr."""
    if _MERGED_CLOSED or isinstance(j, jex.ClosedJaxpr):
        return list(j.consts)
    return []


# --------------------------------------------------------------------------------------------
# Equations

def name_stack(eqn) -> str:
    """The equation's name stack as text (relative to its enclosing equation)."""
    return str(eqn.source_info.name_stack)


_SCATTERS = {"scatter-add": "scatter_add", "scatter-mul": "scatter_mul",
             "scatter-min": "scatter_min", "scatter-max": "scatter_max"}
"""Scatter primitives whose combiner (``update_jaxpr``) is typed by the operand's dtype, by the
`jax.lax` function that builds it."""


def bind(eqn, invals: Sequence[Any], **overrides) -> list:
    """Evaluate `eqn` on `invals` exactly as it was traced (with `overrides` replacing some of
    its params); its outputs as a list. A combining scatter (the transpose of a gather: a
    gradient of indexing) is rebuilt by its `jax.lax` function, whose combiner takes the
    operands' dtype: the traced one is typed by the traced dtype, and operands of another one
    (`promote`'s float64) fail to lower under `vmap` (a region typed f32 over f64 values)."""
    name, p = eqn.primitive.name, {**eqn.params, **overrides}
    if name in _SCATTERS:
        return [getattr(lax, _SCATTERS[name])(
            *invals, p["dimension_numbers"], indices_are_sorted=p["indices_are_sorted"],
            unique_indices=p["unique_indices"], mode=p["mode"])]
    bind_params = eqn.primitive.get_bind_params(p)
    if isinstance(bind_params, tuple):  # (subfuns, params)
        subfuns, params = bind_params
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    else:
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


@contextlib.contextmanager
def eqn_context(eqn) -> Iterator[None]:
    """Re-evaluate under the equation's own source info, name stack and context (mesh, ...), so
    that what is traced inside keeps its module path."""
    from jax._src import source_info_util as siu
    stack = siu.current_name_stack() + eqn.source_info.name_stack
    with siu.user_context(eqn.source_info.traceback, name_stack=stack), eqn.ctx.manager:
        yield


# --------------------------------------------------------------------------------------------
# Container equations: their sub-jaxprs and layouts

INLINE_CALLS: frozenset[str] = frozenset({
    "jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
    "custom_vjp_call_jaxpr"})
REMAT: frozenset[str] = frozenset({"remat2", "checkpoint", "remat"})


def sub_jaxprs(eqn, opaque: frozenset[str] = frozenset()) -> list[tuple[str, Any]]:
    """The (param name, jaxpr) pairs that `eqn` evaluates, in visiting order; [] for a leaf or
    for a primitive in `opaque` (a kernel whose body is not part of the XLA graph)."""
    name = eqn.primitive.name
    if name in opaque:
        return []
    p = eqn.params
    if name == "cond":
        return [("branches", b) for b in cond_branches(eqn)]
    if name == "while":
        w = while_layout(eqn)
        return [("cond_jaxpr", w.cond_jaxpr), ("body_jaxpr", w.body_jaxpr)]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in p and is_jaxpr(p[key]):
            return [(key, p[key])]
    return []


def call_body(eqn) -> Any:
    """The jaxpr of an inlinable call (`jit`, `closed_call`, a custom derivative call)."""
    subs = sub_jaxprs(eqn)
    if len(subs) != 1:
        raise unsupported(eqn.primitive.name, f"expected one body jaxpr, found params "
                          f"{sorted(eqn.params)}")
    return subs[0][1]


def cond_branches(eqn) -> tuple:
    try:
        return tuple(eqn.params["branches"])
    except KeyError:
        raise unsupported("cond", f"no `branches` param (params {sorted(eqn.params)})") from None


@dataclasses.dataclass(frozen=True)
class ScanLayout:
    """A `scan` equation's operands: `num_consts` consts, `num_carry` carries, then the xs."""

    jaxpr: Any
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


def scan_layout(eqn) -> ScanLayout:
    """How a `scan` equation's operands split, on any supported release."""
    p = eqn.params
    try:
        if "num_consts" in p:                        # jax < 0.11
            nc, nk = int(p["num_consts"]), int(p["num_carry"])
        elif "ft_in" in p:                           # jax >= 0.11: FlatTree of (consts, carry, xs)
            parts = p["ft_in"].unpack()
            if len(parts) != 3:
                raise unsupported("scan", f"`ft_in` has {len(parts)} parts, expected 3")
            nc, nk = len(parts[0]), len(parts[1])
        else:
            raise unsupported("scan", f"no operand layout in params {sorted(p)}")
        return ScanLayout(jaxpr=p["jaxpr"], num_consts=nc, num_carry=nk, length=int(p["length"]),
                          reverse=bool(p["reverse"]), unroll=p.get("unroll", 1))
    except (KeyError, AttributeError, TypeError) as e:
        raise unsupported("scan", f"{type(e).__name__}: {e} (params {sorted(p)})") from None


@dataclasses.dataclass(frozen=True)
class WhileLayout:
    cond_jaxpr: Any
    body_jaxpr: Any
    cond_nconsts: int
    body_nconsts: int


def while_layout(eqn) -> WhileLayout:
    p = eqn.params
    try:
        return WhileLayout(cond_jaxpr=p["cond_jaxpr"], body_jaxpr=p["body_jaxpr"],
                           cond_nconsts=int(p["cond_nconsts"]),
                           body_nconsts=int(p["body_nconsts"]))
    except KeyError as e:
        raise unsupported("while", f"no {e} param (params {sorted(p)})") from None


@dataclasses.dataclass(frozen=True)
class LinearSolveLayout:
    """A ``custom_linear_solve`` (`jnp.linalg.solve`, `lax.custom_linear_solve`): its value is
    ``solve(*operands[start:start + nconsts], *operands[total:])``, the solve jaxpr on its own
    constants and the right-hand side (which follows every jaxpr's constants)."""
    solve: Any
    start: int
    nconsts: int
    total: int


def linear_solve_layout(eqn) -> LinearSolveLayout:
    p = eqn.params
    try:
        lengths, jaxprs = p["const_lengths"], p["jaxprs"]
        return LinearSolveLayout(solve=jaxprs.solve, start=lengths.matvec + lengths.vecmat,
                                 nconsts=lengths.solve, total=sum(lengths))
    except (KeyError, AttributeError) as e:
        raise unsupported("custom_linear_solve", f"{e!r} (params {sorted(p)})") from None


@dataclasses.dataclass(frozen=True)
class RematLayout:
    jaxpr: Any
    prevent_cse: bool
    policy: Optional[Any]


def remat_layout(eqn) -> RematLayout:
    p = eqn.params
    if "jaxpr" not in p:
        raise unsupported(eqn.primitive.name, f"no `jaxpr` param (params {sorted(p)})")
    return RematLayout(jaxpr=p["jaxpr"], prevent_cse=bool(p.get("prevent_cse", True)),
                       policy=p.get("policy"))


@dataclasses.dataclass(frozen=True)
class ShardMapLayout:
    """A `shard_map` equation: its body, applied per shard of `mesh`, and how its flat operands
    and results are split over the mesh axes `manual_axes`."""

    jaxpr: Any
    mesh: Any
    in_specs: tuple
    out_specs: tuple
    manual_axes: frozenset
    check_vma: bool


def shard_map_layout(eqn) -> ShardMapLayout:
    """How a `shard_map` equation maps its body over the mesh, on any supported release."""
    p = eqn.params
    try:
        return ShardMapLayout(jaxpr=p["jaxpr"], mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                              out_specs=tuple(p["out_specs"]),
                              manual_axes=frozenset(p["newly_manual_axes"]),
                              check_vma=bool(p["check_vma"]))
    except (KeyError, AttributeError, TypeError) as e:
        raise unsupported("shard_map", f"{type(e).__name__}: {e} (params {sorted(p)})") from None


def shard_map(fn, layout: ShardMapLayout):
    """`fn` mapped over the shards of `layout.mesh` as the equation maps its body, with jax's
    public `shard_map`. `fn(*operands) -> (outputs, extra)` where `extra`
    is a pytree whose leaves carry a leading axis of size 1 (one per shard): they come out
    stacked along that axis over the manual axes' shards, in mesh order."""
    from jax.sharding import PartitionSpec
    stacked = PartitionSpec(tuple(a for a in layout.mesh.axis_names if a in layout.manual_axes))
    out_specs = (tuple(layout.out_specs), stacked)
    return jax.shard_map(fn, mesh=layout.mesh, in_specs=tuple(layout.in_specs),
                         out_specs=out_specs, axis_names=set(layout.manual_axes),
                         check_vma=layout.check_vma)


def scan_length(eqn) -> int:
    """Iterations of a `scan` equation (1 for any other equation)."""
    return scan_layout(eqn).length if eqn.primitive.name == "scan" else 1


# --------------------------------------------------------------------------------------------
# Tracers

def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


@functools.lru_cache(maxsize=None)
def _differentiation_tracers() -> tuple[type, ...]:
    from jax._src.interpreters import ad
    return tuple(t for t in (getattr(ad, "JVPTracer", None), getattr(ad, "LinearizeTracer", None))
                 if t is not None)


def is_differentiating(vals: Sequence[Any]) -> bool:
    """True when any of `vals` is being differentiated (a JVP or linearize tracer)."""
    types = _differentiation_tracers()
    return any(isinstance(v, types) for v in vals)


# --------------------------------------------------------------------------------------------
# Compiled functions

def cache_size(jitted: Any) -> int:
    """Executables a `jax.jit`-wrapped function has compiled so far."""
    return jitted._cache_size()


# `jax.make_user_context` (jax >= 0.7): a value in jax.jit's cache key. Made once, at import
# (making one is not thread-safe; using it is).
_TRACE_KEY = jax.make_user_context(None) if hasattr(jax, "make_user_context") else None


def trace_key_context(value: Any):
    """A context in which `value` (hashable) is part of every `jax.jit` cache key, so that a
    function jitted and traced before is traced again inside it (and a trace made inside is not
    reused outside). A null context on a jax without `jax.make_user_context`."""
    return contextlib.nullcontext() if _TRACE_KEY is None else _TRACE_KEY(value)


# --------------------------------------------------------------------------------------------
# Backends

def ffi_platform() -> str:
    """The XLA FFI platform name of jax's default backend, as `jax.ffi.register_ffi_target`
    takes it: "cpu", "CUDA" or "ROCM" (another backend: its own platform name)."""
    import jax.extend.backend
    backend = jax.extend.backend.get_backend()
    if backend.platform in ("gpu", "cuda", "rocm"):
        return "ROCM" if "rocm" in str(backend.platform_version).lower() else "CUDA"
    return backend.platform


# --------------------------------------------------------------------------------------------
# Pallas

def load_pallas_config_states() -> None:
    """Imports the Pallas modules that register jax config states in the trace context, so that
    they exist before the first program is traced. jax 0.11 registers
    ``pallas_fuser_disable_nested_fuse`` (``include_in_trace_context``) when
    ``jax._src.pallas.fuser`` is first imported, which happens lazily while a Pallas kernel is
    traced in interpret mode: every program traced before that import then has one trace-context
    value fewer than the same program traced after it, and compiles a second time (a playback
    campaign's replay compiled twice). Releases without the module have nothing to load."""
    for name in ("jax.experimental.pallas.fuser", "jax.experimental.pallas.tpu"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def pallas_interpreter():
    """The module of Pallas' checked (TPU-style) interpreter, which holds its race state."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    return interpret_pallas_call


def debug_callback_logger() -> logging.Logger:
    """The logger to which jax reports an exception raised inside a `jax.debug.callback`, with
    its traceback, before the exception reaches the caller (the same module on 0.10-0.12)."""
    return logging.getLogger("jax._src.debugging")


def io_callback_logger() -> logging.Logger:
    """The logger to which jax reports an exception raised inside a `jax.pure_callback` or
    `io_callback` (the checked Pallas interpreter runs its kernels through one), with its
    traceback, before the exception reaches the caller (the same module on 0.10-0.12)."""
    return logging.getLogger("jax._src.callback")


def cuda_versions() -> dict[str, Optional[int]]:
    """The CUDA runtime and cuDNN versions jaxlib's CUDA plugin reports, as integers (e.g.
    12080, 90800), by the keys ``cuda_version`` and ``cudnn_version``; None where the plugin is
    absent or does not say (no public API holds them: jax's own cuDNN checks read the plugin's
    ``_versions`` module, through ``jax._src.lib.cuda_versions``)."""
    try:
        from jax._src.lib import cuda_versions as versions
    except ImportError:
        versions = None

    def ask(name: str) -> Optional[int]:
        fn = getattr(versions, name, None)
        try:
            return int(fn()) if fn is not None else None
        except Exception:  # noqa: BLE001 - a plugin without a working CUDA says nothing
            return None

    return {"cuda_version": ask("cuda_runtime_get_version"),
            "cudnn_version": ask("cudnn_get_version")}


# --------------------------------------------------------------------------------------------
# The multi-process runtime

def live_processes(count: int) -> set[int]:
    """The ids among ``range(count)`` of the processes jax's coordination service counts as
    alive (connected, heartbeats arriving), or ``set(range(count))`` when
    `jax.distributed.initialize` was not called. No public API asks this: the client behind
    `jax.distributed` holds `get_live_nodes` (jax 0.10.2 to 0.12.0.1)."""
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        return set(range(count))
    return {int(i) for i in client.get_live_nodes(list(range(count)))}


def cache_writes_from_every_process() -> None:
    """From now on, let every process of a multi-process runtime write persistent-cache entries
    (jax writes them from process 0 only, against writers contending on filesystems such as
    GCS). A playback process compiles its programs for its own device, and the cache key names
    the device on CPU: process 0 never compiles what process 1 runs, so without this every
    process but 0 compiled its analyzer and replay programs afresh in every run (about 2 s a
    cell against 0.3 s). Keys differ by process, so the processes do not write the same entry
    (jax's cache writes each under its key, through its own file lock when size-limited).

    Read in jax 0.10.2, 0.11.2 and 0.12.0.1 (`jax/_src/compiler.py: _cache_write(cache_key,
    compile_time_secs, module_name, backend, executable[, host_callbacks])`, whose first test is
    `distributed.global_state.process_id != 0`; `compilation_cache.put_executable_and_time(
    cache_key, module_name, executable, backend, compile_time)` on all three)."""
    from jax._src import compilation_cache, compiler, distributed

    original = compiler._cache_write
    if getattr(original, "_peat_every_process", False):
        return

    def write(cache_key, compile_time_secs, module_name, backend, executable, *rest):
        host_callbacks = rest[0] if rest else ()
        if (distributed.global_state.process_id == 0 or host_callbacks
                or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs):
            return original(cache_key, compile_time_secs, module_name, backend, executable,
                            *rest)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable,
                                                      backend, int(compile_time_secs))
        except Exception as e:   # as jax itself: a failed write is a warning, not an error
            warnings.warn(f"Error writing persistent compilation cache entry for "
                          f"'{module_name}': {type(e).__name__}: {e}")

    setattr(write, "_peat_every_process", True)  # patched once (the getattr above)
    compiler._cache_write = write


# --------------------------------------------------------------------------------------------
# Lowering for a GPU this machine does not have (peat_jax._src.lowering)
#
# Read in jax 0.10.2, 0.11.2 and 0.12.0.1 (`jax/_src/pallas/pallas_call.py`,
# `jax/_src/pallas/triton/pallas_call_registration.py`, `.../triton/gpu_info.py`, `jax/_src/
# stages.py`, `jax/_src/export/_export.py`):
# - a `pallas_call` whose `compiler_params` is not Triton's lowers on "cuda" with Mosaic GPU on
#   0.10.2 (which lacks `dot_general` and wants layout casts for `iota`) and is refused on "rocm";
#   with `jax.experimental.pallas.triton.CompilerParams` (that name on all three) it lowers
#   through Triton on both, to a `__gpu$xla.gpu.triton` custom call.
# - 0.10.2's Triton lowering targets the local GPU or, with none, compute capability 9.0: the
#   target device is not asked. 0.11.2 and 0.12.0.1 read it from the abstract mesh's
#   `AbstractDevice(device_kind=...)` ("NVIDIA H200", "NVIDIA A100", "gfx90a", ...) and raise
#   "No supported GPU devices found" without one.
# - `jax.jit(f).trace(*specs).lower(lowering_platforms=(p,))` is what `jax.export.export` does
#   (public `Traced.lower` keyword on all three) minus the serialisation checks. The abstract
#   mesh is read when tracing (each equation keeps it in its context), not when lowering.
# - 0.11.2 and 0.12.0.1 warn at every Triton kernel lowered: "The Pallas Triton backend is
#   deprecated ... migrate to the Mosaic GPU backend" (a DeprecationWarning).

def triton_compiler_params(num_warps: Optional[int] = None, num_stages: Optional[int] = None):
    """Pallas' Triton compiler parameters (the class is `jax.experimental.pallas.triton.
    CompilerParams` on 0.10.2-0.12; older releases called it `TritonCompilerParams`). None for
    a field means Triton's default (4 warps; 3 stages on CUDA, 1 on ROCm)."""
    from jax.experimental.pallas import triton as pltriton
    cls = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams",
                                                               None)
    if cls is None:
        raise unsupported("pallas_call", "jax.experimental.pallas.triton has no CompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def target_device_matters() -> bool:
    """True when this jax's Triton lowering asks which GPU it targets (0.11 and later); 0.10's
    targets the local GPU or, with none, compute capability 9.0 (sm_90) whatever it is told."""
    return _version_tuple(JAX_VERSION) >= (0, 11)


@contextlib.contextmanager
def gpu_target(device_kind: str) -> Iterator[None]:
    """Lower as for a GPU of `device_kind` ("NVIDIA H200", "gfx90a", ...): a one-device abstract
    mesh with that `AbstractDevice` (public in `jax.sharding` on all supported releases)."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    device = AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        yield


def pallas_calls(jaxpr: Any) -> Iterator[Any]:
    """Every `pallas_call` equation in `jaxpr` and the jaxprs nested in its equations' params
    (not inside a kernel body), once per call site: a jitted function's jaxpr called from two
    equations (the same shapes twice) yields its kernels twice."""
    todo = [jaxpr]
    while todo:
        j = jaxpr_body(todo.pop())
        for eqn in j.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
                continue
            for v in eqn.params.values():
                for item in (v if isinstance(v, (tuple, list)) else (v,)):
                    if is_jaxpr(item):
                        todo.append(item)


def pallas_call_name(eqn) -> str:
    """The kernel name of a `pallas_call` equation (its `name=`, else the body's name)."""
    name = eqn.params.get("name")
    if name:
        return str(name)
    body = eqn.params.get("jaxpr")
    info = getattr(body, "debug_info", None)
    return str(getattr(info, "func_name", None) or "pallas kernel")


def pallas_call_interpreted(eqn) -> bool:
    """True when a `pallas_call` equation runs in interpret mode (lowers to plain HLO, no GPU
    kernel): its `interpret` param is True or an interpreter's params."""
    return bool(eqn.params.get("interpret", False))


def pallas_call_compiler_params(eqn) -> Any:
    """The `compiler_params` of a `pallas_call` equation (None when it was given none)."""
    return eqn.params.get("compiler_params")


def pallas_default_gpu_backend() -> str:
    """The backend that lowers a `pallas_call` without compiler parameters for a GPU:
    "mosaic_gpu" on jax 0.10 (its `jax_pallas_use_mosaic_gpu` flag, on by default; ROCm
    refused), "triton" from 0.11 (which has no such flag and lowers every `pallas_call` through
    Triton, Mosaic GPU kernels being `plgpu.kernel`s)."""
    from jax._src import config
    flag = getattr(config, "jax_pallas_use_mosaic_gpu", None)
    return "mosaic_gpu" if flag is not None and bool(flag.value) else "triton"
