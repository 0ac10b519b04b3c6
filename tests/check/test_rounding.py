"""The rounding floor: Monte Carlo arithmetic on the reference (`peat_jax._src.judge.rounding`), its
place in `analyze` and in `check_kernel`'s verdict."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat
from peat_jax._src.analyzer import RoundingFloor, analyze
from peat_jax._src.counter_random import substream, uniforms64
from peat_jax._src.errors import PeatError
from peat_jax._src.judge import ROUNDING_SAMPLES, rounding_samples

RNG = np.random.default_rng(0)
A = RNG.standard_normal((24, 40)).astype(np.float32)
B = RNG.standard_normal((40, 16)).astype(np.float32)


def _float64(fn, *args):
    with jax.enable_x64(True):
        return np.asarray(fn(*[jnp.asarray(np.asarray(a, np.float64)) for a in args]))


def _spread(samples, r64):
    return np.abs(np.asarray(samples) - r64[None]).max(axis=0)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_the_spread_of_a_matmul_is_the_size_of_its_own_rounding(dtype):
    """S correct roundings of a matmul at the inputs' precision scatter around the float64
    result by about the reference's own error: the same order of magnitude, per dtype."""
    a, b = A.astype(dtype), B.astype(dtype)
    samples = rounding_samples(jnp.matmul, (jnp.asarray(a), jnp.asarray(b)), seed=0)
    assert samples.shape == (ROUNDING_SAMPLES, 24, 16) and samples.dtype == np.float64
    r64 = _float64(jnp.matmul, a, b)
    own = np.abs(np.asarray(jnp.matmul(a, b), np.float64) - r64).max()
    spread = _spread(samples, r64).max()
    assert 0.3 * own <= spread <= 30 * own, (spread, own)
    # every sample is on the output dtype's grid, and the samples differ from each other
    assert np.array_equal(samples, samples.astype(dtype).astype(np.float64))
    assert len({s.tobytes() for s in samples}) == ROUNDING_SAMPLES


def test_the_samples_are_fixed_by_the_seed():
    args = (jnp.asarray(A), jnp.asarray(B))
    first, again = (rounding_samples(jnp.matmul, args, seed=3) for _ in range(2))
    other = rounding_samples(jnp.matmul, args, seed=4)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_data_movement_rounds_nothing():
    """Transposes, reshapes, maxima and negations are exact: their spread is 0."""
    def moved(x):
        return -jnp.max(x.T.reshape(8, -1, 3), axis=1)

    x = jnp.asarray(A)
    samples = rounding_samples(moved, (x,), seed=0)
    np.testing.assert_array_equal(_spread(samples, _float64(moved, A)), 0.0)


@pytest.mark.parametrize("op", ["add", "mul", "min", "max", "grad"])
def test_scatters_and_the_gradient_of_an_indexing_are_sampled(op):
    """A combining scatter (``x.at[i].add(...)``; the transpose of a gather: the gradient of
    rows picked by index, as a grouped matmul's reference picks each row's expert) combines in
    float64 under Monte Carlo arithmetic: its combiner, traced at the program's own dtype,
    failed to lower there."""
    rows = jnp.asarray([0, 2, 2, 1, 0, 2], jnp.int32)
    table, x = jnp.asarray(A[:3]), jnp.asarray(A[:6])

    def fn(t, x):
        if op == "grad":
            return jax.grad(lambda t: jnp.sum((t[rows] * x) ** 2))(t)
        return getattr(x[:3].at[rows[:3]], op)(t[rows[:3]] * 2.0)

    samples = rounding_samples(fn, (table, x), seed=0, samples=2)
    with jax.enable_x64(True):
        exact = np.asarray(fn(*(jnp.asarray(v, jnp.float64) for v in (table, x))))
    assert samples.shape == (2, *exact.shape)
    np.testing.assert_allclose(samples[0], exact, rtol=1e-5, atol=1e-5)


def _solve(m):
    return jnp.linalg.solve(m[:6, :6] + 8 * jnp.eye(6), m[:6, 0])


def _fft_power(m):
    return jnp.abs(jnp.fft.rfft(m, axis=1)) ** 2


