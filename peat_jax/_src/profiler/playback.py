"""Playback: replay steps of a golden run from its checkpoints with a candidate at one site.

For each chosen checkpoint c and site s (a *cell*), the train step of step c is replayed as a pure
function from checkpoint c, with the candidate active only at s, and compared with the same step
with nothing active (the same compiled executable, site index -1):
  * local: the candidate's output at s against the reference op's output on the same operands
    (for a site inside a `scan`, the iteration with the largest difference);
  * effect: the step's loss, metrics and updated params against the golden replay, in training
    terms (`peat_jax._src.profiler.effect`: which leaves moved beyond the golden's own noise, by how
    much, and what became of the step's update). Where the step moved at all, its noise is
    measured: the golden step replayed with a rounding pseudo-error at the same site (up to
    `effect.PSEUDO_SAMPLES` samples, on the same executable), a leaf moved when its change is
    beyond `effect.PSEUDO_FACTOR` times its spread under them.
The whole grid runs on one compiled executable per (workload, candidate). No activations are
stored: the batch of step c is regenerated from c, and only the diagnoses are written, one JSON
line per cell in `campaigns/<name>/results.jsonl`, appended as cells finish; running the same
campaign again skips the cells already there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src import _jax, formats
from peat_jax._src.analyzer import Signature, analyze
from peat_jax._src.judge.site import NoFloat64Candidate, SiteOp, judge_site
from peat_jax._src.detector import Diagnosis, detect
from peat_jax._src.errors import PeatError
from peat_jax._src.kernels.base import Kernel
from peat_jax._src.precision import at_matmul_precision, with_callers_precision
from peat_jax._src.profiler.campaign import Campaign, campaign_name, campaign_spec, open_campaign
from peat_jax._src.profiler.effect import (PSEUDO_SAMPLES, Effect, PseudoSpread, diagnose_effect,
                                           moved_leaves, reference_spread, step_changes)
from peat_jax._src.profiler.golden import available_checkpoints, load_workload, restore
from peat_jax._src.profiler.hostio import quiet, to_device
from peat_jax._src.profiler.lock import campaign_writer
from peat_jax._src.profiler.replay import Replay, Taps, error_line
from peat_jax._src.profiler.rundir import PathLike, RunDir, recorded_precision
from peat_jax._src.profiler.workload import Workload
from peat_jax._src.promote import traced_eqn, widened_eqn
from peat_jax._src.sites import Site, Traced, Tracer, reduction_length, select
from peat_jax._src.substitute import Candidate, Substitution, call_kernel, resolve


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (checkpoint, site) replay.

    Attributes:
      checkpoint: the step replayed (its checkpoint holds the state before it).
      site: the site the candidate was active at.
      candidate: the candidate's name.
      local: Diagnosis of the site's output (candidate vs reference op on the same operands), or
        None where it cannot be tapped (a site inside `while`/`cond`).
      effect: the `Effect` of the candidate on the step (loss, metrics and updated params
        against the golden replay): ``masked`` within the golden's noise, else what moved.
      loss: (golden, with candidate) loss of the replayed step.
      local_signature: for a failing local diagnosis, what the report draws (histograms, a
        downsampled error mask).
      effect_leaf: the path of the leaf (``loss`` or a param) that moved most against its noise
        (``effect.leaf``).
      status: "ok"; "crashed" when the candidate raised (while being traced at the site or
        while running), returned outputs of the wrong shape or dtype, or killed the worker
        process; "timeout" when the cell ran past the campaign's `cell_timeout`. A crashed or
        timed-out cell has no diagnoses, and `error` says what happened.
      error: the error message of a crashed / timed-out cell ("" otherwise).
    """

    checkpoint: int
    site: Site
    candidate: str
    local: Any
    effect: Any
    loss: tuple[float, float]
    local_signature: Optional[dict] = None
    effect_leaf: str = ""
    status: str = "ok"
    error: str = ""

    def to_record(self) -> dict[str, Any]:
        s = self.site
        return {"checkpoint": self.checkpoint, "site": s.index, "primitive": s.primitive,
                "path": s.path, "phase": s.phase, "composite": s.composite,
                "candidate": self.candidate, "status": self.status, "error": self.error,
                "local": None if self.local is None else _diag_dict(self.local),
                "effect": None if self.effect is None else self.effect.to_dict(),
                "effect_leaf": self.effect_leaf,
                "loss": list(self.loss), "local_signature": self.local_signature}


