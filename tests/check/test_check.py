"""peat.check_kernel, peat.testing.assert_kernel_matches and the peat_check pytest fixture."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compile_log import compiles
from peat_jax._src._jax import cache_size
from peat_jax._src.analyzer import device
from peat_jax._src.check import VARIANTS, VJP_FORWARD, check_kernel, make_variant
from peat_jax._src.check.variants import near_overflow_log2
from peat_jax._src.check.running import Run, conditioning_spreads, wider_reference
from peat_jax._src.errors import PeatError
from peat_jax._src.judge.float64 import NO_WIDER
from peat_jax._src.kernel_spec import draw_args, parse_dtypes, parse_shapes
from peat_jax._src.kernels import pallas_matmul
from peat_jax._src.pytest_plugin import PeatCheck
from peat_jax._src.testing import assert_kernel_matches

# Square operands: the output and both gradients share one shape (one compile of the analysis).
A = jax.random.normal(jax.random.key(0), (24, 24))
B = jax.random.normal(jax.random.key(1), (24, 24))


def ref(a, b):
    return a @ b


def blocked(a, b):
    """A correct matmul in another summation order."""
    return sum(a[:, i:i + 8] @ b[i:i + 8] for i in range(0, a.shape[1], 8))


@jax.custom_vjp
def wrong_bwd(a, b):
    return a @ b


def _fwd(a, b):
    return a @ b, (a, b)


def _bwd(res, g):
    a, b = res
    return g @ b.T, (a.T @ g) * 1.5      # the rhs gradient is 1.5x too large


wrong_bwd.defvjp(_fwd, _bwd)


@pytest.mark.slow
def test_exact_forward_with_wrong_backward_is_caught():
    d = check_kernel(wrong_bwd, ref, A, B, variants=("example",))
    assert not d.passed and d.model == "wrong_scale"
    assert d.evidence["origin"] == {"variant": "example", "output": "grad[1]"}
    checks = {(v, o): m for v, o, m in d.evidence["checks"]}
    assert checks[("example", "forward")] == "exact"
    assert checks[("example", "grad[0]")] in ("exact", "numerical_noise")
    assert "grad[1]" in d.summary and "1.5x" in d.summary


def naive_logsumexp(x):
    """m + log(sum(exp(x - m))) along the last axis: NaN on a fully masked row (-inf - -inf)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return (m + jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("masked_rows", [(3,), (0, 5, 11)])
def test_nan_for_a_fully_masked_row_is_nan_inf(masked_rows):
    # the porting bug: jax's logsumexp returns -inf for a row of -inf, the naive form NaN
    x = np.array(jax.random.normal(jax.random.key(2), (16, 40)))
    x[list(masked_rows)] = -np.inf
    d = check_kernel(jax.jit(naive_logsumexp),
                     jax.jit(lambda v: jax.scipy.special.logsumexp(v, axis=-1)), jnp.asarray(x),
                     backward=False, variants=("example",))
    assert not d.passed and d.model == "nan_inf"
    assert f"{len(masked_rows)} NaN where the golden is infinite" in d.summary
    assert f"[{masked_rows[0]}]" in d.summary and "where the golden is -inf" in d.summary


def blocked_scaled_forward(a, b):
    """A forward that is 1.5x too large (its gradients follow)."""
    return blocked(a, b) * 1.5


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [blocked, wrong_bwd, blocked_scaled_forward],
                         ids=lambda f: f.__name__)
def test_a_jitted_candidate_is_judged_as_the_same_function_unjitted(kernel):
    """A jitted candidate's forward and backward run as one jitted program; an unjitted one
    eagerly: the verdict and every check's model are the same (up to "exact" against
    "numerical_noise": XLA may fuse a jitted program's transposes into its dots)."""
    variants = ("example", "outliers", "odd_shape")
    plain = check_kernel(kernel, ref, A, B, variants=variants)
    jitted = check_kernel(jax.jit(kernel), jax.jit(ref), A, B, variants=variants)
    assert (jitted.passed, jitted.model) == (plain.passed, plain.model), jitted.summary
    noise = {"exact": "numerical_noise"}
    models = [[v, o, noise.get(m, m)] for v, o, m in jitted.evidence["checks"]]
    assert models == [[v, o, noise.get(m, m)] for v, o, m in plain.evidence["checks"]]
    assert jitted.evidence["origin"]["output"] == plain.evidence["origin"]["output"]


def _bwd_right(res, g):
    a, b = res
    return g @ b.T, a.T @ g


@jax.custom_vjp
def wrong_primal(a, b):
    return (a @ b) * 1.5                 # the plain call is 1.5x too large


wrong_primal.defvjp(_fwd, _bwd_right)


@jax.custom_vjp
def wrong_forward_rule(a, b):
    return a @ b


wrong_forward_rule.defvjp(lambda a, b: ((a @ b) * 1.5, (a, b)), _bwd_right)