@pytest.mark.parametrize("fn", [_solve, _fft_power], ids=["solve", "rfft"])
@pytest.mark.parametrize("grad", [False, True])
def test_linear_solves_and_complex_values_are_sampled_in_float64(fn, grad):
    """A linear solve (its jaxprs typed by the traced dtype) and a program with complex values
    (complex64 literals beside complex128 ones) are evaluated in float64 / complex128: each
    failed to lower or to trace there, leaving the reference without a rounding floor."""
    f = (lambda m: jax.grad(lambda x: jnp.sum(fn(x) ** 2))(m)) if grad else fn
    m = jnp.asarray(A[:6])
    samples = rounding_samples(f, (m,), seed=0, samples=2)
    with jax.enable_x64(True):
        exact = np.asarray(f(jnp.asarray(A[:6], jnp.float64)))
    assert samples.shape == (2, *exact.shape) and samples.dtype == np.float64
    np.testing.assert_allclose(samples[0], exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
    assert not np.array_equal(samples[0], samples[1])     # perturbed: a spread, not a copy


def test_a_sum_that_cancels_has_a_floor_at_the_scale_of_its_terms():
    """Rows of terms that cancel exactly sum to 0 in float64 and, here, in float32: the floor
    of the reference's own error is 0 there. A correct sum in another order is not: the
    rounding floor there is rounding at the scale of what was summed (a few ULPs of the terms),
    not of the result."""
    half = RNG.standard_normal((8, 16)).astype(np.float32)
    x = np.concatenate([half, -half[:, ::-1]], axis=1)
    r64 = _float64(lambda v: jnp.sum(v, axis=1), x)
    np.testing.assert_array_equal(r64, 0.0)
    samples = rounding_samples(lambda v: jnp.sum(v, axis=1), (jnp.asarray(x),), seed=0)
    spread = _spread(samples, r64)
    scale = np.sqrt((half.astype(np.float64) ** 2).sum(axis=1) * 2)
    assert np.all(spread > 0.1 * 2.0 ** -24 * scale) and np.all(spread < 30 * 2.0 ** -24 * scale)


def _matmul_terms(rng, k, mean):
    a = (mean + rng.standard_normal((8, k))).astype(np.float32)
    b = (mean + rng.standard_normal((k, 6))).astype(np.float32)
    return jnp.matmul, (a, b), a[:, :, None] * b[None]     # the products, rounded once each


def _row_sum_terms(rng, k, mean):
    x = (mean + rng.standard_normal((8, k))).astype(np.float32)
    return (lambda v: jnp.sum(v, axis=1)), (x,), x


@pytest.mark.parametrize("k", [4096, 16384])
@pytest.mark.parametrize("mean", [0.0, 1.0], ids=["either_sign", "one_sign"])
@pytest.mark.parametrize("terms", [_matmul_terms, _row_sum_terms], ids=["matmul", "row_sum"])
def test_a_sum_in_order_is_within_the_floor(terms, k, mean):
    """The thread that owns an output element of a GPU matmul (or a float32 Pallas loop, or
    XLA:CPU's dot at some shapes) adds its K products one after another, as a kernel that walks
    a long row adds its blocks: rounding at the scale of the partial sums K times, not at the
    ~log2 K levels of a tree. That order's error is within the floor the samples set (4x their
    spread and 2 ULPs, `analyze`'s) at every element, for terms of either sign and of one."""
    fn, args, t = terms(np.random.default_rng(k), k, mean)
    r64 = _float64(fn, *args)
    in_order = np.cumsum(t, axis=1, dtype=np.float32)[:, -1]    # one add after another
    spread = _spread(rounding_samples(fn, tuple(map(jnp.asarray, args)), seed=0), r64)
    floor = 4 * spread + 2 * np.spacing(np.abs(r64).astype(np.float32)).astype(np.float64)
    error = np.abs(in_order.astype(np.float64) - r64)
    assert np.all(error <= floor), (error / floor).max()


@pytest.mark.parametrize("op", ["sum", "add"])
def test_float64_terms_near_overflow_that_cancel_have_a_floor_at_their_scale(op):
    """Terms near the top of float64's range, whose squares overflow it, that cancel (to 0, or
    to a rounding of theirs): the floor is rounding at the terms' scale, as for terms of any
    size (the test above), not at the result's."""
    unit = RNG.standard_normal((8, 16))
    half = unit * 2.0 ** 900
    x = np.concatenate([half, -half[:, ::-1]], axis=1)
    fn = {"sum": lambda v: jnp.sum(v, axis=1), "add": lambda v: v + v[:, ::-1]}[op]
    with jax.enable_x64(True):
        samples = np.asarray(rounding_samples(fn, (jnp.asarray(x),), seed=0))
        r64 = np.asarray(fn(jnp.asarray(x)))
    assert np.isfinite(samples).all()
    terms = (np.sqrt((unit ** 2).sum(axis=1)) if op == "sum" else np.abs(unit).min(axis=1))
    spread = _spread(samples, r64).reshape(8, -1).max(axis=1)
    assert np.all(spread > 0.1 * 2.0 ** -53 * terms * 2.0 ** 900), (spread, terms)


def test_a_float64_matmul_in_another_order_passes_near_overflow(x64):
    """`a.T @ a` against an einsum in float64 on near_overflow inputs, whose products have
    squares past float64's range: that gave a rounding floor of 0, and the order's rounding read
    as a narrow accumulator (on seed 1's draw; the forward alone, the one check that failed).
    A float64 output is judged by the dtype bound now (`check.running.wider_reference`); the floor's
    own overflow is the test above's."""
    x = np.random.default_rng(0).standard_normal((16, 64))
    d = peat.check_kernel(lambda v: v.T @ v, lambda v: jnp.einsum("ki,kj->ij", v, v), x,
                          variants="near_overflow", seed=1, repeats=1, backward=False)
    assert d.passed, d.summary


def _saturated_ds(a, b, p):
    """dS = P (dP - rowsum(P dP)) with dP = a @ b, as a softmax's backward forms it."""
    dp = a @ b
    return p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True))


