"""XLA FFI custom calls as candidates: build a C++ kernel, register it, wrap it as a Kernel.

    lib = build_ffi_library("my_matmul.cc", "my_matmul")    # g++ against jax.ffi.include_dir()
    kernel = ffi_kernel(lib, "MyMatmul", result=lambda a, b: ...)  # a peat.Kernel
    peat.kernels.ffi_matmul()                               # the bundled naive f32 matmul

Libraries are cached in `cache_dir` (default `$PEAT_CACHE_DIR/ffi`, else
`~/.cache/peat_jax/ffi`) under a name that hashes the source, the compiler, its version, the
flags and the jax headers, so they are rebuilt exactly when one of those changes. Targets are
registered for the CPU platform; calls use `vmap_method="sequential"`.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import pathlib
import shlex
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from peat_jax.errors import PeatError
from peat_jax.kernels._support import dot_general_float_support
from peat_jax.kernels.base import Kernel
from peat_jax.kernels.matmul import dot_general

__all__ = ["build_ffi_library", "register_ffi_target", "ffi_function", "ffi_kernel", "ffi_matmul",
           "CXXFLAGS"]

CXXFLAGS: tuple[str, ...] = ("-O2", "-std=c++17", "-shared", "-fPIC")
_CSRC = pathlib.Path(__file__).parent / "csrc"
_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}            # resolved path -> loaded library (kept alive)
_TARGETS: dict[tuple[str, str, str], str] = {}  # (path, symbol, platform) -> target name


def _default_cache_dir() -> pathlib.Path:
    root = os.environ.get("PEAT_CACHE_DIR")
    if root:
        return pathlib.Path(root) / "ffi"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(xdg) / "peat_jax" / "ffi"


def _compiler(compiler: Optional[str]) -> str:
    cxx = compiler or os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise PeatError(f"C++ compiler {cxx!r} not found on PATH: install g++ (e.g. "
                        "`apt-get install g++`) or pass compiler= / set $CXX")
    return path


def _compiler_version(cxx: str) -> str:
    try:
        res = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise PeatError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    return res.stdout.strip()


def build_ffi_library(source_path: Union[str, os.PathLike], name: str, *,
                      cache_dir: Optional[Union[str, os.PathLike]] = None,
                      extra_flags: Sequence[str] = (), compiler: Optional[str] = None
                      ) -> pathlib.Path:
    """Compile a C++ XLA FFI source into a shared library, or reuse the cached build.

    Runs `<compiler> -O2 -std=c++17 -shared -fPIC -I<jax.ffi.include_dir()> <extra_flags>
    source -o lib`. The compiler is `compiler`, else `$CXX`, else `g++`.

    Args:
      source_path: the `.cc` file.
      name: a file-name-safe stem for the library.
      cache_dir: where libraries are kept (default: see the module docstring).
      extra_flags: more compiler flags (part of the cache key).

    Returns:
      The path of the shared library (`<cache_dir>/lib<name>-<hash>.so`).

    Raises:
      PeatError: the source is missing, the compiler is missing, or compilation failed (the
        message holds the compiler's output).
    """
    src = pathlib.Path(source_path)
    if not src.is_file():
        raise PeatError(f"FFI source {str(src)!r} does not exist")
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise PeatError(f"library name {name!r} must be letters, digits, '_' or '-'")
    cxx = _compiler(compiler)
    include = jax.ffi.include_dir()
    flags = list(CXXFLAGS) + [f"-I{include}"] + [str(f) for f in extra_flags]
    key = hashlib.sha256()
    for part in (src.read_bytes(), cxx.encode(), _compiler_version(cxx).encode(),
                 "\0".join(flags).encode(), jax.__version__.encode()):
        key.update(part)
        key.update(b"\0")
    out_dir = pathlib.Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    out = out_dir / f"lib{name}-{key.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".lib{name}-", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, *flags, str(src), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise PeatError(f"compiling {src.name} failed (exit {res.returncode}): "
                            f"{shlex.join(cmd)}\n{(res.stderr or res.stdout).strip()}")
        os.replace(tmp, out)  # atomic: concurrent builders of the same key agree
    except subprocess.TimeoutExpired as e:
        raise PeatError(f"compiling {src.name} timed out: {shlex.join(cmd)}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load(library: Union[str, os.PathLike, ctypes.CDLL]) -> tuple[str, ctypes.CDLL]:
    if isinstance(library, ctypes.CDLL):
        return str(library._name), library
    path = str(pathlib.Path(library).resolve())
    with _LOCK:
        lib = _LIBS.get(path)
        if lib is None:
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise PeatError(f"cannot load FFI library {path!r}: {e}") from e
            _LIBS[path] = lib
    return path, lib


def register_ffi_target(library: Union[str, os.PathLike, ctypes.CDLL], symbol: str, *,
                        target_name: Optional[str] = None, platform: str = "cpu") -> str:
    """Register the FFI handler `symbol` of `library` with XLA (once per library and symbol).

    Returns:
      The target name to pass to `jax.ffi.ffi_call`.
    """
    path, lib = _load(library)
    with _LOCK:
        known = _TARGETS.get((path, symbol, platform))
        if known is not None and (target_name is None or target_name == known):
            return known
        try:
            fn = getattr(lib, symbol)
        except AttributeError:
            raise PeatError(f"FFI library {path!r} has no symbol {symbol!r} (declare it with "
                            "XLA_FFI_DEFINE_HANDLER_SYMBOL)") from None
        digest = hashlib.sha256(path.encode()).hexdigest()[:10]
        name = target_name or f"peat_{symbol}_{digest}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform=platform)
        _TARGETS[(path, symbol, platform)] = name
        return name


ResultFn = Callable[..., Any]


def _like_first(*operands):
    x = operands[0]
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def ffi_function(target_name: str, result: Optional[ResultFn] = None, *,
                 vmap_method: str = "sequential", **attributes) -> Callable:
    """A jittable function `f(*operands)` calling the registered FFI target.

    Args:
      result: `result(*operands) -> jax.ShapeDtypeStruct` (or a sequence of them) giving the
        output types; default: like the first operand.
      attributes: static FFI attributes (numpy scalars / Python scalars).
    """
    result = result or _like_first

    def call(*operands):
        return jax.ffi.ffi_call(target_name, result(*operands), vmap_method=vmap_method)(
            *operands, **attributes)

    call.__name__ = target_name
    return call


def ffi_kernel(library: Union[str, os.PathLike, ctypes.CDLL], symbol: str,
               result: Optional[ResultFn] = None, *, name: Optional[str] = None,
               target_name: Optional[str] = None, primitive: Optional[str] = None,
               supports: Optional[Callable] = None, vjp: Optional[Callable] = None,
               **attributes) -> Kernel:
    """A `peat.Kernel` whose impl calls an XLA FFI handler from a shared library (CPU).

    `impl(*operands, **op_params)` calls the target on the site's operands (op params are not
    passed; adapt them with a wrapper, as `ffi_matmul` does through
    `peat.kernels.dot_general`).

    Args:
      library, symbol: the shared library (path or loaded `ctypes.CDLL`) and handler symbol.
      result: output types from the operands (default: like the first operand).
      name: the kernel's name (default: the symbol).
      primitive, supports, vjp: as in `peat.Kernel` (an FFI call is not differentiable: pass
        `vjp=` where a gradient flows).
      attributes: static FFI attributes.

    Returns:
      A Kernel calling the target with `vmap_method="sequential"`.
    """
    target = register_ffi_target(library, symbol, target_name=target_name)
    fn = ffi_function(target, result, **attributes)

    def impl(*operands, **_params):
        return fn(*operands)

    return Kernel(name or symbol, impl, primitive=primitive, supports=supports, vjp=vjp)


# --------------------------------------------------------------------------------------------
# The bundled naive matmul


@dataclasses.dataclass(frozen=True)
class _Target:
    name: str


def _ffi_matmul3(a, b, target: _Target):
    fn = ffi_function(target.name, lambda a, b: jax.ShapeDtypeStruct(
        a.shape[:-1] + b.shape[-1:], jnp.float32))
    return fn(a.astype(jnp.float32), b.astype(jnp.float32))


def _make_matmul(target: _Target) -> Callable:
    @jax.custom_vjp
    def mm(a, b):
        return _ffi_matmul3(a, b, target)

    def fwd(a, b):
        return _ffi_matmul3(a, b, target), (a, b)

    def bwd(res, g):
        a, b = res
        da = mm(g, jnp.swapaxes(b, -1, -2))   # [B, M, N] x [B, N, K]
        db = mm(jnp.swapaxes(a, -1, -2), g)   # [B, K, M] x [B, M, N]
        return da.astype(a.dtype), db.astype(b.dtype)

    mm.defvjp(fwd, bwd)
    return mm


def ffi_matmul(*, cache_dir: Optional[Union[str, os.PathLike]] = None,
               compiler: Optional[str] = None) -> Kernel:
    """A `peat.Kernel` for floating-point `dot_general` sites: the bundled naive C++ f32 matmul
    (`csrc/naive_matmul.cc`), built on first use and called through XLA FFI on the CPU.

    Operands are cast to float32 and the result to the site's `preferred_element_type`. It
    trains: the batched matmul carries a `jax.custom_vjp` whose backward is the same FFI matmul on
    the transposed problems (`dA = G @ B^T`, `dB = A^T @ G`); the `dot_general` adapter's
    transposes and reshapes carry that to any dimension numbers.

    Raises:
      PeatError: no compiler, or the build failed (with the compiler's message).
    """
    lib = build_ffi_library(_CSRC / "naive_matmul.cc", "naive_matmul", cache_dir=cache_dir,
                            compiler=compiler)
    target = _Target(register_ffi_target(lib, "NaiveMatmul"))
    kernel = dot_general(_make_matmul(target), name="ffi_matmul", batched=True)
    return dataclasses.replace(kernel, supports=dot_general_float_support("ffi_matmul"))
