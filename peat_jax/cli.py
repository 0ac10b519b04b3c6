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

TARGET: a bundled workload name, or `module.path:attribute` naming a `peat.Workload` or a
zero-argument callable returning one (loaded only when named). KERNEL: a bundled kernel name
(`peat check --help` lists them) or `module.path:attribute` (a `peat.Kernel` or a factory);
for `peat check` also `path/to/file.py:NAME` or a dotted name, any function (`kernel_spec`).
A kernel goes to its own primitive's sites unless --sites says otherwise; one whose primitive is
a library function's dotted name (jax.nn.dot_product_attention) has that function intercepted
(`peat.intercept`; --intercept NAME for others) in sites, profile, playback and runtime.
FAULT: a call of a `peat.faults` constructor with literal arguments, e.g. "bit_flip(bit=30)".
P: a matmul precision, highest | high | default (or jax's float32 | tensorfloat32 | bfloat16).
Exit status: 0 on success, 1 when a check or campaign finds a failing kernel (or `compare` a
divergence beyond noise), 2 on bad input.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import gc
import importlib
import json
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import peat_jax as peat
from peat_jax import check_kernel, kernel_spec, models
from peat_jax.errors import PeatError
from peat_jax.precision import MATMUL_PRECISIONS
from peat_jax.profiler import supervisor
from peat_jax.profiler import distributed
from peat_jax.profiler.campaign import Campaign, campaign_name, merged_records
from peat_jax.profiler.rundir import RunDir

# Bundled kernels by name: factory, and the primitive or region its reference lowers to.
KERNELS: dict[str, Callable[[], "peat.Kernel"]] = {
    "pallas_matmul": lambda: peat.kernels.pallas_matmul(),
    "blocked_matmul": lambda: peat.kernels.blocked_matmul(),
    "xla_matmul": lambda: peat.kernels.xla_matmul(),
    "ffi_matmul": lambda: peat.kernels.ffi_matmul(),
    "ffi_matmul_tile_bug": lambda: peat.kernels.ffi_matmul(tile_bug=True),  # fails: tile_boundary
}


# Bundled region kernels that `peat check` runs against their XLA references: factory,
# reference, default operand shapes.
REGION_KERNELS: dict[str, tuple[Callable[[], "peat.Kernel"], Callable, str]] = {
    "pallas_softmax": (lambda: peat.kernels.pallas_softmax(), peat.kernels.references.softmax,
                       "67x45"),
    "pallas_layer_norm": (lambda: peat.kernels.pallas_layer_norm(),
                          peat.kernels.references.layer_norm, "67x45,45,45"),
    "pallas_attention": (lambda: peat.kernels.pallas_attention(),
                         peat.kernels.references.attention, "2x40x2x16,2x40x2x16,2x40x2x16"),
}


# --------------------------------------------------------------------------------------------
# Console output

def _console():
    from rich.console import Console
    c = Console(stderr=False, highlight=False)
    if not c.is_terminal:  # piped or captured: wide enough for the tables, no wrapping
        c = Console(stderr=False, highlight=False, width=140)
    return c


class _Progress:
    """A rich progress bar (to stderr) that callbacks `(done, total)` can drive."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self._p = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)
            from rich.console import Console
            self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._p.__enter__()
        return self

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)

    def task(self, description: str) -> Callable[[int, int], None]:
        if self._p is None:
            return lambda done, total: None
        tid = self._p.add_task(description, total=None)
        return lambda done, total: self._p.update(tid, completed=done, total=total)


def _say(args, msg: str) -> None:
    if not args.json:
        _console().print(msg)


def _esc(text: Any) -> str:
    """`text` as a str that rich prints as written (a summary's "[forward, large inputs]" is
    not a style tag)."""
    from rich.markup import escape
    return escape(str(text))


# --------------------------------------------------------------------------------------------
# Argument parsing helpers

def _load_attr(spec: str, what: str) -> Any:
    if ":" not in spec:
        raise PeatError(f"{what} {spec!r} is neither a bundled name nor module.path:attribute")
    mod, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise PeatError(f"cannot import module {mod!r} for {what} {spec!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PeatError(f"module {mod!r} has no attribute {attr!r} (from {what} {spec!r})")
        obj = getattr(obj, part)
    return obj


def _workload(target: str) -> peat.Workload:
    if target in models.available():
        return models.get(target)
    obj = _load_attr(target, "workload")
    if callable(obj) and not isinstance(obj, peat.Workload):
        obj = obj()
    if not isinstance(obj, peat.Workload):
        raise PeatError(f"{target!r} is not a peat.Workload (got {type(obj).__name__}); bundled "
                        f"workloads: {', '.join(models.available())}")
    return obj


def _kernel(spec: str) -> peat.Kernel:
    if spec in KERNELS:
        return KERNELS[spec]()
    obj = _load_attr(spec, "kernel") if ":" in spec else None
    if obj is None:
        raise PeatError(f"unknown kernel {spec!r}; bundled kernels: {', '.join(KERNELS)}, or give "
                        "module.path:attribute")
    obj = kernel_spec.as_function(obj, spec)    # a factory taking no arguments is called
    if not isinstance(obj, peat.Kernel):
        raise PeatError(f"{spec!r} is not a peat.Kernel (got {type(obj).__name__})")
    return obj


def parse_fault(spec: str) -> peat.Fault:
    """A fault from text such as "bit_flip(bit=30, index=0)" (literal arguments only)."""
    try:
        tree = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError:
        raise PeatError(f"cannot parse fault {spec!r}; write e.g. \"bit_flip(bit=30)\"") from None
    if isinstance(tree, ast.Name):
        tree = ast.Call(func=tree, args=[], keywords=[])
    if not (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name)):
        raise PeatError(f"fault {spec!r} must be a call like \"scale(2.0)\"")
    name = tree.func.id
    if name not in peat.faults.ALL:
        raise PeatError(f"unknown fault {name!r}; faults: {', '.join(peat.faults.ALL)}")
    try:
        args = [ast.literal_eval(a) for a in tree.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in tree.keywords}
    except ValueError:
        raise PeatError(f"fault {spec!r}: arguments must be literals (numbers, strings, "
                        "tuples)") from None
    try:
        return getattr(peat.faults, name)(*args, **kwargs)
    except TypeError as e:
        raise PeatError(f"fault {spec!r}: {e}") from None


def _candidate(args) -> Any:
    if bool(args.kernel) == bool(args.fault):
        raise PeatError("give exactly one of --kernel and --fault")
    return _kernel(args.kernel) if args.kernel else parse_fault(args.fault)


def _default_sites(cand) -> str:
    """The selector a candidate goes to without --sites: a kernel's own primitive or region
    (`jax.nn.dot_product_attention` for a kernel of that function), else dot_general."""
    return getattr(cand, "primitive", None) or "dot_general"


def _function_names(selector) -> list[str]:
    """The dotted library-function names in a selector (`fwd:` / `bwd:` stripped): those that
    resolve to a function or a Flax module class (a path pattern is left alone)."""
    parts = selector if isinstance(selector, list) else [selector]
    names = []
    for p in parts:
        if not isinstance(p, str):
            continue
        name = p.split(":", 1)[1] if p.startswith(("fwd:", "bwd:")) else p
        if "." in name and not any(c in name for c in "/*?["):
            try:
                peat.regions.resolve_name(name)
            except PeatError:
                continue
            names.append(name)
    return names


def _intercepted(args, cand=None, selector=None) -> list[str]:
    """The library functions a command intercepts while it traces (`peat.intercept`): those
    of --intercept, the kernel's own when it serves one (its primitive is a dotted name), and
    those the selector names."""
    names = [n.strip() for text in (getattr(args, "intercept", None) or [])
             for n in text.split(",") if n.strip()]
    prim = getattr(cand, "primitive", None)
    if isinstance(cand, peat.Kernel) and isinstance(prim, str) and "." in prim:
        names.append(prim)
    if selector is not None:
        names += _function_names(selector)
    return list(dict.fromkeys(names))


def _selector(text: Optional[str], default: str):
    if text is None:
        return default
    parts = [p.strip() for p in text.split(",") if p.strip()]
    sel = [int(p) if p.lstrip("-").isdigit() else p for p in parts]
    return sel[0] if len(sel) == 1 else sel


def _ints(text: Optional[str], what: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PeatError(f"{what} must be comma-separated integers, got {text!r}") from None


def _schedule(args) -> peat.Schedule:
    given = [x is not None for x in (args.every, args.at_steps, args.probability)]
    if sum(given) != 1:
        raise PeatError("give exactly one schedule: --every N, --at-steps S,... or --probability P")
    if args.every is not None:
        return peat.every(args.every, args.offset)
    if args.at_steps is not None:
        return peat.at_steps(_ints(args.at_steps, "--at-steps"))
    return peat.with_probability(args.probability, seed=args.seed)


def _batch(wl, step: int):
    return jax.tree.map(jnp.asarray, wl.batch(step))


def _print_json(args, obj, **dumps_kw) -> None:
    """`obj` as one JSON line on the command's standard output (`main` sends everything else
    printed under ``--json``, a kernel's or jax's own prints included, to stderr)."""
    print(json.dumps(obj, **dumps_kw), file=args.stdout, flush=True)


# --------------------------------------------------------------------------------------------
# Commands

def cmd_sites(args) -> int:
    wl = _workload(args.target)
    state = wl.init(jax.random.key(args.seed))
    sites = peat.list_sites(wl.train_step, state, _batch(wl, 0), primitives=args.primitive or None,
                            regions=_intercepted(args))
    if args.json:
        _print_json(args, [_site_json(s) for s in sites])
        return 0
    from rich.table import Table
    t = Table(title=f"{len(sites)} sites in {wl.name}'s train step")
    for col in ("#", "phase", "primitive", "path", "in", "out", "scope"):
        t.add_column(col)

    def types(shapes, dtypes):
        return ", ".join(f"{np.dtype(d).name}{list(sh)}" for sh, d in zip(shapes, dtypes))

    for s in sites:
        t.add_row(str(s.index), s.phase, s.primitive, _esc(s.path),
                  types(s.in_shapes, s.in_dtypes), types(s.out_shapes, s.out_dtypes),
                  _esc("/".join(s.scope)))
    _console().print(t)
    return 0


def _site_json(s: peat.Site) -> dict[str, Any]:
    return {"index": s.index, "primitive": s.primitive, "path": s.path, "phase": s.phase,
            "in": [[list(sh), str(d)] for sh, d in zip(s.in_shapes, s.in_dtypes)],
            "out": [[list(sh), str(d)] for sh, d in zip(s.out_shapes, s.out_dtypes)],
            "composite": s.composite, "scope": list(s.scope), "repeats": s.repeats}


def cmd_profile(args) -> int:
    distributed.refuse("profile", _processes(args))
    wl = _workload(args.target)
    steps = args.steps or int(wl.config.get("steps", 100))
    substitution, names = None, _intercepted(args)
    if args.kernel or args.fault:
        cand = _candidate(args)
        sel = _selector(args.sites, _default_sites(cand))
        substitution, names = {sel: cand}, _intercepted(args, cand, sel)
    elif args.sites:
        raise PeatError("--sites selects where --kernel or --fault goes; give one of them")
    with _Progress(not args.json) as p, peat.intercept(*names):
        g = peat.profile(wl, args.out, steps=steps, checkpoint_every=args.checkpoint_every,
                         seed=args.seed, stats_every=args.stats_every, substitution=substitution,
                         progress=p.task("golden run"),
                         precision=args.precision)
    out = {"run_dir": g.run_dir, "workload": g.workload, "steps": g.steps,
           "checkpoints": list(g.checkpoints), "loss": [g.losses[0], g.losses[-1]], "eval": g.eval,
           "resumed_from": g.resumed_from}
    peat.report.write_report(args.out)
    if args.json:
        _print_json(args, out)
    else:
        resumed = f" (resumed from step {g.resumed_from})" if g.resumed_from is not None else ""
        _say(args, f"golden run of {g.workload}: {g.steps} steps, loss {g.losses[0]:.4f} -> "
                   f"{g.losses[-1]:.4f}, checkpoints {list(g.checkpoints)}" + resumed)
        _say(args, f"report: {args.out}/report.html")
    return 0


def _cells_table(title: str, records: list[dict]):
    from rich.table import Table
    t = Table(title=title)
    for col in ("step", "site", "phase", "primitive", "path", "local", "effect on step"):
        t.add_column(col)
    for r in records:
        loc = r.get("local") or {}
        eff = None if r.get("effect") is None else peat.Effect.from_dict(r["effect"])
        passed = loc.get("passed", eff is not None and eff.passed)
        style = "green" if passed else "red"
        effect = ("-" if eff is None else
                  f"[{'green' if eff.passed else 'red'}]{_esc(eff.short())}[/]")
        t.add_row(str(r["checkpoint"]), str(r["site"]), r.get("phase", ""), r.get("primitive", ""),
                  _esc(r.get("path", "")),
                  f"[{style}]{_esc(loc.get('model', r.get('status', '-')))}[/]", effect)
    return t


def cmd_playback(args) -> int:
    procs = _processes(args)
    if procs is not None and procs.coordinator is not None and args.cell_timeout is not None:
        raise PeatError("--cell-timeout restarts its worker process, which cannot rejoin "
                        "jax.distributed: give each process its share without --coordinator "
                        "(--process-id I --num-processes N) to use a time limit")
    if procs is not None:
        distributed.start(procs, timeout=args.init_timeout,
                          heartbeat_timeout=args.heartbeat_timeout)
    try:
        cand = _candidate(args)
        sel = _selector(args.sites, _default_sites(cand))
        if args.cell_timeout is not None and not args.worker:
            return _supervise(args, cand, sel)
        with _Progress(not args.json) as p, peat.intercept(*_intercepted(args, cand, sel)):
            res = _playback(args, cand, sel, p.task("playback cells"),
                            procs.share if procs is not None else None)
    finally:
        distributed.finish()  # process 0 waits here for the others
    if procs is None or procs.index == 0:
        if procs is not None and procs.coordinator is not None:
            res = _merged(res)  # every process has finished or died: the whole campaign
        peat.report.write_report(args.run_dir)
    _print_playback(args, cand, res)
    return 1 if res.failing("local") else 0


def _merged(res: "peat.PlaybackResult") -> "peat.PlaybackResult":
    """`res` with the cells of every process's results file (this process's share and the
    others'), in grid order."""
    cells = tuple(merged_records(res.campaign))
    return dataclasses.replace(res, cells=cells)