def test_a_rounding_the_reference_cancels_exactly_is_in_the_floor():
    """With P one-hot, dS = P (dP - rowsum(P dP)) is exactly 0 in float64 and in float32: the
    reference's order subtracts dP's rounding from itself. Another algorithm (D = rowsum(dO O))
    rounds the two sides apart, so the floor at the one-hot element is rounding at the scale of
    the terms dP summed, not 0; elsewhere P is 0 and so is the floor."""
    h = RNG.standard_normal((8, 8)).astype(np.float32) * 100
    c = RNG.standard_normal((8, 12)).astype(np.float32)
    a, b = np.concatenate([h, h], axis=1), np.concatenate([c, -c])   # dP itself cancels to 0
    p = np.eye(8, 12, dtype=np.float32)
    r64 = _float64(_saturated_ds, a, b, p)
    np.testing.assert_array_equal(r64, 0.0)
    np.testing.assert_array_equal(np.asarray(jax.jit(_saturated_ds)(a, b, p)), 0.0)
    spread = _spread(rounding_samples(_saturated_ds, tuple(map(jnp.asarray, (a, b, p))), 0), r64)
    terms = np.sqrt(((a.astype(np.float64)[:, :, None] * b[None]) ** 2).sum(axis=1))
    hot = p.astype(bool)
    assert np.all(spread[hot] > 0.1 * 2.0 ** -24 * terms[hot]), spread[hot] / terms[hot]
    assert np.all(spread[hot] < 30 * 2.0 ** -24 * terms[hot])
    np.testing.assert_array_equal(spread[~hot], 0.0)


