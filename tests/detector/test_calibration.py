"""Calibration of the detector: every fault of `peat_jax._src.faults`, applied to a correct op, is
diagnosed as its own model (the confusion matrix of injected x detected model has an empty
off-diagonal), over float32 / bfloat16 / float16 and several shapes; correct alternatives
(another reduction order, jax's shipped Pallas layer_norm and attention in interpret mode) pass.

Run with ``-s`` to see the confusion matrix.
"""
from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import needs
import numpy as np
import pytest
from jax import lax

from peat_jax._src import faults as F
from peat_jax._src.analyzer import analyze
from peat_jax._src.check import check_kernel
from peat_jax._src.detector import MODELS, detect
from peat_jax._src.kernels import blocked_matmul, references
from peat_jax._src.sites import Site

DN = (((1,), (0,)), ((), ()))

# A fault's name is the model it emulates, except stuck_at, which the detector reports as
# bit_flip (pattern "stuck_at"): see peat_jax._src.detector.
EXPECTED = {"stuck_at": "bit_flip"}


def matmul(a, b):
    return lax.dot_general(a, b, DN)


def _dot_site(a, b):
    return Site(0, "dot_general", "", "fwd", (a.shape, b.shape), (a.dtype, b.dtype),
                ((a.shape[0], b.shape[1]),), (a.dtype,),
                params={"dimension_numbers": DN, "precision": None,
                        "preferred_element_type": a.dtype})


def _sum_site(x):
    return Site(0, "reduce_sum", "", "fwd", (x.shape,), (x.dtype,), ((x.shape[0],),),
                (x.dtype,), params={"axes": (1,)})


def _fault_list(dtype, out_shape, op: str):
    """(fault, label) pairs for one op: every constructor of peat.faults at least once where it
    applies (precision faults only where the dtype has a narrower format below it)."""
    bits, nmant = jnp.finfo(dtype).bits, jnp.finfo(dtype).nmant
    m, n = (1, out_shape[0]) if len(out_shape) == 1 else out_shape
    fs = [
        F.bit_flip(bit_class="exponent"), F.bit_flip(bit=nmant - 2), F.bit_flip(bit=bits - 1),
        F.multi_bit_flip(), F.multi_bit_flip(bits=(nmant - 1, nmant - 3)),
        F.random_value(), F.random_value(count=4),
        F.zeroed(0.25), F.zeroed(1.0),
        F.stuck_at(bit=nmant - 1, value=1), F.stuck_at(bit=nmant - 2, value=0, fraction=0.5),
        F.wrong_scale(1.5), F.wrong_scale(0.5),
        F.sign_flip(), F.sign_flip(0.2),
        F.tile_boundary(8, mode="zero"), F.nan_inf(), F.nan_inf("-inf", count=3),
    ]
    # Tile faults need the axis longer than the block (else the "tile" is the whole axis).
    if n > 32:
        fs += [F.tile_boundary(32), F.tile_boundary(16, where="edges")]
    if len(out_shape) == 2:
        if m > 32:
            fs.append(F.tile_boundary(32, axis=0))
        fs += [F.permuted_layout("tile_swap", block=8), F.operand_corruption(0, axis=0)]
        if m == n:
            fs.append(F.permuted_layout("transpose"))
    if op == "matmul":
        # Exponent MSB stuck at 1: selective only where outputs span |x| < 2 and |x| >= 2.
        fs += [F.operand_corruption(1, axis=1), F.stuck_at(bit=bits - 2, value=1)]
    if op in ("matmul", "sum"):
        if dtype == jnp.float32:
            fs += [F.reduced_precision("bf16"), F.reduced_precision("tf32"),
                   F.reduced_precision("fp16", where="output"),
                   F.low_precision_accumulation("bf16"),
                   F.low_precision_accumulation("fp16", chunk=4)]
        elif dtype == jnp.float16:
            fs += [F.reduced_precision("bf16"), F.reduced_precision("bf16", where="output"),
                   F.low_precision_accumulation("bf16"),
                   F.low_precision_accumulation("fp16", chunk=4)]
        else:  # bfloat16: no narrower format to truncate to; accumulation in bf16 itself
            fs += [F.low_precision_accumulation("bf16", chunk=4)]
    elif dtype == jnp.float32:
        fs += [F.reduced_precision("bf16", where="output")]
    return fs


