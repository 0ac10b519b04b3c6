"""Lowered for CUDA and ROCm on this CPU machine (`peat.lowers_for`, `peat check --lower`).

Every bundled Pallas kernel, forward and backward, built compiled (`interpret=False`), lowers
through Triton for "cuda" (an H200 and an A100) and "rocm" (gfx90a, the MI250); so do jax's own
shipped Pallas GPU kernels and, for each bundled workload, the train step with the Pallas matmul
substituted, the switched step and the injected step. A kernel that cannot lower (an op Triton
has no rule for in a Pallas body, a jnp op without a GPU lowering, a kernel left in interpret
mode) is reported as failing, with the kernel, the platform and jax's message. Lowering only:
nothing is compiled or run.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import needs
import pytest
from jax import lax
from jax.experimental import pallas as pl

import peat_jax as peat
from peat_jax import models
from peat_jax._src import _jax, cli
from peat_jax._src.kernels import pallas as pk
from peat_jax._src.lowering import DEFAULT_DEVICES, Lowering, assert_lowers_for, lowers_for

S = jax.ShapeDtypeStruct
F32 = jnp.float32
TARGETS = [("cuda", "NVIDIA H200"), ("cuda", "NVIDIA A100"), ("rocm", "gfx90a")]
NEW_JAX = _jax.target_device_matters()   # jax >= 0.11 lowers Triton for the named device


def _matmul(kernel, dtype=F32):
    """A bundled dot_general kernel as a function of (a, b): a plain 2-D matmul site."""
    dims = (((1,), (0,)), ((), ()))
    return functools.partial(kernel, dimension_numbers=dims, precision=None,
                             preferred_element_type=dtype)


def _bundled(dtype=F32):
    """(name, fn, operand specs, Pallas kernels in the forward, in forward + backward)."""
    k = peat.kernels
    att = (S((2, 40, 2, 16), dtype),) * 3
    return [
        ("pallas_matmul", _matmul(k.pallas_matmul(interpret=False), dtype),
         (S((67, 45), dtype), S((45, 33), dtype)), 1, 3),
        ("pallas_softmax", k.pallas_softmax(interpret=False), (S((67, 45), dtype),), 1, 2),
        ("pallas_layer_norm", k.pallas_layer_norm(interpret=False),
         (S((67, 45), dtype), S((45,), dtype), S((45,), dtype)), 1, 2),
        ("pallas_attention", k.pallas_attention(interpret=False), att, 1, 3),
        ("pallas_attention_causal", k.pallas_attention(causal=True, interpret=False), att, 1, 3),
    ]


BUNDLED = _bundled()


def _assert_all_lowered(results, expected_phases=("fwd", "fwd+bwd")):
    failed = [str(r) for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    got = {(r.platform, r.device, r.phase) for r in results}
    assert got == {(p, d, ph) for p, d in TARGETS for ph in expected_phases}


# --------------------------------------------------------------------------------------------
# The bundled kernels


@pytest.mark.parametrize("name,fn,specs,n_fwd,n_both", BUNDLED, ids=[b[0] for b in BUNDLED])
def test_bundled_kernel_lowers_fwd_and_bwd_for_cuda_and_rocm(name, fn, specs, n_fwd, n_both):
    results = lowers_for(fn, *specs, grad=True)
    _assert_all_lowered(results)
    for r in results:   # every Pallas call compiled (none left interpreted), fwd and bwd
        assert len(r.kernels) == (n_fwd if r.phase == "fwd" else n_both), str(r)
        assert all(k.startswith("peat_pallas_") for k in r.kernels), r.kernels
        assert r.device_used == NEW_JAX
        assert r.seconds > 0
        if NEW_JAX:   # jax's deprecation of the Triton backend, recorded (not shown)
            assert any("Pallas Triton backend is deprecated" in w for w in r.warnings), r


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_bundled_kernels_lower_in_low_precision(dtype):
    for name, fn, specs, _, _ in _bundled(dtype)[:4]:
        _assert_all_lowered(lowers_for(fn, *specs, grad=True, name=f"{name}[{dtype.__name__}]"))


def test_lower_precision_dots_lower_too():
    k = peat.kernels
    for kernel, specs in ((_matmul(k.pallas_matmul(interpret=False, precision="default")),
                           (S((64, 32), F32), S((32, 16), F32))),
                          (k.pallas_attention(interpret=False, precision="high"),
                           (S((1, 32, 2, 16), F32),) * 3)):
        _assert_all_lowered(lowers_for(kernel, *specs, grad=True))


@pytest.mark.slow
@needs.skip_unless(needs.pallas_op("layer_norm"), needs.pallas_op("attention"))
def test_jax_shipped_pallas_kernels_lower():
    k = peat.kernels
    _assert_all_lowered(lowers_for(k.jax_pallas_layer_norm(interpret=False), S((8, 32), F32),
                                   S((32,), F32), S((32,), F32), grad=True))
    qkv = (S((1, 32, 2, 16), F32),) * 3
    _assert_all_lowered(lowers_for(k.jax_pallas_mha(interpret=False), *qkv, grad=True))


def test_compiled_kernels_ask_for_triton_and_interpreted_ones_stay_as_they_were():
    """The explicit backend choice: Triton's compiler params when compiled (for CUDA and ROCm
    alike), none in the plain interpreter on this CPU, the checked interpreter's with checks."""
    x = jnp.ones((8, 16), F32)
    triton = type(_jax.triton_compiler_params())

    def pallas_eqns(kernel):
        return list(_jax.pallas_calls(jax.make_jaxpr(kernel)(x)))

    [interpreted] = pallas_eqns(peat.kernels.pallas_softmax())
    assert _jax.pallas_call_interpreted(interpreted)
    assert not isinstance(_jax.pallas_call_compiler_params(interpreted), triton)
    with pk.compiling("rocm"):
        [compiled] = pallas_eqns(peat.kernels.pallas_softmax())
    assert not _jax.pallas_call_interpreted(compiled)
    assert isinstance(_jax.pallas_call_compiler_params(compiled), triton)
    [compiled] = pallas_eqns(peat.kernels.pallas_softmax(interpret=False))
    assert isinstance(_jax.pallas_call_compiler_params(compiled), triton)
    with pk.compiling():
        [checked] = pallas_eqns(peat.kernels.pallas_softmax(checks=True))
    assert _jax.pallas_call_interpreted(checked)
    assert not isinstance(_jax.pallas_call_compiler_params(checked), triton)
    assert pk.interpret_mode() is True and pk.interpret_mode(False) is False
    with pk.compiling():
        assert pk.interpret_mode() is False


