"""XLA FFI kernels: the bundled naive C++ matmul compiled from source by this test run (into a
fresh cache directory), its cache, compiler errors, accuracy at dot_general sites and training;
the CUDA build (nvcc) and the ROCm build (hipcc, for gfx90a), compile only here (run where jax
has that GPU), their errors and cache; the seeded tile bug diagnosed; a target with no
implementation for the backend refused before the call."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat
from peat_jax._src import cli
from peat_jax._src._jax import ffi_platform
from peat_jax._src.kernels import ffi

TOL = {jnp.float32: 1e-5, jnp.float16: 1e-2, jnp.bfloat16: 6e-2}  # as in test_kernels_pallas


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ffi_cache")


@pytest.fixture(scope="module")
def kernel(cache_dir):
    return ffi.ffi_matmul(cache_dir=cache_dir)


def _rel_err(got, ref) -> float:
    got, ref = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (got, ref))
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


@pytest.mark.slow
def test_library_is_built_from_source_and_cached(kernel, cache_dir):
    libs = sorted(cache_dir.glob("libnaive_matmul-*.so"))
    assert len(libs) == 1  # built by this run (the fixture's fresh directory)
    mtime = libs[0].stat().st_mtime_ns
    src = ffi.CSRC / "naive_matmul.cc"
    again = ffi.build_ffi_library(src, "naive_matmul", cache_dir=cache_dir)
    assert again == libs[0] and again.stat().st_mtime_ns == mtime  # reused, not rebuilt
    other = ffi.build_ffi_library(src, "naive_matmul", cache_dir=cache_dir, extra_flags=["-DX=1"])
    assert other != again  # flags are part of the key


def test_compiler_errors_are_peat_errors_with_the_compiler_message(tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text("#include \"xla/ffi/api/ffi.h\"\nint broken( {\n")
    with pytest.raises(peat.PeatError, match=r"(?s)compiling bad.cc failed .*bad\.cc:2:.*error"):
        ffi.build_ffi_library(bad, "bad", cache_dir=tmp_path)
    with pytest.raises(peat.PeatError, match="not found on PATH"):
        ffi.build_ffi_library(bad, "bad", cache_dir=tmp_path, compiler="no-such-compiler-g++")
    with pytest.raises(peat.PeatError, match="does not exist"):
        ffi.build_ffi_library(tmp_path / "missing.cc", "missing", cache_dir=tmp_path)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".so")]  # no half-built library


PLAIN = (((30, 45), (45, 29)), (((1,), (0,)), ((), ())))
BATCHED = (((2, 17, 33), (2, 18, 33)), (((2,), (2,)), ((0,), (0,))))  # batch dims, rhs transposed


@pytest.mark.parametrize("shapes,dims,dtype", [
    pytest.param(*PLAIN, jnp.float32, id="plain-float32"),
    pytest.param(*PLAIN, jnp.bfloat16, id="plain-bfloat16"),
    pytest.param(*PLAIN, jnp.float16, id="plain-float16"),
    pytest.param(*BATCHED, jnp.float32, id="batched-float32"),
])
def test_ffi_matmul_matches_xla_forward_and_backward(kernel, shapes, dims, dtype):
    a = jax.random.normal(jax.random.key(0), shapes[0]).astype(dtype)
    b = jax.random.normal(jax.random.key(1), shapes[1]).astype(dtype)
    ref = lambda a, b: jax.lax.dot_general(a, b, dims)  # noqa: E731
    sub = peat.substitute(ref, {"dot_general": kernel})
    y, vjp = jax.vjp(jax.jit(sub), a, b)
    y_r, vjp_r = jax.vjp(ref, a, b)
    g = jax.random.normal(jax.random.key(2), y_r.shape).astype(dtype)
    assert y.dtype == y_r.dtype and _rel_err(y, y_r) <= TOL[dtype]
    for u, v in zip(vjp(g), vjp_r(g)):
        assert u.dtype == v.dtype and _rel_err(u, v) <= TOL[dtype]
    if dtype == jnp.float32:  # vmap of the substituted function: one FFI call per element
        yb = jax.vmap(sub, in_axes=(0, None))(jnp.stack([a, -a]), b)
        assert _rel_err(yb[1], -y_r) <= TOL[dtype]


def test_ffi_matmul_trains_a_model(kernel, linen_train, mlp_data):
    step, state = linen_train
    sub = jax.jit(peat.substitute(step, {"dot_general": kernel}))
    ref = jax.jit(step)
    s1 = s2 = state
    for _ in range(20):
        s1, m1 = ref(s1, mlp_data)
        s2, m2 = sub(s2, mlp_data)
        np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-4, atol=1e-6)
    assert "ffi_call" in str(jax.make_jaxpr(sub)(state, mlp_data))


def test_ffi_kernel_with_a_user_vjp(cache_dir):
    lib = ffi.build_ffi_library(ffi.CSRC / "naive_matmul.cc", "naive_matmul", cache_dir=cache_dir)
    k = ffi.ffi_kernel(lib, "NaiveMatmul",
                       lambda a, b: jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), jnp.float32),
                       name="mm", vjp=lambda ops, out, g: (g @ ops[1].T, ops[0].T @ g))
    a = jax.random.normal(jax.random.key(0), (4, 6))
    b = jax.random.normal(jax.random.key(1), (6, 3))
    np.testing.assert_allclose(k(a, b), a @ b, rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda a: jnp.sum(jnp.sin(k(a, b))))(a)
    np.testing.assert_allclose(g, jax.grad(lambda a: jnp.sum(jnp.sin(a @ b)))(a), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(peat.PeatError, match="has no symbol 'Nope'"):
        ffi.ffi_kernel(lib, "Nope")


def test_ffi_matmul_refuses_sites_it_cannot_serve(kernel):
    i = jnp.ones((3, 3), jnp.int32)
    with pytest.raises(peat.PeatError, match="cannot use kernel 'ffi_matmul'.*int32"):
        peat.substitute(lambda a: a @ a, {"dot_general": kernel}).selected(i)


# --------------------------------------------------------------------------------------------
# CUDA: built with nvcc here (compile only), run only where jax has a GPU

def _have_nvcc() -> bool:
    try:
        ffi.find_nvcc()
        return True
    except peat.PeatError:
        return False


MM_DIMS = (((1,), (0,)), ((), ()))
HAVE_GPU = ffi_platform() == "CUDA"
needs_nvcc = pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found ($NVCC, PATH, "
                                "/usr/local/cuda/bin): the CUDA sources are not compile-tested")
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="jax has no CUDA GPU here: the CUDA build "
                               "of ffi_matmul only runs on one (run this file on a GPU machine)")


class _Runs:
    """Records the commands `ffi` runs through subprocess.run."""

    def __init__(self, monkeypatch):
        self.cmds: list[list[str]] = []
        real = subprocess.run

        def run(cmd, *a, **kw):
            self.cmds.append([str(c) for c in cmd])
            return real(cmd, *a, **kw)

        monkeypatch.setattr(ffi.subprocess, "run", run)

    def compiles(self) -> list[list[str]]:
        return [c for c in self.cmds if "-o" in c]


@pytest.mark.slow
@needs_nvcc
def test_bundled_cuda_source_compiles_with_nvcc_and_is_cached(cache_dir, monkeypatch):
    runs = _Runs(monkeypatch)
    t0 = time.perf_counter()
    lib = ffi.build_cuda_library(ffi.CSRC / "naive_matmul.cu", "naive_matmul_cuda",
                                 cache_dir=cache_dir)
    first = time.perf_counter() - t0
    (cmd,) = runs.compiles()
    assert "-gencode" in cmd and "arch=compute_90,code=sm_90" in cmd  # Hopper machine code
    assert "arch=compute_90,code=compute_90" in cmd  # and PTX for later GPUs
    data = lib.read_bytes()
    assert b"NaiveMatmul\0" in data and b"NaiveMatmulTileBug\0" in data  # exported handlers
    t0 = time.perf_counter()
    again = ffi.build_cuda_library(ffi.CSRC / "naive_matmul.cu", "naive_matmul_cuda",
                                   cache_dir=cache_dir)
    hit = time.perf_counter() - t0
    assert again == lib and len(runs.compiles()) == 1  # cache hit: nvcc --version only
    print(f"nvcc build {first:.1f} s, cache hit {hit:.3f} s")
    other = ffi.build_ffi_library(ffi.CSRC / "naive_matmul.cu", "naive_matmul_cuda",
                                  cache_dir=cache_dir)  # a .cu handed on to nvcc: same key
    assert other == lib


def test_cuda_arch_flags():
    assert ffi.cuda_arch_flags() == ["-gencode", "arch=compute_80,code=sm_80",
                                     "-gencode", "arch=compute_90,code=sm_90",
                                     "-gencode", "arch=compute_90,code=compute_90"]
    assert ffi.cuda_arch_flags("sm_100") == ["-gencode", "arch=compute_100,code=sm_100",
                                             "-gencode", "arch=compute_100,code=compute_100"]
    assert ffi.cuda_arch_flags(["sm_90a"]) == ["-gencode", "arch=compute_90a,code=sm_90a"]
    assert ffi.cuda_arch_flags("native") == ["-arch=native"]
    with pytest.raises(peat.PeatError, match="must look like 'sm_90'"):
        ffi.cuda_arch_flags("hopper")


def test_first_error_location():
    assert ffi.first_error_location("x.cu(12): warning: w\nx.cu(14): error: e") == "x.cu:14"
    assert ffi.first_error_location("In file included from a.h:3,\n/t/b.cc:7:5: error: e") \
        == "/t/b.cc:7"
    assert ffi.first_error_location("nvcc fatal   : Unsupported gpu architecture") is None
    assert ffi.first_error_location(  # hipcc (clang)
        "/t/k.hip:3:38: error: use of undeclared identifier 'y'\n1 error generated when "
        "compiling for gfx90a.") == "/t/k.hip:3"
    assert ffi.first_error_location("clang: error: invalid target ID 'gfx942'") is None


def test_local_headers_are_part_of_the_cache_key(tmp_path):
    (tmp_path / "defs.h").write_text("#define SCALE 1.0f\n")
    src = tmp_path / "k.cc"
    src.write_text('#include "defs.h"\nextern "C" float scale() { return SCALE; }\n')
    first = ffi.build_ffi_library(src, "k", cache_dir=tmp_path)
    (tmp_path / "defs.h").write_text("#define SCALE 2.0f\n")
    assert ffi.build_ffi_library(src, "k", cache_dir=tmp_path) != first


# --------------------------------------------------------------------------------------------
# ROCm: built with hipcc here (compile only, for the MI250's gfx90a), run only where jax has an
# AMD GPU

def _have_hipcc() -> bool:
    try:
        ffi.find_hipcc()
        return True
    except peat.PeatError:
        return False


HAVE_ROCM = ffi_platform() == "ROCM"
needs_hipcc = pytest.mark.skipif(not _have_hipcc(), reason="hipcc is not installed ($HIPCC, "
                                 "PATH, $ROCM_PATH/bin, /opt/rocm/bin, /usr/bin): apt-get install "
                                 "hipcc (or the ROCm toolkit) to compile-test the HIP sources")
needs_rocm_gpu = pytest.mark.skipif(not HAVE_ROCM, reason="jax has no ROCm GPU here: the HIP "
                                    "build of ffi_matmul only runs on an AMD GPU with jax's ROCm "
                                    "backend (run this file there)")


def _exported(lib) -> set[str]:
    """The dynamic symbols `lib` defines (`nm -D --defined-only`)."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@pytest.mark.slow
