"""XLA FFI custom calls as candidates: build C++, CUDA and HIP kernels, register them per
platform, wrap them as a Kernel.

    lib = build_ffi_library("my_matmul.cc", "my_matmul")     # g++ against jax.ffi.include_dir()
    cu = build_cuda_library("my_matmul.cu", "my_matmul")     # nvcc, the same headers
    hip = build_rocm_library("my_matmul.hip", "my_matmul")   # hipcc (AMD GPUs), the same headers
    kernel = ffi_kernel("my_matmul.cc", "MyMatmul", result=lambda a, b: ...,
                        cuda="my_matmul.cu", rocm="my_matmul.hip")  # a peat.Kernel
    peat.kernels.ffi_matmul()                                # the bundled f32 matmul

Libraries are cached in `cache_dir` (default `$PEAT_CACHE_DIR/ffi`, else
`~/.cache/peat_jax/ffi`) under a name that hashes the source (and the headers it includes with
`#include "..."` from its own folder), the compiler, its version, the flags and the jax release
(whose headers it is built against), so they are rebuilt exactly when one of those changes.

One handler symbol may have a CPU implementation (registered for the platform "cpu"), a CUDA one
(registered for "CUDA") and a ROCm one (registered for "ROCM") under the same target name, so the
same `ffi_call` runs on whichever backend jax uses. A CUDA library is built and loaded only when
jax's default backend is CUDA, a ROCm library only when it is ROCm (nothing here opens GPU
libraries on a machine without that GPU; `build_cuda_library` and `build_rocm_library` compile
without one); calling a target on a backend it has no implementation for is a PeatError before the
call. Calls use `vmap_method="sequential"`.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from peat_jax._src._jax import ffi_platform
from peat_jax._src.errors import PeatError
from peat_jax._src.kernels._support import dot_general_float_support
from peat_jax._src.kernels.base import Kernel
from peat_jax._src.kernels.matmul import dot_general


CXXFLAGS: tuple[str, ...] = ("-O2", "-std=c++17", "-shared", "-fPIC")
NVCCFLAGS: tuple[str, ...] = ("-O2", "-std=c++17", "--shared", "-Xcompiler", "-fPIC",
                              "-cudart", "static")
"""nvcc's flags before the include and architecture flags. The CUDA runtime is linked statically,
so the library does not depend on the process finding the toolkit's own libcudart."""
CUDA_ARCHS: tuple[str, ...] = ("sm_80", "sm_90")
"""Default GPU architectures: machine code for A100 (sm_80) and H100/H200 (sm_90), plus PTX of
the newest, which the driver compiles for later GPUs."""
NVCC_DEFAULT = "/usr/local/cuda/bin/nvcc"
"""Where nvcc is looked for after `$NVCC` and PATH (then `$CUDA_HOME/bin/nvcc`)."""
HIPCCFLAGS: tuple[str, ...] = ("-O2", "-std=c++17", "-shared", "-fPIC")
"""hipcc's flags before the include and architecture flags (the library links the HIP runtime,
libamdhip64, dynamically: the ROCm install that jax's ROCm plugin uses must provide it)."""
ROCM_ARCHS: tuple[str, ...] = ("gfx90a", "gfx942")
"""Default AMD GPU architectures: MI210/MI250 (gfx90a) and MI300 (gfx942); by default only those
the compiler accepts are built (Debian's hipcc 5.2, clang 15, has no gfx942)."""
HIPCC_DEFAULTS: tuple[str, ...] = ("/opt/rocm/bin/hipcc", "/usr/bin/hipcc")
"""Where hipcc is looked for after `$HIPCC`, PATH and `$ROCM_PATH/bin/hipcc`: the ROCm toolkit's,
then Debian's (`apt-get install hipcc`)."""
HIPCC_ENV = {"HIP_PLATFORM": "amd"}
"""Set for hipcc's runs: without it hipcc targets NVIDIA (through nvcc) when it finds nvcc and
no `clang++` (as with Debian's hipcc, whose clang is clang++-15)."""
CUDA_SUFFIXES: tuple[str, ...] = (".cu",)
HIP_SUFFIXES: tuple[str, ...] = (".hip",)
CXX_SUFFIXES: tuple[str, ...] = (".cc", ".cpp", ".cxx", ".c++", ".C")
CSRC = pathlib.Path(__file__).parent / "csrc"
_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}            # resolved path -> loaded library (kept alive)
_TARGETS: dict[tuple[str, str, str], str] = {}  # (path, symbol, platform) -> target name
_PLATFORMS: dict[str, set[str]] = {}           # target name -> platforms registered for it
_PLATFORM_NAMES = {"cpu": "cpu", "host": "cpu", "cuda": "CUDA", "gpu": "CUDA", "rocm": "ROCM",
                  "hip": "ROCM"}