@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["eager", "jitted"])
def test_the_plain_call_and_the_forward_under_vjp_are_both_checked(jit):
    """A custom VJP computes its output twice: the plain call (inference) and the forward rule
    (what training sees under jax.grad). Either one wrong fails its own check, jitted (forward
    and backward in one program) or not; where both agree, only "forward" is listed."""
    wrap = jax.jit if jit else (lambda f: f)
    d = check_kernel(wrap(wrong_primal), wrap(ref), A, B, variants=("example",))
    assert not d.passed and d.model == "wrong_scale", d.summary
    assert d.evidence["origin"] == {"variant": "example", "output": "forward"}
    checks = {(v, o): m for v, o, m in d.evidence["checks"]}
    assert checks[("example", VJP_FORWARD)] in ("exact", "numerical_noise")
    assert checks[("example", "grad[1]")] in ("exact", "numerical_noise")

    d = check_kernel(wrap(wrong_forward_rule), wrap(ref), A, B, variants=("example",))
    assert not d.passed and d.model == "wrong_scale", d.summary
    assert d.evidence["origin"] == {"variant": "example", "output": VJP_FORWARD}
    assert VJP_FORWARD in d.summary
    checks = {(v, o): m for v, o, m in d.evidence["checks"]}
    assert checks[("example", "forward")] == "exact"

    d = check_kernel(wrap(wrong_bwd), wrap(ref), A, B, variants=("example",))
    assert [o for _, o, _ in d.evidence["checks"] if not o.startswith("repeat")] == [
        "forward", "grad[0]", "grad[1]"]


@pytest.mark.parametrize("paired", [True, False])
def test_a_jitted_candidate_compiles_one_program_per_new_shape(paired, monkeypatch):
    """Its forward and backward as one program (eagerly, `jax.vjp` of a jitted function
    compiles a linearised forward and a transposed backward, and its plain call one more);
    small, the example's shapes and the odd variant's as one program (`_Pairing`)."""
    from peat_jax._src.check import programs
    if not paired:
        monkeypatch.setattr(programs, "PAIR_MAX_ELEMENTS", 0)
    def fresh_blocked(a, b):        # a function of its own: nothing cached for it
        return blocked(a, b)

    with compiles() as compiled:
        d = check_kernel(jax.jit(fresh_blocked), jax.jit(ref), A, B,
                         variants=("example", "large", "odd_shape"))
    assert d.passed, d.summary
    mine = sorted(n for n in compiled if n.startswith("fresh_blocked"))
    # two shapes (the example's, odd_shape's)
    assert mine == (["fresh_blocked_vjp_pair"] if paired else ["fresh_blocked_vjp"] * 2), compiled
    # the reference: forward and backward as one program per shape, in float32 and float64
    # (at most: another test's may be cached)
    others = [n for n in compiled if not n.startswith("fresh_blocked")]
    assert set(others) <= {"ref_vjp"} and len(others) <= 4, compiled


def test_a_second_check_of_a_reference_reuses_its_rounding_floor_program():
    """The rounding floor's Monte Carlo program of a plain (not jitted) reference is compiled by
    the first check that needs it; a second check of the same reference at the same shapes (a
    kernel author's next try, the next seed) compiles none (it took 3.3 s of a 3.9 s check)."""
    def fresh_ref(a, b):            # a function of its own: nothing cached for it
        return a @ b

    def scaled(a, b):               # fails the floors: the rounding floor is computed
        return (a @ b) * 1.01

    for seed, expected in ((0, ["fresh_ref_vjp_monte_carlo"]), (1, [])):
        with compiles() as compiled:
            d = check_kernel(scaled, fresh_ref, A, B, variants=("example",), seed=seed)
        assert not d.passed and d.model == "wrong_scale", d.summary
        assert [n for n in compiled if n.endswith("_monte_carlo")] == expected, compiled


def test_correct_kernel_passes_on_every_variant():
    d = check_kernel(blocked, ref, A, B)
    assert d.passed and d.model in ("exact", "numerical_noise"), d.summary
    variants = {v for v, _, _ in d.evidence["checks"]}
    assert variants == set(VARIANTS)


def test_not_fooled_by_near_zero_outputs_or_zeros():
    zeros = lambda a, b: jnp.zeros((a.shape[0], b.shape[1]), a.dtype)   # noqa: E731
    tiny = (A * 1e-15, B * 1e-15)                      # outputs ~1e-30: any atol passes zeros
    d = check_kernel(zeros, ref, *tiny, variants=("example",), backward=False)
    assert d.model == "zeroed" and not d.passed
    d = check_kernel(blocked, ref, *tiny, variants=("example", "tiny"))
    assert d.passed, d.summary


def _naive_silu(x):
    """SiLU as a user writes its reference: its gradient is inf / inf = NaN, in float64 too,
    where exp(-x) overflows (x below about -710)."""
    return x / (1 + jnp.exp(-x))


def _naive_softplus(x):
    """Softplus as a user writes its reference: inf, in float64 too, past x = 710."""
    return jnp.log(1 + jnp.exp(x))


@pytest.mark.parametrize("kernel,naive", [(jax.nn.silu, _naive_silu),
                                          (jax.nn.softplus, _naive_softplus)],
                         ids=["silu", "softplus"])