def _diag_dict(d) -> dict:
    return d.to_dict() if hasattr(d, "to_dict") else dataclasses.asdict(d)


@dataclasses.dataclass(frozen=True)
class PlaybackResult:
    """The grid of cells of one playback campaign.

    Attributes:
      cells: one `Cell` per (checkpoint, site), in (checkpoint, site) order, those resumed from
        disk included.
      campaign: the campaign directory, or None.
      compiles: executables compiled for the grid (1 when nothing had to be recompiled).
      reference_spread: for each replayed checkpoint, the largest relative difference between
        golden replays of its step (0.0: the reference is deterministic). Where it is not 0, an
        effect within `REFERENCE_SPREAD_FACTOR` (4) times the reference's own change, leaf by
        leaf, is ``masked`` (its summary says so).
    """

    cells: tuple[Any, ...]
    campaign: Optional[str]
    compiles: int
    reference_spread: dict = dataclasses.field(default_factory=dict)

    def records(self) -> list[dict]:
        return [c.to_record() if isinstance(c, Cell) else c for c in self.cells]

    def failing(self, which: str = "local") -> list[dict]:
        """Records whose `which` diagnosis ("local" or "effect") did not pass, and the cells
        that crashed or timed out (a candidate that cannot run fails its cell)."""
        return [r for r in self.records() if _status(r) != "ok" or
                (r[which] is not None and not r[which]["passed"])]

    def summary(self) -> dict[str, int]:
        """Counts of cells: ``cells``, ``passed`` / ``failed`` (local diagnosis; the effect
        where the site cannot be tapped), ``crashed``, ``timeout``."""
        out = {"cells": 0, "passed": 0, "failed": 0, "crashed": 0, "timeout": 0}
        for r in self.records():
            out["cells"] += 1
            st = _status(r)
            if st != "ok":
                out[st if st in out else "crashed"] += 1
                continue
            d = r["local"] if r["local"] is not None else r["effect"]
            out["passed" if d is not None and d["passed"] else "failed"] += 1
        return out

    def first_divergence(self, which: str = "local") -> Optional[dict]:
        """Localisation: the earliest checkpoint at which the candidate fails, and at it the
        first site (in program order) whose `which` diagnosis fails; None if all pass."""
        bad = self.failing(which)
        return min(bad, key=lambda r: (r["checkpoint"], r["site"])) if bad else None


def _status(rec: dict) -> str:
    return rec.get("status") or "ok"


def _check_cell_timeout(cell_timeout: Any) -> None:
    if cell_timeout is not None and not (isinstance(cell_timeout, (int, float))
                                         and cell_timeout > 0):
        raise PeatError(f"cell_timeout must be a positive number of seconds, got {cell_timeout!r}")


def _play_grid(run: "_Run", rd: RunDir, wl: Workload, checkpoints: Sequence[int],
               grid: Sequence[Site], todo: Any, state0: Any) -> dict[int, float]:
    """Replay this process's cells of the grid, checkpoint by checkpoint (`state0` is the first
    checkpoint's state, restored already); returns {checkpoint: the golden step's own spread}."""
    spread: dict[int, float] = {}
    for c in checkpoints:
        mine = [s for s in grid if (c, s.index) in todo]
        run.count += len(grid) - len(mine)  # resumed, or another host's
        if mine:
            state = state0 if c == checkpoints[0] else _restore(rd, wl, c)
            spread[c] = _play_checkpoint(run, c, mine, state, to_device(wl.batch(c)))
    return spread


