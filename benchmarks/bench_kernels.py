"""Bundled kernels against their XLA references: accuracy and interpret-mode cost.

errors: per kernel and dtype, max|candidate - reference| / max|reference| for the forward output
  and (worst operand of) the backward under one random cotangent, both jitted, on a ragged
  (non-divisible) shape; "ref64" gives the XLA reference's own error against a float64 evaluation
  of the same reference (its noise floor) for comparison.
cost_ratio: median wall time of the jitted forward ("fwd") and forward+backward ("fwd_bwd") of
  the candidate (Pallas kernels in interpret mode on CPU, the FFI / callback kernels as they run)
  over the same for the XLA reference, interleaved calls, float32, on the moderate "shapes" given.

Prints one JSON object on one line. Runs with no arguments in a few minutes on 2 CPU cores
(`--quick` for a smoke run).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import peat_jax as peat
from peat_jax._src.kernels import pallas as pk
from peat_jax._src.kernels import references

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _rel(got, ref) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float64 if got.dtype == jnp.float64 else jnp.float32),
                     np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def _fwd_bwd(fn, g, *args):
    y, vjp = jax.vjp(fn, *args)
    return y, vjp(g)


def _matmul_ref(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())))


def _sub_matmul(kernel):
    return peat.substitute(_matmul_ref, {"dot_general": kernel})


def _made(factory, *args, **kwargs):
    """`factory(*args, **kwargs)`, or the PeatError's message when the kernel cannot be made
    here (the FFI matmul without a compiler; jax's shipped Pallas ops on a jax that dropped
    them)."""
    try:
        return factory(*args, **kwargs)
    except peat.PeatError as e:
        return str(e)


def _ffi_matmul(ffi_dir: str):
    """The substituted FFI matmul (C++ on the CPU, CUDA on a GPU), or why it cannot be built."""
    made = _made(peat.kernels.ffi_matmul, cache_dir=ffi_dir)
    return made if isinstance(made, str) else _sub_matmul(made)


def cases(ffi_dir: str):
    """name -> (candidate fn, reference fn, args builder(dtype, big: bool)), or name -> why it is
    skipped."""
    def rows(dt, big):
        shape = (64, 256) if big else (3, 7, 13)
        return ((3.0 * jax.random.normal(jax.random.key(0), shape)).astype(dt),)

    def ln_args(dt, big):
        x = rows(dt, big)[0] + 0.5
        n = x.shape[-1]
        return (x, (1 + 0.1 * jax.random.normal(jax.random.key(1), (n,))).astype(dt),
                (0.1 * jax.random.normal(jax.random.key(2), (n,))).astype(dt))

    def mm_args(dt, big):
        m, k, n = (256, 256, 256) if big else (30, 45, 29)
        return (jax.random.normal(jax.random.key(0), (m, k)).astype(dt),
                jax.random.normal(jax.random.key(1), (k, n)).astype(dt))

    def att_args(dt, big):
        shape = (2, 128, 4, 32) if big else (1, 21, 2, 12)
        return tuple(jax.random.normal(jax.random.key(i), shape).astype(dt) for i in range(3))

    def mha_args(dt, big):
        shape = (2, 128, 4, 32) if big else (1, 32, 2, 12)
        return tuple(jax.random.normal(jax.random.key(i), shape).astype(dt) for i in range(3))

    causal_ref = functools.partial(references.attention, causal=True)
    import torch
    out = {
        "pallas_matmul": (_sub_matmul(pk.pallas_matmul()), _matmul_ref, mm_args),
        "pallas_softmax": (pk.pallas_softmax(), references.softmax, rows),
        "pallas_layer_norm": (pk.pallas_layer_norm(), references.layer_norm, ln_args),
        "pallas_attention(causal)": (pk.pallas_attention(causal=True), causal_ref, att_args),
        "jax_pallas_layer_norm": (_made(pk.jax_pallas_layer_norm), references.layer_norm,
                                  ln_args),
        "jax_pallas_mha(causal)": (_made(pk.jax_pallas_mha, causal=True), causal_ref, mha_args),
        "ffi_matmul": (_ffi_matmul(ffi_dir), _matmul_ref, mm_args),
        "torch_matmul": (_sub_matmul(peat.kernels.dot_general(
            peat.kernels.torch_kernel(torch.matmul), batched=True)), _matmul_ref, mm_args),
        "numpy_matmul": (_sub_matmul(peat.kernels.dot_general(peat.kernels.numpy_kernel(
            np.matmul, vjp=lambda ops, o, g: (g @ np.swapaxes(ops[1], -1, -2),
                                              np.swapaxes(ops[0], -1, -2) @ g)), batched=True)),
            _matmul_ref, mm_args),
    }
    return {name: case[0] if isinstance(case[0], str) else case for name, case in out.items()}


def errors(cand, ref, make_args) -> dict:
    res = {}
    for dname, dt in DTYPES.items():
        args = make_args(dt, False)
        out = jax.eval_shape(ref, *args)
        g = jax.random.normal(jax.random.key(7), out.shape).astype(out.dtype)
        yc, gc = jax.jit(functools.partial(_fwd_bwd, cand))(g, *args)
        yr, gr = jax.jit(functools.partial(_fwd_bwd, ref))(g, *args)
        with jax.enable_x64(True):
            a64 = [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in args]
            y64, g64 = jax.jit(functools.partial(_fwd_bwd, ref))(
                np.asarray(jnp.asarray(g, jnp.float32), np.float64), *a64)
            y64, g64 = np.asarray(y64), [np.asarray(x) for x in g64]
        res[dname] = {
            "fwd": round(_rel(yc, yr), 8), "bwd": round(max(_rel(a, b) for a, b in zip(gc, gr)), 8),
            "fwd_vs64": round(_rel(yc, y64), 8),
            "bwd_vs64": round(max(_rel(a, b) for a, b in zip(gc, g64)), 8),
            "ref_fwd_vs64": round(_rel(yr, y64), 8),
            "ref_bwd_vs64": round(max(_rel(a, b) for a, b in zip(gr, g64)), 8),
        }
    return res


def _median_ratio(fc, fr, args, repeats: int) -> float:
    jax.block_until_ready(fc(*args))
    jax.block_until_ready(fr(*args))
    tc, tr = [], []
    for i in range(repeats):
        for f, ts in ((fc, tc), (fr, tr)) if i % 2 else ((fr, tr), (fc, tc)):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t0)
    return statistics.median(tc) / statistics.median(tr)


def cost_ratios(cand, ref, make_args, repeats: int) -> dict:
    """Median-time ratios candidate/reference: jitted forward, and jitted forward+backward."""
    args = make_args(jnp.float32, True)
    out = jax.eval_shape(ref, *args)
    g = jnp.ones(out.shape, out.dtype)
    fwd = _median_ratio(jax.jit(cand), jax.jit(ref), args, repeats)
    both = _median_ratio(jax.jit(functools.partial(_fwd_bwd, cand)),
                         jax.jit(functools.partial(_fwd_bwd, ref)), (g, *args), repeats)
    return {"fwd": round(fwd, 2), "fwd_bwd": round(both, 2),
            "shapes": [list(a.shape) for a in args]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 timing repeats instead of --repeats")
    p.add_argument("--repeats", type=int, default=21)
    opts = p.parse_args(argv)
    repeats = 3 if opts.quick else opts.repeats
    result = {"backend": jax.default_backend(), "jax": jax.__version__, "errors": {},
              "cost_ratio": {}, "skipped": {}}
    with tempfile.TemporaryDirectory() as ffi_dir:
        for name, case in cases(ffi_dir).items():
            if isinstance(case, str):
                result["skipped"][name] = case
                print(name, "skipped:", case, file=sys.stderr, flush=True)
                continue
            cand, ref, make_args = case
            result["errors"][name] = errors(cand, ref, make_args)
            result["cost_ratio"][name] = cost_ratios(cand, ref, make_args, repeats)
            print(name, result["cost_ratio"][name], file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
