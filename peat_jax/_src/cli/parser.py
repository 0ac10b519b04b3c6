"""The argument parser of `peat` (`build_parser`)."""
from __future__ import annotations

import argparse
import sys

import peat_jax.models as models
from peat_jax._src.cli.check import cmd_check
from peat_jax._src.cli.commands import (cmd_compare, cmd_demo, cmd_playback, cmd_profile,
                                        cmd_report, cmd_runtime, cmd_sites)
from peat_jax._src.cli.inputs import KERNELS, REGION_KERNELS
from peat_jax._src.precision import MATMUL_PRECISIONS
from peat_jax._src.profiler import distributed
from peat_jax._src.schedule import SWITCHES


class Parser(argparse.ArgumentParser):
    """No prefix matching (`allow_abbrev=False`): `--reference X` is never taken for
    `--reference-precision`, nor `--seed` for `--seeds`."""

    def __init__(self, *a, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*a, **kw)

    def error(self, message):  # one line and the usage, exit status 2
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return v


def positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _common(sp) -> None:
    sp.add_argument("--json", action="store_true",
                    help="print one JSON object instead of tables")
    sp.add_argument("--seed", type=int, default=0, help="seed (default 0)")


def _intercept(sp) -> None:
    sp.add_argument("--intercept", action="append", metavar="NAME",
                    help="a library function whose calls become composite sites, by "
                         "dotted name: jax.nn.dot_product_attention, "
                         "flax.linen.dot_product_attention, optax.softmax_cross_entropy, "
                         "flax.linen.LayerNorm (repeatable, or "
                         "comma-separated; a kernel's own function and one named by --sites "
                         "are intercepted without it)")


def _processes(sp, playback: bool = False) -> None:
    env = dict(zip(("coordinator", "count", "id"), distributed.ENV))
    sp.add_argument("--coordinator", metavar="HOST:PORT",
                    help="jax.distributed coordinator, hosted by process 0 (default "
                         f"${env['coordinator']})")
    sp.add_argument("--num-processes", type=positive, metavar="N",
                    help=f"processes the campaign is split over (default ${env['count']})")
    sp.add_argument("--process-id", type=int, metavar="I",
                    help=f"this process's id, 0..N-1 (default ${env['id']}); without a "
                         "coordinator: run share I of N alone")
    if playback:
        sp.add_argument("--init-timeout", type=positive_float, default=120.0,
                        metavar="SECONDS", help="time to reach the coordinator and for all "
                                                "processes to join (default 120)")
        sp.add_argument("--heartbeat-timeout", type=positive, default=60, metavar="SECONDS",
                        help="silence after which a process is taken for dead (default 60)")


def _candidate(sp, campaign: bool = True) -> None:
    sp.add_argument("--kernel",
                    help=f"bundled kernel ({', '.join(KERNELS)}) or module.path:NAME, "
                         "path/to/file.py:NAME or a dotted name (any peat.Kernel, or a factory "
                         "returning one)")
    sp.add_argument("--fault", help='a fault, e.g. "bit_flip(bit=30)" or "wrong_scale(2.0)"')
    sp.add_argument("--sites", help="site selector(s), comma-separated (default: the "
                                    "kernel's primitive or function, else dot_general)")
    _intercept(sp)
    if campaign:
        sp.add_argument("--name", help="campaign name (default from the candidate)")

def _add_demo(sub) -> None:
    d = sub.add_parser("demo", help="the main job on the default workload (start here)")
    d.add_argument("--out", default="peat-demo",
                   help="run directory to write (default ./peat-demo)")
    d.add_argument("--workload", default=models.DEFAULT, choices=models.available())
    d.add_argument("--steps", type=positive, default=60, help="golden training steps (default 60)")
    _common(d)
    d.set_defaults(func=cmd_demo)


WORKLOAD_HELP = "bundled workload, or module.path:NAME, path/to/file.py:NAME or a dotted name"


def _add_sites(sub) -> None:
    s = sub.add_parser("sites", help="list the op sites of a workload's train step")
    s.add_argument("target", help=WORKLOAD_HELP)
    s.add_argument("--primitive", action="append", help="only these primitives (repeatable)")
    _intercept(s)
    _common(s)
    s.set_defaults(func=cmd_sites)