def playback(run_dir: PathLike, substitution: Substitution, *, sites=None,
             checkpoints: Optional[Sequence[int]] = None, workload: Optional[Workload] = None,
             name: Optional[str] = None, regions: Sequence[type] = (),
             devices: Optional[Sequence[Any]] = None, host: Optional[tuple[int, int]] = None,
             progress: Optional[Callable[[int, int], None]] = None,
             cell_timeout: Optional[float] = None) -> "PlaybackResult":
    """Replay the golden run's checkpointed steps with the candidate at one site per cell.

    Args:
      run_dir: a directory made by `peat.profile`.
      substitution: `{selector: peat.Kernel or fault}` as for `peat.substitute`; its sites are
        the grid's sites.
      sites: optionally narrow the grid to the sites this selector picks.
      checkpoints: the checkpoint steps to replay (default all but the final state).
      workload: the workload object, for a workload that is not bundled.
      name: the campaign's name (default: from the candidates); results go to
        `campaigns/<name>/results.jsonl` and a rerun resumes.
      regions: as in `peat.substitute`.
      devices: the devices to spread a checkpoint's cells over (default: all local devices). With
        several, each device replays its own cell with a real switch (`jax.shard_map` over a
        `cells` mesh axis), so k devices run k cells at a time on one more compiled executable.
        A train state sharded over several devices replays one cell at a time on its own mesh
        (devices= with several devices is then an error).

      host: `(index, count)`: this process replays only its block of the grid (the cells whose
        ordinal k of the grid's N satisfies k * count // N == index), writing
        `results.p<index>-of-<count>.jsonl` (default: from
        `jax.process_index()` / `jax.process_count()`, so the same script started as N
        processes after `jax.distributed.initialize()` splits the grid; `peat playback
        --coordinator` does this, see `peat.start_distributed`). The results of all
        processes are read back merged: the returned cells are those of every process that
        were finished when this one started, and its own.
      progress: called as `progress(done, total)` after each cell.
      cell_timeout: a time limit in seconds for each cell's replay (None: no limit). A cell past
        it is recorded as "timeout" and the campaign stops with `CellTimeout` (a `PeatError`):
        a computation that hangs cannot be stopped from Python, so the next cells run after a
        restart (`peat playback --cell-timeout` runs campaigns in a worker process and restarts
        it by itself).

    The replay runs at the matmul precision the golden run recorded (`peat.profile`'s
    ``precision``), so the golden replay is bitwise the golden step.

    A candidate that fails at a site (raises, returns the wrong shape or dtype, fails while
    running) is isolated: its cells are recorded with status "crashed" and the error message,
    and the other cells run. `PlaybackResult.summary()` counts them.

    Returns:
      A `PlaybackResult` whose cells carry a `local` Diagnosis and an `effect` (`Effect`).

    Raises:
      PeatError: a bad run directory, checkpoint, selector or argument (nothing is written).
      CellTimeout: a cell ran past `cell_timeout` (it is recorded; run the campaign again).
    """
    _check_cell_timeout(cell_timeout)
    rd = RunDir(run_dir)
    manifest = rd.manifest()
    wl = load_workload(manifest, workload)
    checkpoints = _checkpoints(rd, manifest, checkpoints)
    with campaign_writer(rd.path, name, substitution, host), \
            at_matmul_precision(recorded_precision(manifest)):  # as the golden run traced it
        state0 = _restore(rd, wl, checkpoints[0])
        replay_devices = _replay_devices(state0, devices)
        traced, chosen = _trace(wl, state0, checkpoints[0], substitution, sites, regions)
        grid = [traced.sites[i] for i in chosen]
        camp = open_campaign(rd, name or campaign_name(substitution), host=host,
                             spec=campaign_spec(substitution, chosen.values(), grid, wl.name))
        replay = Replay(traced, chosen, grid, replay_devices)
        run = _Run(campaign=camp, replay=replay, chosen=chosen, cell_timeout=cell_timeout,
                   total=len(checkpoints) * len(grid), progress=progress)
        done = camp.done()
        todo = camp.todo([(c, s.index) for c in checkpoints for s in grid], done)
        spread = _play_grid(run, rd, wl, checkpoints, grid, todo, state0)
        cells = _in_order(checkpoints, grid, done, run.cells)
        return PlaybackResult(cells, str(camp.path), replay.compiles(), spread)


class CellTimeout(PeatError):
    """A playback cell ran past its time limit (recorded as 'timeout'; the campaign stopped)."""


def _checkpoints(rd: RunDir, manifest: dict, checkpoints: Optional[Sequence[int]]) -> list[int]:
    """The checkpoint steps to replay, sorted (default: all but the final state's)."""
    have = available_checkpoints(rd)
    if checkpoints is None:
        checkpoints = [c for c in have if c != manifest.get("steps")] or have
    checkpoints = sorted({int(c) for c in checkpoints})
    missing = [c for c in checkpoints if c not in have]
    if missing:
        raise PeatError(f"checkpoints {missing} are not in {rd.checkpoints}; available: {have}")
    return checkpoints


