"""Cost of `peat.analyze` against the cheapest possible comparison.

analyze_ratio: median wall time of `analyze(candidate, golden)` (the public call: device-side
  statistics, the summary's transfer and the host-side Signature) over the median time of a bare
  jitted ``max(|candidate - golden|)`` on the same pair, timed in the same run, interleaved
  (one of each per round, 41 rounds). The pair: 16M float32 elements (4096 x 4096), the
  candidate the golden moved by 0 or +-1 ULP per element (a correct kernel with another
  rounding). Goal <= 3 (<= 1.3 the next).
analyze_ratio_with_errors: the same with 3 elements bit-flipped as well, so the gated stages (worst
  elements, spatial structure) run too.
first_check_s: wall time of a cold ``peat check pallas_matmul`` in a fresh subprocess (jax's
  import included, peat's persistent compilation cache off: ``PEAT_CACHE_DIR=off``), the median
  of 3 such processes (each in first_check_runs_s). Goal < 8.
second_shape_s: in one fresh process, after that check, a second one on other shapes
  (``--shapes 40x24,24x56``): what an author pays per new shape; the median of 3 processes
  (each in second_shape_runs_s; the split below is per process, then the median). Goal < 1.
second_shape_kernel_compile_s: of that, the seconds XLA spent compiling the kernel itself (the
  jitted Pallas matmul, interpreted: its forward and backward at the new shapes and at their
  odd variant, one program (`candidate_vjp_pair`) for small inputs, else one each
  (`candidate_vjp`)), read from jax's compile log: the author's own cost.
second_shape_kernel_s: the same programs' tracing, lowering to MLIR and XLA compilation (the
  kernel's whole cost to be built at a new shape; the Pallas interpreter's lowering is most of
  the part that is not XLA's); second_shape_peat_s: second_shape_s less that, what peat itself
  adds per new shape (the reference's programs, the analyzer, the detector, the report).
first_check_compiles, second_shape_compiles: the analyzer's programs each compiled (the sizes
  of the jit caches of `shape_program` and `sample_program`, read through
  `peat_jax._src._jax.cache_size`): small leaves share a padded bucket's program, so a new small
  shape compiles none.
allclose_first_s: the allclose test an author would write instead of the check, cold: a fresh
  process in the cold check's environment (``PEAT_CACHE_DIR=off``; nothing turns jax's
  persistent compilation cache on) that imports jax and peat_jax, builds the same kernel
  (``peat_jax._src.kernels.pallas_matmul()`` at a float32 ``dot_general`` of 67x45 by 45x33, as
  ``peat check pallas_matmul`` does), runs one jitted forward and backward (``jax.vjp``, a random
  cotangent) of it and of the reference (``jnp.matmul`` at precision "highest") and
  ``np.testing.assert_allclose`` on the output and both gradients (rtol = atol = 1e-5): the
  process's wall time less its second and odd shapes below; the median of 3 processes (each in
  allclose_first_runs_s).
allclose_second_shape_s: in the same process, the same test at the second shape's shapes (40x24
  by 24x56), timed alone; the median of 3 (each in allclose_second_shape_runs_s).
allclose_both_shapes_s: that, and then the same test at the check's odd_shape variant of those
  shapes (43x27 by 27x59), timed together: the allclose tests of the two shapes the check builds
  the kernel at (its coverage); the median of 3.
port_check_s: a cold `check_kernel` of a plain (un-jitted) port, attention written by hand on
  [batch, length, heads, head_dim] operands (2 x 24 x 4 x 16, float32), against a plain library
  function, ``flax.linen.dot_product_attention``, in a fresh process, import included, as
  `first_check_s` (median of 3: port_check_runs_s); port_allclose_s: the allclose test of the
  same pair (one jitted forward and backward of each, ``assert_allclose`` at 1e-5), the same
  way; port_check_ratio: the first over the second (the kernel author's loop for a port).
first_check_ratio: first_check_s over allclose_first_s. Goal <= 1.5, the rounding floor of the
  detector-truth issue included (that issue's own bound: the rounding floor keeps it <= 2.2).
second_shape_ratio: second_shape_s over allclose_second_shape_s. Goal <= 1.5.
second_shape_ratio_both_shapes: second_shape_s over allclose_both_shapes_s (the same coverage).

The three kinds of process (cold check, second shape, allclose) run interleaved: one of each per
round, their order rotated from round to round (the cold check and the allclose test alternate
which runs first), 3 rounds (``--samples``); the ratios are of the medians.

Prints one JSON object on one line. Runs with no arguments in about 75 s on 2 CPU cores shared
with another job (``--no-check`` skips the check timings and the allclose baselines).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

import peat_jax._src.analyzer as analyzer


def _pair(n_side: int, seed: int = 0):
    key_g, key_n = jax.random.split(jax.random.key(seed))
    golden = jax.random.normal(key_g, (n_side, n_side), jnp.float32)
    step = jax.random.randint(key_n, (n_side, n_side), -1, 2, jnp.int32)
    bits = jax.lax.bitcast_convert_type(golden, jnp.int32) + step
    candidate = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jax.block_until_ready(candidate), jax.block_until_ready(golden)


def _with_flips(candidate):
    bits = jax.lax.bitcast_convert_type(candidate, jnp.uint32).reshape(-1)
    for idx, bit in ((5, 30), (1_000_003, 27), (bits.shape[0] - 7, 31)):
        bits = bits.at[idx].set(bits[idx] ^ jnp.uint32(1 << bit))
    return jax.block_until_ready(jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(
        candidate.shape))


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def _interleaved(a, b, args, repeats: int) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(_timed(a, *args))
        tb.append(_timed(b, *args))
    return statistics.median(ta), statistics.median(tb)


_SECOND_SHAPE = r"""
import json, logging, re, time
import jax
from peat_jax._src import _jax, cli
from peat_jax._src.analyzer import device
KERNEL = ("candidate", "candidate_vjp", "candidate_vjp_pair")
STAGE = re.compile(r"Finished (tracing (\w+) for jit|jaxpr to MLIR module conversion "
                   r"jit\((\w+)\)|XLA compilation of jit\((\w+)\)) in ([0-9.e-]+) sec")