def test_a_row_max_shares_its_rounding_with_its_row():
    """s - max(s) is 0 at the row's maximum in every implementation (the max is one of the row's
    elements): its rounding is not drawn apart, so over logits of 1e18, where a rounding of s
    drawn apart from max(s) would overflow exp, the samples whose additions round at their
    result's scale are the one-hot softmax, to its own few ULPs."""
    from peat_jax._src.judge.rounding import OPERAND_SCALE_SAMPLES
    logits = jnp.asarray((RNG.standard_normal((4, 8)) * 1e18).astype(np.float32))
    fn = lambda s: jax.nn.softmax(2 * s, axis=-1)  # noqa: E731 - 2 * s carries a rounding
    samples = np.asarray(rounding_samples(fn, (logits,), 0))
    r64 = _float64(fn, np.asarray(logits))
    assert np.allclose(samples[OPERAND_SCALE_SAMPLES:], r64[None], atol=1e-6)


def test_a_normalisation_by_its_own_sum_has_the_floor_of_one_that_is_not():
    """softmax(s) = e / sum(e) cancels, at a row's dominant element, the rounding e shares with
    its sum; P = exp(s - lse) from a saved log-sum-exp does not. Over logits of ~1e3 the floor
    at the dominant element is rounding at the scale of the logit (u |s| relative), not of 1."""
    s = RNG.standard_normal((6, 8)).astype(np.float32)
    s[:, 0] = 3000.0 + np.arange(6)          # each row dominated by its first logit
    fn = lambda x: jax.nn.softmax(x @ np.eye(8, dtype=np.float32), axis=-1)  # noqa: E731
    r64 = _float64(fn, s)
    spread = _spread(rounding_samples(fn, (jnp.asarray(s),), 0), r64)
    assert np.all(spread[:, 0] > 0.1 * 2.0 ** -24 * 3000), spread[:, 0]
    assert np.all(spread[:, 0] < 100 * 2.0 ** -24 * 3000), spread[:, 0]


def test_loops_are_sampled_with_fresh_perturbations_per_iteration():
    """A scan (lax.map) over rows is walked: each iteration perturbed anew, so identical rows
    come out differently rounded."""
    row = A[:1]
    x = jnp.asarray(np.repeat(row, 6, axis=0))

    def per_row(v):
        return jax.lax.map(lambda r: jnp.tanh(r) @ jnp.asarray(B), v)

    samples = rounding_samples(per_row, (x,), seed=0)
    assert samples.shape == (ROUNDING_SAMPLES, 6, 16)
    assert len({s.tobytes() for s in samples[0]}) > 1


def test_a_kernel_in_the_program_is_refused():
    kernel = peat.kernels.pallas_matmul(8, 8, 8)

    def with_kernel(a, b):
        return kernel(a, b, dimension_numbers=(((1,), (0,)), ((), ())), precision=None,
                      preferred_element_type=jnp.float32)

    with pytest.raises(PeatError, match="cannot widen a program with 'pallas_call'"):
        rounding_samples(with_kernel, (jnp.asarray(A[:8, :8]), jnp.asarray(B[:8, :8])), 0)


def test_analyze_judges_against_the_spread_of_the_samples():
    """An element whose error is within F times the samples' spread passes with the rounding
    floor and fails without it; the signature records the floor, the summary names it."""
    golden = np.zeros((8, 64), np.float32)
    r64 = np.zeros((8, 64))
    samples = np.zeros((ROUNDING_SAMPLES, 8, 64))
    samples[:, 3, 5] = np.linspace(-1e-3, 1e-3, ROUNDING_SAMPLES)
    candidate = golden.copy()
    candidate[3, 5] = 2e-3        # 2x the spread: within F = 4 times it
    without = analyze(candidate, golden, r64)
    within = analyze(candidate, golden, r64, rounding=samples)
    assert not peat.detect(without).passed
    assert peat.detect(within).passed, peat.detect(within).summary
    assert ("or the rounding floor (inputs perturbed at 1 ULP move the float64 result, or "
            f"{ROUNDING_SAMPLES} correct roundings") in peat.detect(within).summary
    assert isinstance(within.noise.rounding, RoundingFloor)
    assert within.noise.rounding.samples == ROUNDING_SAMPLES
    assert within.noise.rounding.max_spread == pytest.approx(1e-3)
    candidate[3, 5] = 8e-3        # 8x the spread
    assert not peat.detect(analyze(candidate, golden, r64, rounding=samples)).passed
    with pytest.raises(PeatError, match="rounding needs reference64"):
        analyze(candidate, golden, rounding=samples)
    with pytest.raises(PeatError, match=r"expected \(S, \*\(8, 64\)\)"):
        analyze(candidate, golden, r64, rounding=samples[:, :4])