def _processes(args) -> Optional[distributed.Processes]:
    return distributed.processes(args.coordinator, args.num_processes, args.process_id)


def _playback(args, cand, sel, progress, host) -> "peat.PlaybackResult":
    """The campaign (this process's share of it, where `host` says); in a worker, a cell past
    its time limit ends the process so that the supervisor starts the next one."""
    try:
        return peat.playback(args.run_dir, {sel: cand},
                             checkpoints=_ints(args.checkpoints, "--checkpoints"), name=args.name,
                             progress=progress, cell_timeout=args.cell_timeout, host=host)
    except peat.CellTimeout as e:
        if not args.worker:
            raise
        supervisor.exit_for_restart(str(e))


def _print_playback(args, cand, res) -> None:
    records = res.records()
    failing = res.failing("local")
    first = res.first_divergence()
    counts = res.summary()
    if args.json:
        _print_json(args, {"campaign": res.campaign, "cells": records, "failing": len(failing),
                           "first_divergence": first, "compiles": res.compiles,
                           "summary": counts})
        return
    _console().print(_cells_table(f"playback of {getattr(cand, 'name', cand)}", records))
    if first:
        what = (first["local"]["summary"] if first.get("local") else
                first.get("error") or (first.get("effect") or {}).get("summary", ""))
        _say(args, f"[red]first divergence: step {first['checkpoint']}, site #{first['site']} "
                   f"({first['phase']} {first['primitive']} @ {_esc(first['path'])}): "
                   f"{_esc(what)}[/]")
    broken = "".join(f", {counts[k]} {k}" for k in ("crashed", "timeout") if counts[k])
    _say(args, f"{len(records) - len(failing)}/{len(records)} cells pass locally{broken}; "
               f"results {res.campaign}/; report {args.run_dir}/report.html")