def _add_profile(sub) -> None:
    pr = sub.add_parser("profile", help="golden run: train, keep Orbax checkpoints and metrics")
    pr.add_argument("target", help=WORKLOAD_HELP)
    pr.add_argument("--out", required=True, help="run directory")
    pr.add_argument("--steps", type=positive, help="training steps (default: the workload's)")
    pr.add_argument("--checkpoint-every", type=positive, default=50)
    pr.add_argument("--stats-every", type=positive, metavar="K",
                    help="record site statistics every K steps (golden/site_stats/)")
    pr.add_argument("--precision", choices=list(MATMUL_PRECISIONS),
                    help="matmul precision to train at, recorded in the manifest and used by its "
                         "replays (default: jax's setting; on GPUs XLA's default is TF32)")
    _candidate(pr, campaign=False)
    _processes(pr)
    _common(pr)
    pr.set_defaults(func=cmd_profile)


def _add_compare(sub) -> None:
    cp = sub.add_parser("compare", help="where two golden runs with site statistics part ways")
    cp.add_argument("run_a", help="the reference run directory")
    cp.add_argument("run_b", help="the run compared with it")
    cp.add_argument("--replay", action="store_true",
                    help="replay the diverging step from RUN_A's checkpoint on this backend and "
                         "diagnose its site against RUN_B's recorded sample (RUN_A's workload "
                         "must be registered)")
    _common(cp)
    cp.set_defaults(func=cmd_compare)


def _add_playback(sub) -> None:
    pb = sub.add_parser("playback", help="replay checkpointed steps with a candidate at each site")
    pb.add_argument("run_dir")
    _candidate(pb)
    pb.add_argument("--checkpoints", help="checkpoint steps, comma-separated (default all)")
    pb.add_argument("--cell-timeout", type=positive_float, metavar="SECONDS",
                    help="time limit per cell: run the campaign in a worker process, record a "
                         "cell past the limit (or one whose kernel kills the process) and go on")
    pb.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    _processes(pb, playback=True)
    _common(pb)
    pb.set_defaults(func=cmd_playback)


def _add_runtime(sub) -> None:
    rt = sub.add_parser("runtime", help="train with the candidate switched in by a schedule")
    rt.add_argument("run_dir")
    _candidate(rt)
    rt.add_argument("--every", type=positive, help="fire every N steps")
    rt.add_argument("--offset", type=int, default=0,
                    help="with --every: fire when step %% N == offset")
    rt.add_argument("--at-steps", help="fire at these steps, comma-separated")
    rt.add_argument("--probability", type=float, help="fire with this probability per step")
    rt.add_argument("--steps", type=positive, help="steps (default: the whole golden run)")
    rt.add_argument("--switch", choices=SWITCHES,
                    help="site: a conditional at each selected site, one executable; host: the "
                         "plain step's executable on steps that do not fire, chosen on the host "
                         "(default: site on CPU, host on a GPU)")
    _processes(rt)
    _common(rt)
    rt.set_defaults(func=cmd_runtime)


