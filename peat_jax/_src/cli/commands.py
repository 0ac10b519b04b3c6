"""The commands but `check`: sites, profile, playback, runtime, compare, report, demo."""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Optional, Union

import jax
import numpy as np
import peat_jax as peat
import peat_jax.models as models
from peat_jax._src.cli.inputs import (batch_at, candidate_of, default_sites, int_list, intercepted,
                                      named_workload, schedule_of, selector_of)
from peat_jax._src.cli.output import (ProgressBar, cells_table, esc, print_json, rich_console, say,
                                      say_nan_origin)
from peat_jax._src.errors import PeatError
from peat_jax._src.profiler import distributed, supervisor
from peat_jax._src.profiler.campaign import Campaign, campaign_name, merged_records
from peat_jax._src.profiler.rundir import RunDir


def cmd_sites(args) -> int:
    wl = named_workload(args.target)
    state = wl.init(jax.random.key(args.seed))
    sites = peat.list_sites(wl.train_step, state, batch_at(wl, 0),
                            primitives=args.primitive or None,
                            regions=intercepted(args))
    if args.json:
        print_json(args, [site_json(s) for s in sites])
        return 0
    from rich.table import Table
    t = Table(title=f"{len(sites)} sites in {wl.name}'s train step")
    for col in ("#", "phase", "primitive", "path", "in", "out", "scope"):
        t.add_column(col)

    def types(shapes, dtypes):
        return ", ".join(f"{np.dtype(d).name}{list(sh)}" for sh, d in zip(shapes, dtypes))

    for s in sites:
        t.add_row(str(s.index), s.phase, s.primitive, esc(s.path),
                  types(s.in_shapes, s.in_dtypes), types(s.out_shapes, s.out_dtypes),
                  esc("/".join(s.scope)))
    rich_console().print(t)
    return 0


def site_json(s: peat.Site) -> dict[str, Any]:
    return {"index": s.index, "primitive": s.primitive, "path": s.path, "phase": s.phase,
            "in": [[list(sh), str(d)] for sh, d in zip(s.in_shapes, s.in_dtypes)],
            "out": [[list(sh), str(d)] for sh, d in zip(s.out_shapes, s.out_dtypes)],
            "composite": s.composite, "scope": list(s.scope), "repeats": s.repeats}


def cmd_profile(args) -> int:
    distributed.refuse("profile", processes_of(args))
    wl = named_workload(args.target)
    steps = args.steps or int(wl.config.get("steps", 100))
    substitution, names = None, intercepted(args)
    if args.kernel or args.fault:
        cand = candidate_of(args)
        sel = selector_of(args.sites, default_sites(cand))
        substitution, names = {sel: cand}, intercepted(args, cand, sel)
    elif args.sites:
        raise PeatError("--sites selects where --kernel or --fault goes; give one of them")
    with ProgressBar(not args.json) as p, peat.intercept(*names):
        g = peat.profile(wl, args.out, steps=steps, checkpoint_every=args.checkpoint_every,
                         seed=args.seed, stats_every=args.stats_every, substitution=substitution,
                         progress=p.task("golden run"),
                         precision=args.precision)
    out = {"run_dir": g.run_dir, "workload": g.workload, "steps": g.steps,
           "checkpoints": list(g.checkpoints), "loss": [g.losses[0], g.losses[-1]], "eval": g.eval,
           "resumed_from": g.resumed_from}
    peat.report.write_report(args.out)
    if args.json:
        print_json(args, out)
    else:
        resumed = f" (resumed from step {g.resumed_from})" if g.resumed_from is not None else ""
        say(args, f"golden run of {g.workload}: {g.steps} steps, loss {g.losses[0]:.4f} -> "
                   f"{g.losses[-1]:.4f}, checkpoints {list(g.checkpoints)}" + resumed)
        say(args, f"report: {args.out}/report.html")
    return 0


