"""The reference's matmul precision: check_kernel's reference_precision, the narrow format a
reduced_precision diagnosis names, the run directory's environment and the precision a golden
run trains (and replays) at, and the Pallas kernels' precision argument.

On CPU XLA ignores the matmul precision (float32 dots are full float32 whatever it says), so a
GPU's TF32 is emulated by rounding the dot's inputs to TF32
(`peat_jax._src.formats.round_to_format`, what `peat.faults.reduced_precision("tf32")` does);
what the precision setting itself changes is checked by the precision jax saw while tracing.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat
from peat_jax._src.check import check_kernel
from peat_jax._src.detector import detect, narrowed
from peat_jax._src.errors import PeatError
from peat_jax._src.formats import NARROW_FORMATS, narrow_formats_like, round_to_format
from peat_jax._src.precision import at_matmul_precision, current_matmul_precision, matmul_precision
from peat_jax._src.profiler.golden import profile
from peat_jax._src.profiler.rundir import environment, recorded_precision
from peat_jax._src.testing import assert_kernel_matches

SHAPES = [((32, 96), (96, 24)), ((24, 200), (200, 40))]


def _operands(shapes, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    return jax.random.normal(ka, shapes[0]), jax.random.normal(kb, shapes[1])


def _tf32(x):
    """`x` rounded to TF32 in the forward pass; the identity's gradient (straight through), as
    a TF32 dot's backward sees the cotangent at full width."""
    return x + jax.lax.stop_gradient(round_to_format(x, "tf32") - x)


def tf32_matmul(a, b):
    """A candidate computing like a TF32 GPU kernel: inputs rounded to TF32, float32 products
    and accumulation, summed over K in blocks of 32 (another order than XLA's)."""
    a, b = _tf32(a), _tf32(b)
    return sum(a[:, i:i + 32] @ b[i:i + 32] for i in range(0, a.shape[1], 32))


def tf32_reference(a, b):
    """The XLA reference at the "default" precision as a GPU computes it (TF32 inputs): on CPU
    XLA ignores the precision, so the rounding is emulated."""
    return jnp.matmul(_tf32(a), _tf32(b))


# ----------------------------------------------------------------------------------------------
# the accepted precisions
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, canonical", [
    ("highest", "highest"), ("float32", "highest"), ("HIGHEST", "highest"),
    (jax.lax.Precision.HIGHEST, "highest"), ("high", "high"), ("tensorfloat32", "high"),
    (jax.lax.Precision.HIGH, "high"), ("default", "default"), ("bfloat16", "default"),
    (jax.lax.Precision.DEFAULT, "default")])
def test_matmul_precision_accepts_jax_names_and_precisions(value, canonical):
    assert matmul_precision(value) == canonical


@pytest.mark.parametrize("bad", ["tf32", "fp32", None, 3])
def test_a_bad_precision_is_an_error_listing_the_accepted_ones(bad):
    with pytest.raises(PeatError, match="reference_precision=.* is not a matmul precision") as e:
        check_kernel(jnp.matmul, jnp.matmul, jnp.ones((4, 4)), jnp.ones((4, 4)),
                     reference_precision=bad)
    assert "'highest'" in str(e.value) and "'default'" in str(e.value)
    assert "jax.lax.Precision" in str(e.value)


# ----------------------------------------------------------------------------------------------
# check_kernel traces the reference at its precision; the candidate runs as written
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("precision, seen", [("highest", "highest"), ("default", "default"),
                                             (jax.lax.Precision.HIGH, "high")])
def test_the_reference_is_traced_at_the_reference_precision(precision, seen):
    ref_saw, cand_saw = set(), set()

    def reference(a, b):
        ref_saw.add(current_matmul_precision())
        return a @ b

    def candidate(a, b):
        cand_saw.add(current_matmul_precision())
        return a @ b

    a, b = _operands(SHAPES[0])
    jitted = jax.jit(reference)
    jitted(a, b)              # traced once outside: the precision keys jit's cache, so traced again
    ref_saw.clear()
    d = check_kernel(candidate, jitted, a, b, variants=("example",), repeats=1,
                     reference_precision=precision)
    assert d.passed and d.evidence["reference_precision"] == seen
    assert ref_saw == {seen}, "forward, backward and the float64 evaluation all at that precision"
    assert cand_saw == {None}, "the candidate runs as written"