def test_default_factory_kernel_is_built_compiled_inside_lowers_for():
    """interpret=None (every factory's default): interpreted on this CPU, compiled for the GPU."""
    k = peat.kernels.pallas_layer_norm()
    specs = (S((16, 32), F32), S((32,), F32), S((32,), F32))
    _assert_all_lowered(lowers_for(k, *specs, grad=True))
    out = jax.jit(k)(jnp.ones((16, 32)), jnp.ones(32), jnp.zeros(32))   # still runs here
    assert out.shape == (16, 32)


# --------------------------------------------------------------------------------------------
# Failures are reported, with the kernel, the platform and jax's message


def _triton_kernel(op, name):
    def body(x_ref, o_ref):
        o_ref[...] = op(x_ref[...])
    return pl.pallas_call(body, out_shape=S((16, 16), F32), name=name,
                          compiler_params=_jax.triton_compiler_params())


def test_unsupported_op_in_a_pallas_body_fails_naming_kernel_platform_and_message():
    bad = _triton_kernel(lambda x: lax.sort(x, dimension=1), "sorting_kernel")
    results = lowers_for(bad, S((16, 16), F32))
    assert [(r.platform, r.device) for r in results] == TARGETS
    for r in results:
        assert not r.ok
        assert r.kernels == ("sorting_kernel",)
        assert "Unimplemented primitive in Pallas Triton lowering: sort" in r.error
        assert r.error.startswith("NotImplementedError: ")
        text = str(r)
        assert "sorting_kernel" in text and r.platform in text and r.device in text
        assert "FAILED" in text and "sort" in text
    with pytest.raises(AssertionError) as e:
        assert_lowers_for(bad, S((16, 16), F32), name="my_sort_kernel", platforms="rocm")
    msg = str(e.value)
    assert "my_sort_kernel fwd for rocm (gfx90a): FAILED" in msg
    assert "Unimplemented primitive in Pallas Triton lowering: sort" in msg