kernel = {"compile": 0.0, "all": 0.0}   # seconds spent on KERNEL's programs
class Compiles(logging.Handler):
    def emit(self, record):
        m = STAGE.match(record.getMessage())
        if m and (m.group(2) or m.group(3) or m.group(4)) in KERNEL:
            kernel["all"] += float(m.group(5))
            kernel["compile"] += float(m.group(5)) if m.group(4) else 0.0
def programs():
    return _jax.cache_size(device.shape_program) + _jax.cache_size(device.sample_program)
cli.main(["check", "pallas_matmul", "--json"])
first = programs()
jax.config.update("jax_log_compiles", True)
log = logging.getLogger("jax")
log.addHandler(Compiles()); log.setLevel(logging.WARNING); log.propagate = False
t0 = time.perf_counter()
cli.main(["check", "pallas_matmul", "--json", "--shapes", "40x24,24x56"])
print(json.dumps({"second_shape_s": time.perf_counter() - t0, "first_check_compiles": first,
                  "second_shape_compiles": programs() - first,
                  "second_shape_kernel_compile_s": kernel["compile"],
                  "second_shape_kernel_s": kernel["all"]}))
"""


def _fresh(args: list[str], failing_is_an_error: bool = False) -> tuple[float, str]:
    """(wall seconds, stdout) of a fresh Python process running `args`, with peat's persistent
    compilation cache off (a cold start); a RuntimeError where it fails (exit 1, a check's
    failing verdict, too with `failing_is_an_error`)."""
    env = dict(os.environ, PEAT_CACHE_DIR="off")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode not in ((0,) if failing_is_an_error else (0, 1)):
        raise RuntimeError(f"{args} failed:\n{done.stderr[-2000:]}")
    return wall, done.stdout


# The allclose test an author would write instead of `peat check pallas_matmul` (the same kernel,
# shapes and dtype as cmd_check's), then the same test at the second shape's shapes.
_ALLCLOSE = r"""
import json, sys, time
import jax
import jax.numpy as jnp
import numpy as np
import peat_jax
kernel = peat_jax._src.kernels.pallas_matmul()
dims = (((1,), (0,)), ((), ()))
def forward_backward(fn):
    @jax.jit
    def run(a, b, cotangent):
        out, vjp = jax.vjp(fn, a, b)
        return (out, *vjp(cotangent))
    return run
