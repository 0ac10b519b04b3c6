"""Where a Pallas candidate runs: compiled on GPU/TPU, interpreted on CPU, optionally with checks.

`interpret=None` (the default of every bundled factory) means "interpret when
`jax.default_backend() == "cpu"`, compile otherwise", decided when the kernel is traced; inside
`compiling()` (what `peat.lowers_for` uses to lower for a GPU on a CPU machine) it means
"compile" whatever the backend.

Compiled, every kernel built through `call` chooses its GPU backend explicitly: Triton
(`jax.experimental.pallas.triton.CompilerParams`), on NVIDIA (CUDA) and AMD (ROCm) GPUs alike.
Without compiler parameters jax 0.10.2 would lower a `pallas_call` for CUDA with Mosaic GPU,
which cannot lower these kernels (no `dot_general`, layout casts wanted for `iota`), and it
refuses ROCm; newer releases chose Triton by default. Interpreted (the CPU), the kernels carry no
compiler parameters (the plain interpreter) or the checked interpreter's (`checks=`).

`checks=` switches on the checks of the installed jax's Pallas interpreter
(`jax.experimental.pallas.tpu.InterpretParams`, which also interprets plain `pl.BlockSpec`
kernels that carry no Triton compiler params):

* out-of-bounds reads of a ref raise (`IndexError: Out-of-bounds read of ...`, surfaced by XLA as a
  `JaxRuntimeError`); the plain interpreter clamps such reads silently;
* buffers the kernel never writes are filled with NaN (the plain interpreter does this too);
* data races between grid points that run on different simulated cores: the grid points of the
  leading dimensions a kernel declares `"parallel"` are divided into `num_cores` contiguous
  chunks, one per core, and a happens-before race detector watches every read and write. A race
  shows when two grid points that touch the same block land on different cores (raise
  `num_cores` to split finer). It is reported as a `PeatError` raised from a callback right after
  the kernel (a `JaxRuntimeError` carrying that message under jit), and `races_found()` is True.

What does not work in jax 0.10.2 (measured): the GPU flavour `InterpretGPUParams` asserts that
every block is the whole array (no `BlockSpec` tiling), so it cannot run tiled kernels; and the
TPU flavour rejects kernels that carry Triton compiler params, which is why jax's own
`jax.experimental.pallas.ops.gpu` kernels cannot run with checks. Checked interpretation is slow
(about 1000x the plain interpreter per grid point): use small shapes.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from typing import Any, Callable, Literal, Optional, Sequence, Union

import jax
from jax.experimental import pallas as pl

from peat_jax._src import _jax
from peat_jax._src.errors import PeatError


@dataclasses.dataclass(frozen=True)
class InterpretChecks:
    """Checks of the Pallas interpreter, for a candidate interpreted on CPU.

    Attributes:
      detect_races: run the happens-before race detector; a race raises a `PeatError`.
      out_of_bounds: `"raise"` (an out-of-bounds read of a ref raises) or `"nan"` (it returns
        the uninitialised value instead).
      uninitialized: value of memory nobody wrote: `"nan"` or `"zero"`.
      num_cores: simulated cores that grid dimensions marked `"parallel"` are split over (races
        need at least 2).
      seed: randomises the order in which parallel grid points run (None: in order).
    """

    detect_races: bool = True
    out_of_bounds: Literal["raise", "nan"] = "raise"
    uninitialized: Literal["nan", "zero"] = "nan"
    num_cores: int = 2
    seed: Optional[int] = None

    def __post_init__(self):
        if self.out_of_bounds not in ("raise", "nan"):
            raise PeatError(f"InterpretChecks.out_of_bounds must be 'raise' or 'nan', got "
                            f"{self.out_of_bounds!r}")
        if self.uninitialized not in ("nan", "zero"):
            raise PeatError(f"InterpretChecks.uninitialized must be 'nan' or 'zero', got "
                            f"{self.uninitialized!r}")
        if int(self.num_cores) < 1:
            raise PeatError(f"InterpretChecks.num_cores must be >= 1, got {self.num_cores}")

    def params(self):
        """These checks as the installed jax's `pltpu.InterpretParams`."""
        from jax.experimental.pallas import tpu as pltpu
        options = dict(
            detect_races=bool(self.detect_races),
            out_of_bounds_reads="raise" if self.out_of_bounds == "raise" else "uninitialized",
            uninitialized_memory=self.uninitialized,
            num_cores_or_threads=int(self.num_cores),
            random_seed=self.seed,
        )
        if "on_race" in {f.name for f in dataclasses.fields(pltpu.InterpretParams)}:
            # jax >= 0.12 raises a RuntimeError from inside the kernel by default; record the
            # race instead, so that it is reported as on older releases (a PeatError after the
            # kernel ran, naming the kernel)
            options["on_race"] = "warn"
        return pltpu.InterpretParams(**options)