def _supervise(args, cand, sel) -> int:
    """`peat playback --cell-timeout S`: the campaign in a worker process (this command with
    `--worker`), restarted by `peat_jax.profiler.supervisor` until the campaign is done; the
    last worker's output and exit status are the command's."""
    procs = _processes(args)
    share = {} if procs is None else {"host": procs.index, "hosts": procs.count}
    camp = Campaign(path=RunDir(args.run_dir).campaign(args.name or campaign_name({sel: cand})),
                    **share)
    worker = [sys.executable, "-m", "peat_jax", *args.argv, "--worker"]
    return supervisor.supervise(worker, camp, args.cell_timeout)


def cmd_runtime(args) -> int:
    distributed.refuse("runtime", _processes(args))
    cand = _candidate(args)
    schedule = _schedule(args)
    run_dir = args.run_dir
    steps = args.steps
    if steps is None:
        steps = len(peat.profiler.rundir.RunDir(run_dir).golden_losses())
    sel = _selector(args.sites, _default_sites(cand))
    with _Progress(not args.json) as p, peat.intercept(*_intercepted(args, cand, sel)):
        r = peat.runtime(run_dir, {sel: cand}, schedule,
                         steps=steps, name=args.name or f"runtime-{cand.name}",
                         progress=p.task("training with injection"))
    peat.report.write_report(run_dir)
    if args.json:
        _print_json(args, r.to_dict())
    else:
        resumed = f"resumed from step {r.resumed_from}; " if r.resumed_from is not None else ""
        _say(args, f"runtime injection of {cand.name} {r.schedule}: outcome [bold]{r.outcome}[/] "
                   f"({resumed}fired at {len(r.fired_steps)} of {steps} steps; final loss "
                   f"{r.losses[-1]:.4f} vs golden {r.golden_losses[-1]:.4f})")
        _say_nan_origin(args, r)
    return 0 if r.outcome == "masked" else 1