@pytest.mark.slow
@pytest.mark.parametrize("shapes", SHAPES)
def test_a_tf32_candidate_is_reduced_precision_against_the_highest_reference(shapes):
    a, b = _operands(shapes)
    d = check_kernel(tf32_matmul, jnp.matmul, a, b, variants=("example", "large"),
                     backward=False, repeats=1)
    assert d.model == "reduced_precision" and not d.passed
    assert d.evidence["reference_precision"] == "highest"
    assert 9 <= d.evidence["effective_mantissa_bits"] <= 11
    # the "large" inputs (~4e9) are beyond float16's range: the candidate kept them, so TF32
    assert d.evidence["formats"] == ["tf32"]
    assert "fails: reduced_precision, inputs rounded to tf32 (about 10 effective mantissa bits" \
        in d.summary
    assert "reference at matmul precision 'highest'" in d.summary
    # ~1000x worse than float32: far outside the float64-measured noise floor
    assert d.evidence["max_floor_ratio"] > 100


@pytest.mark.slow
def test_every_variant_of_a_tf32_candidate_is_put_down_to_tf32():
    """On the "outliers" inputs one outlier rounded to TF32 shifts every output it dominates by
    one factor (the rules alone: wrong_scale); the reference fed TF32 inputs errs as much, so
    check_kernel puts it down to TF32 (rule explained_by_format), forward and backward."""
    a, b = _operands(((16, 64), (64, 8)), seed=11)
    d = check_kernel(tf32_matmul, jnp.matmul, a, b)
    assert d.model == "reduced_precision" and d.evidence["formats"] == ["tf32"], d.summary
    models = {model for _, output, model in d.evidence["checks"] if "repeat" not in output}
    assert models <= {"reduced_precision", "exact", "numerical_noise"}


@pytest.mark.parametrize("mode", ["nearest", "toward_zero"])
def test_a_format_is_named_only_where_its_rounding_reproduces_the_errors(mode):
    """Inputs rounded to TF32, to nearest or toward zero (as some tensor cores convert), are
    named tf32; errors of that size from another function (a matmul of inputs perturbed by
    random relative noise of TF32's size: no rounding reproduces them) name no format."""
    a, b = _operands(SHAPES[0])

    @jax.jit
    def rounded(x, y):
        return jnp.matmul(round_to_format(x, "tf32", mode), round_to_format(y, "tf32", mode))

    d = check_kernel(rounded, jnp.matmul, a, b, variants=("example", "large"), backward=False,
                     repeats=1)
    assert d.model == "reduced_precision" and d.evidence["formats"] == ["tf32"], d.summary
    noise = 2.0 ** -11 * jax.random.uniform(jax.random.key(3), a.shape, minval=-1, maxval=1)

    @jax.jit
    def perturbed(x, y):
        return jnp.matmul(x * (1 + noise), y)

    d = check_kernel(perturbed, jnp.matmul, a, b, variants=("example",), backward=False,
                     repeats=1)
    assert not d.passed and not d.evidence.get("formats"), d.summary
    assert "tf32" not in d.summary.split(" [")[0] or "does not reproduce" in d.summary


@pytest.mark.slow
@pytest.mark.parametrize("shapes", SHAPES)
def test_a_tf32_candidate_passes_against_a_default_precision_reference(shapes):
    """Against the reference a GPU computes at precision "default" (TF32: emulated here by a
    reference rounding its inputs to TF32, as XLA:CPU ignores the precision) the TF32 candidate
    is within the reference's own floor: only its summation order differs."""
    a, b = _operands(shapes)
    d = check_kernel(tf32_matmul, tf32_reference, a, b, variants=("example", "large"),
                     reference_precision="default")
    assert d.passed and d.model in ("exact", "numerical_noise"), d.summary
    assert d.evidence["reference_precision"] == "default"