def test_a_stable_kernel_passes_where_its_naive_reference_is_not_finite_in_float64(kernel,
                                                                                   naive):
    """jax.nn's stable forms against the naive formulas: on the large inputs the reference is
    NaN or inf, in float64 too, where the kernel is finite and right (silu's gradient ~0,
    softplus(x) = x): those elements are unjudged and named, and a kernel wrong where the
    reference is finite still fails."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 24)), jnp.float32)
    d = check_kernel(kernel, naive, x, variants=("example", "large"))
    assert d.passed, d.summary
    assert sum(d.evidence["unjudged"].values()) > 0, d.evidence
    assert "nothing judges those elements" in d.summary
    wrong = lambda v: kernel(v) * (1 + 1e-3 * (v > 0))   # noqa: E731
    d = check_kernel(wrong, naive, x, variants=("example", "large"))
    assert not d.passed, d.summary


def _naive_sigmoid(x):
    return 1 / (1 + jnp.exp(-x))


def test_another_right_algorithm_a_few_ulps_off_at_a_few_elements_passes():
    """jax.nn.sigmoid's gradient s * (1 - s) loses a few ULPs to cancellation where the naive
    reference's exp(-x) / (1 + exp(-x))^2 does not: the rounding floor covers it on most draws,
    and on a few an element lands just past it (bit_flip, unknown). A leaf of 31 x 31, whose
    floor's scale is the golden's own leaf maximum with samples or not (rows and columns both
    shorter than 32): seeds 21, 22 and 29 of 0..39 on jax 0.10.2, 0.11.2 and 0.12.1 (a larger
    leaf takes the samples' row or column maxima, and 32 x 24 passes on all of 0..59). Run in
    float64 it is right and its max |error| is within 8x the reference's own: it passes, saying
    so. It passes on every draw before that one too. Moving those elements in float64 too (a
    kernel that is wrong there) still fails."""
    for seed in range(40):
        (x,) = draw_args(parse_shapes("31x31"), parse_dtypes(None, 1), seed)
        d = check_kernel(jax.nn.sigmoid, _naive_sigmoid, x, variants=("example",), seed=seed)
        assert d.passed, d.summary
        if d.evidence["rule"] == "another_algorithms_rounding":
            break
    else:
        pytest.fail("no draw of seeds 0..39 put an element just past the rounding floor")
    assert "just past the floor, but the algorithm is right" in d.summary
    nudged = lambda v: jax.nn.sigmoid(v) + jnp.where(  # noqa: E731
        jnp.arange(v.size).reshape(v.shape) == 7, 1e-6, 0).astype(v.dtype)
    d = check_kernel(nudged, _naive_sigmoid, x, variants=("example",), seed=seed)
    assert not d.passed, d.summary


def _two_pass_standardize(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def _rms_norm_rsqrt_in_float32(x, w):
    """RMSNorm as keras.ops.rms_normalization computes it under jax's default flags: with
    rsqrt, in float32 whatever the inputs' dtype (its float64 run is no float64 evidence)."""
    y = x.astype(jnp.float32)
    rms = jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)
    return (y * rms * w.astype(jnp.float32)).astype(x.dtype)


def _rms_norm_formula(x, w):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w


@pytest.mark.parametrize("dtypes,expected", [
    ((jnp.float32,), 62.5), ((jnp.bfloat16,), 62.5), ((jnp.float16,), 6.5),
    ((jnp.float32, jnp.float16), 6.5),      # the narrowest float input decides
    ((jnp.int32,), float("inf")),           # nothing to scale
])
def test_near_overflow_log2_is_the_variants_own_magnitude(dtypes, expected):
    args = tuple(jnp.ones((4, 3), dt) for dt in dtypes)
    assert near_overflow_log2(args) == expected
    variant = make_variant("near_overflow", args, 0)
    floats = [x for x in variant if jnp.issubdtype(x.dtype, jnp.floating)]
    if floats:   # the variant scales its inputs to about that magnitude
        assert min(float(np.log2(np.abs(x.astype(np.float64)).max())) for x in floats) \
            == pytest.approx(expected, abs=0.5)


def test_a_kernel_wrong_only_beyond_training_magnitudes_passes_saying_so():
    """rsqrt's derivative, -ans / (2 x), underflows float32 where a row's sum of squares nears
    its max (inputs near 2**62.5): the gradient loses a row there, while the formula stays
    exact. No training reaches those magnitudes: it passes, and says where it fails."""
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (8, 64))
    w = 1 + 0.1 * jax.random.normal(k[1], (64,))
    d = check_kernel(jax.jit(_rms_norm_rsqrt_in_float32), jax.jit(_rms_norm_formula), x, w,
                     variants=("near_overflow",), repeats=1)
    assert d.passed, d.summary
    beyond = d.evidence["beyond_training_range"]
    assert beyond["model"] == "unstable_algorithm" and beyond["max_abs_log2"] == 62.5
    assert beyond["failing_checks"] == ["grad[0] on near_overflow"], beyond
    assert "fails as unstable_algorithm only at inputs near overflow" in d.summary


@pytest.mark.slow
def test_a_right_algorithm_where_the_reference_itself_is_inaccurate_passes_saying_so():
    """At inputs near 2**63 a layer norm's gradient of 64-element rows loses float32's accuracy
    in the reference (the variance's power -3/2 underflows) and in jax.nn.standardize alike (an
    error of 3x the gradient's scale, jitted; where jax.nn.standardize errs 6x as much as the
    reference it is `unstable_algorithm`): the golden cannot judge it; run in float64 it is
    right, so it passes, and the summary says where the reference was inaccurate. torch's
    unbiased x.std() in a port (a real bug) still fails there."""
    (x,) = draw_args(parse_shapes("16x64"), parse_dtypes(None, 1), 0)
    kernel = functools.partial(jax.nn.standardize, epsilon=1e-5)
    d = check_kernel(kernel, _two_pass_standardize, x, variants=("near_overflow",))
    assert d.passed, d.summary
    assert set(d.evidence["inaccurate_reference"]) == {"grad[0] on near_overflow"}, d.evidence
    assert "the reference itself is inaccurate on 1 checks" in d.summary

    def unbiased(v):
        mean = v.mean(-1, keepdims=True)
        return (v - mean) / jnp.sqrt(jnp.var(v, -1, ddof=1, keepdims=True) + 1e-5)

    d = check_kernel(unbiased, _two_pass_standardize, x, variants=("near_overflow",))
    assert not d.passed, d.summary