def _say_nan_origin(args, r) -> None:
    if r.nan_origin is not None:
        _say(args, f"[red]NaN born at {_esc(r.nan_origin)}[/]")


def _check_seeds(args) -> list[int]:
    """The seeds `peat check` runs: --seed, or --seed .. --seed + N - 1 with --seeds N."""
    return list(range(args.seed, args.seed + (args.seeds or 1)))


def _run_checks(args, candidate, reference,
                args_at: Callable[[int], tuple]) -> list[tuple[int, Any]]:
    """`check_kernel` once per seed: [(seed, Diagnosis)], the example args drawn by
    `args_at(seed)` and the variants seeded by it too."""
    out = []
    for seed in _check_seeds(args):
        xs = args_at(seed)
        out.append((seed, check_kernel(candidate, reference, *xs, allow=tuple(args.allow or ()),
                                       variants=kernel_spec.parse_variants(args.variants),
                                       seed=seed, reference_precision=args.reference_precision,
                                       conditioning=args.conditioning)))
    return out


def _report_checks(args, results: list[tuple[int, Any]], extra: Optional[dict] = None) -> int:
    """Prints the verdicts (a JSON object under --json: the first failing seed's diagnosis, or
    the first seed's, with "seeds" listing each with --seeds); 0 when every seed passed."""
    passed = all(d.passed for _, d in results)
    seed, shown = next(((s, d) for s, d in results if not d.passed), results[0])
    if args.json:
        obj = {**_diag_json(shown), "passed": passed, **(extra or {})}
        if args.seeds is not None:
            obj["seed"] = seed
            obj["seeds"] = [{"seed": s, **_diag_json(d)} for s, d in results]
        _print_json(args, obj, default=repr)
        return 0 if passed else 1
    for s, d in results:
        style = "green" if d.passed else "red"
        prefix = f"seed {s}: " if len(results) > 1 else ""
        _say(args, f"[{style}]{prefix}{_esc(d.summary)}[/]")
    if len(results) > 1:
        _say(args, f"evidence of seed {seed}:")
    for k, v in shown.evidence.items():
        _say(args, f"  {k}: {_esc(v)}")
    return 0 if passed else 1