def _replay_devices(state, devices: Optional[Sequence[Any]]) -> list:
    """The devices to spread cells over: `devices` (default: all local devices), or none for a
    state laid out over several devices: its cells run one at a time on the state's own mesh,
    as the golden step did (a copy per device would be another computation)."""
    spans = max((len(leaf.sharding.device_set) for leaf in jax.tree.leaves(state)
                 if hasattr(leaf, "sharding")), default=1)
    if spans == 1:
        return jax.local_devices() if devices is None else list(devices)
    if devices is not None and len(devices) > 1:
        raise PeatError(f"devices= spreads cells over {len(devices)} devices, but this run's "
                        f"train state is sharded over {spans} devices: its cells replay on the "
                        "state's own mesh, one at a time; leave devices= out")
    return []


def _restore(rd: RunDir, wl: Workload, step: int):
    with quiet():
        return restore(rd.path, step, workload=wl)


def _trace(wl: Workload, state, step: int, substitution: Substitution, sites,
           regions: Sequence[type]) -> tuple[Traced, dict[int, Candidate]]:
    """The train step traced on `state` and the batch of `step`, and the grid's candidates by
    site index (the substitution's sites, narrowed to those `sites` selects)."""
    traced = Tracer(wl.train_step, regions=regions).trace((state, to_device(wl.batch(step))), {})
    chosen = resolve(traced.sites, substitution)
    if sites is not None:
        keep = {s.index for s in select(traced.sites, sites)}
        chosen = {i: c for i, c in chosen.items() if i in keep}
        if not chosen:
            raise PeatError("sites= and the substitution's selectors have no site in common")
    return traced, chosen


@dataclasses.dataclass
class _Run:
    """What the replays of a campaign's checkpoints share, and the cells finished so far."""

    campaign: Campaign
    replay: Replay
    chosen: dict[int, Candidate]
    cell_timeout: Optional[float]
    total: int
    progress: Optional[Callable[[int, int], None]]
    count: int = 0  # cells done: finished here, resumed, or another host's
    cells: dict[tuple[int, int], Cell] = dataclasses.field(default_factory=dict)
    shadows: dict[int, SiteOp] = dataclasses.field(default_factory=dict)  # site -> its op

    def candidate(self, site: Site) -> str:
        return getattr(self.chosen[site.index], "name", "?")

    def failed(self, checkpoint: int, site: Site, status: str, error: str) -> Cell:
        return _failed_cell(checkpoint, site, self.candidate(site), status, error)

    def finish(self, cell: Cell) -> None:
        """Record a finished cell and report progress."""
        self.campaign.record([cell.to_record()])
        self.cells[(cell.checkpoint, cell.site.index)] = cell
        self.count += 1
        if self.progress is not None:
            self.progress(self.count, self.total)


def _play_checkpoint(run: _Run, c: int, todo: Sequence[Site], state, batch) -> float:
    """Replay the cells `todo` of checkpoint `c` and record them. Returns the reference's own
    spread at `c` (the largest relative change between golden replays; 0.0: deterministic)."""
    golden = run.replay.fn(-1, state, batch)  # compiles on first use: crashed sites known
    # The reference replayed again: where it differs from itself, the candidate is not
    # blamed for differences the reference makes on its own.
    ref_spread = reference_spread(lambda: run.replay.fn(-1, state, batch), golden)
    spread = max(jax.tree.leaves(ref_spread) or [0.0])
    ref_spread = ref_spread if spread > 0 else None
    crashed = run.replay.crashed
    for s in todo:
        if s.index in crashed:
            run.finish(run.failed(c, s, "crashed", crashed[s.index]))
    groups = run.replay.groups([s for s in todo if s.index not in crashed])
    judge = _SiteJudge(run, c, state, batch)
    for group, outs in _outputs(run, c, groups, state, batch):
        changes = candidate_changes(group, golden, outs)
        pseudo = pseudo_errors(run, group, golden, changes, ref_spread, state, batch)
        for s in group:
            run.finish(_diagnosed(run, c, s, golden, outs, ref_spread, state, judge,
                                  changes.get(s.index), pseudo.get(s.index)))
            if judge.timed_out:
                raise CellTimeout(
                    f"cell {(c, s.index)} of campaign {run.campaign.name!r}: {judge.timed_out}. "
                    "It is recorded with its verdict against the float64 floors; the kernel "
                    "may still be running, so the campaign stopped here: run it again in a new "
                    "process to go on with the other cells")
    run.campaign.clear_running()
    return spread