@pytest.mark.slow
def test_variants_and_reruns_share_the_analyzers_compiled_programs():
    # shapes no other test uses: the output and the two gradients differ in shape
    a = jax.random.normal(jax.random.key(5), (13, 11))
    b = jax.random.normal(jax.random.key(6), (11, 7))
    programs = (device.shape_program, device.sample_program)
    before = [cache_size(p) for p in programs]
    d = check_kernel(blocked, ref, a, b, variants=("example", "large", "outliers"))
    assert d.passed, d.summary
    added = [cache_size(p) - n for p, n in zip(programs, before)]
    # per output shape, one program against the float64 reference (the repeats are bitwise
    # equal: no analysis); the sample's program is shared by the shapes
    assert added[0] <= 3 and added[1] <= 1, added
    after = [cache_size(p) for p in programs]
    d = check_kernel(blocked, ref, a, b, variants=("example", "tiny", "zeros"))
    assert d.passed, d.summary
    assert [cache_size(p) for p in programs] == after


@pytest.mark.parametrize("repeats", [1, 3])
def test_a_deterministic_candidates_repeats_compile_no_statistics(repeats):
    """A 3-D output with square last axes is analysed at its own shape (no padded bucket): the
    check compiles one statistics program for it, against the float64 reference, whatever the
    repeats; bitwise equal repeats are exact without an analysis."""
    a = jax.random.normal(jax.random.key(7), (2, 5 + repeats, 4))
    b = jax.random.normal(jax.random.key(8), (2, 4, 5 + repeats))
    before = cache_size(device.shape_program)
    d = check_kernel(lambda x, y: jnp.einsum("bik,bkj->bij", x, y), jnp.matmul, a, b,
                     variants=("example",), backward=False, repeats=repeats)
    assert d.passed, d.summary
    assert cache_size(device.shape_program) - before == 1
    repeated = [m for _, o, m in d.evidence["checks"] if o.startswith("repeat")]
    assert repeated == ["exact"] * (repeats - 1)


DIMS = (((1,), (0,)), ((), ()))


def _pinned(x, y):
    """A matmul reference as mixed-precision kernels' are written: float32 out, whatever in."""
    return jax.lax.dot_general(x, y, DIMS, preferred_element_type=jnp.float32)


def test_a_reference_that_cannot_run_in_float64_is_named_with_the_reason():
    """The float64 reference sets the noise floor and the conditioning floor; a reference that
    raises on float64 inputs, or pins a narrower dtype in a program that cannot be widened (a
    bitcast), leaves the dtype bound, and the verdict says so and why, on every variant."""
    def strict(x, y):
        if x.dtype != jnp.float32:
            raise TypeError("float32 inputs only")
        return x @ y

    @jax.custom_jvp
    def through_bits(z):   # a no-op round trip through the bits, as a kernel's reference may do
        return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(z, jnp.int32),
                                            jnp.float32)
    through_bits.defjvps(lambda t, ans, z: t)

    def bitcast(x, y):
        return through_bits(_pinned(x, y))

    variants = ("example", "large")
    for reference, why in (
            (strict, "raised under float64 (TypeError: float32 inputs only)"),
            (bitcast, "returns float32 on float64 inputs (a dtype pinned in it")):
        d = check_kernel(blocked, reference, A, B, variants=variants)
        assert d.passed, d.summary
        assert sorted(d.evidence["no_float64_reference"]) == sorted(variants)
        assert all(why in w for w in d.evidence["no_float64_reference"].values()), why
        assert "the floor is the dtype bound, not a float64 reference, on 2 of 2 variants" \
            in d.summary and why in d.summary
    assert "cannot widen a program with 'bitcast_convert_type'" in d.summary
    d = check_kernel(blocked, ref, A, B, variants=variants)
    assert "no_float64_reference" not in d.evidence and "dtype bound" not in d.summary
    assert "float64_reference" not in d.evidence


def test_plain_callables_run_as_one_program_per_shape_where_they_trace():
    """A plain (un-jitted) candidate and reference run forward and backward as one jitted
    program, as in a training step, and so does the reference's float64 evaluation: traced once
    per shape, the programs shared by later checks, not run op by op on every check; one that jit
    rejects (it reads a value on the host) runs op by op, with its float64 floors all the same;
    forward-only checks likewise."""
    widths = {"candidate": [], "reference": []}

    def candidate(a, b):
        widths["candidate"].append(a.dtype)
        return blocked(a, b)

    def reference(a, b):
        widths["reference"].append(a.dtype)
        return a @ b

    def reads_a_value(a, b, flags):   # a value of the argument it is not differentiated by
        return -(a @ b) if bool(flags.any()) else a @ b

    variants = ("example", "large")
    assert check_kernel(candidate, reference, A, B, variants=variants, seed=0).passed
    traced = {k: len(v) for k, v in widths.items()}
    assert widths["reference"].count(jnp.float64) >= len(variants)
    d = check_kernel(candidate, reference, A, B, variants=variants, seed=1)
    assert d.passed and "no_float64_reference" not in d.evidence, d.summary
    assert len(widths["candidate"]) == traced["candidate"]
    again = widths["reference"][traced["reference"]:]
    # one trace remains per check: the reductions' reach read from its program
    assert jnp.float64 not in again and len(again) <= 1, again
    for backward in (True, False):
        d = check_kernel(lambda a, b, flags: blocked(a, b), reads_a_value, A, B,
                         jnp.zeros(4, bool), variants=variants, backward=backward)
        assert d.passed and "no_float64_reference" not in d.evidence, d.summary
    forward_only = len(widths["candidate"])
    assert check_kernel(candidate, reference, A, B, variants=variants, backward=False).passed
    assert check_kernel(candidate, reference, A, B, variants=variants, backward=False,
                        seed=1).passed
    assert len(widths["candidate"]) == forward_only + 1   # its forward traced once