@needs_hipcc
def test_bundled_hip_source_compiles_for_gfx90a_and_is_cached(cache_dir, monkeypatch):
    runs = _Runs(monkeypatch)
    t0 = time.perf_counter()
    lib = ffi.build_rocm_library(ffi.CSRC / "naive_matmul.hip", "naive_matmul_rocm",
                                 cache_dir=cache_dir)
    first = time.perf_counter() - t0
    (cmd,) = runs.compiles()
    assert "--offload-arch=gfx90a" in cmd  # the MI250, by default
    if shutil.which("nm"):
        assert {"NaiveMatmul", "NaiveMatmulTileBug"} <= _exported(lib)  # exported handlers
    data = lib.read_bytes()
    assert b"NaiveMatmul\0" in data and b"NaiveMatmulTileBug\0" in data
    assert b"amdgcn-amd-amdhsa--gfx90a" in data  # a gfx90a code object in the offload bundle
    t0 = time.perf_counter()
    again = ffi.build_rocm_library(ffi.CSRC / "naive_matmul.hip", "naive_matmul_rocm",
                                   cache_dir=cache_dir)
    hit = time.perf_counter() - t0
    assert again == lib and len(runs.compiles()) == 1  # cache hit: hipcc --version only
    print(f"hipcc build {first:.1f} s ({' '.join(a for a in cmd if 'offload-arch' in a)}), "
          f"cache hit {hit:.3f} s")
    other = ffi.build_ffi_library(ffi.CSRC / "naive_matmul.hip", "naive_matmul_rocm",
                                  cache_dir=cache_dir)  # a .hip handed on to hipcc: same key
    assert other == lib