def candidate_changes(group: Sequence[Site], golden, outs) -> dict[int, dict]:
    """Site index -> the `step_changes` of the candidate's step against the golden step, for
    the cells of `group` whose replay ran and could be read (waits for those replays)."""
    if isinstance(outs, BaseException):
        return {}
    found: dict[int, dict] = {}
    for s in group:
        try:
            found[s.index] = step_changes(golden, outs[s.index])
        except Exception:  # noqa: BLE001 - the cell is recorded as crashed by _diagnosed
            pass
    return found


def pseudo_errors(run: _Run, group: Sequence[Site], golden, changes: dict[int, dict],
                  ref_spread, state, batch) -> dict[int, PseudoSpread]:
    """Site index -> the step's `PseudoSpread` under rounding pseudo-errors at the cell's
    site, for the cells of `group` with `changes` (`candidate_changes`): the golden step
    replayed with up to `PSEUDO_SAMPLES` pseudo-errors there (the same executable, `sample`
    traced), for the cells whose step moved beyond the dtype's rounding and the reference's
    own spread; sampling stops for a cell as soon as its step is within the noise of the
    samples so far (a cell whose step went non-finite needs none: no rounding excuses it)."""
    found = {s.index: PseudoSpread() for s in group if s.index in changes}

    def moving(s: Site) -> bool:
        moved = moved_leaves(golden, changes[s.index], ref_spread, found[s.index])
        return bool(moved) and not any(changes[s.index][p][1] for p in moved)

    need = [s for s in group if s.index in found and moving(s)]
    for k in range(PSEUDO_SAMPLES):
        if not need:
            break
        try:
            steps = jax.block_until_ready(run.replay.dispatch(need, state, batch, k))
            for s in need:
                found[s.index].add(step_changes(golden, steps[s.index]))
        except Exception as e:  # noqa: BLE001 - judged without it, and the effect says why
            for s in need:
                found[s.index].error = error_line(e)
            break
        need = [s for s in need if moving(s)]
    return found


def _outputs(run: _Run, c: int, groups: list[list[Site]], state, batch) -> Iterator[tuple]:
    """(group, its replays' outputs by site index, or the exception running them raised), for
    each group in turn."""
    dispatch = run.replay.dispatch
    if run.cell_timeout is None:
        # one group in flight ahead of the one being analysed: the replays overlap the
        # analysis, and at most two groups' outputs are held
        ahead = _attempt(dispatch, groups[0], state, batch) if groups else None
        for i, group in enumerate(groups):
            outs = ahead
            ahead = _attempt(dispatch, groups[i + 1], state, batch) if i + 1 < len(groups) else None
            yield group, outs
        return
    if len(run.replay.devices) > 1 and groups:
        jax.block_until_ready(dispatch([], state, batch))  # compile outside the limit
    for group in groups:
        yield group, _time_limited(run, c, group, state, batch)


def _time_limited(run: _Run, c: int, group: Sequence[Site], state, batch) -> Any:
    """The group's replay outputs (or the exception running them raised), waited for at most
    `run.cell_timeout` seconds. While they run, the campaign's running marker holds what a
    supervisor records if the process dies. Past the limit the group's cells are recorded as
    "timeout" and `CellTimeout` is raised."""
    assert run.cell_timeout is not None  # `_outputs` limits the time only with a cell_timeout
    died = "the process died while running this cell"
    run.campaign.mark_running([run.failed(c, s, "crashed", died).to_record() for s in group])
    outs = _with_time_limit(lambda: jax.block_until_ready(run.replay.dispatch(group, state, batch)),
                            run.cell_timeout)
    if outs is not _TIMED_OUT:
        run.campaign.clear_running()  # the candidate's part is over
        return outs
    limit = f"the time limit of {run.cell_timeout:g} s"
    for s in group:
        run.finish(run.failed(c, s, "timeout", f"TimeoutError: the cell ran longer than {limit}"))
    run.campaign.clear_running()
    raise CellTimeout(
        f"cell(s) {[(c, s.index) for s in group]} of campaign {run.campaign.name!r} ran past "
        f"{limit} and are recorded as 'timeout'. The device may still be busy with them, so the "
        "campaign stopped here: run it again in a new process to go on with the other cells "
        "(`peat playback --cell-timeout` restarts its worker by itself)")


