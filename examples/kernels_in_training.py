"""Candidate kernels inside real training: the bundled vision workload (a CNN on digits) trained
with a Pallas matmul, an XLA FFI C++ matmul and a PyTorch matmul at every GEMM site, forward and
backward, next to the golden run; then the Pallas interpreter's checks catching a racy kernel.

    python3 examples/kernels_in_training.py [--steps 30] [--no-torch]

On CPU the Pallas kernels run in interpret mode (chosen automatically); on GPU they compile.
The FFI kernel is compiled from `peat_jax/_src/kernels/csrc/naive_matmul.cc` on first use (g++).
Takes about a minute on 2 CPU cores.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import peat_jax as peat
from peat_jax import models


def losses(step_fn, state, workload, steps: int) -> list[float]:
    out = []
    for i in range(steps):
        state, metrics = step_fn(state, workload.batch(i))
        out.append(float(metrics["loss"]))
    return out


def racy_matmul() -> peat.Kernel:
    """A matmul that splits K over the grid and accumulates into one output block, with the
    reduction dimension wrongly declared "parallel": a data race on a GPU."""
    def body(a_ref, b_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    def matmul(a, b):
        (m, k), n = a.shape, b.shape[1]
        return peat.kernels.pallas_call(
            body, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32), grid=(m // 16, k // 16),
            in_specs=[pl.BlockSpec((16, 16), lambda i, kk: (i, kk)),
                      pl.BlockSpec((16, n), lambda i, kk: (kk, 0))],
            out_specs=pl.BlockSpec((16, n), lambda i, kk: (i, 0)),
            dimension_semantics=("parallel", "parallel"), name="racy_matmul", checks=True)(a, b)

    return peat.kernels.dot_general(matmul, name="racy_matmul")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch candidate")
    opts = p.parse_args(argv)

    wl = models.get("vision")
    state = wl.init(jax.random.key(0))
    golden = losses(jax.jit(wl.train_step), state, wl, opts.steps)
    print(f"golden: loss {golden[0]:.4f} -> {golden[-1]:.4f} over {opts.steps} steps")

    candidates = {"pallas_matmul": peat.kernels.pallas_matmul(),
                  "ffi_matmul": peat.kernels.ffi_matmul()}
    if not opts.no_torch:
        try:
            import torch
        except ImportError:
            print("torch is not installed (pip install -e '.[torch]'): no PyTorch candidate")
        else:
            candidates["torch_matmul"] = peat.kernels.dot_general(
                peat.kernels.torch_kernel(torch.matmul), name="torch_matmul", batched=True)
    for name, kernel in candidates.items():
        step = peat.substitute(wl.train_step, {"dot_general": kernel})
        sites = step.selected(state, wl.batch(0))
        got = losses(jax.jit(step), state, wl, opts.steps)
        worst = max(abs(a - b) for a, b in zip(got, golden))
        print(f"{name:14s} at {len(sites)} GEMM sites "
              f"({sum(s.phase == 'bwd' for s in sites)} backward): final loss {got[-1]:.4f}, "
              f"max per-step difference {worst:.2g}")

    # a racy kernel is caught by the interpreter's race detector (small shapes: checks are slow)
    # (the parallel grid points are split into contiguous chunks, one per simulated core: with
    # one row block the four K blocks land on two cores, which then write the same block)
    a = jax.random.normal(jax.random.key(1), (16, 64))
    b = jax.random.normal(jax.random.key(2), (64, 16))
    f = peat.substitute(lambda a, b: a @ b, {"dot_general": racy_matmul()})
    try:
        jax.block_until_ready(f(a, b))
        print("racy_matmul: no race reported")
    except Exception as e:  # noqa: BLE001 - XLA wraps the callback's PeatError
        line = next((ln for ln in str(e).splitlines() if "data race" in ln), str(e).splitlines()[0])
        print(f"racy_matmul: {line.strip()}")
    finally:
        peat.kernels.reset_interpret_state()


if __name__ == "__main__":
    main()