Library = Union[str, os.PathLike, ctypes.CDLL]


def _default_cache_dir() -> pathlib.Path:
    root = os.environ.get("PEAT_CACHE_DIR")
    if root:
        return pathlib.Path(root) / "ffi"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(xdg) / "peat_jax" / "ffi"


# --------------------------------------------------------------------------------------------
# Toolchains


def _compiler(compiler: Optional[str]) -> str:
    cxx = compiler or os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise PeatError(f"C++ compiler {cxx!r} not found on PATH: install g++ (e.g. "
                        "`apt-get install g++`) or pass compiler= / set $CXX")
    return path


def _find_compiler(what: str, tool: str, given: Optional[str], source: str, home: str,
                   defaults: Sequence[str], toolkit: str, install: str) -> str:
    """The path of compiler `tool`: `given` (from `source`, an argument or an environment
    variable), else `tool` on PATH, else `$<home>/bin/<tool>`, else the first of `defaults`
    that is an executable; a one-line PeatError naming `install` otherwise."""
    if given:
        path = shutil.which(given)
        if path is None:
            raise PeatError(f"{what} compiler {given!r} (from {source}) is not an executable: "
                            f"point it at the {toolkit}'s bin/{tool}")
        return path
    candidates = [shutil.which(tool)]
    if os.environ.get(home):
        candidates.append(os.path.join(os.environ[home], "bin", tool))
    candidates += list(defaults)
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    env = f"${tool.upper()}"
    raise PeatError(f"{what} compiler {tool} not found ({env} unset, not on PATH, not at "
                    f"{' or '.join(defaults)}): {install}, or set {env} (or pass {tool}=) to "
                    f"its bin/{tool}")


def find_nvcc(nvcc: Optional[str] = None) -> str:
    """The path of the CUDA compiler: `nvcc` if given, else `$NVCC`, else `nvcc` on PATH, else
    `$CUDA_HOME/bin/nvcc`, else `NVCC_DEFAULT`.

    Raises:
      PeatError: none of them is an executable (saying what to install or set).
    """
    return _find_compiler("CUDA", "nvcc", nvcc or os.environ.get("NVCC"),
                          "nvcc=" if nvcc else "$NVCC", "CUDA_HOME", [NVCC_DEFAULT],
                          "CUDA toolkit",
                          "install the CUDA toolkit (https://developer.nvidia.com/cuda-downloads;"
                          " its version must be one the GPU driver supports)")


def cuda_arch_flags(arch: Union[None, str, Sequence[str]] = None) -> list[str]:
    """nvcc's architecture flags: `-gencode` machine code for each `sm_XY` of `arch` (default
    `CUDA_ARCHS`) plus PTX of the newest (for later GPUs); `arch="native"`: `-arch=native` (the
    GPUs of the building machine).

    Raises:
      PeatError: an architecture that is not `sm_<digits>[a-z]`.
    """
    if arch == "native":
        return ["-arch=native"]
    archs = [arch] if isinstance(arch, str) else list(arch or CUDA_ARCHS)
    parsed = []
    for a in archs:
        m = re.fullmatch(r"sm_(\d+)([a-z]?)", str(a))
        if m is None:
            raise PeatError(f"CUDA architecture {a!r} must look like 'sm_90' (or 'native')")
        parsed.append((int(m.group(1)), m.group(1) + m.group(2)))
    if not parsed:
        raise PeatError("arch= names no CUDA architecture; e.g. arch=('sm_90',)")
    flags = []
    for _, code in parsed:
        flags += ["-gencode", f"arch=compute_{code},code=sm_{code}"]
    newest = max(parsed)[1]
    if newest.isdigit():  # arch-specific targets (sm_90a) have no forward-compatible PTX
        flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    return flags