Checks = Union[None, bool, InterpretChecks]
# per grid dimension, as `call` takes them (Pallas TPU's names)
DimensionSemantics = Literal["parallel", "arbitrary"]


def normalize_checks(checks: Checks) -> Optional[InterpretChecks]:
    """`checks` as an `InterpretChecks` or None (`True` means the defaults)."""
    if checks is None or checks is False:
        return None
    if checks is True:
        return InterpretChecks()
    if isinstance(checks, InterpretChecks):
        return checks
    raise PeatError("checks must be None, a bool or peat.kernels.InterpretChecks, got "
                    f"{type(checks).__name__}")


def validate_interpret(interpret: Optional[bool], checks: Checks) -> None:
    """PeatError for contradictory options (checks need the interpreter)."""
    if interpret not in (None, True, False):
        raise PeatError(f"interpret must be None (choose by backend), True or False, got "
                        f"{interpret!r}")
    if interpret is False and normalize_checks(checks) is not None:
        raise PeatError("interpret=False compiles the kernel, but checks= needs the Pallas "
                        "interpreter: pass interpret=None or True with checks")


_COMPILING: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "peat_pallas_compiling", default=None)


@contextlib.contextmanager
def compiling(platform: str = "cuda"):
    """Within this context a kernel with `interpret=None` is built compiled (`interpret=False`)
    for `platform` ("cuda", "rocm" or "tpu"), whatever the default backend: for lowering a
    program for a GPU on a CPU machine (`peat.lowers_for`). The choice is made when a kernel is
    traced, so it applies to what is traced inside. Kernels built with `interpret=True` or
    `checks=` stay interpreted."""
    token = _COMPILING.set(str(platform).lower())
    try:
        yield
    finally:
        _COMPILING.reset(token)


def lowered_once(fn: Callable) -> Callable:
    """`fn(*operands, cfg)` (a bundled kernel's Pallas call or calls on its array operands, its
    frozen config last) as one jitted program per operand shapes, `cfg` and `compiling()`
    platform. Where a program calls it twice on the same shapes (a check's plain and
    differentiated forward; a model's sites of one shape) jax traces and lowers the Pallas call
    once, which in interpret mode is most of a small kernel's build. Measured on 2 CPU cores
    (jax 0.10.2): `peat check pallas_matmul`'s kernel program lowered in 0.58-0.80 s against
    0.86-1.05 s one call at a time; the language workload's step with `pallas_matmul` at its
    34 GEMM sites traced in 0.56 s against 0.66-0.76 s and lowered in 0.77-0.80 s against
    1.27-1.49 s."""

    def body(*operands, cfg, platform):
        del platform    # a key of jit's cache: `interpret_mode` reads it when `fn` is traced
        return fn(*operands, cfg)

    body.__name__ = body.__qualname__ = fn.__name__    # its name in compile logs and HLO
    jitted = jax.jit(body, static_argnames=("cfg", "platform"))

    @functools.wraps(fn)
    def call(*args):
        *operands, cfg = args
        return jitted(*operands, cfg=cfg, platform=_COMPILING.get())

    return call


def _target_platform() -> str:
    """The platform a compiled kernel is built for: `compiling()`'s, else the default backend."""
    return _COMPILING.get() or jax.default_backend()


def interpret_mode(interpret: Optional[bool] = None, checks: Checks = None) -> Any:
    """The value for `pl.pallas_call(interpret=...)`.

    Returns:
      False (compile: GPU/TPU), True (the plain interpreter), or an `InterpretParams` (the
      interpreter with checks). `interpret=None` interprets exactly when the default backend
      is the CPU, and never inside `compiling()`.
    """
    validate_interpret(interpret, checks)
    chk = normalize_checks(checks)
    if chk is not None:
        return chk.params()
    if interpret is None:
        return jax.default_backend() == "cpu" and _COMPILING.get() is None
    return bool(interpret)