def cmd_playback(args) -> int:
    procs = processes_of(args)
    if procs is not None and procs.coordinator is not None and args.cell_timeout is not None:
        raise PeatError("--cell-timeout restarts its worker process, which cannot rejoin "
                        "jax.distributed: give each process its share without --coordinator "
                        "(--process-id I --num-processes N) to use a time limit")
    if procs is not None:
        distributed.start(procs, timeout=args.init_timeout,
                          heartbeat_timeout=args.heartbeat_timeout)
    try:
        cand = candidate_of(args)
        sel = selector_of(args.sites, default_sites(cand))
        if args.cell_timeout is not None and not args.worker:
            return supervise(args, cand, sel)
        with ProgressBar(not args.json) as p, peat.intercept(*intercepted(args, cand, sel)):
            res = run_playback(args, cand, sel, p.task("playback cells"),
                            procs.share if procs is not None else None)
    finally:
        distributed.finish()  # process 0 waits here for the others
    if procs is None or procs.index == 0:
        if procs is not None and procs.coordinator is not None:
            res = merged(res)  # every process has finished or died: the whole campaign
        peat.report.write_report(args.run_dir)
    print_playback(args, cand, res)
    return 1 if res.failing("local") else 0


def merged(res: "peat.PlaybackResult") -> "peat.PlaybackResult":
    """`res` with the cells of every process's results file (this process's share and the
    others'), in grid order."""
    assert res.campaign is not None  # peat.playback always records to a campaign directory
    cells = tuple(merged_records(res.campaign))
    return dataclasses.replace(res, cells=cells)


def processes_of(args) -> Optional[distributed.Processes]:
    return distributed.processes(args.coordinator, args.num_processes, args.process_id)


def run_playback(args, cand, sel, progress, host) -> "peat.PlaybackResult":
    """The campaign (this process's share of it, where `host` says); in a worker, a cell past
    its time limit ends the process so that the supervisor starts the next one."""
    try:
        return peat.playback(args.run_dir, {sel: cand},
                             checkpoints=int_list(args.checkpoints, "--checkpoints"),
                             name=args.name,
                             progress=progress, cell_timeout=args.cell_timeout, host=host)
    except peat.CellTimeout as e:
        if not args.worker:
            raise
        supervisor.exit_for_restart(str(e))


def print_playback(args, cand, res) -> None:
    records = res.records()
    failing = res.failing("local")
    first = res.first_divergence()
    counts = res.summary()
    if args.json:
        print_json(args, {"campaign": res.campaign, "cells": records, "failing": len(failing),
                           "first_divergence": first, "compiles": res.compiles,
                           "summary": counts})
        return
    rich_console().print(cells_table(f"playback of {getattr(cand, 'name', cand)}", records))
    if first:
        what = (first["local"]["summary"] if first.get("local") else
                first.get("error") or (first.get("effect") or {}).get("summary", ""))
        say(args, f"[red]first divergence: step {first['checkpoint']}, site #{first['site']} "
                   f"({first['phase']} {first['primitive']} @ {esc(first['path'])}): "
                   f"{esc(what)}[/]")
    broken = "".join(f", {counts[k]} {k}" for k in ("crashed", "timeout") if counts[k])
    say(args, f"{len(records) - len(failing)}/{len(records)} cells pass locally{broken}; "
               f"results {res.campaign}/; report {args.run_dir}/report.html")


def supervise(args, cand, sel) -> int:
    """`peat playback --cell-timeout S`: the campaign in a worker process (this command with
    `--worker`), restarted by `peat_jax._src.profiler.supervisor` until the campaign is done; the
    last worker's output and exit status are the command's."""
    procs = processes_of(args)
    share = {} if procs is None else {"host": procs.index, "hosts": procs.count}
    camp = Campaign(path=RunDir(args.run_dir).campaign(args.name or campaign_name({sel: cand})),
                    **share)
    worker = [sys.executable, "-m", "peat_jax", *args.argv, "--worker"]
    return supervisor.supervise(worker, camp, args.cell_timeout)