def find_hipcc(hipcc: Optional[str] = None) -> str:
    """The path of the HIP compiler: `hipcc` if given, else `$HIPCC`, else `hipcc` on PATH, else
    `$ROCM_PATH/bin/hipcc`, else the first of `HIPCC_DEFAULTS` that exists.

    Raises:
      PeatError: none of them is an executable (saying what to install or set).
    """
    return _find_compiler("HIP", "hipcc", hipcc or os.environ.get("HIPCC"),
                          "hipcc=" if hipcc else "$HIPCC", "ROCM_PATH", HIPCC_DEFAULTS,
                          "ROCm toolkit",
                          "install the ROCm toolkit (https://rocm.docs.amd.com; the version "
                          "jax's ROCm plugin uses, to run the library), or Debian's hipcc "
                          "(`apt-get install hipcc`, enough to compile)")


_ARCH_SUPPORT: dict[tuple[str, str], bool] = {}  # (hipcc, arch) -> whether it accepts the arch


def hipcc_accepts(hipcc: str, arch: str) -> bool:
    """Whether `hipcc` knows the offload architecture `arch` (a syntax-only run on an empty file,
    about 0.2-0.6 s, once per compiler and architecture in a process)."""
    key = (hipcc, arch)
    if key not in _ARCH_SUPPORT:
        try:
            res = subprocess.run([hipcc, f"--offload-arch={arch}", "-x", "hip", "-fsyntax-only",
                                  "-nogpulib", os.devnull], capture_output=True, text=True,
                                 timeout=60, env=_hipcc_env())
            _ARCH_SUPPORT[key] = res.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _ARCH_SUPPORT[key] = False
    return _ARCH_SUPPORT[key]


def rocm_arch_flags(arch: Union[None, str, Sequence[str]] = None, *,
                    hipcc: Optional[str] = None) -> list[str]:
    """hipcc's architecture flags: `--offload-arch=<gfx...>` for each of `arch` (code objects for
    each in the library). With `arch` None: those of `ROCM_ARCHS` that `hipcc` (a path; default
    `find_hipcc()`) accepts.

    Raises:
      PeatError: an architecture that is not `gfx<digits/letters>[:feature±...]`, or no default
        one the compiler accepts.
    """
    if arch is None:
        compiler = hipcc or find_hipcc()
        archs = [a for a in ROCM_ARCHS if hipcc_accepts(compiler, a)]
        if not archs:
            raise PeatError(f"{compiler} accepts none of the default AMD GPU architectures "
                            f"{', '.join(ROCM_ARCHS)}: pass arch= (e.g. arch='gfx90a')")
    else:
        archs = [arch] if isinstance(arch, str) else list(arch)
    for a in archs:
        if re.fullmatch(r"gfx[0-9a-z]+(-[0-9a-z]+)*(:[a-z0-9]+[+-])*", str(a)) is None:
            raise PeatError(f"AMD GPU architecture {a!r} must look like 'gfx90a' (or "
                            "'gfx90a:xnack-')")
    if not archs:
        raise PeatError("arch= names no AMD GPU architecture; e.g. arch=('gfx90a',)")
    return [f"--offload-arch={a}" for a in archs]


def _hipcc_env() -> dict[str, str]:
    return {**os.environ, **HIPCC_ENV}


def _compiler_version(cxx: str, env: Optional[dict[str, str]] = None) -> str:
    try:
        res = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60,
                             env=env)
    except (OSError, subprocess.SubprocessError) as e:
        raise PeatError(f"cannot run the compiler {cxx!r}: {e}") from e
    return res.stdout.strip()


# --------------------------------------------------------------------------------------------
# Cached builds


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_ERROR_AT = (re.compile(r"^(?P<file>[^\s:(][^:(\n]*):(?P<line>\d+):(?:\d+:)?\s*(?:fatal )?error",
                        re.MULTILINE),                       # g++, clang (hipcc): file:line:col
             re.compile(r"^(?P<file>[^\s(][^(\n]*)\((?P<line>\d+)\): (?:catastrophic )?error",
                        re.MULTILINE))                       # nvcc: file(line): error