_TIMED_OUT = object()


def _attempt(fn, *args):
    """`fn(*args)`, or the exception it raised (reported on the cells it concerns)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return e


def _with_time_limit(fn, seconds: float):
    """`fn()` run in a daemon thread: its result (or the exception it raised), or `_TIMED_OUT`
    when it has not finished after `seconds`. A computation that hangs cannot be stopped from
    Python; the thread is left behind and the caller stops the campaign."""
    box: list[Any] = []
    fn = with_callers_precision(fn)
    t = threading.Thread(target=lambda: box.append(_attempt(fn)), daemon=True, name="peat-cell")
    t.start()
    t.join(seconds)
    return box[0] if box else _TIMED_OUT


def _diagnosed(run: _Run, c: int, site: Site, golden, outs, ref_spread, before,
               judge: Optional["_SiteJudge"] = None, changes: Optional[dict] = None,
               pseudo: Optional[PseudoSpread] = None) -> Cell:
    """The cell of `site` diagnosed from its replay's outputs; a crashed cell where running the
    replay raised (`outs` is then the exception) or its outputs cannot be read."""
    try:
        if isinstance(outs, BaseException):
            raise outs
        return _cell(c, site, run.candidate(site), golden, outs[site.index], ref_spread, before,
                     judge, pseudo, changes)
    except Exception as e:  # noqa: BLE001 - the candidate failed while running
        return run.failed(c, site, "crashed", error_line(e))


def _in_order(checkpoints: Sequence[int], grid: Sequence[Site], done: dict, new: dict
              ) -> tuple[Cell, ...]:
    """The grid's cells in (checkpoint, site) order, resumed from the records `done` or
    finished now (`new`); another host's cells that are not done yet are left out."""
    out = []
    for c, s in itertools.product(checkpoints, grid):
        key = (c, s.index)
        if key in done:
            out.append(_cell_from_record(done[key], s))
        elif key in new:
            out.append(new[key])
    return tuple(out)


def _failed_cell(checkpoint: int, site: Site, candidate: str, status: str, error: str) -> Cell:
    nan = float("nan")
    return Cell(checkpoint, site, candidate, None, None, (nan, nan), None, "", status, error)


def _cell_from_record(rec: dict, site: Site) -> Cell:
    """A cell read back from results.jsonl (a resumed campaign), with Diagnosis and Effect
    objects again."""
    def diag(d):
        return None if d is None else Diagnosis(d["model"], bool(d["passed"]),
                                                float(d["confidence"]), d.get("evidence", {}),
                                                d.get("summary", ""))

    return Cell(int(rec["checkpoint"]), site, rec.get("candidate", "?"), diag(rec.get("local")),
                None if rec.get("effect") is None else Effect.from_dict(rec["effect"]),
                tuple(rec.get("loss", (float("nan"), float("nan")))),
                rec.get("local_signature"), rec.get("effect_leaf", ""), _status(rec),
                rec.get("error", ""))


def _cell(checkpoint: int, site: Site, candidate: str, golden, got, ref_spread=None,
          before=None, judge: Optional["_SiteJudge"] = None,
          pseudo: Optional[PseudoSpread] = None, changes: Optional[dict] = None) -> Cell:
    """The diagnosed cell: `golden` and `got` are the golden and the candidate's replay
    outputs (new state, metrics, Taps); `before` the state the step started from; `judge`
    judges a failing site again with float64 evidence; `pseudo` the step's spread under
    rounding pseudo-errors at the site and `changes` the step's `step_changes`."""
    gs, gm, _ = golden
    cs, cm, taps = got
    local, compact = _local(site, taps, judge)
    effect = diagnose_effect((gs, gm), (cs, cm), ref_spread, before, pseudo, changes)
    return Cell(checkpoint, site, candidate, local, effect, effect.loss, compact, effect.leaf)