def test_jnp_op_without_a_gpu_lowering_fails():
    def schur_t(x):
        return jax.scipy.linalg.schur(x)[0]

    for r in lowers_for(schur_t, S((8, 8), F32)):
        assert not r.ok and r.kernels == ()
        assert f"MLIR translation rule for primitive 'schur' not found for platform " \
               f"{r.platform}" in r.error
        assert str(r).startswith(f"schur_t fwd for {r.platform} ({r.device}): FAILED")
    # it lowers for the CPU: the check is about the GPU platforms
    jax.jit(schur_t).trace(S((8, 8), F32)).lower(lowering_platforms=("cpu",))


def test_backward_failure_is_reported_separately():
    """A kernel whose forward lowers but whose backward has an op Triton cannot lower."""
    good = _triton_kernel(lambda x: x * 2.0, "fwd_ok")
    bad = _triton_kernel(lambda x: lax.sort(x, dimension=0), "bwd_sorts")

    @jax.custom_vjp
    def f(x):
        return good(x)

    f.defvjp(lambda x: (good(x), None), lambda _, g: (bad(g),))
    results = lowers_for(f, S((16, 16), F32), grad=True, platforms=["cuda"],
                         devices=["NVIDIA H200"])
    assert [(r.phase, r.ok) for r in results] == [("fwd", True), ("fwd+bwd", False)]
    assert "sort" in results[1].error and results[1].kernels == ("fwd_ok", "bwd_sorts")


def test_a_kernel_left_in_interpret_mode_is_a_failure():
    interpreted = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1.0),
                                 out_shape=S((16, 16), F32), interpret=True, name="interp_only")
    for r in lowers_for(interpreted, S((16, 16), F32)):
        assert not r.ok and "interp_only" in r.error and "interpret mode" in r.error
    checked = peat.kernels.pallas_softmax(checks=True)
    [r] = lowers_for(checked, S((16, 16), F32), platforms="cuda", devices=["NVIDIA H200"])
    assert not r.ok and "peat_pallas_softmax" in r.error and "interpret mode" in r.error


def test_tracing_error_is_reported_not_raised():
    def wrong_shapes(a, b):
        return a @ b

    [r] = lowers_for(wrong_shapes, S((4, 3), F32), S((5, 2), F32), platforms="cuda",
                     devices=["NVIDIA A100"])
    assert not r.ok and r.error.startswith("while tracing: TypeError")


@pytest.mark.filterwarnings("ignore:Using ``pl.pallas_call`` for Mosaic GPU kernels is deprecated")
def test_pallas_call_without_compiler_params():
    """jax 0.10 lowers it with Mosaic GPU (which cannot lower an unannotated iota and refuses
    ROCm), saying what to pass; jax 0.11+ lowers every pallas_call through Triton."""
    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + lax.broadcasted_iota(F32, (16, 16), 1)

    plain = pl.pallas_call(body, out_shape=S((16, 16), F32), name="no_params")
    results = lowers_for(plain, S((16, 16), F32))
    if _jax.pallas_default_gpu_backend() == "mosaic_gpu":
        for r in results:
            assert not r.ok
            assert "no_params without compiler_params are lowered by Mosaic GPU" in r.error
        assert "Mosaic GPU does not yet support AMD ROCm" in results[-1].error
    else:
        assert all(r.ok for r in results), [str(r) for r in results]