def test_a_reference_pinned_to_float32_is_widened_to_float64():
    """preferred_element_type=float32 returns float32 on float64 inputs: its program, widened
    to float64, is the float64 reference (the same floors as an unpinned reference)."""
    d = check_kernel(blocked, _pinned, A, B, variants=("example", "large"))
    plain = check_kernel(blocked, ref, A, B, variants=("example", "large"))
    assert d.passed and "no_float64_reference" not in d.evidence, d.summary
    assert "widened to float64" in d.evidence["float64_reference"]
    assert d.evidence["max_floor_ratio"] == pytest.approx(plain.evidence["max_floor_ratio"])


@pytest.mark.slow
def test_mixed_precision_kernels_are_judged_against_float64():
    """bfloat16 in, float32 out, the reference pinned to float32: a kernel accumulating in
    bfloat16 is named low_precision_accumulation (the conditioning floor perturbs the exact
    bfloat16 inputs at float32's last bit, the precision the result resolves, so it does not
    hide the accumulator), and the bundled Pallas matmul passes."""
    a = jax.random.normal(jax.random.key(0), (40, 96)).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (96, 24)).astype(jnp.bfloat16)
    kernel = pallas_matmul()

    @jax.jit
    def pallas(x, y):
        return kernel(x, y, dimension_numbers=DIMS, precision=None,
                      preferred_element_type=jnp.float32)

    def bf16_accumulator(x, y):
        out = jnp.zeros((x.shape[0], y.shape[1]), jnp.bfloat16)
        for k in range(0, x.shape[1], 32):
            out = out + _pinned(x[:, k:k + 32], y[k:k + 32]).astype(jnp.bfloat16)
        return out.astype(jnp.float32)

    good = check_kernel(pallas, _pinned, a, b, variants=("example", "large", "odd_shape"))
    assert good.passed and "widened" in good.evidence["float64_reference"], good.summary
    bad = check_kernel(bf16_accumulator, _pinned, a, b, variants=("example", "large"))
    assert not bad.passed and bad.model == "low_precision_accumulation", bad.summary


@pytest.mark.slow
def test_a_new_reduction_length_compiles_no_new_statistics():
    """Two matmuls whose output and gradients share padded layouts but whose K differ (13, 21):
    the second check compiles no analyzer program (K only widens the detector's rounding
    reach; it recompiled the statistics once, for every new K)."""
    programs = (device.shape_program, device.sample_program)
    for inner in (13, 21):
        a = jax.random.normal(jax.random.key(inner), (16, inner))
        b = jax.random.normal(jax.random.key(inner + 1), (inner, 8))
        d = check_kernel(blocked, ref, a, b, variants=("example",), repeats=1)
        assert d.passed, d.summary
        if inner == 13:
            after = [cache_size(p) for p in programs]
    assert [cache_size(p) for p in programs] == after


def test_a_raising_candidate_still_raises_with_analyses_queued():
    calls = []

    def breaks_on_large(a, b):
        calls.append(1)
        if float(jnp.max(jnp.abs(a))) > 1e6:
            raise ValueError("overflow guard")
        return a @ b

    with pytest.raises(PeatError, match="overflow guard"):
        check_kernel(breaks_on_large, ref, A, B, variants=("example", "large"), backward=False)


def test_nondeterministic_candidate():
    rng = np.random.default_rng(0)

    def flaky(a, b):            # run-to-run differences far beyond rounding
        out = np.asarray(a @ b)
        out = out + rng.integers(0, 2, out.shape) * np.float32(1e-2) * np.abs(out)
        return jnp.asarray(out)

    d = check_kernel(flaky, ref, A, B, variants=("example",), backward=False, repeats=3)
    assert d.model == "nondeterministic", d.summary
    assert d.evidence["origin"]["output"] == "repeat forward"


@pytest.mark.slow
@pytest.mark.parametrize("inside", [None, jnp.float32])
def test_float64_rules_need_a_candidate_that_computes_in_float64(inside):
    """tanh-GELU for the exact GELU: run in float64 it is still off, so it is an approximation;
    the same kernel casting to float32 inside returns float32 values from float64 inputs, which
    say nothing about its algorithm: no float64 rule names it."""
    def gelu_tanh(x):
        return jax.nn.gelu(x if inside is None else x.astype(inside),
                           approximate=True).astype(x.dtype)

    x = jax.random.normal(jax.random.key(0), (32, 32))
    d = check_kernel(gelu_tanh, lambda x: jax.nn.gelu(x, approximate=False), x,
                     variants=("example",), backward=False, repeats=1)
    assert not d.passed
    assert (d.model == "approximation") == (inside is None), d.summary


def test_allow_reduced_precision():
    def bf16_inputs(a, b):
        return a.astype(jnp.bfloat16).astype(a.dtype) @ b.astype(jnp.bfloat16).astype(b.dtype)

    d = check_kernel(bf16_inputs, ref, A, B, variants=("example",), backward=False)
    assert d.model == "reduced_precision" and not d.passed
    assert 5 <= d.evidence["effective_mantissa_bits"] <= 10
    d = check_kernel(bf16_inputs, ref, A, B, variants=("example",), backward=False,
                     allow=("reduced_precision",))
    assert d.passed and d.evidence["allowed"]