def _case(op: str, dtype, shape, seed=0):
    """(reference fn, operands, site, golden, float64 reference)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    if op == "matmul":
        m, k, n = shape
        ops = (jax.random.normal(k1, (m, k)).astype(dtype),
               jax.random.normal(k2, (k, n)).astype(dtype))
        fn, site = matmul, _dot_site(*ops)
    elif op == "sum":
        ops = (jax.random.normal(k1, shape).astype(dtype),)
        fn, site = (lambda x: jnp.sum(x, axis=1)), _sum_site(ops[0])
    else:  # elementwise
        ops = (jax.random.normal(k1, shape).astype(dtype),)
        fn, site = jnp.tanh, None
    golden = fn(*ops)
    with jax.enable_x64(True):
        ref64 = np.asarray(fn(*(np.asarray(o, np.float64) for o in ops)))
    return fn, ops, site, golden, ref64


CONFIGS = [
    ("matmul", jnp.float32, (72, 100, 72)),    # square (transpose), not divisible by 16..128
    ("matmul", jnp.bfloat16, (64, 128, 40)),
    ("matmul", jnp.float16, (40, 96, 64)),
    ("elementwise", jnp.float32, (24, 80)),
    ("sum", jnp.float32, (72, 256)),           # reduce_sum site, 1-D output
]
SLOW_CONFIGS = [
    ("matmul", jnp.float32, (40, 64, 100)),
    ("matmul", jnp.float32, (100, 200, 72)),
    ("matmul", jnp.bfloat16, (48, 200, 48)),
    ("matmul", jnp.float16, (64, 256, 48)),
    ("elementwise", jnp.bfloat16, (32, 48)),
    ("elementwise", jnp.float16, (40, 64)),
    ("sum", jnp.float16, (40, 192)),
    ("sum", jnp.bfloat16, (48, 128)),
]


def _two_halves(a, b):
    """A correct matmul in another summation order: two half-length products accumulated in
    float32, added, rounded once to the output dtype (as XLA's dot)."""
    k = a.shape[1] // 2
    dot = functools.partial(lax.dot_general, dimension_numbers=DN,
                            preferred_element_type=jnp.float32)
    return (dot(a[:, :k], b[:k]) + dot(a[:, k:], b[k:])).astype(a.dtype)


# The faults' programs compile without LLVM's optimisations: ~40% less compile time (the
# calibration's largest cost), the same arithmetic (XLA:CPU does not allow fast math), and the
# arrays are small.
_QUICK_COMPILE = {"xla_backend_optimization_level": 0}


def _run(configs, noisy: bool = False):
    """Apply every fault of every config; return [(label, injected, expected, detected,
    summary)]. The faults run inside one jitted function per config, with the golden output
    computed in the same function (as they run inside a jitted train step). With `noisy`, the
    faults corrupt a correct candidate that differs from the golden by rounding (a matmul in
    another summation order), as a faulty kernel would, instead of the golden itself."""
    rows = []
    for op, dtype, shape in configs:
        fn, ops, site, _, ref64 = _case(op, dtype, shape)
        base = _two_halves if noisy else fn
        out_shape = tuple(jax.eval_shape(fn, *ops).shape)
        fault_list = _fault_list(dtype, out_shape, op)

        def apply_all(ops):
            return fn(*ops), [f.apply(base, ops, jax.random.key(i + 1), site)
                              for i, f in enumerate(fault_list)]

        golden, candidates = jax.jit(apply_all).lower(ops).compile(_QUICK_COMPILE)(ops)
        for fault, cand in zip(fault_list, candidates):
            d = detect(analyze(cand, golden, ref64))
            label = (f"{op} {jnp.dtype(dtype).name}{list(shape)} {F.describe(fault)}"
                     f"{' on a noisy candidate' if noisy else ''}")
            rows.append((label, fault.name, EXPECTED.get(fault.name, fault.name), d.model,
                         d.summary))
    return rows


def _extra_rows(configs, by_hand: int = 2):
    """Models no fault emulates, injected by hand on the same configs: exact (the golden
    itself), numerical_noise (the matmul in another summation order), and on the first
    `by_hand` configs flush_to_zero (subnormal outputs set to 0) and nondeterministic (a second
    run that differs beyond the floor; these two compare without a float64 reference)."""
    rows = []
    for n_config, (op, dtype, shape) in enumerate(configs):
        fn, ops, _, golden, ref64 = _case(op, dtype, shape)
        name = f"{op} {jnp.dtype(dtype).name}{list(shape)}"
        cases = [("exact", golden, golden, ref64, "golden")]
        if op == "matmul":
            other = blocked_matmul(16)(*ops, dimension_numbers=DN)
            same = np.array_equal(np.asarray(other).view(np.uint8),
                                  np.asarray(golden).view(np.uint8))
            cases.append(("exact" if same else "numerical_noise", other, golden, ref64,
                          "golden"))
        g = np.array(golden, copy=True).reshape(-1)
        tiny = np.asarray(jnp.finfo(dtype).smallest_normal, g.dtype)
        g[:16] = (tiny.astype(np.float64) * np.linspace(0.1, 0.9, 16)).astype(g.dtype)
        flushed = g.copy()
        flushed[:16] = 0
        run2 = np.array(golden, copy=True).reshape(-1)
        run2[::50] = (run2[::50].astype(np.float32) * 1.01).astype(run2.dtype)
        if n_config < by_hand:
            cases.append(("flush_to_zero", flushed.reshape(golden.shape),
                          g.reshape(golden.shape), None, "golden"))
            cases.append(("nondeterministic", run2.reshape(golden.shape), golden, None,
                          "repeat"))
        for model, cand, gold, r, comparison in cases:
            d = detect(analyze(cand, gold, r, comparison=comparison))
            rows.append((f"{name} {model} (by hand)", model, model, d.model, d.summary))
    return rows


def _confusion(rows) -> str:
    """The confusion matrix as text: one row per injected model, columns numbered (legend
    below), "." for zero."""
    injected = sorted({r[1] for r in rows})
    detected = sorted({r[3] for r in rows} | {EXPECTED.get(i, i) for i in injected})
    counts = collections.Counter((r[1], r[3]) for r in rows)
    lines = [f"{'injected / detected':28s}" + "".join(f"{j + 1:>4d}" for j in range(len(detected)))]
    for i in injected:
        lines.append(f"{i:28s}" + "".join(f"{(counts[(i, m)] or '.')!s:>4s}" for m in detected))
    lines.append("columns: " + ", ".join(f"{j + 1} {m}" for j, m in enumerate(detected)))
    return "\n".join(lines)


def _assert_diagonal(rows):
    print("\n" + _confusion(rows))
    wrong = [f"{label}: expected {exp}, got {got}: {summary}"
             for label, _, exp, got, summary in rows if got != exp]
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_every_fault_is_diagnosed_as_its_own_model():
    rows = _run(CONFIGS)
    required = {"wrong_scale": {"factor": 2.0}, "stuck_at": {"bit": 1}}
    every = {getattr(F, n)(**required.get(n, {})).name for n in F.ALL}
    assert {r[1] for r in rows} == every, "a fault constructor is not calibrated"
    rows += _extra_rows(CONFIGS)
    assert {r[2] for r in rows} <= set(MODELS)
    _assert_diagonal(rows)


@pytest.mark.slow
def test_every_fault_is_diagnosed_more_shapes():
    """More shapes and dtypes, and every fault on top of a correct candidate that differs from
    the golden by rounding (a kernel with another summation order that is also faulty)."""
    matmuls = [c for c in CONFIGS + SLOW_CONFIGS if c[0] == "matmul"]
    _assert_diagonal(_run(SLOW_CONFIGS) + _extra_rows(SLOW_CONFIGS, by_hand=len(SLOW_CONFIGS))
                     + _run(matmuls, noisy=True))


# ----------------------------------------------------------------------------------------------
# Correct alternatives pass

def _passes(d):
    assert d.model in ("exact", "numerical_noise") and d.passed, d.summary


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_blocked_matmul_passes(dtype):
    kernel = blocked_matmul(16)
    # Square operands: the output and both gradients share one shape (one compile).
    a = jax.random.normal(jax.random.key(0), (48, 48)).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (48, 48)).astype(dtype)
    d = check_kernel(lambda a, b: kernel(a, b, dimension_numbers=DN), matmul, a, b,
                     variants=("example", "outliers", "tiny"), repeats=1)
    _passes(d)


