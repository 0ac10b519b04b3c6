"""Validate a ported Pallas kernel inside training: a golden run of the vision workload, playback
of the bundled Pallas matmul (correct) and of a copy with a bug in its last partial tile at every
GEMM site of checkpointed steps, then runtime injection of the buggy copy every 10th step.

    python3 examples/pallas_in_training.py [--out DIR] [--steps 60]

On CPU the Pallas kernel runs in interpret mode. Takes about two minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import tempfile

import jax.numpy as jnp

import peat_jax as peat
from peat_jax import models


def buggy_pallas_matmul() -> peat.Kernel:
    """The bundled Pallas matmul, but rows past the last full 8-row tile come out stale (zero):
    the classic missing-mask bug of a ragged last block."""
    good = peat.kernels.pallas_matmul(block_m=8, block_n=8, block_k=8)

    def impl(a, b, **params):
        out = good(a, b, **params)
        rows = out.shape[0]
        full = (rows // 8) * 8
        keep = jnp.arange(rows) < full  # all rows when the tiles divide evenly: no bug then
        return jnp.where(keep.reshape((-1,) + (1,) * (out.ndim - 1)), out, 0).astype(out.dtype)

    return peat.Kernel("pallas_matmul_ragged_bug", impl, primitive="dot_general")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    p.add_argument("--steps", type=int, default=60)
    opts = p.parse_args(argv)
    out = opts.out or tempfile.mkdtemp(prefix="peat-pallas-")
    wl = models.get("vision", batch_size=12, width=8, hidden=32)  # 12 rows: a ragged last tile
    g = peat.profile(wl, out, steps=opts.steps, checkpoint_every=max(1, opts.steps // 3))
    print(f"golden run: loss {g.losses[0]:.4f} -> {g.losses[-1]:.4f}, checkpoints {g.checkpoints}")
    for kernel in (peat.kernels.pallas_matmul(), buggy_pallas_matmul()):
        res = peat.playback(out, {"dot_general": kernel}, name=kernel.name.split("(")[0])
        models_seen = sorted({r["local"]["model"] for r in res.records()})
        first = res.first_divergence()
        print(f"{kernel.name}: {len(res.records()) - len(res.failing())}/{len(res.records())} "
              f"cells pass locally ({', '.join(models_seen)}); " +
              (f"first divergence at step {first['checkpoint']}, site #{first['site']} "
               f"{first['phase']} {first['path']}: {first['local']['summary']}" if first else
               "no divergence"))
    rt = peat.runtime(out, {"dot_general": buggy_pallas_matmul()}, peat.every(10, offset=5),
                      steps=g.steps, name="runtime-buggy")
    print(f"runtime injection every 10th step: outcome {rt.outcome} "
          f"(final loss {rt.losses[-1]:.4f} vs golden {rt.golden_losses[-1]:.4f})")
    print(f"report: {peat.report.write_report(out)}")


if __name__ == "__main__":
    main()