def test_odd_shapes_are_skipped_when_the_candidate_rejects_them():
    def fixed(a, b):
        if a.shape != (24, 24):
            raise ValueError("only 24x24")
        return blocked(a, b)

    d = check_kernel(fixed, ref, A, B, variants=("example", "odd_shape"), backward=False)
    assert d.passed
    assert "candidate rejects" in d.evidence["skipped"]["odd_shape"]


def test_variants_are_what_they_say():
    x = np.asarray(A)
    assert make_variant("zeros", (x,))[0].max() == 0
    sub = make_variant("subnormal", (x,))[0]
    assert np.abs(sub).max() < np.finfo(np.float32).smallest_normal
    big = make_variant("large", (x,))[0]
    assert 1e9 < np.abs(big).max() < 1e10
    odd = make_variant("odd_shape", (x, np.asarray(B)[:, :8]))
    assert odd[0].shape == (27, 27) and odd[1].shape == (27, 11)


@pytest.mark.parametrize("sizes", [(5, 13), (29, 61), (125, 24)])
def test_odd_shapes_are_never_whole_blocks(sizes):
    """d + 3 is a whole number of 8-wide blocks for d = 5, 13, 29, 61, 125: the odd variant
    must still leave a partial block in every dimension, and keep equal sizes equal."""
    m, k = sizes
    a, b = np.ones((m, k), np.float32), np.ones((k, m), np.float32)
    odd_a, odd_b = make_variant("odd_shape", (a, b))
    assert all(d % 8 and d > s for d, s in zip(odd_a.shape, (m, k)))
    assert odd_b.shape == odd_a.shape[::-1]


def test_errors():
    with pytest.raises(PeatError, match="example arguments"):
        check_kernel(ref, ref)
    with pytest.raises(PeatError, match="unknown variants"):
        check_kernel(ref, ref, A, B, variants=("huge",))
    with pytest.raises(PeatError, match=r"argument 1 has an empty float array \(shape \(0, 4\)\)"):
        check_kernel(ref, ref, A, np.ones((0, 4), np.float32))

    def opaque(a, b):
        return jax.pure_callback(lambda a, b: np.asarray(a) @ np.asarray(b),
                                 jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), a.dtype), a, b)

    with pytest.raises(PeatError, match="backward=False"):
        check_kernel(opaque, ref, A, B, variants=("example",))


@pytest.mark.parametrize("jitted", [False, True])
def test_outputs_of_two_dtypes_are_named_before_the_gradients(jitted):
    """A reference that promotes bfloat16 to float32 (a NumPy scalar is not weakly typed): the
    check says what each returned, before its gradients (one cotangent cannot serve both) or
    the analyzer (which compares one dtype) fail on it."""
    x = jax.random.normal(jax.random.key(0), (16, 64)).astype(jnp.bfloat16)

    def promoting(x):
        return 0.5 * x * (1 + jax.scipy.special.erf(x / np.sqrt(2)))

    candidate = jax.jit(jax.nn.gelu) if jitted else jax.nn.gelu
    for backward in (True, False):
        with pytest.raises(PeatError, match=r"candidate returned bfloat16\[16, 64\], the "
                                            r"reference float32\[16, 64\]: .*NumPy scalar"):
            check_kernel(candidate, jax.jit(promoting) if jitted else promoting, x,
                         variants=("example",), backward=backward)


@pytest.mark.parametrize("outputs", ["array", "tuple"])
def test_a_kernel_returning_its_wider_accumulator_is_told_how_to_check_it(outputs):
    """flash-attention-jax returns float32 for bfloat16 inputs: the error says how to check it
    as a model that casts the output back uses it."""
    x = jax.random.normal(jax.random.key(0), (16, 64)).astype(jnp.bfloat16)
    wrap = (lambda y: y) if outputs == "array" else (lambda y: (y, y))

    def accumulating(v):
        return wrap(jax.nn.softmax(v.astype(jnp.float32)))

    hint = (r"lambda \*a: kernel\(\*a\)\.astype\(jnp\.bfloat16\)" if outputs == "array"
            else "cast its outputs to the reference's in a wrapper")
    with pytest.raises(PeatError, match=r"candidate returned .*float32.*bfloat16.*" + hint):
        check_kernel(jax.jit(accumulating), jax.jit(lambda v: wrap(jax.nn.softmax(v))), x,
                     variants=("example",))
    d = check_kernel(jax.jit(lambda v: jax.tree.map(lambda y: y.astype(jnp.bfloat16),
                                                    accumulating(v))),
                     jax.jit(lambda v: wrap(jax.nn.softmax(v))), x, variants=("example",))
    assert d.passed, d.summary


@pytest.mark.parametrize("fails", ["at_run_time", "backward"])
def test_a_jitted_reference_that_fails_says_which_part(fails):
    """A jitted reference runs forward and backward as one program; when that program fails,
    the error still says whether the forward raised or the reference is not differentiable."""
    def raising(x):
        raise ValueError("the reference's own failure")

    def opaque(a, b):
        out = jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), a.dtype)
        if fails == "at_run_time":
            return jax.pure_callback(raising, out, a)
        return jax.pure_callback(lambda a, b: np.asarray(a) @ np.asarray(b), out, a, b)

    match = "the reference raised on the 'example' inputs" if fails == "at_run_time" else \
        "the reference is not differentiable"
    with pytest.raises(PeatError, match=match):
        check_kernel(ref, jax.jit(opaque), A, B, variants=("example",))