@pytest.mark.slow
def test_reduction_in_another_order_passes():
    x = jax.random.normal(jax.random.key(0), (48, 300))

    def chunked(x):             # 10 partial sums of 30, added one after the other
        parts = x.reshape(x.shape[0], 10, 30).sum(-1)
        return lax.fori_loop(0, 10, lambda i, acc: acc + parts[:, i],
                             jnp.zeros(x.shape[0], x.dtype))

    def pairwise(x):
        while x.shape[1] > 1:
            if x.shape[1] % 2:
                x = jnp.concatenate([x, jnp.zeros((x.shape[0], 1), x.dtype)], axis=1)
            x = x[:, 0::2] + x[:, 1::2]
        return x[:, 0]

    def sequential(x):          # one addition after the other
        return lax.fori_loop(0, x.shape[1], lambda i, acc: acc + x[:, i],
                             jnp.zeros(x.shape[0], x.dtype))

    ref = functools.partial(jnp.sum, axis=1)
    opts = dict(variants=("example", "outliers"), backward=False, repeats=1)
    _passes(check_kernel(chunked, ref, x, **opts))
    _passes(check_kernel(pairwise, ref, x, **opts))
    # 300 terms: the median ULP error is ~3x XLA's, the 99th percentile and max are below it.
    _passes(check_kernel(sequential, ref, x, **opts))
    # 3000 terms: every quantile 7-10x XLA's, an in-order sum's rounding (a GPU thread adds a
    # matmul's K products so): within the rounding floor, whose float32 sums round at K / 3
    # levels
    long = jax.random.normal(jax.random.key(0), (48, 3000))
    _passes(check_kernel(sequential, ref, long, **opts))


