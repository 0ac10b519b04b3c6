"""The `peat` command: the whole PEAT flow on a bundled workload, or step by step.

  peat demo [--out DIR]                        golden run, playback campaigns, runtime injection,
                                               a summary table and an HTML report
  peat sites TARGET [--intercept NAME]         the op sites of a train step (or any function);
                                               NAME: a library function made a composite site
  peat profile TARGET --out DIR [--stats-every K] [--precision P]
               [--kernel K | --fault F [--sites S]]
                                               the golden run (Orbax checkpoints, metrics, site
                                               statistics; a candidate in place for the run)
  peat compare RUN_A RUN_B [--replay]          first step and site where two runs part ways
                                               (--replay: that step replayed on this backend)
  peat playback RUN_DIR (--kernel K | --fault F) [--sites SEL] [--checkpoints C,...]
  peat runtime RUN_DIR (--kernel K | --fault F) (--every N [--offset O] | --at-steps S,... |
               --probability P) [--steps N]
  peat check KERNEL [--shapes 64x32,32x16] [--dtypes float32] [--reference-precision P]
                                               a bundled (or dot_general) kernel against XLA
  peat check KERNEL --reference REF --shapes S,... [--dtypes D,...] [--config JSON|MOD:SPEC]
               [--variants V,...] [--seeds N]   any kernel against any reference (REF: a
                                               function like KERNEL, or jax.nn.softmax, ...)
  peat check KERNEL --lower cuda,rocm          does it lower (fwd and bwd) for those GPUs
  peat playback ... --cell-timeout S           campaign in a restartable worker process
  peat playback ... --coordinator HOST:PORT --num-processes N --process-id I
                                               process I of N on jax.distributed: its share of
                                               the grid (without --coordinator: share I alone)
  peat report RUN_DIR                          (re)write RUN_DIR/report.html

TARGET: a bundled workload name, or `module.path:NAME` (or `path/to/file.py:NAME`, or a dotted
name) naming a `peat.Workload` or a zero-argument callable returning one (loaded only when named).
KERNEL: a bundled kernel name (`peat check --help` lists them) or a name as for TARGET (a
`peat.Kernel` or a factory); for `peat check` any function (`kernel_spec`).
A kernel goes to its own primitive's sites unless --sites says otherwise; one whose primitive is
a library function's dotted name (jax.nn.dot_product_attention) has that function intercepted
(`peat.intercept`; --intercept NAME for others) in sites, profile, playback and runtime.
FAULT: a call of a `peat.faults` constructor with literal arguments, e.g. "bit_flip(bit=30)".
P: a matmul precision, highest | high | default (or jax's float32 | tensorfloat32 | bfloat16).
Exit status: 0 on success, 1 when a check or campaign finds a failing kernel (or `compare` a
divergence beyond noise), 2 on bad input.
"""
from __future__ import annotations

import contextlib
import gc
import sys
from typing import Optional, Sequence

import peat_jax as peat
from peat_jax._src.cli.inputs import KERNELS as KERNELS
from peat_jax._src.cli.inputs import REGION_KERNELS as REGION_KERNELS
from peat_jax._src.cli.inputs import parse_fault as parse_fault
from peat_jax._src.cli.parser import build_parser as build_parser
from peat_jax._src.errors import PeatError

__all__ = ["FROZEN_AT_IMPORT", "KERNELS", "REGION_KERNELS", "build_parser", "main", "parse_fault"]

FROZEN_AT_IMPORT: int = gc.get_freeze_count()
"""Objects frozen (`gc.get_freeze_count`) when this module was imported: not 0 on CPython 3.12,
which freezes a few itself. More than this at a command's start means a caller froze its heap,
and the command leaves it as it is."""


@contextlib.contextmanager
def _heap_frozen():
    """Python's objects alive at entry frozen (`gc.freeze`) until exit, unless something froze
    objects since this module was imported: a full collection then scans only what the command
    made. jax, jaxlib and their caches are ~230k objects, and one full pass over them (which a
    check's tracing triggers about once) takes 0.13-0.17 s on this project's CPUs, an eighth of
    a kernel check at a new shape. The CLI owns its process; `check_kernel` and the rest of the
    library leave the caller's heap alone."""
    mine = gc.get_freeze_count() <= FROZEN_AT_IMPORT
    if mine:
        gc.freeze()
    try:
        yield
    finally:
        if mine:
            gc.unfreeze()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    peat.enable_compilation_cache()
    # under --json, stdout carries the one JSON object only: anything else printed while the
    # command runs (the Pallas interpreter's race reports, a kernel's own prints) goes to stderr
    args.stdout = sys.stdout
    quiet = contextlib.redirect_stdout(sys.stderr) if getattr(args, "json", False) \
        else contextlib.nullcontext()
    try:
        with quiet, _heap_frozen():
            return args.func(args)
    except PeatError as e:
        print(f"peat: error: {e}", file=sys.stderr)
        return 2
    except (ModuleNotFoundError, ValueError, OSError) as e:
        print(f"peat: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("peat: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