def cmd_check(args) -> int:
    if args.reference is not None:
        return _check_any(args)
    for opt in ("config", "int_bound"):
        if getattr(args, opt) is not None:
            raise PeatError(f"--{opt.replace('_', '-')} needs --reference (the function to check "
                            "the kernel against)")
    region = REGION_KERNELS.get(args.kernel)
    if region:
        kernel = region[0]()
    elif args.kernel in KERNELS:
        kernel = KERNELS[args.kernel]()
    elif ":" in args.kernel or "." in args.kernel:
        kernel = kernel_spec.as_function(kernel_spec.load(args.kernel, "kernel"), args.kernel)
        if not isinstance(kernel, peat.Kernel):
            raise PeatError(f"{args.kernel!r} is a function, not a dot_general peat.Kernel: give "
                            f"--reference REF to check it against (REF as "
                            f"{kernel_spec.SPEC_FORMS})")
    else:
        raise PeatError(f"unknown kernel {args.kernel!r}; bundled kernels: "
                        f"{', '.join([*KERNELS, *REGION_KERNELS])}; or check any function with "
                        f"--reference (KERNEL as {kernel_spec.SPEC_FORMS})")
    shapes = kernel_spec.parse_shapes(args.shapes or (region[2] if region else "67x45,45x33"))
    dtypes = kernel_spec.parse_dtypes(args.dtypes, len(shapes))
    dtype = dtypes[0]
    if len(set(dtypes)) != 1 or dtype.name not in ("float32", "bfloat16", "float16"):
        raise PeatError(f"bundled and dot_general kernels take one float dtype for all operands "
                        f"(float32, bfloat16 or float16), got --dtypes {args.dtypes!r}")

    def draw(seed: int) -> tuple:    # on the host: a jax draw compiles per shape
        return tuple(jax.device_put(x) for x in kernel_spec.draw_args(shapes, dtypes, seed))

    if region:
        reference, candidate = region[1], kernel
        n_args = {"pallas_softmax": 1, "pallas_layer_norm": 3, "pallas_attention": 3}[args.kernel]
        if len(shapes) != n_args:
            raise PeatError(f"{args.kernel} takes {n_args} operand(s); --shapes gave "
                            f"{len(shapes)} (default {region[2]})")
    else:
        if kernel.primitive == "dot_general" and len(shapes) != 2:
            raise PeatError(f"{args.kernel} multiplies two operands: --shapes takes two shapes "
                            f"like 67x45,45x33 (MxK,KxN), got {len(shapes)} ({args.shapes!r})")
        if kernel.primitive != "dot_general":
            raise PeatError(f"kernel {kernel.name!r} serves {kernel.primitive!r}, not "
                            f"dot_general: give --reference REF to check it against (REF as "
                            f"{kernel_spec.SPEC_FORMS})")
        dims = (((len(shapes[0]) - 1,), (0,)), ((), ()))
        params = {"dimension_numbers": dims, "precision": None, "preferred_element_type": dtype}

        # jitted, so the variants of one shape share one compiled program (eager, a Pallas
        # kernel compiles again at every call); its result follows its inputs' dtype (here
        # `dtype`), so that it also runs in float64 and sets the float64 noise floor
        @jax.jit
        def reference(a, b):
            return jax.lax.dot_general(a, b, dims)

        @jax.jit
        def candidate(a, b):
            return kernel(a, b, **params)

    if args.lower:
        # lowering only: the kernel, forward and backward, built compiled for each GPU
        fn = kernel if region else (lambda a, b: kernel(a, b, **params))
        return _check_lowering(args, kernel.name, fn, draw(_check_seeds(args)[0]))
    return _report_checks(args, _run_checks(args, candidate, reference, draw))


