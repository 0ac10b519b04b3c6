"""peat.analyze: exact bit-level statistics, noise floors, structure, pytrees, JSON."""
from __future__ import annotations

import dataclasses
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from compile_log import compiles

from peat_jax._src import analyzer as A
from peat_jax._src._jax import cache_size
from peat_jax._src.detector import detect
from peat_jax._src.analyzer import Signature, analyze
from peat_jax._src.analyzer.bucket import bucket_of
from peat_jax._src.errors import PeatError

TINY32 = np.float32(np.finfo(np.float32).smallest_subnormal)
SHAPE = (16, 32)   # most tests share one shape: one compile of the analysis


def _normal(seed: int, shape=SHAPE, dtype=np.float32, shift: float = 0.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) + shift).astype(dtype)


def _f32(values) -> np.ndarray:
    return np.asarray(values, np.float32)


def _bits32(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def _ulp_np(c: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Reference ULP distance in NumPy: bits to the monotonic line (-x -> -magnitude bits)."""
    def mono(x):
        u = x.view({2: np.uint16, 4: np.uint32}[x.itemsize]).astype(np.int64)
        sign = 1 << (8 * x.itemsize - 1)
        return np.where(u & sign, -(u & (sign - 1)), u)
    return np.abs(mono(c) - mono(g))


def _flip(x: np.ndarray, flat_index: int, bit: int) -> np.ndarray:
    """x with one bit of one element flipped (NumPy, any float dtype)."""
    y = np.array(x, copy=True)
    u = y.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[y.dtype.itemsize]).reshape(-1)
    u[flat_index] ^= u.dtype.type(1 << bit)
    return y


def test_identical_arrays_are_exact():
    g = _normal(0)
    s = analyze(g, g)
    assert isinstance(s, Signature)
    assert s.counts.mismatched == 0 and s.counts.significant == 0
    assert s.errors.max_ulp == 0 and s.errors.ulp_histogram[0] == g.size
    assert s.noise.kind == "dtype_bound"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_a_finite_candidate_where_the_reference_is_nan_in_float64_too_is_unjudged(dtype):
    """Where the golden is not finite, a finite candidate is judged by the float64 reference;
    where that is not finite either (a naive reference's inf / inf, or exp past float64's
    range), nothing judges it: unjudged, not significant."""
    dt = np.dtype(dtype)
    g64 = _normal(0).astype(np.float64)
    g = g64.astype(dt)
    c = g.copy()
    r = g.astype(np.float64)
    cases = {0: (np.nan, np.nan, 0.0),      # golden, float64 reference, candidate: unjudged
             1: (np.nan, np.nan, -3.0),     # unjudged
             2: (np.nan, 2.5, 2.5),         # the golden's own overflow: judged, within floor
             3: (np.inf, np.inf, 7.0),      # unjudged: the float64 result overflows too
             4: (np.nan, 1.0, 9.0),         # judged, significant
             5: (-np.inf, 3.0, 8.0)}        # judged, significant
    for i, (gi, ri, ci) in cases.items():
        g.flat[i], r.flat[i], c.flat[i] = gi, ri, ci
    sig = analyze(c, g, r)
    assert sig.counts.lost_nonfinite == 6
    assert sig.counts.unjudged == 3
    assert sig.counts.significant == 2
    d = detect(sig)
    assert not d.passed and d.evidence["unjudged"] == 3
    c.flat[4], c.flat[5] = 1.0, 3.0        # the judged elements right: it passes
    sig = analyze(c, g, r)
    assert (sig.counts.unjudged, sig.counts.significant) == (3, 0)
    d = detect(sig)
    assert d.passed and d.evidence["unjudged"] == 3
    assert analyze(c, g).counts.significant == 6     # without a reference every one counts


def test_ulp_distance_is_exact_across_zero_and_subnormals():
    # golden, candidate, expected ULP distance (integer line: -x maps to -bits(x)).
    g = _f32([0.0, TINY32, TINY32, 1.0, -TINY32, 0.0, np.finfo(np.float32).max, 1.0])
    c = _f32([TINY32, 2 * TINY32, -TINY32, np.nextafter(np.float32(1), np.float32(2)),
              TINY32, -0.0, np.inf, 2.0])
    want = [1, 1, 2, 1, 2, 0, 1, 1 << 23]
    for i, w in enumerate(want):
        s = analyze(c[i:i + 1], g[i:i + 1])
        assert s.errors.max_ulp == w, (i, s.errors.max_ulp)
        assert s.counts.mismatched == 1          # +0 vs -0 mismatches although 0 ULP apart
    s = analyze(c, g)
    hist = s.errors.ulp_histogram
    assert hist[0] == 1 and hist[1] == 4 and hist[2] == 2 and hist[24] == 1


def test_subnormals_are_seen_by_integer_bit_tests():
    """On XLA:CPU a jitted float compare treats subnormals as 0; the analyzer must not."""
    g = _f32([TINY32 * 5, 3e-39, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    c = _f32([TINY32 * 6, 3e-39, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    s = analyze(c, g)
    assert s.counts.mismatched == 1 and s.errors.max_ulp == 1
    assert s.counts.subnormal_golden == 2 and s.counts.subnormal_candidate == 2
    flushed = _f32([0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    s = analyze(flushed, g)
    assert s.counts.flushed == 2 and s.counts.significant_not_flushed == 0
    assert s.counts.subnormal_candidate == 0


@pytest.mark.parametrize("dtype,bit,klass", [(np.float32, 27, "exponent"),
                                              (np.float32, 3, "mantissa"),
                                              (ml_dtypes.bfloat16, 11, "exponent"),
                                              (np.float16, 15, "sign")])
def test_single_flip_found_at_the_right_element_and_bit(dtype, bit, klass):
    g = _normal(1, dtype=dtype, shift=3.0)
    c = _flip(g, 39, bit)
    s = analyze(c, g)
    assert s.counts.mismatched == 1
    assert s.bits.histogram[bit] == 1 and sum(s.bits.histogram) == 1
    assert s.bits.popcount_histogram[1] == 1
    assert getattr(s.bits, klass) == 1
    if s.counts.significant:
        assert s.worst[0].index == (1, 7) and s.worst[0].differing_bits == (bit,)
    assert s.errors.max_ulp == _ulp_np(c, g).max()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.float64])
def test_bit_histograms_count_every_position(dtype):
    """The bit histograms (summed eight bits at a time on the device) equal NumPy's counts:
    differing bits of the mismatched elements by position and by number, golden bits set among
    the finite ones, over a sample holding the whole leaf, non-finite elements included."""
    g = _normal(2, (40, 50), dtype)
    c = g.copy()
    flat_c, flat_g = c.reshape(-1), g.reshape(-1)
    width = np.dtype(dtype).itemsize * 8
    uint = {16: np.uint16, 32: np.uint32, 64: np.uint64}[width]
    rng = np.random.default_rng(3)
    for i in rng.choice(flat_c.size, 300, replace=False):     # 1-3 random bits per element
        bits = rng.choice(width, rng.integers(1, 4), replace=False)
        mask = sum(uint(1) << uint(b) for b in bits)
        flat_c[i:i + 1].view(uint)[0] ^= mask
    flat_g[[7, 8]] = [np.inf, np.nan]
    cb, gb = c.reshape(-1).view(uint), g.reshape(-1).view(uint)
    pos = np.arange(width, dtype=uint)
    differing = cb != gb
    finite = np.isfinite(c.reshape(-1)) & np.isfinite(g.reshape(-1))
    with jax.enable_x64(width == 64):     # a float64 leaf is analysed as one under x64
        s = analyze(c, g)
    assert s.counts.mismatched == differing.sum()
    per_bit = lambda words: ((words[:, None] >> pos) & uint(1)).sum(0).tolist()  # noqa: E731
    assert list(s.bits.histogram) == per_bit((cb ^ gb)[differing])
    assert list(s.bits.golden_bit_set) == per_bit(gb[finite])
    assert s.bits.finite == finite.sum()
    popcounts = ((cb ^ gb)[differing][:, None] >> pos & uint(1)).sum(1)
    assert list(s.bits.popcount_histogram) == np.bincount(popcounts, minlength=width + 1).tolist()


@pytest.mark.parametrize("leaf,narrow", [
    (np.float64, np.float32), (np.float64, np.float16), (np.float64, ml_dtypes.bfloat16),
    (np.float32, np.float16), (np.float32, ml_dtypes.bfloat16)])
def test_a_candidate_on_a_narrower_grid_is_read_as_one(leaf, narrow):
    """The candidate's trailing zero mantissa bits say which grid it lies on, also where that
    leaves more than 32 of a float64 mantissa's bits zero (a bfloat16 result: 45)."""
    g = _normal(4, (40, 50), leaf)
    with jax.enable_x64(leaf == np.float64):
        s = analyze(g.astype(narrow).astype(leaf), g)
    assert s.precision.candidate_grid_bits == np.finfo(narrow).nmant
    assert s.precision.golden_grid_bits == np.finfo(leaf).nmant


def test_a_float64_leafs_worst_elements_carry_float64_values():
    """Values and floors below float32's range (a float64 leaf at 1e-200) are reported as
    they are, not as float32's zeros."""
    g = _normal(6, (8, 16), np.float64) * 1e-200
    c = g.copy()
    c[3, 5] = g[3, 5] * 4 + 1e-200
    with jax.enable_x64(True):
        (w,) = analyze(c, g).worst
    assert w.index == (3, 5) and (w.candidate, w.golden) == (c[3, 5], g[3, 5])
    assert 0 < w.floor < abs(c[3, 5] - g[3, 5])


@pytest.mark.slow
def test_float64_noise_floor_passes_reduction_order_and_flags_bf16_inputs():
    a = jax.random.normal(jax.random.key(0), (16, 200))
    b = jax.random.normal(jax.random.key(1), (200, 32))
    g = a @ b
    other = sum(a[:, i:i + 8] @ b[i:i + 8] for i in range(0, 200, 8))   # another order
    with jax.enable_x64(True):
        r = np.asarray(np.asarray(a, np.float64) @ np.asarray(b, np.float64))
    s = analyze(other, g, r)
    assert s.noise.kind == "float64" and s.counts.mismatched > 0
    assert s.counts.significant == 0 and s.noise.distribution_ok
    assert s.noise.golden_max_abs_error > 0 and s.noise.golden_max_ulp_error > 0
    bf = (a.astype(jnp.bfloat16).astype(jnp.float32) @ b.astype(jnp.bfloat16).astype(
        jnp.float32))
    s = analyze(bf, g, r)
    assert s.counts.significant > 0.5 * s.counts.elements
    assert 5 <= s.precision.effective_mantissa_bits <= 10


def test_scale_invariance_near_zero_outputs():
    """A correct candidate passes and a zero candidate fails, whatever the magnitude."""
    rng = np.random.default_rng(2)
    g = rng.standard_normal((16, 32)).astype(np.float32)
    noisy = (g.view(np.uint32) + rng.integers(0, 2, g.shape).astype(np.uint32)).view(
        np.float32)                                   # 0 or 1 ULP off
    for scale in (1.0, 2.0 ** -100, 2.0 ** 60):
        gs, cs = (g * np.float32(scale)), (noisy * np.float32(scale))
        assert analyze(cs, gs).counts.significant == 0, scale
        z = analyze(np.zeros_like(gs), gs)
        assert z.counts.significant == gs.size and z.bits.candidate_zero == 1.0, scale


def test_structure_last_partial_block_rows():
    g = np.random.default_rng(3).standard_normal((100, 24)).astype(np.float32)
    c = g.copy()
    c[96:] += 10.0
    s = analyze(c, g)
    st = s.structure
    assert st.span[-2] == (96, 99) and st.rows_with_errors == 4 and st.n_full_rows == 4
    match = [m for m in st.blocks if m.axis == -2 and m.pattern == "last_block"]
    assert match and match[0].block == 32 and match[0].precision == 1.0
    assert match[0].recall == 1.0 and (match[0].start, match[0].stop) == (96, 100)


def test_structure_edges_and_period():
    g = _normal(4)
    c = g.copy()
    j = np.arange(SHAPE[1])
    edges = (j % 8 == 0) | (j % 8 == 7)
    c[:, edges] = 7.0
    st = analyze(c, g).structure
    assert st.period[-1] == 8
    best = [m for m in st.blocks if m.axis == -1 and m.pattern == "edges"][0]
    assert best.block == 8 and best.precision == 1.0 and best.recall == 1.0


def test_ratio_permutation_and_transpose():
    g = _normal(5)
    s = analyze(g * np.float32(2), g)
    assert s.ratio.constant and s.ratio.median == 2.0
    g = _normal(5, shape=(16, 16))
    s = analyze(g.T.copy(), g)
    assert s.permutation.is_transpose and s.permutation.is_permutation
    assert s.permutation.sorted_differ == 0
    swapped = np.concatenate([g[8:], g[:8]])
    s = analyze(swapped, g)
    assert s.permutation.is_permutation and not s.permutation.is_transpose


@pytest.mark.parametrize("shape", [SHAPE, (96, 1024)])   # in a bucket, and as it is
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_the_largest_errors_are_exact_beside_rare_values(dtype, shape):
    """The whole-leaf pass marks a rare element (subnormal or non-finite, in either operand) in
    place of its ULP distance, and the rare pass takes the largest distance again: an equal
    pair of subnormals, NaNs or infinities beside the errors leaves the largest ULP distance as
    it was (and a subnormal pair the largest floor ratio too)."""
    g = _normal(11, shape, np.float32)
    g += np.copysign(np.float32(0.5), g)    # no subnormal of its own
    c = (g * (1 + 1e-2 * _normal(12, shape))).astype(dtype)
    g = g.astype(dtype)
    g[0, 0] = c[0, 0] = 0
    base = analyze(c, g)
    assert base.errors.max_ulp == _ulp_np(c, g).max() > 1 and base.counts.subnormal_golden == 0
    for rare in (ml_dtypes.finfo(dtype).smallest_subnormal, np.nan, -np.inf):
        g2, c2 = g.copy(), c.copy()
        g2[0, 0] = c2[0, 0] = rare
        s = analyze(c2, g2)
        assert s.errors.max_ulp == base.errors.max_ulp, rare
        if rare == ml_dtypes.finfo(dtype).smallest_subnormal:
            assert s.counts.subnormal_golden == 1 and s.counts.subnormal_candidate == 1
            assert s.errors.max_floor_ratio == base.errors.max_floor_ratio
            assert s.counts.significant == base.counts.significant
        else:
            assert s.counts.nonfinite_golden == 1 and s.counts.nonfinite_candidate == 1


def test_large_leaf_is_sampled_but_counts_are_exact():
    g = np.random.default_rng(6).standard_normal((300, 400)).astype(np.float32)  # 120k > 16k
    c = _flip(_flip(_flip(g, 5, 30), 60_001, 29), 119_999, 28)
    s = analyze(c, g)
    assert s.errors.sampled and s.errors.sample_size == A.DEFAULT_SAMPLE_SIZE
    assert s.counts.mismatched == 3 and s.counts.significant == 3
    assert sorted(w.index for w in s.worst) == [(0, 5), (150, 1), (299, 399)]


def test_pytree_worst_leaf_and_json():
    g = {"a": np.ones(SHAPE, np.float32), "b": np.arange(1, 9, dtype=np.float32),
         "n": np.arange(3)}
    c = {"a": np.ones(SHAPE, np.float32), "b": np.arange(1, 9, dtype=np.float32) * 3,
         "n": np.arange(3)}
    s = analyze(c, g)
    assert len(s.leaves) == 3 and s.path == "['b']"
    assert [leaf.path for leaf in s.leaves] == ["['a']", "['b']", "['n']"]
    assert s.leaves[2].bits is None and s.leaves[2].counts.mismatched == 0
    d = s.to_dict()
    text = json.dumps(d, allow_nan=False)
    assert json.loads(text)["leaves"][1]["ratio"]["median"] == 3.0
    inf = analyze(_f32([np.inf] + [1.0] * 7), _f32([1.0] * 8)).to_dict()
    json.dumps(inf, allow_nan=False)


@pytest.mark.parametrize("golden_inf", [-np.inf, np.inf])
def test_a_nan_where_the_golden_is_infinite_makes_the_worst_leaf(golden_inf):
    # leaf "a" is wrong everywhere (3x); leaf "b" holds one NaN where the golden is infinite,
    # as a new non-finite value would: it is the leaf reported
    g = {"a": np.arange(1, 9, dtype=np.float32), "b": np.ones(SHAPE, np.float32)}
    g["b"][2, 3] = golden_inf
    c = {"a": g["a"] * 3, "b": g["b"].copy()}
    c["b"][2, 3] = np.nan
    s = analyze(c, g)
    assert s.path == "['b']" and s.counts.nan_for_infinite == 1
    assert s.leaves[0].counts.nan_for_infinite == 0


def test_one_compile_per_shape_and_dtype():
    g = _normal(7)
    before = cache_size(A.device.shape_program)
    for k in range(3):
        analyze(g + np.float32(k), g)
    assert cache_size(A.device.shape_program) <= before + 1


def test_a_small_leaf_on_a_cpu_runs_the_programs_compiled_at_level_0():
    """`shape_program` and `detail_program` compile at XLA's backend optimisation level 0 for a
    leaf of at most SMALL_LEAF elements (0.6 s against 1.0 s here, as fast at that size), and as
    XLA compiles by default for a larger one (level 0 runs a 16M-element leaf 30x slower)."""
    small, large = A.device.SMALL_LEAF, A.device.SMALL_LEAF + 1
    for program in (A.device.shape_program, A.device.detail_program):
        assert program.for_leaf(jnp.zeros((small,), jnp.float16)) is program.small
        assert program.for_leaf(np.zeros((small,), np.float16)) is program.small
        assert program.for_leaf(jnp.zeros((large,), jnp.float16)) is program.default
    shape = (3, 9, 9)   # square last axes: its own program, which no other test compiles
    before = [cache_size(p) for p in (A.device.shape_program.small,
                                      A.device.shape_program.default)]
    analyze(_normal(1, shape), _normal(2, shape))
    after = [cache_size(p) for p in (A.device.shape_program.small,
                                     A.device.shape_program.default)]
    assert [a - b for a, b in zip(after, before)] == [1, 0]


def test_a_passing_leaf_traces_no_detail_stage(monkeypatch):
    """A leaf without significant errors gets the detail stages' empty results from the host
    (`structure.no_detail`): no trace of `detail_program` (each held the GIL 0.2-0.3 s per new
    shape in a cold check, on its critical path), also where analyses on several threads
    (`check_kernel`'s) miss together; a failing leaf still runs the stages."""
    traced = []
    real = A.device.structure

    def counted(c, *args):
        traced.append(c.shape)
        return real(c, *args)

    monkeypatch.setattr(A.device, "structure", counted)
    g = _normal(5, (3, 5, 77))   # a shape (and bucket) no other test analyses
    start = threading.Barrier(3)

    def one(k):
        start.wait()
        return analyze(g, g)

    with ThreadPoolExecutor(3) as pool:
        sigs = list(pool.map(one, range(3)))
    assert traced == []
    assert all(s.counts.significant == 0 and s.worst == () for s in sigs)
    assert all(s.structure.full_rows == s.structure.full_cols == () for s in sigs)
    c = g.copy()
    c[1, 2, 3] = 7.0
    assert analyze(c, g).worst[0].index == (1, 2, 3)
    assert traced


@pytest.mark.parametrize("x64", [False, True])
def test_a_share_at_a_rules_threshold_reads_exactly_with_or_without_x64(x64):
    """The structure's shares are divided on the host from exact counts: 19 of 20 errors in one
    full row read 0.95 (float32 division read 0.94999999 without 64-bit types), which
    `operand_corruption`'s >= 0.95 names either way; 9 of 10 error rows each scaled by its own
    constant read 0.9 (float32 on both), which `wrong_scale`'s >= 0.9 names."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal((8, 19)).astype(np.float32)
    c = g.copy()
    c[2, :] += 3.0
    c[5, 7] += 3.0
    g2 = rng.standard_normal((32, 64)).astype(np.float32)
    c2 = g2.copy()
    for i in range(9):
        c2[i] *= 1.5 + 0.25 * i
    c2[9] += rng.standard_normal(64).astype(np.float32)
    with jax.enable_x64(x64):
        full, scaled = analyze(c, g), analyze(c2, g2)
    assert (full.counts.significant, full.structure.in_full_rows) == (20, 0.95)
    assert detect(full).model == "operand_corruption"
    assert (scaled.structure.rows_with_errors, scaled.ratio.rows_constant) == (10, 0.9)
    assert detect(scaled).model == "wrong_scale"


def test_a_row_with_one_large_value_shows_no_constant_ratio():
    """A row counts as scaled by its own constant only over two or more values with
    |g| >= rms(g): rows of one large value each (softmax-like) scaled by unrelated factors are
    not `wrong_scale` (every such row read constant, on its single value, before)."""
    rng = np.random.default_rng(1)
    g = np.full((20, 12), 0.01, np.float32)
    g[:, 3] = 1.0
    g += rng.uniform(0, 0.001, g.shape).astype(np.float32)
    c = g * rng.uniform(1.2, 1.5, g.shape).astype(np.float32)
    sig = analyze(c, g)
    assert (sig.structure.rows_with_errors, sig.ratio.n) == (20, 20)
    assert sig.ratio.rows_constant == 0.0
    assert detect(sig).model != "wrong_scale"


@pytest.mark.parametrize("dtype, shape, reference", [
    (np.float32, (67, 33), False), (np.float32, (300, 40), True),
    (ml_dtypes.bfloat16, (2, 24, 4, 16), True), (np.float16, (100,), False),
    (np.float64, (5, 7, 3), True)])
def test_the_host_empty_detail_is_what_the_detail_program_returns_without_errors(
        dtype, shape, reference):
    """`structure.no_detail` on the host (what a passing leaf gets) equals what the device's
    `detail_program` returns when the leaf has no significant error, in tree, dtypes, shapes
    and values, with and without 64-bit types (the stages' sums follow them)."""
    x64 = reference or dtype == np.float64
    with jax.enable_x64(x64):
        g = jnp.asarray(_normal(3, shape, dtype))
        r = jnp.asarray(np.asarray(g, np.float64)) if reference else None
        f = A.noise.analyzed_format(g.dtype)
        options = A.contract.Options(noise_factor=4.0, ulp_allowance=2.0, bound_coef=1e-5,
                                     sample_size=8192, blocks=(8, 16))
        stats, _, scales, _, row_cnt = A.device.shape_program(g, g, r, options)
        assert int(stats.whole.significant) == 0
        device = A.device.to_host(A.device.detail_program(
            g, g, r, scales, stats.whole.significant, stats.scales.rel_tol, row_cnt, options))
        host = A.structure.no_detail(shape, f, x64)
    assert jax.tree.structure(device) == jax.tree.structure(host)
    for d, h in zip(jax.tree.leaves(device), jax.tree.leaves(host)):
        assert (d.dtype, d.shape) == (h.dtype, h.shape)
        np.testing.assert_array_equal(d, h)


def test_small_shapes_share_one_compiled_program_and_large_ones_reuse_the_sample_program():
    analyze(_normal(8), _normal(9))
    shapes, samples = cache_size(A.device.shape_program), cache_size(A.device.sample_program)
    # the (128, 64) bucket, as SHAPE; N-D leaves by their 2-D view
    for shape in ((7, 3), (5, 40), (128, 64), (1, 1), (3, 4, 5), (2, 3, 4, 16)):
        analyze(_normal(1, shape), _normal(2, shape))
    assert cache_size(A.device.shape_program) == shapes
    for shape in ((3, 5, 5), (129, 64)):   # 3-D with square last axes; too many rows
        analyze(_normal(1, shape), _normal(2, shape))
    assert cache_size(A.device.sample_program) == samples
    assert cache_size(A.device.shape_program) == shapes + 2


@pytest.mark.parametrize("shape, bucketed", [
    ((5, 40), True), ((33, 33), True), ((2, 5, 40), True), ((2, 3, 4, 16), True),
    ((3, 8, 8), False),      # square last axes: the transpose check runs per leading slice
    ((2, 8, 16), False),     # a square 2-D view (16 x 16) whose leaf's last axes are not
    ((129, 64), False)])     # more rows than the bucket holds
def test_a_leaf_shares_a_bucket_where_its_analysis_needs_no_shape_of_its_own(shape, bucketed):
    assert (bucket_of(shape, np.float32, 8192) is not None) == bucketed


def _programs(names: list[str]) -> list[str]:
    """The analyzer's programs among compiled `names`, as "shape", "sample", "detail"."""
    return [m.group(1) for n in names if (m := re.fullmatch(r"(shape|sample|detail)_program", n))]


# a shape no other test analyses, in float16 with a float64 reference: new programs for each test
# (3-D with square last axes: no padded bucket)
_FRESH = {"concurrent": (3, 7, 7), "ahead": (2, 11, 11), "detail": (2, 13, 13)}


def test_concurrent_analyses_of_a_new_shape_compile_its_programs_once():
    shape = _FRESH["concurrent"]
    g = _normal(3, shape, np.float16)
    r = g.astype(np.float64)
    start = threading.Barrier(3)

    def one(k):
        start.wait()
        return analyze(g + np.float16(k), g, r)

    with compiles(all_threads=True) as names, ThreadPoolExecutor(3) as pool:
        sigs = list(pool.map(one, range(3)))
    # the two that differ have significant errors: the detail stages too, once
    assert sorted(_programs(names)) == ["detail", "sample", "shape"], names
    assert [s.counts.mismatched for s in sigs][0] == 0


def test_compile_ahead_builds_what_analyze_runs_for_those_shapes():
    shape = _FRESH["ahead"]
    with compiles(all_threads=True) as ahead:
        n = A.compile_ahead([jax.ShapeDtypeStruct(shape, jnp.float16)], reference64=True,
                            conditioning=True)
    assert n == 1 and sorted(_programs(ahead)) == ["sample", "shape"], _programs(ahead)
    g = _normal(4, shape, np.float16)
    with compiles(all_threads=True) as later:
        analyze(g, g, g.astype(np.float64), conditioning=np.zeros(shape))
    assert _programs(later) == []
    assert A.compile_ahead([jax.ShapeDtypeStruct((2,), jnp.int32)], reference64=True,
                           conditioning=True) == 0   # nothing to analyse as floats
    assert A.compile_ahead([jax.ShapeDtypeStruct((64, 64), jnp.float32)], reference64=False,
                           conditioning=False, max_elements=4095) == 0   # over the cap


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("reference", [False, True])
def test_detail_stages_are_built_and_run_only_for_a_leaf_with_significant_errors(
        dtype, reference, monkeypatch):
    """A leaf without significant errors (a correct kernel's) neither compiles nor runs the
    worst-element, structure and permutation stages (`device.detail_program`: about half of
    the statistics' compile time); what stands in for them is what their gated branch gives.
    The first failing leaf of a shape compiles them once."""
    shape = _FRESH["detail"]
    g = _normal(5, shape, dtype)
    r = g.astype(np.float64) if reference else None
    c = g.copy()
    c.reshape(-1)[17] = c.reshape(-1)[17] * 4 + 1
    calls = []
    real = A.api.leaf_stats
    monkeypatch.setattr(A.api, "leaf_stats", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    with compiles(all_threads=True) as passing:
        ok = analyze(g, g, r)
    with compiles(all_threads=True) as failing:
        bad = [analyze(c, g, r) for _ in range(2)]
    assert "shape" in _programs(passing) and "detail" not in _programs(passing), passing
    assert _programs(failing) == ["detail"], _programs(failing)
    assert ok.counts.significant == 0 and bad[0].counts.significant == 1
    assert [w.index for w in bad[0].worst] == [tuple(np.unravel_index(17, shape))]
    (c0, g0, r0, options, *rest), kwargs = calls[0]
    k0 = rest[0] if rest else None
    with jax.enable_x64(reference):
        stats, _, scales, _, rows = A.device.shape_program(c0, g0, r0, options, k0)
        ran = A.device.detail_program(c0, g0, r0, scales, stats.whole.significant,
                                      stats.scales.rel_tol, rows, options, k0)
        got = real(c0, g0, r0, options, *rest, **kwargs)
    as_lists = lambda t: jax.tree.map(lambda x: (np.asarray(x).dtype, np.asarray(x).tolist()), t)  # noqa: E731
    assert as_lists((got.worst, got.structure, got.permutation)) == as_lists(ran)


def _fields(d, path=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _fields(v, f"{path}.{k}")
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            yield from _fields(v, f"{path}[{i}]")
    else:
        yield path, d


def _same_signature(a: A.Signature, b: A.Signature) -> list:
    """The fields where `a` and `b` differ beyond float32 rounding of a sum."""
    fa, fb = dict(_fields(a.to_dict())), dict(_fields(b.to_dict()))
    assert fa.keys() == fb.keys()
    return [(k, fa[k], fb[k]) for k in fa
            if not (fa[k] == fb[k] or (isinstance(fa[k], float) and isinstance(fb[k], float) and
                                       (np.isnan(fa[k]) and np.isnan(fb[k]) or
                                        abs(fa[k] - fb[k]) <= 1e-5 * abs(fb[k]))))]


def _faulty(kind: str, g: np.ndarray) -> np.ndarray:
    c = g.copy()
    flat = c.reshape(-1)
    if kind == "one":
        flat[flat.size // 2] *= -4
    elif kind == "last_row":
        c.reshape(-1, g.shape[-1])[-1] = 0
    elif kind == "scale":
        c = g * np.asarray(3, g.dtype)
    elif kind == "transpose":
        c = g.T.copy()
    elif kind == "nan":
        flat[-1] = np.nan
    return c


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
@pytest.mark.parametrize("shape", [(7,), (1, 1), (5, 40), (33, 33), (3, 200), (2, 5, 40),
                                   (2, 3, 4, 16)])
def test_a_leaf_padded_into_its_bucket_has_the_signature_it_has_alone(shape, dtype,
                                                                      monkeypatch):
    from peat_jax._src.analyzer import api
    r = _normal(3, shape).astype(np.float64)
    g = np.asarray(jnp.asarray(r).astype(dtype))
    kinds = ["noise", "one", "last_row", "scale", "nan"] + (
        ["transpose"] if shape[0] == shape[-1] and len(shape) == 2 else [])
    for kind in kinds:
        c = (np.asarray((jnp.asarray(r) * (1 + 1e-3 * _normal(4, shape))).astype(dtype))
             if kind == "noise" else _faulty(kind, g))
        for ref, k in ((None, None), (r, np.abs(r) * 1e-7)):
            padded = analyze(c, g, ref, conditioning=k)
            with monkeypatch.context() as m:
                m.setattr(api, "bucket_of", lambda *_: None)
                alone = analyze(c, g, ref, conditioning=k)
            assert _same_signature(padded, alone) == [], (kind, ref is not None)
            assert detect(padded).model == detect(alone).model


_MOMENTS = ("bias_mean", "bias_std_error", "bias_t", "error_slope", "geo_mean_rel_significant")


@pytest.mark.slow
@pytest.mark.parametrize("with_reference", [False, True])
def test_padding_the_sample_changes_no_statistic(with_reference):
    # the whole leaf (512 elements) as its own sample, vs padded with equal NaNs to 8192
    g = _normal(11)
    c = (g.astype(np.float64) * (1 + 1e-6 * np.random.default_rng(3).standard_normal(SHAPE)))
    c = c.astype(np.float32)
    c[2, 5], c[7, 0], c[9, 31], c[0, 0] = -c[2, 5], np.nan, 0.0, np.inf
    r = k = None
    if with_reference:
        r = g.astype(np.float64) + 1e-8 * np.random.default_rng(4).standard_normal(SHAPE)
        k = np.abs(r) * 1e-7
    exact = analyze(c, g, r, conditioning=k, sample_size=g.size)
    padded = analyze(c, g, r, conditioning=k)
    assert exact.counts.significant >= 4    # the gated stages run too
    for field in ("counts", "bits", "noise", "ratio", "structure", "precision", "permutation",
                  "worst"):
        assert repr(getattr(padded, field)) == repr(getattr(exact, field)), field  # NaN == NaN
    e, p = exact.errors, padded.errors
    for name in _MOMENTS:   # float32 sums: the padding may change their order
        assert getattr(p, name) == pytest.approx(getattr(e, name), rel=1e-5, nan_ok=True), name
    unsummed = {n: 0.0 for n in _MOMENTS}
    assert repr(dataclasses.replace(p, **unsummed)) == repr(dataclasses.replace(e, **unsummed))


def test_errors_name_the_problem():
    g = np.zeros((3, 4), np.float32)
    with pytest.raises(PeatError, match="shape"):
        analyze(np.zeros((4, 3), np.float32), g)
    with pytest.raises(PeatError, match="dtype"):
        analyze(g.astype(np.float16), g)
    with pytest.raises(PeatError, match="structures"):
        analyze({"a": g}, {"b": g})
    with pytest.raises(PeatError, match="supports"):
        analyze(g.astype(ml_dtypes.float8_e4m3fn), g.astype(ml_dtypes.float8_e4m3fn))
    with pytest.raises(PeatError, match="reduction_length"):
        analyze(g, g, reduction_length=0)


def test_dtype_bound_is_documented_formula():
    a, coef = A.dtype_noise_bound(jnp.bfloat16, reduction_length=256)
    assert a == 1.0 and coef == pytest.approx(4 * 2.0 ** -23 * 16)
    a, coef = A.dtype_noise_bound(jnp.float32, reduction_length=1)
    assert a == 4.0 and coef == pytest.approx(4 * 2.0 ** -23)


@pytest.mark.parametrize("shape", [(64, 48), (8, 300), (3, 40, 24)])
@pytest.mark.parametrize("n_errors", [1, 5, 16, 17, 40])
def test_worst_elements_are_the_largest_errors(shape, n_errors):
    """The listed worst elements are the largest errors, worst first, wherever they sit: every
    one of them when at most 16 (found from the rows the whole-leaf pass counted), the top 16
    otherwise (rows ranked by a second pass)."""
    rng = np.random.default_rng(n_errors)
    g = rng.uniform(1.0, 2.0, shape).astype(np.float32)
    c = g.copy()
    flat = rng.choice(g.size, size=n_errors, replace=False)
    sizes = (1.0 + np.arange(n_errors)) * 1e-2           # distinct, each far beyond the floor
    c.reshape(-1)[flat] += sizes.astype(np.float32)
    s = analyze(c, g)
    assert s.counts.significant == n_errors
    expected = [np.unravel_index(i, shape) for i in flat[np.argsort(-sizes)][:16]]
    assert [w.index for w in s.worst] == [tuple(int(x) for x in e) for e in expected]


def test_empty_leaves_are_a_clear_error():
    with pytest.raises(PeatError, match=r"are empty \(shape \(0, 3\)\): nothing to analyze"):
        analyze(np.ones((0, 3), np.float32), np.ones((0, 3), np.float32))