@pytest.mark.parametrize("shape", [(16, 256), (24, 512)])   # in a bucket, and as it is
def test_a_rows_scale_is_the_largest_error_of_the_golden_and_the_samples(shape):
    """A cross-entropy-like gradient: per row one element near -1 (which the golden happens to
    round exactly) and small ones. A candidate off by half an ULP at 1 at one small element per
    row (rounding at the row's scale) fails against the golden's own row maxima and passes once
    the samples, which round the large element as a correct kernel may, set them; 10x that
    still fails."""
    rows, cols = shape
    rng = np.random.default_rng(0)
    r64 = rng.uniform(1e-6, 1e-4, shape)
    label = rng.integers(0, cols, rows)
    r64[np.arange(rows), label] = -(1 - 2.0 ** -15)      # a float32: the golden is exact there
    golden = r64.astype(np.float32)
    # each sample rounds every element once more, by up to half an ULP of float32 there
    ulp = np.spacing(np.abs(golden)).astype(np.float64)
    samples = r64[None] + rng.uniform(-0.5, 0.5, (ROUNDING_SAMPLES, *shape)) * ulp[None]
    away = (label + cols // 2) % cols
    for error, passes in ((0.5 * 2.0 ** -23, True), (5 * 2.0 ** -23, False)):
        candidate = golden.copy()
        candidate[np.arange(rows), away] += np.float32(error)
        assert not peat.detect(analyze(candidate, golden, r64)).passed
        d = peat.detect(analyze(candidate, golden, r64, rounding=samples))
        assert d.passed == passes, d.summary


def _online_cross_entropy(logits, labels, block: int = 256):
    """Cross-entropy with its log-sum-exp accumulated block by block over the vocabulary (a
    running maximum and a rescaled sum, as a fused kernel's forward walks it), differentiated
    by autodiff through the running maxima: their gradient terms cancel exactly, and in float32
    leave a rounding at the row's scale at each running maximum."""
    rows = logits.shape[0]
    m = jnp.full((rows,), -jnp.inf, logits.dtype)
    s = jnp.zeros((rows,), logits.dtype)
    for i in range(0, logits.shape[1], block):
        blk = logits[:, i:i + block]
        m_new = jnp.maximum(m, jnp.max(blk, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(blk - m_new[:, None]), axis=1)
        m = m_new
    return m + jnp.log(s) - jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_a_cross_entropy_differentiated_through_its_running_maxima_passes(seed):
    """Against optax's cross-entropy (16 x 4096 logits): its gradient's error, about an ULP at
    1 at each running maximum, is within the rows' rounding (the golden's row maxima alone, one
    lucky rounding of the label's p - 1, failed it on every seed); a gradient moved there by
    10x that still fails."""
    optax = pytest.importorskip("optax")
    logits = jax.random.normal(jax.random.key(seed), (16, 4096), jnp.float32)
    labels = jax.random.randint(jax.random.key(seed + 100), (16,), 0, 4096)

    def reference(x, y):
        return optax.softmax_cross_entropy_with_integer_labels(x, y)

    d = peat.check_kernel(jax.jit(_online_cross_entropy), jax.jit(reference), logits, labels,
                          seed=seed)
    assert d.passed, d.summary

    @jax.custom_vjp
    def nudged(x, y):
        return _online_cross_entropy(x, y)

    def fwd(x, y):
        return _online_cross_entropy(x, y), (x, y)

    def bwd(res, ct):
        x, y = res
        g = jax.vjp(lambda v: _online_cross_entropy(v, y), x)[1](ct)[0]
        return g + jnp.where(jnp.arange(x.shape[1]) == 7, 10 * 2.0 ** -23, 0.0), None

    nudged.defvjp(fwd, bwd)
    d = peat.check_kernel(jax.jit(nudged), jax.jit(reference), logits, labels, seed=seed)
    assert not d.passed, d.summary
    checks = {(v, o): m for v, o, m in d.evidence["checks"]}
    assert checks[("example", "grad[0]")] not in ("exact", "numerical_noise"), checks


def _in_order_matmul(accumulator):
    """A matmul that adds its K products one after another in `accumulator`'s dtype, as a GPU
    thread does in float32 (correct) or a kernel with a 16-bit accumulator does (a fault)."""
    def matmul(a, b):
        def step(k, acc):
            return (acc + jax.lax.dynamic_slice_in_dim(a, k, 1, 1) @
                    jax.lax.dynamic_slice_in_dim(b, k, 1, 0)).astype(accumulator)
        zeros = jnp.zeros((a.shape[0], b.shape[1]), accumulator)
        return jax.lax.fori_loop(0, a.shape[1], step, zeros)
    return matmul


@pytest.mark.parametrize("seed", [3, 4])
def test_a_matmul_summed_in_order_passes(seed):
    """Over K = 16384 its error is several times the reference's own (a tree's): only the
    rounding floor of an in-order sum tells it apart from a fault (on these seeds a floor of
    ~log2 K levels said `unstable_algorithm` and `unknown`)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((48, 16384)).astype(np.float32)
    b = rng.standard_normal((16384, 40)).astype(np.float32)
    d = peat.check_kernel(_in_order_matmul(jnp.float32), jnp.matmul, a, b, seed=seed, repeats=1,
                          backward=False)
    assert d.passed, d.summary


@pytest.mark.parametrize("seed", [0, 1])
def test_a_bfloat16_sum_in_order_is_not_within_the_floor(seed):
    """A bfloat16 matmul is accumulated in float32 by every backend: in order in bfloat16 it
    is a fault, which the rounding floor of its bfloat16 reference must not excuse."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, 1024)).astype(jnp.bfloat16)
    b = rng.standard_normal((1024, 8)).astype(jnp.bfloat16)
    d = peat.check_kernel(_in_order_matmul(jnp.bfloat16), jnp.matmul, a, b, seed=seed, repeats=1,
                          backward=False)
    assert not d.passed, d.summary


def _masked_scores(q, k):
    s = q @ k.T
    return jnp.where(jnp.tril(jnp.ones(s.shape, bool)), s, -jnp.inf)


def _attention(q, k, v):
    return jax.nn.softmax(_masked_scores(q, k), axis=-1) @ v


def _lse_attention(d_scale: float = 1.0):
    """Causal attention with FlashAttention-2's backward: P recomputed from the log-sum-exp,
    D = rowsum(dO * O), dS = P (dP - D); `d_scale` != 1 is a bug in D."""
    @jax.custom_vjp
    def attn(q, k, v):
        return fwd(q, k, v)[0]

    def fwd(q, k, v):
        s = _masked_scores(q, k)
        m = s.max(-1, keepdims=True)
        p = jnp.exp(s - m)
        denom = p.sum(-1, keepdims=True)
        o = (p @ v) / denom
        return o, (q, k, v, o, m + jnp.log(denom))

    def bwd(res, do):
        q, k, v, o, lse = res
        p = jnp.exp(_masked_scores(q, k) - lse)
        ds = p * (do @ v.T - jnp.sum(do * o, -1, keepdims=True) * d_scale)
        return ds @ k, ds.T @ q, p.T @ do

    attn.defvjp(fwd, bwd)
    return jax.jit(attn)


@pytest.mark.slow
def test_an_lse_attention_backward_passes_and_a_bug_in_it_fails():
    """Saturated causal rows (P one-hot) cancel exactly in dS = P (dP - D) in the reference:
    its own error there is 0, and the lse-based backward's rounding of D is beyond that floor.
    The rounding floor passes it; a 1.001x D fails."""
    rng = np.random.default_rng(1)
    q, k = ((rng.standard_normal((48, 16)) * 3).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((48, 16)).astype(np.float32)
    variants = ("example", "outliers")
    d = peat.check_kernel(_lse_attention(), jax.jit(_attention), q, k, v, variants=variants)
    # on the outliers variant P recomputed from the log-sum-exp carries a rounding at the scale
    # of the row's largest logit, shared by the row: the floor has it too (judge.rounding: a
    # quotient's operands' roundings drawn independently, a broadcast's once per row)
    assert d.passed, d.summary
    assert any(c.endswith("on example") for c in d.evidence.get("rounding_checks", [])), \
        d.evidence   # the rounding floor was needed
    # and is named alone for them: not as the problem's conditioning as well
    assert not set(d.evidence["rounding_checks"]) & set(d.evidence.get("conditioned_checks", []))
    bad = peat.check_kernel(_lse_attention(1.001), jax.jit(_attention), q, k, v,
                            variants=variants)
    assert not bad.passed, bad.summary


def test_a_softmax_over_huge_logits_has_a_floor_in_every_sample():
    """Over logits of ~1e18, s - max(s) rounds at its result's scale in every sample (the
    maximum is one of the row's own values: no order of operations mixes it into the sums that
    made them), so no sample overflows exp, and every one of them is a correct rounding."""
    logits = jnp.asarray((RNG.standard_normal((8, 16)) * 1e18).astype(np.float32))
    samples = np.asarray(rounding_samples(lambda s: jax.nn.softmax(s, axis=-1), (logits,), 0))
    assert np.isfinite(samples).all()
    r64 = _float64(lambda s: jax.nn.softmax(s, axis=-1), np.asarray(logits))
    assert np.allclose(samples, r64[None], atol=1e-6)


def test_check_kernel_differentiates_only_the_positions_asked_for():
    def loss(x, t):
        return jnp.mean(jnp.square(x - t))
    x, t = jnp.asarray(A[:4, :8]), jnp.asarray(B[:4, :8])
    d = peat.check_kernel(loss, loss, x, t, backward=(0,), variants="example", repeats=1)
    outputs = {c[1] for c in d.evidence["checks"]}
    assert "grad[0]" in outputs and "grad[1]" not in outputs, outputs
    both = peat.check_kernel(loss, loss, x, t, variants="example", repeats=1)
    assert {"grad[0]", "grad[1]"} <= {c[1] for c in both.evidence["checks"]}
    with pytest.raises(PeatError, match=r"argument\(s\) \[2\] hold no floats"):
        peat.check_kernel(loss, loss, x, t, backward=(2,))
    with pytest.raises(PeatError, match="a sequence of argument positions, got 'x'"):
        peat.check_kernel(loss, loss, x, t, backward="x")
    one = peat.check_kernel(loss, loss, x, t, backward=1, variants="example", repeats=1)
    assert {c[1] for c in one.evidence["checks"]} == {"forward", "grad[1]"}


def test_the_perturbations_are_uniform_and_independent_between_streams():
    """The uniforms every perturbation draws (`counter_random`: SplitMix64 over the element
    index): in [-1, 1), flat (a chi-square over 32 bins), independent between the substreams
    of consecutive equations and of two samples, and fixed by the stream."""
    n = 1 << 16
    with jax.enable_x64(True):
        sample0, sample1 = (substream(jnp.uint64(s), 0) for s in (0, 1))
        draws = np.asarray(jnp.stack([uniforms64(substream(sample0, 1), (n,)),
                                      uniforms64(substream(sample0, 2), (n,)),
                                      uniforms64(substream(sample1, 1), (n,))]))
        again = np.asarray(uniforms64(substream(sample0, 1), (256, n // 256)))
    assert draws.dtype == np.float64 and draws.min() >= -1.0 and draws.max() < 1.0
    np.testing.assert_array_equal(again.reshape(-1), draws[0])
    for d in draws:
        counts = np.histogram(d, bins=32, range=(-1, 1))[0]
        chi2 = ((counts - n / 32) ** 2 / (n / 32)).sum()
        assert chi2 < 70, chi2   # 31 degrees of freedom: p ~ 1e-4
    corr = np.corrcoef(draws)
    assert np.abs(corr[np.triu_indices(3, 1)]).max() < 0.02, corr
    assert len(np.unique(draws)) == draws.size