candidate = forward_backward(lambda a, b: kernel(a, b, dimension_numbers=dims, precision=None,
                                                 preferred_element_type=jnp.float32))
reference = forward_backward(lambda a, b: jnp.matmul(a, b, precision="highest"))
def test(m, k, n, seed):
    rng = np.random.default_rng(seed)
    a, b, cotangent = (rng.standard_normal(s, np.float32) for s in ((m, k), (k, n), (m, n)))
    for got, want in zip(candidate(a, b, cotangent), reference(a, b, cotangent)):
        try:
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        except AssertionError as e:   # exit 2: _fresh takes 1 for a check's failing verdict
            print(f"the allclose baseline failed at {m}x{k},{k}x{n}: {e}", file=sys.stderr)
            sys.exit(2)
test(67, 45, 33, 0)
t0 = time.perf_counter()
test(40, 24, 56, 1)
t1 = time.perf_counter()
test(43, 27, 59, 2)   # the check's odd_shape variant of the second shape (here each d -> d + 3)
print(json.dumps({"second_shape_s": t1 - t0, "odd_shape_s": time.perf_counter() - t1}))
"""


# A plain port checked against a plain library function (argv[1] "check"), or the allclose test
# of the same pair ("allclose").
_PORT = r"""
import sys
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import peat_jax
def attention(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)
q, k, v, ct = (np.random.default_rng(i).standard_normal((2, 24, 4, 16), np.float32)
               for i in range(4))
if sys.argv[1] == "check":
    d = peat_jax.check_kernel(attention, nn.dot_product_attention, q, k, v)
    sys.exit(0 if d.passed else 1)
def forward_backward(fn):
    @jax.jit
    def run(q, k, v, ct):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(ct))
    return run