def test_a_candidate_whose_backward_raises_says_so():
    """flash-attention-jax's backward in bfloat16 raises inside its custom VJP (a scan carry of
    two dtypes): the one-line error names the backward and the way to check the forward."""
    @jax.custom_vjp
    def kernel(x):
        return jnp.tanh(x)

    def bwd(_, g):
        raise TypeError("scan body function carry input and carry output must have equal types")

    kernel.defvjp(lambda x: (jnp.tanh(x), None), bwd)
    with pytest.raises(PeatError, match=r"the candidate's backward failed \(TypeError: scan body"
                                        r".*pass backward=False to check the forward alone"):
        check_kernel(kernel, jnp.tanh, A, variants=("example",))
    assert check_kernel(kernel, jnp.tanh, A, variants=("example",), backward=False).passed


def test_atol_is_an_escape_hatch():
    shifted = lambda a, b: a @ b + 1e-3     # noqa: E731
    assert not check_kernel(shifted, ref, A, B, variants=("example",), backward=False).passed
    assert check_kernel(shifted, ref, A, B, variants=("example",), backward=False,
                        atol=2e-3).passed


def test_assert_kernel_matches_message():
    d = assert_kernel_matches(blocked, ref, A, B, variants=("example",))
    assert d.passed
    with pytest.raises(AssertionError) as err:
        assert_kernel_matches(wrong_bwd, ref, A, B, variants=("example",))
    msg = str(err.value)
    assert msg.startswith("fails: wrong_scale") and '"origin"' in msg and "grad[1]" in msg


def test_pytest_fixture(request):
    """The peat_check fixture (registered by the package's pytest11 entry point)."""
    if request.config.pluginmanager.get_plugin("peat_jax") is None:
        pytest.skip("the pytest11 entry point is not installed (pip install -e .)")
    peat_check = request.getfixturevalue("peat_check")
    assert isinstance(peat_check, PeatCheck)
    d = peat_check(blocked, ref, A, B, variants=("example",))
    assert d.passed and peat_check.diagnoses == [d]
    with pytest.raises(AssertionError, match="wrong_scale"):
        peat_check(wrong_bwd, ref, A, B, variants=("example",))


def test_fixture_defaults_come_from_the_command_line():
    check = PeatCheck(variants=["example"], backward=False)
    d = check(wrong_bwd, ref, A, B)           # backward off: the wrong gradient is not seen
    assert d.passed and {o for _, o, _ in d.evidence["checks"]} == {"forward",
                                                                   "repeat forward"}


# ------------------------------------------------------------------------------------------
# The candidate at the example's shapes and at the odd variant's, built as one program


def _pallas_mm():
    from peat_jax._src.kernels.pallas.matmul import matmul
    return jax.jit(lambda a, b: matmul(a, b, block_m=8, block_n=8, block_k=8))


@pytest.mark.slow
def test_the_paired_program_computes_what_each_shape_computes_alone():
    """Each half of the pair program is bitwise the program of that shape alone (forward,
    forward under vjp, gradients): pairing changes what is compiled, not what is computed."""
    from peat_jax._src.check import programs
    cand = _pallas_mm()
    rng = np.random.default_rng(0)
    halves = []
    for shape in ((16, 24, 8), (19, 27, 11)):
        m, k, n = shape
        args = (jnp.asarray(rng.standard_normal((m, k)), jnp.float32),
                jnp.asarray(rng.standard_normal((k, n)), jnp.float32))
        halves.append((args, jnp.asarray(rng.standard_normal((m, n)), jnp.float32)))
    paired = programs.jitted_pair(cand, (0, 1))(halves[0], halves[1])
    for half, together in zip(halves, paired):
        alone = programs.jitted_vjp(cand, (0, 1), True)(*half)
        for x, y in zip(jax.tree_util.tree_leaves(alone), jax.tree_util.tree_leaves(together)):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.slow
def test_a_small_check_builds_the_candidate_once_for_both_shapes(monkeypatch):
    """A jitted candidate checked on small inputs compiles one program for the example's shapes
    and the odd variant's (not one each), and the check's verdict and every check's model are
    those of the check without pairing."""
    from peat_jax._src.check import programs
    a = np.random.default_rng(1).standard_normal((16, 24)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal((24, 8)).astype(np.float32)
    cand = _pallas_mm()
    paired = check_kernel(cand, ref, a, b)
    assert cache_size(programs.jitted_pair(cand, (0, 1))) == 1
    assert cache_size(programs.jitted_vjp(cand, (0, 1), True)) == 0
    monkeypatch.setattr(programs, "PAIR_MAX_ELEMENTS", 0)
    alone_cand = _pallas_mm()
    alone = check_kernel(alone_cand, ref, a, b)
    assert cache_size(programs.jitted_pair(alone_cand, (0, 1))) == 0
    assert cache_size(programs.jitted_vjp(alone_cand, (0, 1), True)) == 2
    assert (paired.model, paired.passed) == (alone.model, alone.passed)
    assert paired.evidence["checks"] == alone.evidence["checks"]


def test_pairing_still_skips_odd_shapes_the_candidate_rejects():
    @jax.jit
    def only_multiples_of_8(a, b):
        if any(d % 8 for d in a.shape + b.shape):
            raise ValueError("block-aligned shapes only")
        return a @ b

    d = check_kernel(only_multiples_of_8, ref, np.ones((16, 8), np.float32),
                     np.ones((8, 16), np.float32))
    assert d.passed, d.summary
    assert "odd_shape" in d.evidence["skipped"], d.evidence


@pytest.mark.slow
def test_pairing_blames_a_fault_on_the_odd_variant_only():
    """A candidate wrong only at shapes that are not multiples of 8 (its two halves share one
    program) fails on odd_shape alone: tile_boundary, origin odd_shape."""
    @jax.jit
    def wrong_at_partial_blocks(a, b):
        out = a @ b
        return out.at[-1].multiply(1.5) if a.shape[0] % 8 else out

    d = check_kernel(wrong_at_partial_blocks, ref, np.ones((16, 8), np.float32) * 0.5,
                     np.ones((8, 16), np.float32))
    assert not d.passed and d.model == "tile_boundary", d.summary
    assert d.evidence["origin"]["variant"] == "odd_shape"
    assert {v for v, _, m in d.evidence["checks"] if m not in ("exact", "numerical_noise")} == \
        {"odd_shape"}


def _layer_norm(eps):
    def norm(x, scale, bias):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + eps) * scale + bias
    return jax.jit(norm)