def _local_headers(src: pathlib.Path) -> list[pathlib.Path]:
    """The files `src` includes with `#include "..."` that exist next to it, recursively, in a
    stable order (the jax headers are covered by the jax release in the cache key)."""
    seen: dict[pathlib.Path, None] = {}
    todo = [src]
    while todo:
        text = todo.pop(0).read_text(errors="replace")
        for inc in _INCLUDE.findall(text):
            path = (src.parent / inc).resolve()
            if path.is_file() and path not in seen and path != src.resolve():
                seen[path] = None
                todo.append(path)
    return list(seen)


def first_error_location(output: str) -> Optional[str]:
    """`file:line` of the first error in a compiler's output (g++'s and clang's (hipcc's)
    `file:line:col: error` or nvcc's `file(line): error`), or None when it names no line."""
    hits = [m for pattern in _ERROR_AT for m in pattern.finditer(output)]
    if not hits:
        return None
    first = min(hits, key=lambda m: m.start())
    return f"{first.group('file')}:{first.group('line')}"


def _build_key(src: pathlib.Path, compiler: str, flags: Sequence[str],
               env: Optional[dict[str, str]] = None) -> str:
    """A hex digest of what the build depends on: sources, compiler, its version, flags, jax."""
    key = hashlib.sha256()
    for part in (src.read_bytes(), *(h.read_bytes() for h in _local_headers(src)),
                 compiler.encode(), _compiler_version(compiler, env).encode(),
                 "\0".join(flags).encode(), jax.__version__.encode()):
        key.update(part)
        key.update(b"\0")
    return key.hexdigest()


def _check_source(src: pathlib.Path, name: str) -> None:
    if not src.is_file():
        raise PeatError(f"FFI source {str(src)!r} does not exist")
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise PeatError(f"library name {name!r} must be letters, digits, '_' or '-'")