for got, want in zip(forward_backward(attention)(q, k, v, ct),
                     forward_backward(nn.dot_product_attention)(q, k, v, ct)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
"""


def port_checks(samples: int) -> dict:
    """port_check_s, port_allclose_s and their ratio (see the docstring): medians over
    `samples` fresh processes of each, interleaved, the order alternating."""
    checks, allclose = [], []
    for i in range(samples):
        for kind in (("check", "allclose") if i % 2 == 0 else ("allclose", "check")):
            wall, _ = _fresh(["-c", _PORT, kind], failing_is_an_error=True)
            (checks if kind == "check" else allclose).append(wall)
    check, baseline = statistics.median(checks), statistics.median(allclose)
    return {"port_check_s": round(check, 2), "port_check_runs_s": [round(t, 2) for t in checks],
            "port_allclose_s": round(baseline, 2),
            "port_allclose_runs_s": [round(t, 2) for t in allclose],
            "port_check_ratio": round(check / baseline, 2)}


def first_checks(samples: int) -> dict:
    """first_check_s, second_shape_s, the analyzer's compiles in each and the allclose baseline
    (see the docstring): the medians over `samples` fresh processes of each kind (one cold
    process is one noisy sample: +-15% here from run to run), run interleaved: one of each kind
    per round, the order rotated from round to round."""
    firsts, seconds, allclose = [], [], []

    def first_check():
        firsts.append(_fresh(["-m", "peat_jax", "check", "pallas_matmul", "--json"])[0])

    def second_shape():
        seconds.append(json.loads(_fresh(["-c", _SECOND_SHAPE])[1].strip().splitlines()[-1]))

    def allclose_test():
        wall, out = _fresh(["-c", _ALLCLOSE])
        times = json.loads(out.strip().splitlines()[-1])
        second, odd = times["second_shape_s"], times["odd_shape_s"]
        allclose.append((wall - second - odd, second, odd))

    kinds = [first_check, allclose_test, second_shape]
    for i in range(samples):
        for run in kinds[i % 3:] + kinds[:i % 3]:
            run()

    def median(key: str) -> float:
        return round(statistics.median(s[key] for s in seconds), 2)

    first_s = statistics.median(firsts)
    second_s = statistics.median(s["second_shape_s"] for s in seconds)
    allclose_first = statistics.median(a for a, _, _ in allclose)
    allclose_second = statistics.median(b for _, b, _ in allclose)
    allclose_both = statistics.median(b + o for _, b, o in allclose)
    return {"first_check_s": round(first_s, 2),
            "first_check_runs_s": [round(t, 2) for t in firsts],
            "second_shape_s": median("second_shape_s"),
            "second_shape_runs_s": [round(s["second_shape_s"], 2) for s in seconds],
            "second_shape_kernel_compile_s": median("second_shape_kernel_compile_s"),
            "second_shape_kernel_s": median("second_shape_kernel_s"),
            "second_shape_peat_s": round(statistics.median(
                s["second_shape_s"] - s["second_shape_kernel_s"] for s in seconds), 2),
            "first_check_compiles": seconds[0]["first_check_compiles"],
            "second_shape_compiles": max(s["second_shape_compiles"] for s in seconds),
            "allclose_first_s": round(allclose_first, 2),
            "allclose_first_runs_s": [round(a, 2) for a, _, _ in allclose],
            "allclose_second_shape_s": round(allclose_second, 2),
            "allclose_second_shape_runs_s": [round(b, 2) for _, b, _ in allclose],
            "allclose_both_shapes_s": round(allclose_both, 2),
            "first_check_ratio": round(first_s / allclose_first, 2),
            "second_shape_ratio": round(second_s / allclose_second, 2),
            "second_shape_ratio_both_shapes": round(second_s / allclose_both, 2)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=4096, help="matrix side (default 4096: 16M)")
    parser.add_argument("--repeats", type=int, default=41, help="timed rounds per pair")
    parser.add_argument("--samples", type=int, default=3, help="fresh processes per check "
                        "timing (medians reported)")
    parser.add_argument("--no-check", action="store_true", help="skip first_check_s, "
                        "second_shape_s, the port's check and the allclose baselines")
    args = parser.parse_args(argv)

    candidate, golden = _pair(args.side)
    max_abs_diff = jax.jit(lambda c, g: jnp.max(jnp.abs(c - g)))

    def analyze(c, g):
        return analyzer.analyze(c, g)

    t0 = time.perf_counter()
    sig = analyze(candidate, golden)          # compile + first run
    first_call = time.perf_counter() - t0
    jax.block_until_ready(max_abs_diff(candidate, golden))
    t_mad, t_an = _interleaved(max_abs_diff, analyze, (candidate, golden), args.repeats)

    faulty = _with_flips(candidate)
    sig_f = analyze(faulty, golden)
    t_mad_f, t_an_f = _interleaved(max_abs_diff, analyze, (faulty, golden), args.repeats)

    result = {
        "benchmark": "analyze",
        "analyze_ratio": round(t_an / t_mad, 2),
        "analyze_ms": round(1e3 * t_an, 2),
        "max_abs_diff_ms": round(1e3 * t_mad, 2),
        "analyze_ratio_with_errors": round(t_an_f / t_mad_f, 2),
        "analyze_with_errors_ms": round(1e3 * t_an_f, 2),
        "first_call_s": round(first_call, 2),
        "elements": int(candidate.size),
        "mismatched": sig.counts.mismatched,
        "significant": sig.counts.significant,
        "significant_with_errors": sig_f.counts.significant,
        **({} if args.no_check else first_checks(args.samples)),
        **({} if args.no_check else port_checks(args.samples)),
        "repeats": args.repeats,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
    }
    assert sig.counts.significant == 0 and sig_f.counts.significant == 3
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