def test_device_kind_matters_on_jax_that_uses_it():
    """An FP8 cast needs compute capability 8.9: it lowers for an H200, not for an A100, where
    jax lowers Triton for the named device (0.11+); 0.10 lowers for sm_90 whatever it is told."""
    fp8 = _triton_kernel(lambda x: x.astype(jnp.float8_e4m3fn).astype(F32), "fp8_roundtrip")
    h200, a100 = lowers_for(fp8, S((16, 16), F32), platforms="cuda")
    assert (h200.device, a100.device) == DEFAULT_DEVICES["cuda"]
    assert h200.ok, str(h200)
    if NEW_JAX:
        assert not a100.ok and "float8_e4m3fn" in a100.error, str(a100)
        [unknown] = lowers_for(fp8, S((16, 16), F32), devices=["Tesla V100-SXM2-16GB"],
                               platforms="cuda")
        assert not unknown.ok and "does not know the device kind" in unknown.error
    else:
        assert a100.ok and not a100.device_used


def test_platforms_and_devices_arguments():
    k = _matmul(peat.kernels.pallas_matmul(interpret=False))
    specs = (S((16, 16), F32), S((16, 16), F32))
    rs = lowers_for(k, *specs, platforms="rocm,cuda", devices={"cuda": "NVIDIA A100"})
    assert [(r.platform, r.device) for r in rs] == [("rocm", "gfx90a"), ("cuda", "NVIDIA A100")]
    rs = lowers_for(k, *specs, devices=["gfx942", "NVIDIA H100 80GB HBM3"], name="mm")
    assert [(r.platform, r.device, r.ok) for r in rs] == [
        ("cuda", "NVIDIA H100 80GB HBM3", True), ("rocm", "gfx942", True)]
    assert all(r.name == "mm" for r in rs)
    for bad in (dict(platforms="tpu"), dict(platforms=()), dict(devices={"metal": ["M1"]}),
                dict(platforms="cuda", devices=["gfx90a"]),
                dict(devices=["NVIDIA H200"])):           # no ROCm device named
        with pytest.raises(peat.PeatError):
            lowers_for(k, *specs, **bad)
    r = rs[0]
    assert isinstance(r, Lowering) and r.to_dict()["kernels"] == list(r.kernels)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.ok = False


def test_arrays_and_python_scalars_as_arguments():
    def scaled(x, s):
        return peat.kernels.pallas_softmax()(x * s)

    rs = lowers_for(scaled, jnp.ones((8, 16)), 2.0, grad=True)
    assert all(r.ok for r in rs), [str(r) for r in rs]


# --------------------------------------------------------------------------------------------
# The bundled workloads: the substituted, switched and injected train steps

WORKLOADS = {
    "vision": dict(batch_size=8, width=4, hidden=16),
    "language": dict(n_layers=1, d_model=16, n_heads=2, seq_len=16, batch_size=2),
}


def _program(workload: str, kind: str):
    wl = models.get(workload, **WORKLOADS[workload])
    state = jax.eval_shape(wl.init, jax.random.key(0))   # shapes only: nothing computed
    batch = wl.batch(0)
    subs = {"dot_general": peat.kernels.pallas_matmul(interpret=False)}
    if kind == "substituted":
        return peat.substitute(wl.train_step, subs), (state, batch)
    if kind == "switched":
        return peat.switched(wl.train_step, subs), (0, state, batch)
    return peat.inject(wl.train_step, subs, peat.every(10, offset=3)), (state, batch, 7)


def _gemm_sites(step, state, batch) -> int:
    """The step's dot_general sites, listed on abstract values (`sites()` takes arrays, and the
    state's PRNG key as a ShapeDtypeStruct is not one)."""
    found = []

    def count(s, b):
        found.append(sum(site.primitive == "dot_general" for site in step.sites(s, b)))
        return 0

    jax.eval_shape(count, state, batch)
    return found[0]