def cmd_runtime(args) -> int:
    distributed.refuse("runtime", processes_of(args))
    cand = candidate_of(args)
    schedule = schedule_of(args)
    run_dir = args.run_dir
    steps = args.steps
    if steps is None:
        steps = len(RunDir(run_dir).golden_losses())
    sel = selector_of(args.sites, default_sites(cand))
    with ProgressBar(not args.json) as p, peat.intercept(*intercepted(args, cand, sel)):
        r = peat.runtime(run_dir, {sel: cand}, schedule,
                         steps=steps, name=args.name or f"runtime-{cand.name}",
                         progress=p.task("training with injection"), switch=args.switch)
    peat.report.write_report(run_dir)
    if args.json:
        print_json(args, r.to_dict())
    else:
        resumed = f"resumed from step {r.resumed_from}; " if r.resumed_from is not None else ""
        say(args, f"runtime injection of {cand.name} {r.schedule}: outcome [bold]{r.outcome}[/] "
                   f"({resumed}fired at {len(r.fired_steps)} of {steps} steps; final loss "
                   f"{r.losses[-1]:.4f} vs golden {r.golden_losses[-1]:.4f})")
        say_nan_origin(args, r)
    return 0 if r.outcome == "masked" else 1


def cmd_compare(args) -> int:
    from peat_jax._src.profiler.compare import save_comparison
    c = peat.compare(args.run_a, args.run_b, replay=args.replay)
    saved = save_comparison(c)
    peat.report.write_report(args.run_a)
    if args.json:
        print_json(args, c.to_dict(), allow_nan=False)
        return 1 if c.divergence else 0
    from rich.table import Table
    t = Table(title="environments")
    for col in ("", args.run_a, args.run_b):
        t.add_column(col)
    for r in c.environments:
        style = "bold yellow" if r.differs else ""
        t.add_row(r.key, *(f"[{style}]{esc(v)}[/]" if style else esc(v) for v in (r.a, r.b)))
    rich_console().print(t)
    colour = "red" if c.divergence else "green"
    say(args, f"[{colour}]{esc(c.summary())}[/]")
    say(args, f"comparison: {saved}; report {args.run_a}/report.html")
    return 1 if c.divergence else 0


def cmd_report(args) -> int:
    path = peat.report.write_report(args.run_dir, args.output)
    if args.json:
        print_json(args, {"report": str(path)})
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
    with ProgressBar(not args.json) as p:
        g = peat.profile(wl, out, steps=args.steps, checkpoint_every=max(1, args.steps // 3),
                         seed=args.seed, progress=p.task("golden run"))
        say(args, f"golden run: {wl.name}, {g.steps} steps, loss {g.losses[0]:.4f} -> "
                   f"{g.losses[-1]:.4f}, checkpoints {list(g.checkpoints)}")
        state = peat.restore(out, 0)
        sites = peat.list_sites(wl.train_step, state, batch_at(wl, 0))
        gemm = [s for s in sites if s.primitive == "dot_general"]
        n_fwd, n_bwd = (sum(s.phase == phase for s in gemm) for phase in ("fwd", "bwd"))
        say(args, f"{len(sites)} sites in the train step, {len(gemm)} dot_general "
                   f"({n_fwd} fwd, {n_bwd} bwd)")
        campaigns: dict[str, Union[peat.Kernel, peat.Fault]] = {
            "pallas_matmul": peat.kernels.pallas_matmul(),
            "tile_bug": peat.faults.tile_boundary(block=8, axis=0, mode="garbage")}
        summary["playback"] = {}
        for name, cand in campaigns.items():
            res = peat.playback(out, {"dot_general": cand}, name=name,
                                progress=p.task(f"playback: {name}"))
            recs = res.records()
            if not args.json:
                rich_console().print(cells_table(f"playback: {getattr(cand, 'name', name)}", recs))
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
        print_json(args, summary)
        return 0
    for name, s in summary["playback"].items():
        fd = s["first_divergence"]
        say(args, f"{name}: {s['cells'] - s['failing']}/{s['cells']} cells pass "
                   f"({', '.join(s['models'])}); " +
             (f"first divergence at step {fd['checkpoint']}, site #{fd['site']} {fd['phase']} "
              f"@ {esc(fd['path'])}" if fd else "no divergence") + f"; {s['compiles']} compile(s)")
    say(args, f"runtime injection bit_flip(bit=30) {rt.schedule}: outcome [bold]{rt.outcome}[/]")
    say_nan_origin(args, rt)
    say(args, f"report: {report}   ({summary['seconds']} s)")
    return 0