def _compile_cached(src: pathlib.Path, name: str, compiler: str, flags: Sequence[str],
                    cache_dir: Optional[Union[str, os.PathLike]],
                    env: Optional[dict[str, str]] = None) -> pathlib.Path:
    """Run `compiler flags src -o lib` (in `env`, default this process's environment) unless
    `<cache_dir>/lib<name>-<key>.so` exists.

    Returns:
      The library's path.

    Raises:
      PeatError: compilation failed or timed out (with the command, the first error's file:line
        and the compiler's output); no half-built library is left behind.
    """
    out_dir = pathlib.Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    out = out_dir / f"lib{name}-{_build_key(src, compiler, flags, env)[:16]}.so"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".lib{name}-", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [compiler, *flags, str(src), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if res.returncode != 0:
            message = "\n".join(x for x in (res.stderr.strip(), res.stdout.strip()) if x)
            where = first_error_location(message)
            raise PeatError(f"compiling {src.name} failed{f' at {where}' if where else ''} "
                            f"(exit {res.returncode}): {shlex.join(cmd)}\n{message}")
        os.replace(tmp, out)  # atomic: concurrent builders of the same key agree
    except subprocess.TimeoutExpired as e:
        raise PeatError(f"compiling {src.name} timed out: {shlex.join(cmd)}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build_ffi_library(source_path: Union[str, os.PathLike], name: str, *,
                      cache_dir: Optional[Union[str, os.PathLike]] = None,
                      extra_flags: Sequence[str] = (), compiler: Optional[str] = None
                      ) -> pathlib.Path:
    """Compile a C++ XLA FFI source into a shared library, or reuse the cached build.

    Runs `<compiler> -O2 -std=c++17 -shared -fPIC -isystem <jax.ffi.include_dir()> <extra_flags>
    source -o lib`. The compiler is `compiler`, else `$CXX`, else `g++`. A `.cu` source is handed
    to `build_cuda_library` (`compiler` then names nvcc), a `.hip` one to `build_rocm_library`
    (`compiler` then names hipcc).

    Args:
      source_path: the `.cc` file.
      name: a file-name-safe stem for the library.
      cache_dir: where libraries are kept (default: see the module docstring).
      extra_flags: more compiler flags (part of the cache key).

    Returns:
      The path of the shared library (`<cache_dir>/lib<name>-<hash>.so`).

    Raises:
      PeatError: the source is missing, the compiler is missing, or compilation failed (the
        message holds the first error's file:line and the compiler's output).
    """
    src = pathlib.Path(source_path)
    if src.suffix in CUDA_SUFFIXES:
        return build_cuda_library(src, name, cache_dir=cache_dir, extra_flags=extra_flags,
                                  nvcc=compiler)
    if src.suffix in HIP_SUFFIXES:
        return build_rocm_library(src, name, cache_dir=cache_dir, extra_flags=extra_flags,
                                  hipcc=compiler)
    _check_source(src, name)
    flags = [*CXXFLAGS, "-isystem", jax.ffi.include_dir(), *map(str, extra_flags)]
    return _compile_cached(src, name, _compiler(compiler), flags, cache_dir)


def build_cuda_library(source_path: Union[str, os.PathLike], name: str, *,
                       cache_dir: Optional[Union[str, os.PathLike]] = None,
                       extra_flags: Sequence[str] = (), nvcc: Optional[str] = None,
                       arch: Union[None, str, Sequence[str]] = None) -> pathlib.Path:
    """Compile a CUDA XLA FFI source with nvcc into a shared library, or reuse the cached build.

    Runs `nvcc -O2 -std=c++17 --shared -Xcompiler -fPIC -cudart static -isystem
    <jax.ffi.include_dir()> <cuda_arch_flags(arch)> <extra_flags> source -o lib` (nvcc from
    `find_nvcc`). No GPU is needed to build; the library runs only on one (whose driver supports
    the toolkit's CUDA version). Its handlers take the stream as
    `.Ctx<ffi::PlatformStream<cudaStream_t>>()`.

    Args:
      source_path: the `.cu` file.
      name: a file-name-safe stem for the library.
      arch: GPU architectures (see `cuda_arch_flags`; default `CUDA_ARCHS`).

    Returns:
      The path of the shared library (`<cache_dir>/lib<name>-<hash>.so`).

    Raises:
      PeatError: the source or nvcc is missing, or compilation failed (the message holds the
        first error's file:line and nvcc's output).
    """
    src = pathlib.Path(source_path)
    _check_source(src, name)
    flags = [*NVCCFLAGS, "-isystem", jax.ffi.include_dir(), *cuda_arch_flags(arch),
             *map(str, extra_flags)]
    return _compile_cached(src, name, find_nvcc(nvcc), flags, cache_dir)


def build_rocm_library(source_path: Union[str, os.PathLike], name: str, *,
                       cache_dir: Optional[Union[str, os.PathLike]] = None,
                       extra_flags: Sequence[str] = (), hipcc: Optional[str] = None,
                       arch: Union[None, str, Sequence[str]] = None) -> pathlib.Path:
    """Compile a HIP XLA FFI source with hipcc (for AMD GPUs) into a shared library, or reuse the
    cached build.

    Runs `hipcc -O2 -std=c++17 -shared -fPIC -isystem <jax.ffi.include_dir()>
    <rocm_arch_flags(arch)> <extra_flags> source -o lib` (hipcc from `find_hipcc`, with
    `HIP_PLATFORM=amd`). No GPU is needed to build; the library runs only on an AMD GPU of one of
    its architectures, with jax's ROCm backend, and needs the HIP runtime of the compiler's ROCm
    release (Debian's hipcc 5.2 links libamdhip64.so.5: build with the ROCm toolkit jax's ROCm
    plugin uses to run it). Its handlers take the stream as
    `.Ctx<ffi::PlatformStream<hipStream_t>>()`.

    Args:
      source_path: the `.hip` file.
      name: a file-name-safe stem for the library.
      arch: AMD GPU architectures (see `rocm_arch_flags`; default: those of `ROCM_ARCHS` the
        compiler accepts).

    Returns:
      The path of the shared library (`<cache_dir>/lib<name>-<hash>.so`).

    Raises:
      PeatError: the source or hipcc is missing, or compilation failed (the message holds the
        first error's file:line and hipcc's output).
    """
    src = pathlib.Path(source_path)
    _check_source(src, name)
    compiler = find_hipcc(hipcc)
    flags = [*HIPCCFLAGS, "-isystem", jax.ffi.include_dir(),
             *rocm_arch_flags(arch, hipcc=compiler), *map(str, extra_flags)]
    return _compile_cached(src, name, compiler, flags, cache_dir, env=_hipcc_env())


# --------------------------------------------------------------------------------------------
# Registration per platform


def _load(library: Library) -> tuple[str, ctypes.CDLL]:
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


def _platform(platform: str) -> str:
    name = _PLATFORM_NAMES.get(str(platform).lower())
    if name is None:
        raise PeatError(f"unknown FFI platform {platform!r}; use 'cpu', 'CUDA' or 'ROCM'")
    return name


def register_ffi_target(library: Library, symbol: str, *, target_name: Optional[str] = None,
                        platform: str = "cpu") -> str:
    """Register the FFI handler `symbol` of `library` with XLA for `platform` ("cpu", "CUDA" or
    "ROCM"), once per library, symbol and platform. Loading a CUDA library needs a CUDA machine.

    Returns:
      The target name to pass to `jax.ffi.ffi_call` (`target_name`, else one derived from the
      symbol and the library's path).
    """
    platform = _platform(platform)
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
        _PLATFORMS.setdefault(name, set()).add(platform)
        return name


def registered_platforms(target_name: str) -> Optional[frozenset[str]]:
    """The platforms peat_jax registered `target_name` for, or None for a target it does not know
    (registered with jax directly)."""
    with _LOCK:
        known = _PLATFORMS.get(target_name)
        return None if known is None else frozenset(known)


_SOURCE_FOR = {"cpu": "a CPU library or C++ source",
               "CUDA": "a cuda= source (a .cu file, built with nvcc)",
               "ROCM": "a rocm= source (a .hip file, built with hipcc)"}
_ROLE = {"cpu": "the CPU library", "CUDA": "cuda=", "ROCM": "rocm="}


def _require_platform(target_name: str, what: str) -> None:
    """A PeatError unless `target_name` is registered for jax's default backend (targets that
    peat_jax did not register are not checked)."""
    have = registered_platforms(target_name)
    if have is None:
        return
    active = ffi_platform()
    if active not in have:
        raise PeatError(
            f"{what} has no {active} implementation registered (it has: "
            f"{', '.join(sorted(have)) or 'none'}), and jax's default backend is {active}: give "
            f"ffi_kernel {_SOURCE_FOR.get(active, 'a source for it')} or run on a backend it "
            "has (e.g. JAX_PLATFORMS=cpu)")


def _library(spec: Library, symbol: str, platform: str, *, cache_dir, compiler, nvcc, hipcc,
             arch, rocm_arch) -> Library:
    """`spec` as a library: a C++, CUDA or HIP source is built (cached), a library is kept."""
    if isinstance(spec, ctypes.CDLL):
        return spec
    path = pathlib.Path(spec)
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", path.stem) or symbol
    if path.suffix in CUDA_SUFFIXES:
        if platform != "CUDA":
            raise PeatError(f"{path.name} is a CUDA source: pass it as cuda=, not as "
                            f"{_ROLE[platform]}")
        return build_cuda_library(path, f"{stem}_cuda", cache_dir=cache_dir, nvcc=nvcc,
                                  arch=arch)
    if path.suffix in HIP_SUFFIXES:
        if platform != "ROCM":
            raise PeatError(f"{path.name} is a HIP source: pass it as rocm=, not as "
                            f"{_ROLE[platform]}")
        return build_rocm_library(path, f"{stem}_rocm", cache_dir=cache_dir, hipcc=hipcc,
                                  arch=rocm_arch)
    if path.suffix in CXX_SUFFIXES:
        return build_ffi_library(path, stem, cache_dir=cache_dir, compiler=compiler)
    return path


def _spec_text(spec: Library) -> str:
    return str(spec._name) if isinstance(spec, ctypes.CDLL) else str(pathlib.Path(spec).resolve())


def ffi_target(library: Optional[Library], symbol: str, *, cuda: Optional[Library] = None,
               rocm: Optional[Library] = None, target_name: Optional[str] = None,
               cache_dir: Optional[Union[str, os.PathLike]] = None,
               compiler: Optional[str] = None, nvcc: Optional[str] = None,
               hipcc: Optional[str] = None, arch: Union[None, str, Sequence[str]] = None,
               rocm_arch: Union[None, str, Sequence[str]] = None) -> str:
    """Build and register the implementations of the FFI handler `symbol` under one target name.

    Args:
      library: the CPU implementation (a shared library path or `ctypes.CDLL`, or a C++ source,
        built with `build_ffi_library`), or None. Registered for "cpu".
      cuda: the CUDA implementation (a `.cu` source, built with `build_cuda_library`, or a
        library built from one), or None. Built, loaded and registered for "CUDA" only when
        jax's default backend is CUDA (`nvcc=`, `arch=` as in `build_cuda_library`).
      rocm: the ROCm implementation (a `.hip` source, built with `build_rocm_library`, or a
        library built from one), or None. Built, loaded and registered for "ROCM" only when
        jax's default backend is ROCm (`hipcc=`, `rocm_arch=` as `build_rocm_library`'s
        `hipcc=`, `arch=`).
      target_name: the name to register under (default: derived from the symbol and the
        libraries).

    Returns:
      The target name; calling it through `ffi_function` on a backend with no implementation
      is a PeatError.

    Raises:
      PeatError: neither implementation given, or a build or load failed.
    """
    specs = {p: s for p, s in (("cpu", library), ("CUDA", cuda), ("ROCM", rocm))
             if s is not None}
    if not specs:
        raise PeatError(f"FFI handler {symbol!r}: give a CPU library/source, cuda= or rocm= (or "
                        "several)")
    active = ffi_platform()
    libs = {p: _library(s, symbol, p, cache_dir=cache_dir, compiler=compiler, nvcc=nvcc,
                        hipcc=hipcc, arch=arch, rocm_arch=rocm_arch)
            for p, s in specs.items() if p == "cpu" or p == active}
    if target_name is None:
        parts = sorted(f"{p}={_spec_text(libs.get(p, s))}" for p, s in specs.items())
        digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]
        target_name = f"peat_{symbol}_{digest}"
    for p, lib in libs.items():
        register_ffi_target(lib, symbol, target_name=target_name, platform=p)
    with _LOCK:
        _PLATFORMS.setdefault(target_name, set())
    return target_name