def _add_check(sub) -> None:
    ck = sub.add_parser(
        "check", help="check a kernel against a reference (or a bundled kernel against XLA), "
                      "forward and backward",
        description="Check KERNEL against --reference REF (any functions: module.path:NAME, "
                    "path/to/file.py:NAME or a dotted name such as jax.nn.softmax) on operands "
                    "drawn from --shapes and --dtypes, forward and backward, on adversarial "
                    "variants; or a bundled kernel (or a dot_general peat.Kernel) against XLA. "
                    "Exit status: 0 passes, 1 fails, 2 bad input.",
        epilog="examples: peat check mymod:attention --reference jax.nn.dot_product_attention "
               "--shapes 2x128x4x64,2x128x4x64,2x128x4x64 --config '{\"is_causal\": true}'; "
               "peat check mymod:xent --reference "
               "optax.softmax_cross_entropy_with_integer_labels --shapes 8x10,8 "
               "--dtypes float32,int32; peat check pallas_matmul")
    ck.add_argument("kernel", metavar="KERNEL",
                    help=f"bundled kernel ({', '.join([*KERNELS, *REGION_KERNELS])}), or "
                         "module.path:NAME, path/to/file.py:NAME or a dotted name: a function, "
                         "a peat.Kernel or a factory taking no arguments that returns one "
                         "(without --reference: a dot_general peat.Kernel)")
    ck.add_argument("--reference", metavar="REF",
                    help="the function KERNEL must match, named as KERNEL can be, e.g. "
                         "jax.nn.softmax, jax.nn.dot_product_attention, mymod:my_reference")
    ck.add_argument("--shapes",
                    help="operand shapes, one per operand: 2x128x4x64,2x128x4x64,2x128x4x64; () "
                         "or scalar for a scalar (default 67x45,45x33 for matmuls; 67x45 for "
                         "softmax, 67x45,45,45 for layer norm, 2x40x2x16 (x3) for attention)")
    ck.add_argument("--dtypes", "--dtype", dest="dtypes", metavar="DTYPES",
                    help="operand dtypes, one for all or one per operand, comma-separated: "
                         "float32 (default), bfloat16, float16, int32, int16, int8, uint32, "
                         "uint16, uint8, bool. Floats are drawn standard normal, integers "
                         "uniform in [0, K) (see --int-bound: labels and indices stay in "
                         "range), bools True with probability 1/2, all from --seed")
    ck.add_argument("--int-bound", type=positive, metavar="K",
                    help="integer operands are drawn from [0, K) (default: the smallest "
                         "last-axis size of the float operands, e.g. the class count of the "
                         "logits; 8 when none)")
    ck.add_argument("--config", metavar="CONFIG",
                    help="keyword arguments for both KERNEL and REF: inline JSON "
                         "('{\"is_causal\": true}'; arrays become tuples), a JSON file, or a "
                         "Python spec MOD:SPEC, a tuple or dict or a callable SPEC(seed) (or "
                         "SPEC()) returning one: a tuple is the example args (no --shapes), a "
                         "dict has \"args\" and/or \"kwargs\"")
    ck.add_argument("--kernel-kwargs", metavar="JSON",
                    help="keyword arguments for KERNEL only, over --config's: inline JSON or a "
                         "JSON file (a port whose arguments are named otherwise, e.g. "
                         "'{\"eps\": 1e-5}' beside --reference-kwargs '{\"epsilon\": 1e-5}')")
    ck.add_argument("--reference-kwargs", metavar="JSON",
                    help="keyword arguments for REF only, over --config's (as --kernel-kwargs)")
    ck.add_argument("--variants",
                    help="input variants, comma-separated (default all: example, large, tiny, "
                         "near_overflow, subnormal, zeros, outliers, odd_shape; example alone "
                         "for a quick check)")
    ck.add_argument("--seeds", type=positive, metavar="N",
                    help="run the check N times, seeds --seed .. --seed+N-1 (the example args "
                         "and the variants drawn from each); fails if any seed fails; --json "
                         "lists each under \"seeds\"")
    ck.add_argument("--allow", action="append", help="an error model to accept (repeatable)")
    ck.add_argument("--reference-precision", choices=list(MATMUL_PRECISIONS), default="highest",
                    help="matmul precision of the reference (default highest: full float32; "
                         "'default' is what the program would do, TF32 on recent GPUs)")
    ck.add_argument("--no-conditioning", dest="conditioning", action="store_false",
                    help="the noise floor alone: no conditioning floor (the float64 reference "
                         "on inputs perturbed at 1 ULP)")
    ck.add_argument("--lower", metavar="PLATFORMS",
                    help="instead of checking, lower the kernel compiled (forward and backward) "
                         "for these GPU platforms on this machine, e.g. cuda,rocm (an H200 and "
                         "an A100; the MI250's gfx90a): one line per GPU, exit 1 when one fails")
    _common(ck)
    ck.set_defaults(func=cmd_check)


def _add_report(sub) -> None:
    rp = sub.add_parser("report", help="write the HTML report of a run directory")
    rp.add_argument("run_dir")
    rp.add_argument("--output", help="path of the HTML file (default RUN_DIR/report.html)")
    _common(rp)
    rp.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="peat", description="Validate GPU kernels inside JAX training: find op sites, "
                "replay training steps with a candidate kernel or a modelled fault at one site, "
                "inject it during training, and diagnose what differs.",
                epilog="Run `peat demo` first. Exit status: 0 ok, 1 a kernel fails, 2 bad input.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    _add_demo(sub)
    _add_sites(sub)
    _add_profile(sub)
    _add_compare(sub)
    _add_playback(sub)
    _add_runtime(sub)
    _add_check(sub)
    _add_report(sub)
    return p