_STEPS = [pytest.param(w, k, marks=[pytest.mark.slow] if w == "language" else [])
          for w in WORKLOADS for k in ("substituted", "switched", "injected")]


@pytest.mark.parametrize("workload,kind", _STEPS)
def test_workload_train_step_with_pallas_matmul_lowers(workload, kind):
    step, args = _program(workload, kind)
    results = []
    for platform, device in TARGETS:
        results += lowers_for(step, *args, platforms=platform, devices=[device],
                              name=f"{workload} {kind} step")
    _assert_all_lowered(results, expected_phases=("fwd",))
    gemms = _gemm_sites(step, *(args[1:] if kind == "switched" else args[:2]))
    for r in results:
        assert len(r.kernels) == gemms > 0, str(r)    # one Triton matmul per GEMM site
        assert set(r.kernels) == {"peat_pallas_matmul"}


def test_substituted_function_is_traced_per_device():
    """An FP8 cast lowers for an H200, not an A100 (jax 0.11+): a substituted function lowered
    for both must say so for both, in either order."""
    fp8 = _triton_kernel(lambda x: x.astype(jnp.float8_e4m3fn).astype(F32), "fp8_roundtrip")
    kernel = peat.Kernel("fp8_tanh", lambda x, **_: fp8(x), primitive="tanh")
    for order in (["NVIDIA H200", "NVIDIA A100"], ["NVIDIA A100", "NVIDIA H200"]):
        step = peat.substitute(lambda x: 2.0 * jnp.tanh(x), {"tanh": kernel})
        results = {r.device: r for r in lowers_for(step, S((16, 16), F32), platforms="cuda",
                                                   devices=order)}
        assert results["NVIDIA H200"].ok, str(results["NVIDIA H200"])
        assert results["NVIDIA A100"].ok is not NEW_JAX, str(results["NVIDIA A100"])


# --------------------------------------------------------------------------------------------
# peat check --lower


def test_cli_check_lower_bundled_kernels(capsys):
    for name in ("pallas_matmul", "pallas_softmax"):   # all four: the tests above
        assert cli.main(["check", name, "--lower", "cuda,rocm"]) == 0
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
        per_gpu = [ln for ln in lines if ": " in ln and "lowers" in ln]
        assert [ln.split(":")[0] for ln in per_gpu] == \
            ["cuda NVIDIA H200", "cuda NVIDIA A100", "rocm gfx90a"], lines
        assert all("fwd and fwd+bwd" in ln and name in ln for ln in per_gpu)


def test_cli_check_lower_failure_exits_1(tmp_path, monkeypatch, capsys):
    (tmp_path / "lowering_cli_kernels.py").write_text(
        "import jax.numpy as jnp\n"
        "import jax.scipy.linalg\n"
        "import peat_jax as peat\n\n\n"
        "def _schur_matmul(a, b):   # no GPU lowering for schur\n"
        "    return jax.scipy.linalg.schur(jnp.matmul(a, b))[0]\n\n"
        "schur_matmul = peat.kernels.dot_general(_schur_matmul, name='schur_matmul')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["check", "lowering_cli_kernels:schur_matmul", "--shapes", "8x8,8x8",
                     "--lower", "rocm"]) == 1
    out = capsys.readouterr().out
    assert "rocm gfx90a: schur_matmul FAILED (fwd)" in out
    assert "MLIR translation rule for primitive 'schur' not found for platform rocm" in out
    assert cli.main(["check", "pallas_softmax", "--lower", "cuda", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and len(doc["lowerings"]) == 4      # H200, A100 x fwd, fwd+bwd
    assert cli.main(["check", "pallas_softmax", "--lower", "metal"]) == 2
    assert "lowers for the GPU platforms cuda, rocm; got 'metal'" in capsys.readouterr().err