def _local(site: Site, taps: Taps, judge: Optional["_SiteJudge"] = None
           ) -> tuple[Optional[Diagnosis], Optional[dict]]:
    """The Diagnosis at the site (None where it was not tapped) and, when it fails, its
    compact signature for the report. The floor is the dtype bound; a failing site is judged
    again by `judge` (float64 evidence at the site), whose verdict stands where it has one."""
    if not bool(taps.found):
        return None, None
    n = int(np.prod(site.out_shapes[0]))
    shape, dtype = site.out_shapes[0], site.out_dtypes[0]
    # sliced on the host: the taps are one site output each, and eager device slicing
    # would compile a small program per distinct shape
    ct, rt = jax.device_get((taps.candidate, taps.reference))
    c, r = (np.asarray(t[:n]).reshape(shape).astype(dtype) for t in (ct, rt))
    sig = analyze(c, r)
    local = detect(sig)
    if not local.passed and judge is not None:
        sig, local = judge(site, c, r, sig, local)
    return local, None if local.passed else _compact_signature(sig, c, r)


class _SiteJudge:
    """A failing site judged again as `check_kernel` judges a failing output
    (`judge.site.judge_site`: the site's op in float64 on the golden step's operands there as the
    noise floor, their perturbations at the last bit as the conditioning floor, Monte Carlo
    arithmetic on the op as the rounding floor, and the candidate's own float64 run naming what
    remains). Kernels only (a modelled fault has no float64 run); sites that run once
    per step. The operands are read out on the first failing site of a checkpoint (one more
    compiled program per campaign). The kernel's float64 run is the candidate's code: it is
    held to the campaign's `cell_timeout` as its replay is, and past it `timed_out` says so
    (the caller records the cell and stops the campaign)."""

    def __init__(self, run: _Run, checkpoint: int, state, batch):
        self.run, self.checkpoint, self.state, self.batch = run, checkpoint, state, batch
        self._operands: Optional[dict] = None
        self.timed_out = ""   # why the campaign must stop: a float64 run past the time limit

    def __call__(self, site: Site, c: np.ndarray, r: np.ndarray, sig: Signature,
                 local: Diagnosis) -> tuple[Signature, Diagnosis]:
        kernel = self.run.chosen.get(site.index)
        if not isinstance(kernel, Kernel):
            return sig, local
        try:
            if site.repeats != 1:
                raise PeatError(f"the site runs {site.repeats} times a step (inside a scan): "
                                "its operands are not read out")
            if self._operands is None:
                self._operands = self.run.replay.operands(self.state, self.batch)
            if site.index not in self._operands:
                raise PeatError("the site's operands are not read out inside a while loop or "
                                "a branch")
            operands = jax.device_get(self._operands[site.index])
            if site.index not in self.run.shadows:   # compiled once per site and shape
                self.run.shadows[site.index] = _site_op(site, self.run.replay.eqns[site.index])
            return _judged_in_float64(site, kernel, self.run.shadows[site.index], operands,
                                      c, r, functools.partial(self._limited, site))
        except Exception as e:  # noqa: BLE001 - the dtype bound's verdict stands, and says why
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            ev = {**local.evidence, "no_float64_reference": why}
            return sig, dataclasses.replace(local, evidence=ev, summary=(
                f"{local.summary} (judged against the dtype bound: no float64 evaluation of "
                f"the site, {why})"))

    def _limited(self, site: Site, fn: Callable[[], Any]) -> Any:
        """`fn()` (the kernel's float64 run at `site`) held to the campaign's `cell_timeout`
        and marked running meanwhile (a process that dies in it leaves the cell "crashed");
        `_KernelTimedOut` past the limit."""
        run = self.run
        if run.cell_timeout is None:
            return fn()
        died = "the process died while running the kernel in float64"
        run.campaign.mark_running([run.failed(self.checkpoint, site, "crashed", died).to_record()])
        try:
            out = _with_time_limit(fn, run.cell_timeout)
        finally:
            run.campaign.clear_running()
        if out is _TIMED_OUT:
            self.timed_out = (f"the kernel's float64 run ran past the time limit of "
                              f"{run.cell_timeout:g} s")
            raise _KernelTimedOut(self.timed_out)
        if isinstance(out, BaseException):
            raise out
        return out