def compiler_params(mode: Any, chk: Optional[InterpretChecks] = None,
                    dimension_semantics: Optional[Sequence[DimensionSemantics]] = None) -> dict:
    """The `compiler_params=` of a bundled kernel's `pallas_call` (as a keyword dict) for the
    interpret `mode` that `interpret_mode` chose.

    Compiled (`mode` False) for a GPU: Triton's, on NVIDIA (CUDA) and AMD (ROCm) alike; for a
    TPU none (Mosaic TPU, jax's default there). With the checked interpreter: the TPU-style
    params carrying `dimension_semantics` (where it looks for races). The plain interpreter:
    none."""
    if mode is False:
        if _target_platform() == "tpu":
            return {}
        return {"compiler_params": _jax.triton_compiler_params()}
    if chk is not None and dimension_semantics is not None:
        from jax.experimental.pallas import tpu as pltpu
        return {"compiler_params": pltpu.CompilerParams(
            dimension_semantics=tuple(dimension_semantics))}
    return {}


def call(body: Callable, *, out_shape: Any, grid: Sequence[int], in_specs: Any, out_specs: Any,
         dimension_semantics: Optional[Sequence[DimensionSemantics]] = None,
         name: Optional[str] = None,
         interpret: Optional[bool] = None, checks: Checks = None) -> Callable:
    """`pl.pallas_call` with the backend choice and the interpreter checks of this module.

    Args:
      body, out_shape, grid, in_specs, out_specs, name: as for `pl.pallas_call`.
      dimension_semantics: per grid dimension `"parallel"` (grid points independent: split over
        cores under checks) or `"arbitrary"` (run in order). Only used by the checked
        interpreter (it is where races are looked for); the plain interpreter and Triton ignore it.
      interpret: None (by backend; compiled inside `compiling()`), True or False.
      checks: None/False, True (default `InterpretChecks`) or an `InterpretChecks`.

    Compiled, the kernel lowers through Triton on CUDA and ROCm alike (see `compiler_params`).

    Returns:
      A function of the kernel's operands returning its outputs; with race detection on, a race
      raises `PeatError` (from a callback, after the kernel ran).
    """
    validate_interpret(interpret, checks)
    chk = normalize_checks(checks)
    grid = tuple(int(g) for g in grid)
    if dimension_semantics is not None and len(dimension_semantics) != len(grid):
        raise PeatError(f"dimension_semantics has {len(dimension_semantics)} entries for a "
                        f"{len(grid)}-d grid")

    def run(*operands):
        mode = interpret_mode(interpret, chk)
        extra = compiler_params(mode, chk, dimension_semantics)
        fn = pl.pallas_call(body, out_shape=out_shape, grid=grid, in_specs=in_specs,
                            out_specs=out_specs, interpret=mode, name=name, **extra)
        out = fn(*operands)
        if chk is not None and chk.detect_races:
            out = _race_guard(out, name or getattr(body, "__name__", "pallas kernel"))
        return out

    return run


# --------------------------------------------------------------------------------------------
# Race reports


_interp_module = _jax.pallas_interpreter

# before any program is traced: a config state registered by a lazy import mid-run would make
# programs traced before it and after it two cache entries (a replay compiled twice)
_jax.load_pallas_config_states()


def races_found() -> bool:
    """True when the last kernel run by the checked interpreter had a data race."""
    races = getattr(_interp_module(), "races", None)
    return bool(races is not None and races.races_found)


def reset_interpret_state() -> None:
    """Reset the checked interpreter's global state. Needed after a checked kernel raised (e.g.
    an out-of-bounds read), before the next checked kernel runs in the same process."""
    _interp_module().reset_tpu_interpret_mode_state()


class DataRaceError(PeatError):
    """The Pallas interpreter's race detector saw a data race in a checked kernel."""


class _WithoutRaceTracebacks(logging.Filter):
    """Drops jax's log of a `DataRaceError` raised in `_check_races`' callback (a traceback on
    stderr): the error itself reaches the caller, who reports it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], DataRaceError))


_jax.debug_callback_logger().addFilter(_WithoutRaceTracebacks())


def _check_races(name: str, *_):
    # runs after the kernel: its output is this callback's operand
    if races_found():
        raise DataRaceError(f"data race detected in Pallas kernel {name!r} by the interpreter's "
                            "race detector: two grid points on different cores accessed the same "
                            "memory with at least one write (is a reduction or revisited output "
                            "dimension marked 'parallel'?)")


def _race_guard(out, name: str):
    leaves = jax.tree.leaves(out)
    if leaves:
        jax.debug.callback(functools.partial(_check_races, name), leaves[0])
    return out