@pytest.mark.slow
@pytest.mark.parametrize("rows, n", [(16, 64), (5, 33)])
@pytest.mark.parametrize("bias", [0.0, 0.3])
def test_a_norm_with_another_eps_is_a_per_row_scale_whatever_its_bias(rows, n, bias):
    """eps 1e-5 for 1e-6 scales each row by its own constant; a bias added after it keeps the
    ratio from being constant, not the errors from being a scale of the golden up to an offset
    (rule per_row_scale where the ratio rule misses it)."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    scale = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    b = (bias * rng.standard_normal(n)).astype(np.float32)
    d = check_kernel(_layer_norm(1e-5), _layer_norm(1e-6), x, scale, b, variants="example",
                     backward=False, repeats=1)
    assert not d.passed and d.model == "wrong_scale", d.summary


def _softmax_port(x):
    e = jnp.exp(x - jnp.max(x, -1, keepdims=True))
    return e / jnp.sum(e, -1, keepdims=True)


def _logsumexp_port(x):
    m = jnp.max(x, -1, keepdims=True)
    return (m + jnp.log(jnp.sum(jnp.exp(x - m), -1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("port,reference", [(_softmax_port, jax.nn.softmax),
                                            (_logsumexp_port, lambda x: jax.nn.logsumexp(x, -1))],
                         ids=["softmax", "logsumexp"])
def test_a_correct_float64_port_passes_judged_by_the_dtype_bound(x64, port, reference):
    """A float64 output has no wider reference: its float64 evaluation is the golden itself,
    whose floor of 0 called another correct rounding of softmax's gradient an error. Such
    outputs are judged by the dtype bound, and the verdict says so."""
    x = np.random.default_rng(0).standard_normal((8, 32))
    d = check_kernel(jax.jit(port), jax.jit(reference), x, variants=("example", "odd_shape"),
                     repeats=1)
    assert d.passed, d.summary
    assert "returns float64 already" in d.summary


@pytest.mark.parametrize("bug", ["float32_accumulation", "one_element_doubled"])
def test_a_float64_kernel_with_a_bug_still_fails(x64, bug):
    a = np.random.default_rng(0).standard_normal((16, 64))

    def candidate(v):
        if bug == "float32_accumulation":
            v32 = v.astype(jnp.float32)
            return (v32.T @ v32).astype(jnp.float64)
        return (v.T @ v).at[3, 5].multiply(2.0)

    d = check_kernel(jax.jit(candidate), jax.jit(lambda v: v.T @ v), a, variants=("example",),
                     repeats=1)
    # -4.45 -> -8.9: the exponent's two lowest bits
    expected = {"float32_accumulation": "low_precision_accumulation",
                "one_element_doubled": "multi_bit_flip"}
    assert not d.passed and d.model == expected[bug], d.summary


def test_a_mixed_precision_run_keeps_its_float32_outputs_float64_floors(x64):
    """float32 a, float64 b: the forward and a's gradient are float32 and have a float64
    reference and conditioning floors; b's gradient is float64 already and has neither (the
    dtype bound judges it); where every output is float64 there is none at all."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 4))
    ct = rng.standard_normal((8, 4)).astype(np.float32)

    def f(a, b):
        return a @ b.astype(jnp.float32)

    out, vjp = jax.vjp(f, a, b)
    ga, gb = vjp(ct)
    outs = {"forward": np.asarray(out), "grad[0]": np.asarray(ga), "grad[1]": np.asarray(gb)}
    assert outs["grad[1]"].dtype == np.float64
    run = Run("example", (a, b), (0, 1), ct, outs, outs)
    ref64, why = wider_reference(f, run)
    assert set(ref64) == {"forward", "grad[0]"} and why == NO_WIDER
    assert all(v.dtype == np.float64 for v in ref64.values())
    np.testing.assert_allclose(ref64["forward"], outs["forward"], rtol=1e-5)
    spreads = conditioning_spreads(f, run, ref64, seed=0)
    assert set(spreads) == {"forward", "grad[0]"}
    assert all(np.shape(s) == outs[o].shape for o, s in spreads.items())
    assert np.max(spreads["forward"]) > 0   # a's last bit moves a @ b; a's grad has b in float32

    only64 = Run("example", (b,), (), None, {"forward": b * 2}, {"forward": b * 2})
    assert wider_reference(lambda b: b * 2, only64) == ({}, NO_WIDER)
