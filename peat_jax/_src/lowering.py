"""Does a kernel (or a whole program) build for the GPUs you target? Answered on a CPU machine.

`lowers_for(fn, *args)` lowers `fn` (and, with `grad=True`, its VJP: forward and backward) for
each GPU platform and device kind it is given, as `jax.export` lowers for a platform this machine
does not have, and reports each lowering: ok, or jax's first error line. Nothing is compiled or
run, so a CPU laptop or a CI runner answers "does my Pallas kernel lower through Triton for an
H200, an A100 and an MI250 on this jax release?" in well under a second per kernel::

    import peat_jax as peat
    for r in peat.lowers_for(my_kernel, x, grad=True):
        print(r)    # "my_kernel fwd+bwd for cuda (NVIDIA H200): ok, 3 Pallas kernels"

What it does:

* Pallas kernels are built compiled, not interpreted: inside it, a kernel with `interpret=None`
  (the default of every bundled factory and of `peat.kernels.pallas_call`, with which you build
  your own, when that is called inside your function, i.e. decided when it is traced) is built
  with `interpret=False`. A kernel in interpret mode lowers to
  plain HLO with no GPU kernel in it, so a `pallas_call` still interpreted in the traced program
  (built with `interpret=True` or `checks=`) is reported as a failure that says so.
* Each (platform, device) is traced and lowered with `jax.jit(fn).trace(*specs).lower(
  lowering_platforms=(p,))` (what `jax.export` does, without serialising) inside a one-device
  abstract mesh whose `AbstractDevice` names the GPU ("NVIDIA H200", "gfx90a", ...). jax 0.11
  and later lower Triton kernels for that device (an FP8 cast, say, lowers for an H200 but not
  for an A100);
  jax 0.10's Triton lowering targets compute capability 9.0 whatever device it is told
  (`Lowering.device_used` is False there).
* The bundled Pallas kernels choose Triton explicitly on both vendors
  (`jax.experimental.pallas.triton.CompilerParams`); a `pallas_call` without compiler
  parameters is lowered by jax's default GPU backend, which on jax 0.10.2 is Mosaic GPU for
  CUDA (it cannot lower `dot_general` or an unannotated `iota`) and refuses ROCm.

jax 0.11 and later deprecate the Pallas Triton backend (a `DeprecationWarning` at every Triton
kernel lowered, pointing to Mosaic GPU, which serves NVIDIA only); `lowers_for` records jax's
warnings in each result (`Lowering.warnings`) instead of showing them.

Limits: a host callback (`jax.pure_callback`, `jax.debug.callback`/`print` outside a Pallas body,
`io_callback`) needs a device of the target platform to lower and is reported as a failure here
although it would lower on that GPU. Lowering checks that every op has a rule for the platform
and that Pallas bodies translate to Triton IR; Triton's own compilation (registers, shared
memory: a block too large for the GPU) happens only on a GPU.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src import _jax
from peat_jax._src.errors import PeatError
from peat_jax._src.kernels.pallas import interpret as _interp


PLATFORMS: tuple[str, ...] = ("cuda", "rocm")
"""The platforms `lowers_for` lowers for."""

DEFAULT_DEVICES: Mapping[str, tuple[str, ...]] = {
    "cuda": ("NVIDIA H200", "NVIDIA A100"),   # Hopper (sm_90) and Ampere (sm_80)
    "rocm": ("gfx90a",),                      # AMD Instinct MI250 / MI250X / MI210
}
"""The device kinds lowered for on each platform unless `devices=` says otherwise: jax's
`device_kind` names of the GPUs (an AMD GPU's is its architecture, "gfx90a", "gfx942")."""

Devices = Union[None, Mapping[str, Sequence[str]], Sequence[str], str]


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One lowering of a function for one GPU.

    Attributes:
      name: what was lowered (`fn`'s name, a `peat.Kernel`'s name, or `name=`).
      platform: "cuda" or "rocm".
      device: the device kind it was lowered for ("NVIDIA H200", "gfx90a", ...).
      phase: "fwd" (the function) or "fwd+bwd" (its VJP, with `grad=True`).
      ok: True when it lowered, with every Pallas kernel in it compiled (none interpreted).
      error: None, or why not: jax's first error line (`"NotImplementedError: Unimplemented
        primitive in Pallas Triton lowering: sort. ..."`), prefixed with "while tracing: " when
        the function failed before lowering, or the interpreted kernels named.
      kernels: the names of the Pallas kernels (`pallas_call`s) in the traced program, one per
        call site (empty when tracing failed).
      device_used: whether this jax release lowers for `device` (0.11 and later) or for
        compute capability 9.0 whatever the device (0.10).
      warnings: the distinct warnings jax gave while tracing and lowering, as
        `"Category: first line"` (recorded here instead of shown: jax 0.11 and later deprecate
        the Pallas Triton backend at every Triton kernel lowered).
      seconds: how long tracing and lowering took.
    """

    name: str
    platform: str
    device: str
    phase: str
    ok: bool
    error: Optional[str] = None
    kernels: tuple[str, ...] = ()
    device_used: bool = True
    warnings: tuple[str, ...] = ()
    seconds: float = 0.0

    def __str__(self) -> str:
        where = f"{self.name} {self.phase} for {self.platform} ({self.device})"
        if not self.ok:
            return f"{where}: FAILED: {self.error}"
        n = len(self.kernels)
        what = f"{n} Pallas kernel{'s' if n != 1 else ''}" if n else "no Pallas kernel"
        return f"{where}: ok, {what}"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kernels"] = list(self.kernels)
        d["warnings"] = list(self.warnings)
        return d


def _devices_for(platforms: Sequence[str], devices: Devices) -> list[tuple[str, str]]:
    """(platform, device kind) pairs in order; PeatError for a bad request."""
    if isinstance(platforms, str):
        platforms = [p for p in platforms.split(",") if p.strip()]
    platforms = [str(p).strip().lower() for p in platforms]
    if not platforms:
        raise PeatError(f"lowers_for needs at least one platform of {', '.join(PLATFORMS)}")
    for p in platforms:
        if p not in PLATFORMS:
            raise PeatError(f"lowers_for lowers for the GPU platforms {', '.join(PLATFORMS)}; "
                            f"got {p!r}")
    if devices is None:
        table = {p: tuple(DEFAULT_DEVICES[p]) for p in platforms}
    elif isinstance(devices, Mapping):
        table = {str(p).lower(): tuple([d] if isinstance(d, str) else d)
                 for p, d in devices.items()}
        unknown = sorted(set(table) - set(PLATFORMS))
        if unknown:
            raise PeatError(f"devices= names platforms {unknown}; lowers_for knows "
                            f"{', '.join(PLATFORMS)}")
        for p in platforms:
            table.setdefault(p, tuple(DEFAULT_DEVICES[p]))
    else:
        given = [devices] if isinstance(devices, str) else list(devices)
        table = {p: () for p in platforms}
        for kind in given:
            p = _platform_of(str(kind))
            if p not in table:
                raise PeatError(f"device {kind!r} is a {p} GPU, but platforms= is "
                                f"{tuple(platforms)}")
            table[p] = table[p] + (str(kind),)
        missing = [p for p in platforms if not table[p]]
        if missing:
            raise PeatError(f"devices= names no GPU for platform(s) {missing}: give a mapping "
                            f"such as {{'rocm': ['gfx90a']}} or device kinds of each platform")
    pairs = []
    for p in platforms:
        kinds = table.get(p, ())
        if not kinds or not all(isinstance(k, str) and k for k in kinds):
            raise PeatError(f"devices for platform {p!r} must be device kind names, got {kinds!r}")
        pairs += [(p, k) for k in kinds]
    return pairs


def _platform_of(kind: str) -> str:
    """"rocm" for an AMD device kind ("gfx90a", "AMD Instinct MI250X"), else "cuda"."""
    k = kind.strip().lower()
    return "rocm" if k.startswith(("gfx", "amd")) else "cuda"


def _spec(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=getattr(x, "weak_type", False))
    s = jax.eval_shape(lambda: x)   # a Python scalar: jit's weakly-typed array
    return jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=getattr(s, "weak_type", False))


def _specs(args: Sequence[Any]) -> tuple:
    """`args` as shape/dtype specs without shardings (committed CPU arrays would pin the
    lowering to the CPU)."""
    return tuple(jax.tree.map(_spec, a) for a in args)


def _cotangent(o: Any) -> Any:
    if jnp.issubdtype(o.dtype, jnp.inexact):
        return jnp.ones(o.shape, o.dtype)
    return np.zeros(o.shape, jax.dtypes.float0)


def _with_vjp(fn: Callable) -> Callable:
    """`fn`'s outputs and its VJP at all-ones cotangents: the forward and the backward pass."""
    def fwd_bwd(*args):
        out, pull = jax.vjp(fn, *args)
        return out, pull(jax.tree.map(_cotangent, out))
    return fwd_bwd


def _name_of(fn: Callable) -> str:
    for attr in ("name", "__name__"):
        v = getattr(fn, attr, None)
        if isinstance(v, str) and v:
            return v
    inner = getattr(fn, "func", None)   # functools.partial
    return _name_of(inner) if callable(inner) else type(fn).__name__


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else ""


def first_error_line(e: BaseException) -> str:
    """`"ExceptionType: first non-empty line of its message"`."""
    line = _first_line(str(e))
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def _hint(message: str, platform: str, device: str, unparametrised: Sequence[str]) -> str:
    """A short note after jax's message where it is known to mislead (`unparametrised`: the
    Pallas kernels in the program without compiler parameters)."""
    if "No supported GPU devices found" in message and _jax.target_device_matters():
        return (f" (jax {_jax.JAX_VERSION}'s Triton lowering does not know the device kind "
                f"{device!r}: name one it knows, e.g. {', '.join(DEFAULT_DEVICES[platform])})")
    if unparametrised and _jax.pallas_default_gpu_backend() == "mosaic_gpu":
        return (f" (Pallas kernel(s) {', '.join(sorted(set(unparametrised)))} without "
                f"compiler_params are lowered by Mosaic GPU on jax {_jax.JAX_VERSION}: pass "
                "compiler_params=jax.experimental.pallas.triton.CompilerParams() for Triton)")
    if "require devices to be present" in message or "is different from the lowering platform" \
            in message:
        return (" (a host callback needs a device of the target platform to lower: it cannot "
                "be checked on this machine)")
    return ""


_GENERIC_NAMES = frozenset({"<lambda>", "wrapped", "fresh"})


def _lower_one(fn: Callable, specs: tuple, name: str, platform: str, device: str,
               phase: str) -> Lowering:
    t0 = time.perf_counter()
    result: dict[str, Any] = dict(name=name, platform=platform, device=device, phase=phase,
                                  device_used=_jax.target_device_matters())

    def fresh(*a):       # a new function object: no trace of an earlier jit of `fn` is reused
        return fn(*a)

    caught: list = []   # the warnings recorded below

    def report(error: Optional[str], kernels: tuple[str, ...] = ()) -> Lowering:
        seen = tuple(dict.fromkeys(f"{w.category.__name__}: {_first_line(str(w.message))}"
                                   for w in caught))
        return Lowering(**result, ok=error is None, error=error, kernels=kernels,
                        warnings=seen, seconds=time.perf_counter() - t0)

    with _interp.compiling(platform), _jax.gpu_target(device), \
            warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        caught = recorded
        try:
            traced = jax.jit(fresh).trace(*specs)
        except Exception as e:  # noqa: BLE001 - reported: the program does not build
            return report(f"while tracing: {first_error_line(e)}")
        eqns = list(_jax.pallas_calls(traced.jaxpr))
        kernels = tuple(_jax.pallas_call_name(q) for q in eqns)
        if name in _GENERIC_NAMES and kernels:   # e.g. a bare pl.pallas_call
            result["name"] = "/".join(dict.fromkeys(kernels))
        interpreted = sorted({_jax.pallas_call_name(q) for q in eqns
                              if _jax.pallas_call_interpreted(q)})
        if interpreted:   # it would lower, to plain HLO: not the kernel a GPU would run
            return report(f"Pallas kernel(s) {', '.join(interpreted)} built in interpret mode "
                          "(interpret=True or checks=) lower to plain HLO, not a GPU kernel: "
                          "build them with interpret=False, or interpret=None (compiled "
                          "here)", kernels)
        try:
            traced.lower(lowering_platforms=(platform,))
        except Exception as e:  # noqa: BLE001 - a lowering failure is the answer
            msg = first_error_line(e)
            unparametrised = [_jax.pallas_call_name(q) for q in eqns
                              if _jax.pallas_call_compiler_params(q) is None]
            return report(msg + _hint(msg, platform, device, unparametrised), kernels)
    return report(None, kernels)


def lowers_for(fn: Callable, *args: Any, platforms: Union[str, Sequence[str]] = PLATFORMS,
               devices: Devices = None, grad: bool = False,
               name: Optional[str] = None) -> tuple[Lowering, ...]:
    """Lower `fn(*args)` for each GPU platform and device kind, on this (CPU) machine.

    Args:
      fn: any JAX function of arrays (a `peat.Kernel`, a Pallas kernel, a train step, ...).
        Pallas kernels built with `interpret=None` are built compiled here (see module doc).
      *args: example arguments (arrays, `jax.ShapeDtypeStruct`s or pytrees of them); only their
        shapes and dtypes are used.
      platforms: "cuda", "rocm", or both (a sequence, or "cuda,rocm").
      devices: the device kinds per platform: None for `DEFAULT_DEVICES` (an H200 and an A100
        for CUDA, the MI250's gfx90a for ROCm), a mapping `{"rocm": ["gfx942"]}` (platforms it
        leaves out keep the defaults), or a sequence of kinds (an AMD one starts with "gfx").
      grad: also lower `fn`'s VJP (forward and backward, at all-ones cotangents; `fn` must be
        differentiable in its float arguments).
      name: shown in each result (default `fn`'s name).

    Returns:
      One `Lowering` per (platform, device), in that order, and with `grad=True` two: the
      forward (`phase="fwd"`) then the VJP (`"fwd+bwd"`). A lowering failure is reported in
      its result (`ok=False`, `error` with jax's first error line), never raised.

    Raises:
      PeatError: an unknown platform or malformed `devices`.
    """
    if not callable(fn):
        raise PeatError(f"lowers_for needs a function, got {type(fn).__name__}")
    pairs = _devices_for(platforms, devices)
    specs = _specs(args)
    name = name or _name_of(fn)
    programs = [("fwd", fn)] + ([("fwd+bwd", _with_vjp(fn))] if grad else [])
    return tuple(_lower_one(prog, specs, name, platform, device, phase)
                 for platform, device in pairs for phase, prog in programs)


def assert_lowers_for(fn: Callable, *args: Any, **options: Any) -> tuple[Lowering, ...]:
    """`lowers_for(fn, *args, **options)`, raising `AssertionError` listing every failed
    lowering (name, phase, platform, device and jax's message) when any failed; for tests."""
    results = lowers_for(fn, *args, **options)
    failed = [r for r in results if not r.ok]
    if failed:
        raise AssertionError(f"{len(failed)} of {len(results)} lowerings failed:\n"
                             + "\n".join(f"  {r}" for r in failed))
    return results