@pytest.mark.slow
def test_the_tf32_fault_is_named_with_its_format_and_gradients_too():
    a, b = _operands(SHAPES[0], seed=3)
    fault = peat.faults.reduced_precision("tf32")
    d = check_kernel(lambda a, b: fault(jnp.matmul, (a, b), jax.random.key(0)), jnp.matmul,
                     a, b, variants=("example",), backward=False, repeats=1)
    assert d.model == "reduced_precision"
    # example inputs alone (values ~10) fit float16's range too: both formats are named
    assert d.evidence["formats"] == ["tf32", "fp16"]
    assert "inputs rounded to tf32/fp16-like" in d.summary
    with pytest.raises(AssertionError, match="reduced_precision, inputs rounded to tf32"):
        assert_kernel_matches(tf32_matmul, jnp.matmul, a, b, variants=("example", "large"))
    d = assert_kernel_matches(tf32_matmul, tf32_reference, a, b, variants=("example",),
                              reference_precision="default")
    assert d.evidence["reference_precision"] == "default"


# ----------------------------------------------------------------------------------------------
# the detector's narrow formats
# ----------------------------------------------------------------------------------------------

def test_narrow_formats_are_told_apart_by_mantissa_and_range():
    assert narrow_formats_like(9.7) == ("tf32", "fp16")
    assert narrow_formats_like(6.8) == ("bf16",)
    assert narrow_formats_like(10, magnitudes=(1e6,)) == ("tf32",)       # beyond float16's max
    assert narrow_formats_like(10, magnitudes=(1e-6,)) == ("tf32",)      # below its normals
    assert narrow_formats_like(15) == ()
    assert NARROW_FORMATS["tf32"].mantissa_bits == NARROW_FORMATS["fp16"].mantissa_bits == 10


@pytest.mark.slow
@pytest.mark.parametrize("fmt, where, expected", [
    ("bf16", "inputs", "inputs rounded to bf16"),
    ("tf32", "output", "output rounded to tf32/fp16-like, 10 mantissa bits")])
def test_detect_names_the_format(fmt, where, expected):
    a, b = _operands(SHAPES[1], seed=5)
    golden = a @ b
    cand = peat.faults.reduced_precision(fmt, where=where)(jnp.matmul, (a, b), jax.random.key(0))
    with jax.enable_x64(True):
        ref64 = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    d = detect(peat.analyze(cand, golden, ref64))
    assert d.model == "reduced_precision" and expected in d.summary, d.summary
    assert narrowed(d, ["tf32"]).summary == d.summary.replace("tf32/fp16-like", "tf32")


@pytest.mark.slow
def test_large_values_rule_float16_out_in_the_detector():
    a, b = _operands(SHAPES[0], seed=7)
    a, b = a * 2.0 ** 12, b * 2.0 ** 12          # outputs ~1e8: float16 cannot hold them
    cand = tf32_matmul(a, b)
    d = detect(peat.analyze(cand, a @ b))
    assert d.model == "reduced_precision" and d.evidence["formats"] == ["tf32"], d.summary


# ----------------------------------------------------------------------------------------------
# the run directory's environment, and the precision a golden run trains and replays at
# ----------------------------------------------------------------------------------------------