ResultFn = Callable[..., Any]


def _like_first(*operands):
    x = operands[0]
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def ffi_function(target_name: str, result: Optional[ResultFn] = None, *,
                 vmap_method: str = "sequential", name: Optional[str] = None,
                 **attributes) -> Callable:
    """A jittable function `f(*operands)` calling the registered FFI target.

    Args:
      result: `result(*operands) -> jax.ShapeDtypeStruct` (or a sequence of them) giving the
        output types; default: like the first operand.
      name: what error messages call it (default: the target name).
      attributes: static FFI attributes (numpy scalars / Python scalars).

    Returns:
      The function; when traced on a backend (jax's default) that peat_jax registered no
      implementation of the target for, it raises a PeatError instead of calling.
    """
    result = result or _like_first
    what = name or f"FFI target {target_name!r}"

    def call(*operands):
        _require_platform(target_name, what)
        return jax.ffi.ffi_call(target_name, result(*operands), vmap_method=vmap_method)(
            *operands, **attributes)

    call.__name__ = target_name
    return call


def ffi_kernel(library: Optional[Library], symbol: str, result: Optional[ResultFn] = None, *,
               cuda: Optional[Library] = None, rocm: Optional[Library] = None,
               name: Optional[str] = None, target_name: Optional[str] = None,
               primitive: Optional[str] = None, supports: Optional[Callable] = None,
               vjp: Optional[Callable] = None,
               cache_dir: Optional[Union[str, os.PathLike]] = None,
               compiler: Optional[str] = None, nvcc: Optional[str] = None,
               hipcc: Optional[str] = None, arch: Union[None, str, Sequence[str]] = None,
               rocm_arch: Union[None, str, Sequence[str]] = None, **attributes) -> Kernel:
    """A `peat.Kernel` whose impl calls an XLA FFI handler, on the CPU, a CUDA GPU and/or an AMD
    GPU (ROCm).

    `impl(*operands, **op_params)` calls the target on the site's operands (op params are not
    passed; adapt them with a wrapper, as `ffi_matmul` does through
    `peat.kernels.dot_general`).

    Args:
      library: the CPU implementation: a shared library (path or loaded `ctypes.CDLL`), or a C++
        source built with g++; None for a GPU-only kernel.
      symbol: the handler symbol (the same in every implementation).
      result: output types from the operands (default: like the first operand).
      cuda: the CUDA implementation: a `.cu` source built with nvcc (`arch=`, `nvcc=`), or a
        library built from one; used when jax's default backend is CUDA (see `ffi_target`).
      rocm: the ROCm implementation: a `.hip` source built with hipcc (`rocm_arch=`, `hipcc=`),
        or a library built from one; used when jax's default backend is ROCm.
      name: the kernel's name (default: the symbol).
      primitive, supports, vjp: as in `peat.Kernel` (an FFI call is not differentiable: pass
        `vjp=` where a gradient flows; it serves every platform).
      attributes: static FFI attributes.

    Returns:
      A Kernel calling the target with `vmap_method="sequential"`.
    """
    target = ffi_target(library, symbol, cuda=cuda, rocm=rocm, target_name=target_name,
                        cache_dir=cache_dir, compiler=compiler, nvcc=nvcc, hipcc=hipcc,
                        arch=arch, rocm_arch=rocm_arch)
    fn = ffi_function(target, result, name=name or symbol, **attributes)

    def impl(*operands, **_params):
        return fn(*operands)

    return Kernel(name or symbol, impl, primitive=primitive, supports=supports, vjp=vjp)


