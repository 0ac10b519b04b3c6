"""The `peat` command.

  peat demo [--workload NAME] [--steps N] [--json]   the main job on a bundled workload
  peat sites TARGET [--primitive P ...] [--json]     list the op sites of a workload's train step

TARGET is a bundled workload name (see `peat sites --help`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import peat_jax as peat
from peat_jax import models


def _workload(name: str):
    if name not in models.available():
        raise peat.PeatError(f"unknown workload {name!r}; bundled workloads: "
                             f"{', '.join(models.available())}")
    return models.get(name)


def _batch(wl, step: int):
    return jax.tree.map(jnp.asarray, wl.batch(step))


def cmd_sites(args) -> int:
    wl = _workload(args.target)
    state = wl.init(jax.random.key(args.seed))
    sites = peat.list_sites(wl.train_step, state, _batch(wl, 0),
                            primitives=args.primitive or None)
    if args.json:
        print(json.dumps([_site_json(s) for s in sites]))
    else:
        print(peat.format_sites(sites))
        counts: dict[tuple[str, str], int] = {}
        for s in sites:
            counts[(s.primitive, s.phase)] = counts.get((s.primitive, s.phase), 0) + 1
        print(f"\n{len(sites)} sites in {wl.name}'s train step: " +
              ", ".join(f"{p} {ph} x{n}" for (p, ph), n in sorted(counts.items())))
    return 0


def _site_json(s: peat.Site) -> dict[str, Any]:
    return {"index": s.index, "primitive": s.primitive, "path": s.path, "phase": s.phase,
            "in": [[list(sh), str(d)] for sh, d in zip(s.in_shapes, s.in_dtypes)],
            "out": [[list(sh), str(d)] for sh, d in zip(s.out_shapes, s.out_dtypes)],
            "composite": s.composite, "scope": list(s.scope)}


def cmd_demo(args) -> int:
    """Golden training, a one-compile sweep of a fault over every GEMM site, a correct kernel at
    every GEMM site, and a scheduled injection run; prints what each did to the loss."""
    wl = _workload(args.workload)
    t0 = time.perf_counter()
    state0 = wl.init(jax.random.key(args.seed))
    batch0 = _batch(wl, 0)
    sites = peat.list_sites(wl.train_step, state0, batch0)
    gemm = ["dot_general", "conv_general_dilated"]
    dots = [s for s in sites if s.primitive in gemm]
    _say(args, f"workload {wl.name}: {len(sites)} sites, {len(dots)} GEMM/conv sites "
               f"({sum(s.phase == 'fwd' for s in dots)} fwd, {sum(s.phase == 'bwd' for s in dots)} bwd)")

    # golden run
    step = jax.jit(wl.train_step)
    state, golden = state0, []
    for i in range(args.steps):
        state, m = step(state, _batch(wl, i))
        golden.append(float(m["loss"]))
    _say(args, f"golden run: loss {golden[0]:.4f} -> {golden[-1]:.4f} over {args.steps} steps")

    # sweep: a fault at each GEMM site in turn, one compiled executable
    fault = peat.faults.bit_flip(bit=30, seed=args.seed)  # top exponent bit of one element
    sw = jax.jit(peat.switched(wl.train_step, {"dot_general": fault,
                                               "conv_general_dilated": fault}))
    ref_state, ref_m = sw(-1, state, _batch(wl, args.steps))
    rows = []
    for s in dots:
        new_state, m = sw(s.index, state, _batch(wl, args.steps))
        dloss = abs(float(m["loss"]) - float(ref_m["loss"]))
        dparam = max(float(jnp.max(jnp.abs(a - b))) if jnp.issubdtype(a.dtype, jnp.floating) else 0.0
                     for a, b in zip(jax.tree.leaves(new_state["params"]),
                                     jax.tree.leaves(ref_state["params"])))
        rows.append({"site": s.index, "phase": s.phase, "path": s.path,
                     "loss_change": dloss, "max_param_change": dparam})
    compiles = sw._cache_size()

    # a correct candidate kernel at every GEMM: training should match the golden run
    kernel = peat.kernels.blocked_matmul(block_k=16)
    ks = jax.jit(peat.substitute(wl.train_step, {"dot_general": kernel}))
    state_k, kernel_losses = state0, []
    for i in range(args.steps):
        state_k, m = ks(state_k, _batch(wl, i))
        kernel_losses.append(float(m["loss"]))

    # runtime injection: the fault every 10th step
    inj = jax.jit(peat.inject(wl.train_step, {"bwd:dot_general": fault}, peat.every(10, offset=5)))
    state_i, injected = state0, []
    for i in range(args.steps):
        state_i, m = inj(state_i, _batch(wl, i), i)
        injected.append(float(m["loss"]))

    result = {
        "workload": wl.name, "sites": len(sites),
        "gemm_sites": len(dots), "golden_loss": [golden[0], golden[-1]],
        "sweep": {"fault": peat.faults.describe(fault), "compiles": compiles, "cells": rows},
        "kernel": {"name": kernel.name, "final_loss": kernel_losses[-1],
                   "max_loss_difference": max(abs(a - b) for a, b in zip(kernel_losses, golden))},
        "runtime": {"schedule": str(peat.every(10, offset=5)), "final_loss": injected[-1],
                    "non_finite_steps": int(sum(not np.isfinite(x) for x in injected)),
                    "first_difference_step": next((i for i, (a, b) in enumerate(zip(injected, golden))
                                                   if a != b), None)},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\nsweep of {result['sweep']['fault']} over {len(dots)} GEMM/conv sites "
          f"({compiles} compile):")
    print(f"{'site':>5} {'phase':5} {'loss change':>12} {'max param change':>17}  path")
    for r in rows:
        print(f"{r['site']:>5} {r['phase']:5} {r['loss_change']:12.3g} {r['max_param_change']:17.3g}  "
              f"{r['path']}")
    k = result["kernel"]
    print(f"\ncandidate {k['name']} at every GEMM: final loss {k['final_loss']:.4f} "
          f"(golden {golden[-1]:.4f}, max per-step difference {k['max_loss_difference']:.2g})")
    r = result["runtime"]
    print(f"runtime injection {r['schedule']}: final loss {r['final_loss']:.4f}, "
          f"{r['non_finite_steps']} non-finite steps, first differs at step "
          f"{r['first_difference_step']}")
    print(f"done in {result['seconds']} s")
    return 0


def _say(args, msg: str) -> None:
    if not args.json:
        print(msg, flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and the usage, exit status 2
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="peat", description="Validate GPU kernels inside JAX training: find op "
                "sites, substitute candidates or faults, replay and inject them.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    d = sub.add_parser("demo", help="run the main job on a bundled workload")
    d.add_argument("--workload", default=models.DEFAULT, help=f"one of {', '.join(models.available())}")
    d.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    d.set_defaults(func=cmd_demo)
    s = sub.add_parser("sites", help="list the op sites of a workload's train step")
    s.add_argument("target", help=f"a bundled workload: {', '.join(models.available())}")
    s.add_argument("--primitive", action="append", help="only these primitives (repeatable)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_sites)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "steps", 1) is not None and getattr(args, "steps", 1) <= 0:
        parser.error("--steps must be a positive integer")
    try:
        return args.func(args)
    except (peat.PeatError, ValueError, ModuleNotFoundError) as e:
        print(f"peat: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