@pytest.mark.slow
@needs.skip_unless(needs.pallas_op("layer_norm"))
def test_pallas_layer_norm_interpret_passes():
    from jax.experimental.pallas.ops.gpu import layer_norm as pln

    ref = functools.partial(references.layer_norm, eps=1e-5)  # jax's kernel's default eps
    x = jax.random.normal(jax.random.key(2), (2, 16, 128))
    w = 1 + 0.1 * jax.random.normal(jax.random.key(3), (128,))
    b = 0.1 * jax.random.normal(jax.random.key(4), (128,))
    d = check_kernel(lambda x, w, b: pln.layer_norm(x, w, b, interpret=True), ref, x, w, b,
                     variants=("example",), repeats=1)
    _passes(d)
    assert ["example", "grad[0]", "numerical_noise"] in d.evidence["checks"]


@pytest.mark.slow
@needs.skip_unless(needs.pallas_op("attention"))
def test_pallas_attention_interpret_passes():
    from jax.experimental.pallas.ops.gpu import attention as patt

    bsz, t, h, dh = 1, 64, 2, 32
    q, k, v = (jax.random.normal(key, (bsz, t, h, dh))
               for key in jax.random.split(jax.random.key(0), 3))
    blocks = patt.BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_kv_dkv=32,
                             block_q_dq=32, block_kv_dq=32)

    def cand(q, k, v):
        return patt.mha(q, k, v, None, sm_scale=dh ** -0.5, block_sizes=blocks, interpret=True)

    def ref(q, k, v):
        return patt.mha_reference(q, k, v, None, sm_scale=dh ** -0.5)

    _passes(check_kernel(cand, ref, q, k, v, variants=("example",), repeats=1))
