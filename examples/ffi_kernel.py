"""Validate an XLA FFI custom-call kernel: the bundled matmul, compiled here against jax's FFI
headers (the naive C++ `peat_jax/_src/kernels/csrc/naive_matmul.cc` with g++ on the CPU; on a CUDA
GPU also the tiled `naive_matmul.cu` with nvcc, registered under the same target), checked against
XLA's dot forward and backward, its seeded-bug variant named by the detector, then replayed at
every GEMM site of a training step and used for training. The same script runs on a CPU or a GPU
backend.

    python3 examples/ffi_kernel.py [--quick]

Takes about a minute on 2 CPU cores.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import peat_jax as peat
from peat_jax import models


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="example inputs only, 5 training steps")
    opts = p.parse_args(argv)
    kernel = peat.kernels.ffi_matmul()  # builds (once, cached) and registers the target
    a = jax.random.normal(jax.random.key(0), (67, 45))
    b = jax.random.normal(jax.random.key(1), (45, 33))
    dims = (((1,), (0,)), ((), ()))

    def check(k):
        return peat.check_kernel(lambda a, b: k(a, b, dimension_numbers=dims),
                                 lambda a, b: jax.lax.dot_general(a, b, dims), a, b,
                                 variants=("example",) if opts.quick else None)

    print(f"ffi_matmul vs XLA dot on {jax.default_backend()} (forward, backward, adversarial "
          f"inputs): {check(kernel).summary}")
    bug = peat.kernels.ffi_matmul(tile_bug=True)  # rows of the last partial 16-row tile unwritten
    print(f"ffi_matmul_tile_bug: {check(bug).summary}")

    wl = models.get("vision", batch_size=16, width=8, hidden=32)
    state = wl.init(jax.random.key(0))
    batch = jax.tree.map(jnp.asarray, wl.batch(0))
    sw = jax.jit(peat.switched(wl.train_step, {"dot_general": kernel}))
    golden_state, golden_m = sw(-1, state, batch)
    for s in peat.list_sites(wl.train_step, state, batch):
        if s.primitive == "dot_general":
            new_state, m = sw(s.index, state, batch)
            diag = peat.detect(peat.analyze({"loss": m["loss"], "params": new_state["params"]},
                                            {"loss": golden_m["loss"],
                                             "params": golden_state["params"]}))
            print(f"  ffi_matmul at {s.phase} {s.path}: {diag.summary}")
    step = jax.jit(peat.substitute(wl.train_step, {"dot_general": kernel}))
    plain = jax.jit(wl.train_step)
    s0 = s1 = state
    steps = 5 if opts.quick else 20
    for i in range(steps):
        s0, m0 = plain(s0, jax.tree.map(jnp.asarray, wl.batch(i)))
        s1, m1 = step(s1, jax.tree.map(jnp.asarray, wl.batch(i)))
    print(f"{steps} steps trained with ffi_matmul at every GEMM: loss {float(m1['loss']):.5f} "
          f"(golden {float(m0['loss']):.5f})")


if __name__ == "__main__":
    main()