def _check_any(args) -> int:
    """`peat check KERNEL --reference REF`: any function against any reference, on operands
    drawn from --shapes/--dtypes (or given by a --config spec), kwargs from --config."""
    if args.kernel in REGION_KERNELS:
        fn = REGION_KERNELS[args.kernel][0]()
    elif args.kernel in KERNELS:
        fn = KERNELS[args.kernel]()
    elif ":" in args.kernel or "." in args.kernel:
        fn = kernel_spec.as_function(kernel_spec.load(args.kernel, "kernel"), args.kernel)
    else:
        raise PeatError(f"unknown kernel {args.kernel!r}; bundled kernels: "
                        f"{', '.join([*KERNELS, *REGION_KERNELS])}, or give "
                        f"{kernel_spec.SPEC_FORMS}")
    ref = kernel_spec.as_function(kernel_spec.load(args.reference, "reference"), args.reference,
                                  "reference")
    first = _check_seeds(args)[0]
    config = kernel_spec.parse_config(args.config, first)
    if config.args is not None:
        if args.shapes is not None or args.dtypes is not None or args.int_bound is not None:
            raise PeatError(f"--config {args.config!r} returned the example args: leave out "
                            "--shapes, --dtypes and --int-bound (or return only \"kwargs\")")
        shapes = dtypes = None
    elif args.shapes is None:
        raise PeatError("give --shapes, one per operand (like 2x128x4x64,2x128x4x64,2x128x4x64; "
                        "() for a scalar), or a --config MOD:SPEC returning the example args")
    else:
        shapes = kernel_spec.parse_shapes(args.shapes)
        dtypes = kernel_spec.parse_dtypes(args.dtypes, len(shapes))

    drawn: dict[int, tuple] = {}

    def args_at(seed: int) -> tuple:
        if seed not in drawn:
            if shapes is None:
                got = config if seed == first else kernel_spec.parse_config(args.config, seed)
                if got.args is None:
                    raise PeatError(f"--config {args.config!r} returned no \"args\" for seed "
                                    f"{seed} (it did for seed {first}); return them every time")
                drawn[seed] = got.args
            else:
                drawn[seed] = tuple(jax.device_put(x) for x in
                                    kernel_spec.draw_args(shapes, dtypes, seed, args.int_bound))
        return drawn[seed]

    kwargs = config.kwargs
    # the candidate jitted (its kwargs static), so that the variants of one shape share one
    # compiled program; the reference runs as given
    candidate = jax.jit(functools.partial(fn, **kwargs)) if kwargs else jax.jit(fn)
    reference = functools.partial(ref, **kwargs) if kwargs else ref
    if args.lower:
        bound = functools.partial(fn, **kwargs)
        return _check_lowering(args, args.kernel, bound, args_at(first))
    results = _run_checks(args, candidate, reference, args_at)
    extra = {"candidate": args.kernel, "reference": args.reference,
             "operands": kernel_spec.describe_args(args_at(first)), "kwargs": kwargs}
    return _report_checks(args, results, extra)


def _check_lowering(args, name: str, fn: Callable, xs) -> int:
    """`peat check --lower`: one line per (platform, device), its forward and its VJP lowered
    for that GPU on this machine; 1 when one failed."""
    from peat_jax.lowering import lowers_for
    results = lowers_for(fn, *xs, platforms=args.lower, grad=True, name=name)
    by_target: dict[tuple[str, str], list] = {}
    for r in results:
        by_target.setdefault((r.platform, r.device), []).append(r)
    ok = all(r.ok for r in results)
    if args.json:
        _print_json(args, {"kernel": name, "ok": ok, "jax": jax.__version__,
                           "lowerings": [r.to_dict() for r in results]})
        return 0 if ok else 1
    console = _console()

    def say(msg: str) -> None:   # one line per GPU however long jax's message
        console.print(msg, soft_wrap=True)

    for (platform, device), rs in by_target.items():
        failed = [r for r in rs if not r.ok]
        where = f"{platform} {_esc(device)}: {_esc(name)}"
        if failed:
            say(f"[red]{where} FAILED ({failed[0].phase}): {_esc(failed[0].error)}[/]")
        else:
            n = max(len(r.kernels) for r in rs)
            say(f"[green]{where} lowers[/] ({' and '.join(r.phase for r in rs)}; {n} "
                f"Pallas kernel{'' if n == 1 else 's'})")
    for w in dict.fromkeys(w for r in results for w in r.warnings):
        say(f"[yellow]jax warned: {_esc(w)}[/]")
    if any(r.kernels for r in results) and not results[0].device_used:
        say(f"(jax {jax.__version__} without a GPU lowers Triton kernels for compute "
            "capability 9.0 whatever the device kind)")
    return 0 if ok else 1


def _diag_json(d) -> dict:
    return {"model": d.model, "passed": d.passed, "confidence": d.confidence,
            "evidence": d.evidence, "summary": d.summary}


def cmd_compare(args) -> int:
    from peat_jax.profiler.compare import save_comparison
    c = peat.compare(args.run_a, args.run_b, replay=args.replay)
    saved = save_comparison(c)
    peat.report.write_report(args.run_a)
    if args.json:
        _print_json(args, c.to_dict(), allow_nan=False)
        return 1 if c.divergence else 0
    from rich.table import Table
    t = Table(title="environments")
    for col in ("", args.run_a, args.run_b):
        t.add_column(col)
    for r in c.environments:
        style = "bold yellow" if r.differs else ""
        t.add_row(r.key, *(f"[{style}]{_esc(v)}[/]" if style else _esc(v) for v in (r.a, r.b)))
    _console().print(t)
    colour = "red" if c.divergence else "green"
    _say(args, f"[{colour}]{_esc(c.summary())}[/]")
    _say(args, f"comparison: {saved}; report {args.run_a}/report.html")
    return 1 if c.divergence else 0


def cmd_report(args) -> int:
    path = peat.report.write_report(args.run_dir, args.output)
    if args.json:
        _print_json(args, {"report": str(path)})
    else:
        print(f"report: {path}")
    return 0