def _site_op(site: Site, eqn) -> SiteOp:
    """The site's op as `judge.site` evaluates it: in float64 and as traced."""
    k = next(i for i, d in enumerate(site.out_dtypes) if jnp.issubdtype(d, jnp.floating))
    return SiteOp(float64=widened_eqn(eqn), traced=traced_eqn(eqn), output=k,
                  reduction_length=reduction_length(site))


class _KernelTimedOut(NoFloat64Candidate):
    """The kernel's float64 run at a site ran past the campaign's time limit."""


def _judged_in_float64(site: Site, kernel: Kernel, op: SiteOp, operands, c: np.ndarray,
                       r: np.ndarray, limited: Callable[[Callable[[], Any]], Any] = lambda f: f()
                       ) -> tuple[Signature, Diagnosis]:
    """`judge.site.judge_site` of the site's candidate output `c` against the reference's `r`,
    the kernel's float64 run held by `limited(fn)` (a time limit, in the campaign)."""
    def kernel64():   # x64 is set in the thread that runs it (jax's config is per thread)
        with jax.enable_x64(True), _callback_errors_unlogged():
            x64 = [np.asarray(x, np.float64) if jnp.issubdtype(np.asarray(x).dtype, jnp.floating)
                   else x for x in operands]
            return np.asarray(call_kernel(kernel, _widened_site(site), x64)[op.output])

    return judge_site(op, operands, c, r, seed=site.index, candidate64=lambda: limited(kernel64))


@contextlib.contextmanager
def _callback_errors_unlogged():
    """jax's log of an exception inside a callback (a checked Pallas kernel that cannot run
    in float64 fails there) silenced: the exception itself still reaches the caller."""
    logger = _jax.io_callback_logger()
    drop = logging.Filter("nothing")   # a filter that passes no record of "jax._src.callback"
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _widened_site(site: Site) -> Site:
    """`site` with a float `preferred_element_type` made float64 (the candidate's float64
    run computes in float64 where the op's params would pin its output narrower)."""
    pref = site.params.get("preferred_element_type")
    if pref is None or not jnp.issubdtype(pref, jnp.floating):
        return site
    return dataclasses.replace(site, params={**site.params,
                                             "preferred_element_type": np.dtype(np.float64)})


_MASK_SIDE = 48


@jax.jit
def _mask_grid(c, r):
    """Fraction of differing elements in each block of a <= 48 x 48 grid over the output viewed
    as (rows = all leading axes, cols = last axis)."""
    c2 = c.reshape(-1, c.shape[-1]) if c.ndim else c.reshape(1, 1)
    r2 = r.reshape(c2.shape)
    wrong = ~((c2 == r2) | (jnp.isnan(c2) & jnp.isnan(r2)))
    rows, cols = wrong.shape
    br, bc = -(-rows // _MASK_SIDE), -(-cols // _MASK_SIDE)
    pr, pc = -(-rows // br) * br, -(-cols // bc) * bc
    w = jnp.pad(wrong.astype(jnp.float32), ((0, pr - rows), (0, pc - cols)))
    return w.reshape(pr // br, br, pc // bc, bc).mean(axis=(1, 3))


def _compact_signature(sig, c, r) -> dict:
    """What the report draws for a failing cell: histograms and a downsampled error mask."""
    out: dict[str, Any] = {"dtype": sig.dtype, "shape": list(sig.shape)}
    if sig.errors is not None:
        out["ulp_histogram"] = [int(x) for x in sig.errors.ulp_histogram]
    if sig.bits is not None:
        out["bit_histogram"] = [int(x) for x in sig.bits.histogram]
        out["bit_classes"] = formats.bit_classes(sig.dtype)
    grid = np.asarray(_mask_grid(c, r))
    out["mask"] = [[round(float(v), 3) for v in row] for row in grid]
    rows = int(np.prod(c.shape[:-1])) if c.ndim > 1 else 1
    cols = c.shape[-1] if c.ndim else 1
    out["mask_note"] = f"{rows} rows x {cols} cols, {grid.shape[0]}x{grid.shape[1]} blocks"
    return out