def test_environment_says_what_the_numbers_depend_on(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    env = environment()
    assert env["jax_default_matmul_precision"] is None
    assert env["xla_flags"] == "--xla_cpu_enable_fast_math=false"
    assert env["x64"] is False and env["backend"] == jax.default_backend()
    assert env["device_kind"] == jax.devices()[0].device_kind
    assert ("cuda_version" in env) == (jax.default_backend() == "gpu")
    with at_matmul_precision("float32"):
        assert environment()["jax_default_matmul_precision"] == "highest"
    json.dumps(env)


def recording_workload(seen: list) -> peat.Workload:
    """Least squares on a 4x3 weight; its train step notes the precision it is traced at."""
    def init(key):
        return {"w": jax.random.normal(key, (4, 3))}

    def train_step(state, batch):
        seen.append(current_matmul_precision())
        x, y = batch
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(state["w"])
        return {"w": state["w"] - 0.1 * g}, {"loss": loss}

    def batch(step):
        x = np.random.default_rng(step).standard_normal((8, 4)).astype(np.float32)
        return x, x[:, :3] * np.float32(2.0)

    return peat.Workload("precision_recorder", init, train_step, batch)


@pytest.mark.slow
def test_a_golden_run_trains_and_replays_at_its_precision(tmp_path):
    seen: list = []
    wl = recording_workload(seen)
    run = tmp_path / "run"
    g = profile(wl, run, steps=4, checkpoint_every=2, precision="float32")
    m = json.loads((run / "manifest.json").read_text())
    env = m["environment"]
    assert env["jax_default_matmul_precision"] == "highest" == recorded_precision(m)
    assert set(env) >= {"xla_flags", "x64", "device_kind", "backend"}
    assert m["backend"] == env["backend"] and m["device_kind"] == env["device_kind"]
    assert set(seen) == {"highest"}

    seen.clear()
    res = peat.playback(run, {"dot_general": peat.faults.wrong_scale(1.0)}, workload=wl)
    assert seen and set(seen) == {"highest"}, "playback traces at the recorded precision"
    assert res.summary()["passed"] == len(res.cells) > 0
    # with a time limit the cells run in another thread, at the same precision (the candidate's
    # trace there notes it)
    def recording_dot(a, b, **params):
        seen.append(current_matmul_precision())
        return jax.lax.dot_general(a, b, **params)

    seen.clear()
    peat.playback(run, {"dot_general": peat.Kernel("rec", recording_dot, primitive="dot_general")},
                  workload=wl, cell_timeout=60)
    assert seen and set(seen) == {"highest"}
    seen.clear()
    rt = peat.runtime(run, {"dot_general": peat.faults.wrong_scale(1.0)}, peat.every(2), steps=4,
                      workload=wl)
    assert seen and set(seen) == {"highest"} and len(rt.losses) == len(g.losses)

    with pytest.raises(PeatError, match="matmul precision differs .* pass precision='highest'"):
        profile(wl, run, steps=6, checkpoint_every=2, precision="default")
    assert profile(wl, run, steps=6, checkpoint_every=2, precision="highest").resumed_from == 4

    text = peat.report.write_report(run).read_text()
    assert "matmul precision" in text and "XLA_FLAGS" in text and "x64" in text


def test_a_run_without_a_precision_records_none(tmp_path):
    seen: list = []
    wl = recording_workload(seen)
    profile(wl, tmp_path / "run", steps=2, checkpoint_every=2)
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert recorded_precision(m) is None and set(seen) == {None}
    assert recorded_precision({"workload": "old"}) is None       # a manifest from before


# ----------------------------------------------------------------------------------------------
# the Pallas kernels' precision
# ----------------------------------------------------------------------------------------------

def _dot_precisions(fn, *args) -> set:
    text = str(jax.make_jaxpr(fn)(*args))
    return {p for p in ("HIGHEST", "HIGH", "DEFAULT") if f"precision=(Precision.{p}," in text}


def test_pallas_kernels_dot_at_full_float32_by_default():
    pk = peat.kernels
    assert pk.pallas_matmul().name == "pallas_matmul(block_m=32, block_n=32, block_k=32)"
    assert pk.pallas_matmul(precision="default").name == \
        "pallas_matmul(block_m=32, block_n=32, block_k=32, precision='default')"
    assert "precision='high'" in pk.pallas_attention(precision=jax.lax.Precision.HIGH).name
    assert "precision" not in pk.pallas_attention().name
    with pytest.raises(PeatError, match="precision='tf32' is not a matmul precision"):
        pk.pallas_matmul(precision="tf32")

    from peat_jax._src.kernels.pallas.attention import attention
    from peat_jax._src.kernels.pallas.matmul import matmul
    a = jnp.ones((16, 16))
    q = jnp.ones((1, 16, 1, 16))
    assert _dot_precisions(lambda a: matmul(a, a), a) == {"HIGHEST"}
    assert _dot_precisions(lambda a: matmul(a, a, precision="default"), a) == {"DEFAULT"}
    assert _dot_precisions(jax.grad(lambda q: attention(q, q, q).sum()), q) == {"HIGHEST"}
    assert _dot_precisions(lambda q: attention(q, q, q, precision="high"), q) == {"HIGH"}


@pytest.mark.slow
def test_pallas_matmul_passes_against_the_highest_reference():
    a, b = _operands(((40, 24), (24, 20)), seed=9)
    kernel = peat.kernels.pallas_matmul(16, 16, 16)
    dims = (((1,), (0,)), ((), ()))
    d = check_kernel(lambda a, b: kernel(a, b, dimension_numbers=dims, precision=None,
                                         preferred_element_type=jnp.float32),
                     jnp.matmul, a, b, variants=("example",), repeats=1)
    assert d.passed and d.evidence["reference_precision"] == "highest"