@pytest.mark.parametrize("suffix, header, build, message", [
    pytest.param("cu", '"xla/ffi/api/ffi.h"', lambda src, d: ffi.build_cuda_library(
        src, "bad", cache_dir=d), r"\S*nvcc .*identifier \"y\" is undefined",
        marks=needs_nvcc, id="nvcc"),
    pytest.param("hip", "<hip/hip_runtime.h>", lambda src, d: ffi.build_rocm_library(
        src, "bad", cache_dir=d, arch="gfx90a"),
        r"\S*hipcc .*--offload-arch=gfx90a.*undeclared identifier 'y'", marks=needs_hipcc,
        id="hipcc"),
])
def test_gpu_compile_error_names_file_and_line(tmp_path, suffix, header, build, message):
    bad = tmp_path / f"bad.{suffix}"
    bad.write_text(f"#include {header}\n\n__global__ void k(float* x) {{ x[0] = y; }}\n")
    with pytest.raises(peat.PeatError,
                       match=rf"(?s)compiling bad.{suffix} failed at \S*bad\.{suffix}:3 "
                             rf"\(exit \d+\): {message}"):
        build(bad, tmp_path)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".so")]  # no half-built library


@pytest.mark.parametrize("tool, suffix, home, defaults, build, install", [
    ("nvcc", "cu", "CUDA_HOME", ("NVCC_DEFAULT", "cuda/bin/nvcc"), ffi.build_cuda_library,
     ["install the CUDA toolkit"]),
    ("hipcc", "hip", "ROCM_PATH", ("HIPCC_DEFAULTS", "rocm/bin/hipcc"), ffi.build_rocm_library,
     ["install the ROCm toolkit", "`apt-get install hipcc`"]),
])
def test_missing_gpu_compiler_is_one_line_saying_what_to_do(tmp_path, monkeypatch, tool, suffix,
                                                           home, defaults, build, install):
    src = tmp_path / f"k.{suffix}"
    src.write_text("// empty\n")
    env = tool.upper()
    monkeypatch.setenv(env, str(tmp_path / f"no-{tool}"))
    with pytest.raises(peat.PeatError,
                       match=rf"no-{tool}' \(from \${env}\) is not an executable"):
        build(src, "k", cache_dir=tmp_path)
    monkeypatch.delenv(env)
    monkeypatch.delenv(home, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    attr, missing = defaults
    where = str(tmp_path / missing)
    monkeypatch.setattr(ffi, attr, where if attr == "NVCC_DEFAULT" else (where,))
    with pytest.raises(peat.PeatError) as e:
        build(src, "k", cache_dir=tmp_path)
    message = str(e.value)
    assert "\n" not in message, message  # one line
    assert f"compiler {tool} not found (${env} unset, not on PATH, not at {where})" in message
    assert all(text in message for text in install) and f"set ${env}" in message, message


def test_rocm_arch_flags(monkeypatch):
    assert ffi.rocm_arch_flags("gfx90a") == ["--offload-arch=gfx90a"]
    assert ffi.rocm_arch_flags(["gfx90a", "gfx942:xnack-"]) == [
        "--offload-arch=gfx90a", "--offload-arch=gfx942:xnack-"]
    with pytest.raises(peat.PeatError, match="must look like 'gfx90a'"):
        ffi.rocm_arch_flags("mi250")
    with pytest.raises(peat.PeatError, match="names no AMD GPU architecture"):
        ffi.rocm_arch_flags([])
    # by default: those of ROCM_ARCHS the compiler accepts (Debian's hipcc 5.2 has no gfx942)
    monkeypatch.setattr(ffi, "hipcc_accepts", lambda hipcc, arch: arch != "gfx942")
    assert ffi.rocm_arch_flags(hipcc="/x/hipcc") == ["--offload-arch=gfx90a"]
    monkeypatch.setattr(ffi, "hipcc_accepts", lambda hipcc, arch: True)
    assert ffi.rocm_arch_flags(hipcc="/x/hipcc") == ["--offload-arch=gfx90a",
                                                     "--offload-arch=gfx942"]
    monkeypatch.setattr(ffi, "hipcc_accepts", lambda hipcc, arch: False)
    with pytest.raises(peat.PeatError, match="accepts none of the default"):
        ffi.rocm_arch_flags(hipcc="/x/hipcc")


@needs_hipcc
def test_default_rocm_archs_are_those_hipcc_accepts():
    flags = ffi.rocm_arch_flags()
    assert "--offload-arch=gfx90a" in flags
    print("default ROCm archs of", ffi.find_hipcc(), ":", " ".join(flags))


def test_gpu_sources_go_to_their_own_platform(tmp_path):
    with pytest.raises(peat.PeatError, match="naive_matmul.hip is a HIP source: pass it as "
                                             "rocm=, not as the CPU library"):
        ffi.ffi_target(ffi.CSRC / "naive_matmul.hip", "NaiveMatmul", cache_dir=tmp_path)
    with pytest.raises(peat.PeatError, match="naive_matmul.cu is a CUDA source: pass it as "
                                             "cuda=, not as the CPU library"):
        ffi.ffi_target(ffi.CSRC / "naive_matmul.cu", "NaiveMatmul", cache_dir=tmp_path)


@pytest.mark.skipif(HAVE_GPU, reason="the backend is CUDA: a CUDA-only kernel has its "
                    "implementation here")
def test_a_backend_without_an_implementation_is_refused_before_the_call():
    # CUDA only: on a CPU backend the .cu file is neither built nor loaded (so no nvcc is
    # needed), and calling it is an error before any ffi_call
    k = ffi.ffi_kernel(None, "NaiveMatmul", cuda=ffi.CSRC / "naive_matmul.cu", name="cuda_mm",
                       nvcc="/no/such/nvcc")
    assert ffi.registered_platforms(ffi.ffi_target(
        None, "NaiveMatmul", cuda=ffi.CSRC / "naive_matmul.cu")) == frozenset()
    a = jnp.ones((4, 4))
    with pytest.raises(peat.PeatError, match=r"cuda_mm has no cpu implementation registered "
                                             r"\(it has: none\).*JAX_PLATFORMS"):
        jax.jit(k)(a, a)


@pytest.mark.skipif(HAVE_ROCM, reason="the backend is ROCm: a ROCm-only kernel has its "
                    "implementation here")
def test_a_rocm_only_kernel_is_neither_built_nor_called_elsewhere():
    # on a backend other than ROCm the .hip file is neither built nor loaded (no hipcc needed)
    k = ffi.ffi_kernel(None, "NaiveMatmul", rocm=ffi.CSRC / "naive_matmul.hip", name="rocm_mm",
                       hipcc="/no/such/hipcc")
    a = jnp.ones((4, 4))
    with pytest.raises(peat.PeatError, match=rf"rocm_mm has no {ffi_platform()} implementation "
                                             r"registered \(it has: none\)"):
        jax.jit(k)(a, a)


def _target_of(kernel) -> str:
    """The FFI target name in the jaxpr of `kernel` at a plain matmul site."""
    jaxpr = str(jax.make_jaxpr(lambda a, b: kernel(a, b, dimension_numbers=MM_DIMS))(
        jnp.ones((2, 3)), jnp.ones((3, 2))))
    return jaxpr.split("target_name=")[1].split()[0].strip(",]")


def test_one_target_name_for_every_platform(kernel):
    assert ffi.registered_platforms(_target_of(kernel)) == (
        {"cpu", "CUDA"} if HAVE_GPU else {"cpu", "ROCM"} if HAVE_ROCM else {"cpu"})


def _check_matmul(kernel, variants=None):
    a = jax.random.normal(jax.random.key(0), (67, 45))
    b = jax.random.normal(jax.random.key(1), (45, 33))
    return peat.check_kernel(lambda a, b: kernel(a, b, dimension_numbers=MM_DIMS),
                             lambda a, b: jax.lax.dot_general(a, b, MM_DIMS), a, b,
                             variants=variants)


@pytest.mark.slow
@pytest.mark.parametrize("tile_bug", [False, True], ids=["correct", "tile_bug"])
def test_seeded_tile_bug_is_named_by_the_detector(cache_dir, tile_bug):
    """The C++ build holds the same seeded bug as the CUDA one (rows of the last partial 16-row
    tile never written): `check_kernel` fails it as tile_boundary; the correct kernel passes."""
    k = ffi.ffi_matmul(tile_bug=tile_bug, cache_dir=cache_dir)
    assert k.name == ("ffi_matmul_tile_bug" if tile_bug else "ffi_matmul")
    d = _check_matmul(k, variants=("example", "odd_shape"))
    if tile_bug:
        assert not d.passed and d.model == "tile_boundary", d.summary
        assert "rows 64..66" in d.summary  # forward: the last partial tile of 67 rows
    else:
        assert d.passed, d.summary
    assert "ffi_matmul_tile_bug" in cli.KERNELS


@needs_gpu
def test_cuda_build_checks_on_the_gpu(cache_dir):
    k = ffi.ffi_matmul(cache_dir=cache_dir)
    assert "CUDA" in ffi.registered_platforms(_target_of(k))
    d = _check_matmul(k)
    assert d.passed, d.summary
    bug = _check_matmul(ffi.ffi_matmul(tile_bug=True, cache_dir=cache_dir))
    assert not bug.passed and bug.model == "tile_boundary", bug.summary


@needs_rocm_gpu
def test_rocm_build_checks_on_the_gpu(cache_dir):
    k = ffi.ffi_matmul(cache_dir=cache_dir)
    assert "ROCM" in ffi.registered_platforms(_target_of(k))
    d = _check_matmul(k)
    assert d.passed, d.summary
    bug = _check_matmul(ffi.ffi_matmul(tile_bug=True, cache_dir=cache_dir))
    assert not bug.passed and bug.model == "tile_boundary", bug.summary