def cmd_demo(args) -> int:
    """The main job on the default workload: golden run, playback of a correct Pallas matmul and
    of a faulty one at every GEMM site, runtime injection, summary and HTML report."""
    t0 = time.perf_counter()
    out = args.out
    wl = models.get(args.workload, **({"batch_size": 16, "width": 8, "hidden": 32}
                                      if args.workload == "vision" else {}))
    summary: dict[str, Any] = {"run_dir": out, "workload": wl.name}
    with _Progress(not args.json) as p:
        g = peat.profile(wl, out, steps=args.steps, checkpoint_every=max(1, args.steps // 3),
                         seed=args.seed, progress=p.task("golden run"))
        _say(args, f"golden run: {wl.name}, {g.steps} steps, loss {g.losses[0]:.4f} -> "
                   f"{g.losses[-1]:.4f}, checkpoints {list(g.checkpoints)}")
        state = peat.profiler.restore(out, 0)
        sites = peat.list_sites(wl.train_step, state, _batch(wl, 0))
        gemm = [s for s in sites if s.primitive == "dot_general"]
        n_fwd, n_bwd = (sum(s.phase == phase for s in gemm) for phase in ("fwd", "bwd"))
        _say(args, f"{len(sites)} sites in the train step, {len(gemm)} dot_general "
                   f"({n_fwd} fwd, {n_bwd} bwd)")
        campaigns = {"pallas_matmul": peat.kernels.pallas_matmul(),
                     "tile_bug": peat.faults.tile_boundary(block=8, axis=0, mode="garbage")}
        summary["playback"] = {}
        for name, cand in campaigns.items():
            res = peat.playback(out, {"dot_general": cand}, name=name,
                                progress=p.task(f"playback: {name}"))
            recs = res.records()
            if not args.json:
                _console().print(_cells_table(f"playback: {getattr(cand, 'name', name)}", recs))
            first = res.first_divergence()
            where = ("checkpoint", "site", "path", "phase")
            summary["playback"][name] = {
                "cells": len(recs), "failing": len(res.failing("local")),
                "models": sorted({r["local"]["model"] for r in recs if r["local"]}),
                "first_divergence": first and {k: first[k] for k in where},
                "compiles": res.compiles}
        rt = peat.runtime(out, {"fwd:dot_general": peat.faults.bit_flip(bit=30)},
                          peat.every(10, offset=5), steps=g.steps, name="runtime-bit30",
                          progress=p.task("runtime injection"))
    summary["runtime"] = {"schedule": rt.schedule, "outcome": rt.outcome,
                          "fired_steps": list(rt.fired_steps),
                          "nan_origin": rt.to_dict()["nan_origin"]}
    report = peat.report.write_report(out)
    summary["report"] = str(report)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        _print_json(args, summary)
        return 0
    for name, s in summary["playback"].items():
        fd = s["first_divergence"]
        _say(args, f"{name}: {s['cells'] - s['failing']}/{s['cells']} cells pass "
                   f"({', '.join(s['models'])}); " +
             (f"first divergence at step {fd['checkpoint']}, site #{fd['site']} {fd['phase']} "
              f"@ {_esc(fd['path'])}" if fd else "no divergence") + f"; {s['compiles']} compile(s)")
    _say(args, f"runtime injection bit_flip(bit=30) {rt.schedule}: outcome [bold]{rt.outcome}[/]")
    _say_nan_origin(args, rt)
    _say(args, f"report: {report}   ({summary['seconds']} s)")
    return 0


# --------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """No prefix matching (`allow_abbrev=False`): `--reference X` is never taken for
    `--reference-precision`, nor `--seed` for `--seeds`."""

    def __init__(self, *a, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*a, **kw)

    def error(self, message):  # one line and the usage, exit status 2
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return v


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="peat", description="Validate GPU kernels inside JAX training: find op sites, "
                "replay training steps with a candidate kernel or a modelled fault at one site, "
                "inject it during training, and diagnose what differs.",
                epilog="Run `peat demo` first. Exit status: 0 ok, 1 a kernel fails, 2 bad input.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    def common(sp):
        sp.add_argument("--json", action="store_true",
                        help="print one JSON object instead of tables")
        sp.add_argument("--seed", type=int, default=0, help="seed (default 0)")

    def intercept(sp):
        sp.add_argument("--intercept", action="append", metavar="NAME",
                        help="a library function whose calls become composite sites, by "
                             "dotted name: jax.nn.dot_product_attention, "
                             "flax.linen.dot_product_attention, optax.softmax_cross_entropy, "
                             "flax.linen.LayerNorm (repeatable, or "
                             "comma-separated; a kernel's own function and one named by --sites "
                             "are intercepted without it)")

    def processes(sp, playback=False):
        env = dict(zip(("coordinator", "count", "id"), distributed.ENV))
        sp.add_argument("--coordinator", metavar="HOST:PORT",
                        help="jax.distributed coordinator, hosted by process 0 (default "
                             f"${env['coordinator']})")
        sp.add_argument("--num-processes", type=_positive, metavar="N",
                        help=f"processes the campaign is split over (default ${env['count']})")
        sp.add_argument("--process-id", type=int, metavar="I",
                        help=f"this process's id, 0..N-1 (default ${env['id']}); without a "
                             "coordinator: run share I of N alone")
        if playback:
            sp.add_argument("--init-timeout", type=_positive_float, default=120.0,
                            metavar="SECONDS", help="time to reach the coordinator and for all "
                                                    "processes to join (default 120)")
            sp.add_argument("--heartbeat-timeout", type=_positive, default=60, metavar="SECONDS",
                            help="silence after which a process is taken for dead (default 60)")

    d = sub.add_parser("demo", help="the main job on the default workload (start here)")
    d.add_argument("--out", default="peat-demo",
                   help="run directory to write (default ./peat-demo)")
    d.add_argument("--workload", default=models.DEFAULT, choices=models.available())
    d.add_argument("--steps", type=_positive, default=60, help="golden training steps (default 60)")
    common(d)
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("sites", help="list the op sites of a workload's train step")
    s.add_argument("target", help="bundled workload or module.path:attribute")
    s.add_argument("--primitive", action="append", help="only these primitives (repeatable)")
    intercept(s)
    common(s)
    s.set_defaults(func=cmd_sites)

    pr = sub.add_parser("profile", help="golden run: train, keep Orbax checkpoints and metrics")
    pr.add_argument("target", help="bundled workload or module.path:attribute")
    pr.add_argument("--out", required=True, help="run directory")
    pr.add_argument("--steps", type=_positive, help="training steps (default: the workload's)")
    pr.add_argument("--checkpoint-every", type=_positive, default=50)
    pr.add_argument("--stats-every", type=_positive, metavar="K",
                    help="record site statistics every K steps (golden/site_stats/)")
    pr.add_argument("--precision", choices=list(MATMUL_PRECISIONS),
                    help="matmul precision to train at, recorded in the manifest and used by its "
                         "replays (default: jax's setting; on GPUs XLA's default is TF32)")

    def candidate(sp, campaign=True):
        sp.add_argument("--kernel",
                        help=f"bundled kernel ({', '.join(KERNELS)}) or module:attribute (any "
                             "peat.Kernel, or a factory returning one)")
        sp.add_argument("--fault", help='a fault, e.g. "bit_flip(bit=30)" or "scale(2.0)"')
        sp.add_argument("--sites", help="site selector(s), comma-separated (default: the "
                                        "kernel's primitive or function, else dot_general)")
        intercept(sp)
        if campaign:
            sp.add_argument("--name", help="campaign name (default from the candidate)")

    candidate(pr, campaign=False)
    processes(pr)
    common(pr)
    pr.set_defaults(func=cmd_profile)

    cp = sub.add_parser("compare", help="where two golden runs with site statistics part ways")
    cp.add_argument("run_a", help="the reference run directory")
    cp.add_argument("run_b", help="the run compared with it")
    cp.add_argument("--replay", action="store_true",
                    help="replay the diverging step from RUN_A's checkpoint on this backend and "
                         "diagnose its site against RUN_B's recorded sample (RUN_A's workload "
                         "must be registered)")
    common(cp)
    cp.set_defaults(func=cmd_compare)

    pb = sub.add_parser("playback", help="replay checkpointed steps with a candidate at each site")
    pb.add_argument("run_dir")
    candidate(pb)
    pb.add_argument("--checkpoints", help="checkpoint steps, comma-separated (default all)")
    pb.add_argument("--cell-timeout", type=_positive_float, metavar="SECONDS",
                    help="time limit per cell: run the campaign in a worker process, record a "
                         "cell past the limit (or one whose kernel kills the process) and go on")
    pb.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    processes(pb, playback=True)
    common(pb)
    pb.set_defaults(func=cmd_playback)

    rt = sub.add_parser("runtime", help="train with the candidate switched in by a schedule")
    rt.add_argument("run_dir")
    candidate(rt)
    rt.add_argument("--every", type=_positive, help="fire every N steps")
    rt.add_argument("--offset", type=int, default=0,
                    help="with --every: fire when step %% N == offset")
    rt.add_argument("--at-steps", help="fire at these steps, comma-separated")
    rt.add_argument("--probability", type=float, help="fire with this probability per step")
    rt.add_argument("--steps", type=_positive, help="steps (default: the whole golden run)")
    processes(rt)
    common(rt)
    rt.set_defaults(func=cmd_runtime)

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
    ck.add_argument("--int-bound", type=_positive, metavar="K",
                    help="integer operands are drawn from [0, K) (default: the smallest "
                         "last-axis size of the float operands, e.g. the class count of the "
                         "logits; 8 when none)")
    ck.add_argument("--config", metavar="CONFIG",
                    help="keyword arguments for both KERNEL and REF: inline JSON "
                         "('{\"is_causal\": true}'; arrays become tuples), a JSON file, or a "
                         "Python spec MOD:SPEC, a tuple or dict or a callable SPEC(seed) (or "
                         "SPEC()) returning one: a tuple is the example args (no --shapes), a "
                         "dict has \"args\" and/or \"kwargs\"")
    ck.add_argument("--variants",
                    help="input variants, comma-separated (default all: example, large, tiny, "
                         "near_overflow, subnormal, zeros, outliers, odd_shape; example alone "
                         "for a quick check)")
    ck.add_argument("--seeds", type=_positive, metavar="N",
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
    common(ck)
    ck.set_defaults(func=cmd_check)

    rp = sub.add_parser("report", help="write the HTML report of a run directory")
    rp.add_argument("run_dir")
    rp.add_argument("--output", help="path of the HTML file (default RUN_DIR/report.html)")
    common(rp)
    rp.set_defaults(func=cmd_report)
    return p


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
