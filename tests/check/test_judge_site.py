"""`judge.site.judge_site`: one op site's output judged with the float64, conditioning and
rounding floors of the site's op, and the candidate's float64 run (what playback calls for a
failing site)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peat_jax._src.analyzer import RoundingFloor
from peat_jax._src.judge.float64 import float64_evidence
from peat_jax._src.judge.site import NoFloat64Candidate, SiteOp, judge_site
from peat_jax._src.promote import traced_eqn, widened_eqn

RNG = np.random.default_rng(0)


def _op(fn, *args, reduction_length=None) -> SiteOp:
    """The one equation `fn` traces to, as a `SiteOp`."""
    (eqn,) = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return SiteOp(float64=widened_eqn(eqn), traced=traced_eqn(eqn),
                  reduction_length=reduction_length)


@pytest.mark.parametrize("shape", [(8, 32, 16), (3, 17, 5)])
def test_a_matmul_in_another_order_passes_and_a_scaled_one_fails(shape):
    m, k, n = shape
    a = RNG.standard_normal((m, k)).astype(np.float32)
    b = RNG.standard_normal((k, n)).astype(np.float32)
    op = _op(jnp.matmul, a, b, reduction_length=k)
    reference = np.asarray(jnp.matmul(a, b))
    reordered = np.zeros((m, n), np.float32)
    for i in reversed(range(k)):   # float32 sums in the opposite order
        reordered += np.outer(a[:, i], b[i]).astype(np.float32)
    sig, d = judge_site(op, [a, b], reordered, reference, seed=0)
    assert d.passed, d.summary
    sig, d = judge_site(op, [a, b], reference * np.float32(1.001), reference, seed=0,
                        candidate64=lambda: np.asarray(a, np.float64) @ b * 1.001)
    assert not d.passed and d.model == "wrong_scale", d.summary
    assert isinstance(sig.noise.rounding, RoundingFloor)   # the rounding floor was applied


def test_a_failing_site_has_the_rounding_floor_and_the_float64_rules():
    """A composite site (a jitted softmax: one call equation) with a zeroed column fails with
    the rounding floor applied; a candidate64 that gives up with `NoFloat64Candidate` leaves
    the verdict and says why."""
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    op = _op(jax.jit(lambda v: jax.nn.softmax(v, axis=-1)), x)
    reference = np.asarray(jax.nn.softmax(x, axis=-1))
    wrong = reference.copy()
    wrong[:, 0] = 0.0
    sig, d = judge_site(op, [x], wrong, reference, seed=1)
    assert not d.passed and isinstance(sig.noise.rounding, RoundingFloor)

    def gives_up():
        raise NoFloat64Candidate("past the time limit of 1 s")

    _, d = judge_site(op, [x], wrong, reference, seed=1, candidate64=gives_up)
    assert not d.passed and "no float64 rule: past the time limit of 1 s" in d.summary
    assert d.evidence["no_float64_candidate"] == "past the time limit of 1 s"


def test_an_op_monte_carlo_cannot_evaluate_keeps_the_other_floors_and_says_why():
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    op = _op(jnp.sin, x)

    def refuses(*operands):
        raise ValueError("no Monte Carlo here")

    op = SiteOp(float64=op.float64, traced=refuses)
    reference = np.sin(x)
    _, d = judge_site(op, [x], reference * np.float32(1.01), reference, seed=0)
    assert not d.passed
    assert d.evidence["no_rounding_floor"].startswith("ValueError: no Monte Carlo here")


def test_float64_evidence_leaves_out_what_no_reference_judges():
    """Where the float64 reference is not finite, the candidate's errors are not measured (the
    analyzer's unjudged elements); the reference's own error leaves out its overflow in its
    dtype (inf there would make any error "within 8x" of it)."""
    ref64 = np.array([np.nan, np.inf, 2.0, 1.0])
    golden = np.array([np.nan, np.inf, np.inf, 1.0], np.float32)   # overflowed at element 2
    candidate = np.array([0.0, 5.0, 2.0, 1.0 + 2 ** -20], np.float32)
    f = float64_evidence(candidate, golden, ref64, np.array([0.0, 5.0, 2.0, 1.0]))
    assert f.error == pytest.approx(2 ** -20) and f.error64 == 0.0
    assert f.reference_error == 0.0 and f.scale == 2.0
    f = float64_evidence(np.array([np.nan, 5.0, 2.0, 1.0], np.float32), golden, ref64,
                         np.array([0.0, 5.0, 2.0, np.nan]))
    assert f.error == 0.0 and f.error64 == float("inf")   # NaN where the reference is finite


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_float64_run_that_computed_in_float32_is_no_float64_evidence(dtype):
    """A kernel that computes in float32 inside (keras' ops under `jax.enable_x64`, which read
    jax's global flag) returns float32 values from float64 inputs: off a bfloat16 or float16
    grid, and still no float64 run."""
    x = np.random.default_rng(0).standard_normal(64)
    ref64 = np.exp(x)
    golden = ref64.astype(jnp.dtype(dtype))
    in_float32 = np.exp(x.astype(np.float32)).astype(np.float64)
    assert not float64_evidence(golden, golden, ref64, in_float32).in_float64
    assert float64_evidence(golden, golden, ref64, np.exp(x)).in_float64


def _softmax_port(x):
    e = jnp.exp(x - jnp.max(x, -1, keepdims=True))
    return e / jnp.sum(e, -1, keepdims=True)


def test_a_float64_site_is_judged_by_the_dtype_bound():
    """A float64 site's op in float64 is the golden itself: a floor of 0 called another correct
    rounding of softmax's gradient (on this draw) a bit flip. The dtype bound judges it, says
    so, and still finds a doubled element."""
    rng = np.random.default_rng(9)
    x, ct = rng.standard_normal((8, 32)), rng.standard_normal((8, 32))
    with jax.enable_x64(True):
        reference_fn = jax.jit(lambda x, ct: jax.vjp(jax.nn.softmax, x)[1](ct)[0])
        op = _op(reference_fn, x, ct)
        reference = np.asarray(reference_fn(x, ct))
        port = np.asarray(jax.jit(lambda x, ct: jax.vjp(_softmax_port, x)[1](ct)[0])(x, ct))
        assert reference.dtype == np.float64 and not np.array_equal(port, reference)
        _, d = judge_site(op, [x, ct], port, reference, seed=0)
        assert d.passed, d.summary
        assert "returns float64 already" in d.summary and "no_float64_reference" in d.evidence
        wrong = reference.copy()
        wrong[2, 3] *= 2
        _, d = judge_site(op, [x, ct], wrong, reference, seed=0)
    assert not d.passed and d.model in ("bit_flip", "multi_bit_flip"), d.summary