# --------------------------------------------------------------------------------------------
# The bundled matmul (naive C++ on the CPU, tiled CUDA / HIP on a GPU)


@dataclasses.dataclass(frozen=True)
class _Target:
    name: str
    kernel: str


def _ffi_matmul3(a, b, target: _Target):
    fn = ffi_function(target.name, lambda a, b: jax.ShapeDtypeStruct(
        a.shape[:-1] + b.shape[-1:], jnp.float32), name=target.kernel)
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


def ffi_matmul(*, tile_bug: bool = False,
               cache_dir: Optional[Union[str, os.PathLike]] = None,
               compiler: Optional[str] = None, nvcc: Optional[str] = None,
               hipcc: Optional[str] = None, arch: Union[None, str, Sequence[str]] = None,
               rocm_arch: Union[None, str, Sequence[str]] = None) -> Kernel:
    """A `peat.Kernel` for floating-point `dot_general` sites: the bundled f32 matmul called
    through XLA FFI, built on first use: naive C++ on the CPU (`csrc/naive_matmul.cc`, g++), a
    16x16-tiled shared-memory kernel on a CUDA GPU (`csrc/naive_matmul.cu`, nvcc; `arch=` as in
    `cuda_arch_flags`) and the same kernel on an AMD GPU (`csrc/naive_matmul.hip`, hipcc;
    `rocm_arch=` as in `rocm_arch_flags`), one target name for all.

    Operands are cast to float32 and the result to the site's `preferred_element_type`. It
    trains: the batched matmul carries a `jax.custom_vjp` whose backward is the same FFI matmul on
    the transposed problems (`dA = G @ B^T`, `dB = A^T @ G`); the `dot_general` adapter's
    transposes and reshapes carry that to any dimension numbers.

    `tile_bug=True` gives `ffi_matmul_tile_bug`, the same kernel with a seeded bug on every
    platform: the row bound is the number of full 16-row tiles times 16, so the rows of a last
    partial row tile are never written (they read as zeros). `peat.check_kernel` (and
    `peat check ffi_matmul_tile_bug`) fails it as `tile_boundary` (last partial block along axis
    -2, e.g. rows 64..66 of a 67-row output).

    Raises:
      PeatError: no compiler (g++; nvcc on a CUDA backend, hipcc on a ROCm one), or a build
        failed (with the compiler's message).
    """
    kernel_name = "ffi_matmul_tile_bug" if tile_bug else "ffi_matmul"
    symbol = "NaiveMatmulTileBug" if tile_bug else "NaiveMatmul"
    target = _Target(ffi_target(CSRC / "naive_matmul.cc", symbol,
                                cuda=CSRC / "naive_matmul.cu",
                                rocm=CSRC / "naive_matmul.hip", cache_dir=cache_dir,
                                compiler=compiler, nvcc=nvcc, hipcc=hipcc, arch=arch,
                                rocm_arch=rocm_arch), kernel_name)
    kernel = dot_general(_make_matmul(target), name=kernel_name, batched=True)
    return dataclasses.replace(kernel, supports=dot_general_float_support(kernel_name))
