"""Playback: replay steps of a golden run from its checkpoints with a candidate at one site.

For each chosen checkpoint c and site s (a *cell*), the train step of step c is replayed as a pure
function from checkpoint c, with the candidate active only at s, and compared with the same step
with nothing active (the same compiled executable, site index -1):
  * local: the candidate's output at s against the reference op's output on the same operands
    (for a site inside a `scan`, the iteration with the largest difference);
  * effect: the step's loss and its updated params against the golden replay (diagnosed on the
    leaf that changed most).
The whole grid runs on one compiled executable per (workload, candidate). No activations are
stored: the batch of step c is regenerated from c, and only the diagnoses are written, one JSON
line per cell in `campaigns/<name>/results.jsonl`, appended as cells finish; running the same
campaign again skips the cells already there.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from peat_jax.errors import PeatError
from peat_jax.faults import Fault
from peat_jax.profiler.golden import _quiet, _to_device, available_checkpoints, load_workload, restore
from peat_jax.profiler.rundir import PathLike, RunDir, append_jsonl, atomic_write_json, read_jsonl
from peat_jax.profiler.workload import Workload
from peat_jax.sites import Site, Tracer, select
from peat_jax.substitute import Substitution, _run_candidate, _static_key, resolve
from peat_jax import _interpreter as _ip

__all__ = ["Cell", "CellTimeout", "PlaybackResult", "playback"]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (checkpoint, site) replay.

    Attributes:
      checkpoint: the step replayed (its checkpoint holds the state before it).
      site: the site the candidate was active at.
      candidate: the candidate's name.
      local: Diagnosis of the site's output (candidate vs reference op on the same operands), or
        None where it cannot be tapped (a site inside `while`/`cond`).
      effect: Diagnosis of the step's loss and updated params against the golden replay.
      loss: (golden, with candidate) loss of the replayed step.
      local_signature: for a failing local diagnosis, what the report draws (histograms, a
        downsampled error mask).
      effect_leaf: the path of the leaf (`['loss']` or a param) that changed most; `effect` is
        that leaf's diagnosis.
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
                "effect": None if self.effect is None else _diag_dict(self.effect),
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
        leaf, is not blamed on the candidate (its evidence says so).
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


def _substitution_digest(substitution: Substitution) -> str:
    """Hex digest of the selectors, candidate names and fault parameters (two faults of one
    kind with other parameters, e.g. scale(2.0) and scale(1.0), differ)."""
    return hashlib.sha1(repr(sorted((repr(k), getattr(c, "name", "?"),
                                     repr(getattr(c, "params", "")))
                                    for k, c in substitution.items())).encode()).hexdigest()


def _campaign_name(substitution: Substitution) -> str:
    names = "+".join(sorted(getattr(c, "name", "?") for c in substitution.values()))
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", names)[:48].strip("_") or "campaign"
    return f"{slug}-{_substitution_digest(substitution)[:8]}"


def _pad(x: jax.Array, n: int) -> jax.Array:
    flat = x.reshape(-1).astype(jnp.float32)
    return jnp.pad(flat, (0, n - flat.size))


class _Replay:
    """One compiled executable: (site index, state, batch) -> (new state, metrics, local taps)."""

    def __init__(self, train_step, traced, chosen: dict, sites: list[Site]):
        self.traced, self.chosen = traced, chosen
        outs = [s for s in sites]
        self.width = max(int(np.prod(s.out_shapes[0])) for s in outs) if outs else 1
        self.fn = jax.jit(self._run)
        self._multi = None
        # site index -> error message, for candidates that raised while being traced there
        # (wrong output shape or dtype included); filled when `fn` is first traced
        self.crashed: dict[int, str] = {}

    def multi(self, devices: Sequence[Any]):
        """The replay spread over `devices`: site indices [len(devices)] (one per device, each
        device runs its own cell with a real switch), state and batch replicated; outputs gain a
        leading device axis."""
        if self._multi is None:
            from jax.sharding import Mesh, PartitionSpec as P
            mesh = Mesh(np.asarray(devices), ("cells",))

            def per_device(site_index, state, batch):
                out = self._run(site_index[0], state, batch)
                return jax.tree.map(lambda x: x[None], out)

            fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("cells"), P(), P()),
                                       out_specs=P("cells"), check_vma=False))
            spread = jax.sharding.NamedSharding(mesh, P("cells"))
            same = jax.sharding.NamedSharding(mesh, P())

            def run(ids, state, batch):
                state, batch = jax.device_put((state, batch), same)
                return fn(jax.device_put(ids, spread), state, batch)

            run._cache_size = fn._cache_size
            self._multi = run
        return self._multi

    def _run(self, site_index, state, batch):
        traced, width = self.traced, self.width
        rules = {}
        for idx, cand in self.chosen.items():
            site = traced.sites[idx]
            k = next((i for i, d in enumerate(site.out_dtypes)
                      if jnp.issubdtype(d, jnp.inexact)), 0)

            def rule(op, invals, reference, site=site, cand=cand, k=k):
                key = _static_key(site, cand) if isinstance(cand, Fault) else None

                def on(*vals):
                    ref = reference(*vals)
                    got = _run_candidate(cand, site, vals, reference, key)
                    got = [lax.convert_element_type(o, v.aval.dtype)
                           for o, v in zip(got, op.eqn.outvars)]
                    return got, (_pad(got[k], width), _pad(ref[k], width))

                def off(*vals):
                    ref = reference(*vals)
                    ref = [lax.convert_element_type(o, jnp.result_type(o)) for o in ref]
                    zero = jnp.zeros((width,), jnp.float32)
                    return ref, (zero, zero)

                try:
                    outs, taps = lax.cond(site_index == site.index, on, off, *invals)
                except Exception as e:  # noqa: BLE001 - the candidate failed at this site
                    # Isolated: its cells are recorded as crashed, the rest of the grid runs.
                    self.crashed.setdefault(site.index, _error_line(e))
                    outs, taps = off(*invals)
                return _ip.WithSide(outs, taps, _worst_iteration)

            rules[idx] = rule
        flat = traced.flat_args((state, batch), {})
        outs, sides = _ip.evaluate(traced.program, rules, traced.program.closed_jaxpr.consts, flat,
                                   with_sides=True)
        new_state, metrics = jax.tree.unflatten(traced.out_tree, outs)
        zero = jnp.zeros((width,), jnp.float32)
        cand_tap, ref_tap, found = zero, zero, jnp.zeros((), bool)
        for idx, (c, r) in sides.items():
            hit = site_index == idx
            cand_tap = jnp.where(hit, c, cand_tap)
            ref_tap = jnp.where(hit, r, ref_tap)
            found = found | hit
        return new_state, metrics, (cand_tap, ref_tap, found)


def _error_line(e: BaseException) -> str:
    """`Type: first line of the message` of an exception, for a crashed cell's record."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    if not lines:
        return type(e).__name__
    head = lines[0]
    if len(lines) > 1 and "Traceback (most recent call last)" in str(e):
        # an error raised in a host callback: XLA wraps the callback's traceback; its last line
        # is the callback's own exception
        head = head.split("Traceback (most recent call last)")[0].rstrip(" :") + ": " + lines[-1]
    return f"{type(e).__name__}: {head}"[:1000]


def _worst_iteration(stacked):
    c, r = stacked
    err = jnp.max(jnp.where(jnp.isnan(c - r), jnp.inf, jnp.abs(c - r)), axis=1)
    i = jnp.argmax(err)
    return c[i], r[i]


def _effect_tree(state, metrics) -> dict:
    if isinstance(state, dict) and "params" in state:
        return {"loss": metrics["loss"], "params": state["params"]}
    return {"loss": metrics["loss"], "state": state}


@jax.jit
def _relative_changes(got, golden):
    """Per leaf: max |got - golden| / max(max |golden|, tiny), NaN-aware (inf when the
    non-finite pattern differs)."""
    def one(c, g):
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            return jnp.where(jnp.all(c == g), 0.0, jnp.inf).astype(jnp.float32)
        c32, g32 = c.astype(jnp.float32), g.astype(jnp.float32)
        same_nan = jnp.isnan(c32) & jnp.isnan(g32)
        d = jnp.where(same_nan, 0.0, jnp.abs(c32 - g32))
        d = jnp.where(jnp.isnan(d), jnp.inf, d)
        scale = jnp.maximum(jnp.max(jnp.where(jnp.isfinite(g32), jnp.abs(g32), 0.0)), 1e-30)
        return jnp.max(d) / scale if d.size else jnp.float32(0)
    return jax.tree.map(one, got, golden)


def _reference_spread(replay, golden, state, batch) -> Any:
    """Per effect leaf, the largest relative change between golden replays of the step (floats
    on the host): all 0.0 for a deterministic reference (two replays agree bitwise); otherwise
    the maximum over three replays' pairs, a steadier estimate of the reference's own spread."""
    g = _effect_tree(*golden[:2])
    runs = [_effect_tree(*replay.fn(-1, state, batch)[:2])]
    first = jax.device_get(_relative_changes(runs[0], g))
    if not any(float(v) > 0 for v in jax.tree.leaves(first)):
        return jax.tree.map(float, first)
    runs.append(_effect_tree(*replay.fn(-1, state, batch)[:2]))
    more = jax.device_get((_relative_changes(runs[1], g), _relative_changes(runs[1], runs[0])))
    return jax.tree.map(lambda *v: max(float(x) for x in v), first, *more)


def _effect(analyze, detect, golden, got, ref_spread=None) -> tuple[Any, str]:
    """The step's effect: the Diagnosis of the leaf (loss or a param) that changed most,
    relative to its own scale, and that leaf's path. One small reduction over all leaves picks
    it, so the full analysis runs on one leaf (and compiles once per leaf shape, not per tree).

    `ref_spread` (`_reference_spread`, when the reference is nondeterministic) excuses changes
    within `REFERENCE_SPREAD_FACTOR` times the reference's own in every leaf: those pass as
    `numerical_noise` with the evidence saying why."""
    (gs, gm), (cs, cm) = golden, got
    g_tree, c_tree = _effect_tree(gs, gm), _effect_tree(cs, cm)
    rel = jax.tree_util.tree_flatten_with_path(jax.device_get(_relative_changes(c_tree, g_tree)))[0]
    paths = [jax.tree_util.keystr(p) for p, _ in rel]
    values = [float(v) for _, v in rel]
    if ref_spread is not None:
        own = [float(v) for v in jax.tree.leaves(ref_spread)]
        from peat_jax.check import REFERENCE_SPREAD_FACTOR
        # (+ 4 float32 ULPs: relative changes this small are quantised)
        if all(v <= REFERENCE_SPREAD_FACTOR * o + 4 * 2.0 ** -23 for v, o in zip(values, own)):
            from peat_jax.detector import Diagnosis
            k = int(np.argmax(values))
            return Diagnosis(
                "numerical_noise", True, 0.5,
                {"reference_nondeterministic": True, "change": values[k],
                 "reference_change": own[k]},
                f"within the reference's own run-to-run difference ({values[k]:.3g} vs "
                f"{own[k]:.3g} relative at {paths[k]}): the reference is nondeterministic"), paths[k]
    k = int(np.argmax(values)) if any(v > 0 for v in values) else 0
    leaf_c, leaf_g = jax.tree.leaves(c_tree)[k], jax.tree.leaves(g_tree)[k]
    return detect(analyze(leaf_c, leaf_g)), paths[k]


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

      host: `(index, count)`: this process replays only the cells whose ordinal in the grid is
        `index` mod `count`, writing `results.host<index>.jsonl` (default: from
        `jax.process_index()` / `jax.process_count()` after `jax.distributed.initialize()`, so
        the same script started on every host splits the grid). Results of all hosts are read
        back together.
      progress: called as `progress(done, total)` after each cell.
      cell_timeout: a time limit in seconds for each cell's replay (None: no limit). A cell past
        it is recorded as "timeout" and the campaign stops with `CellTimeout` (a `PeatError`):
        a computation that hangs cannot be stopped from Python, so the next cells run after a
        restart (`peat playback --cell-timeout` runs campaigns in a worker process and restarts
        it by itself).

    A candidate that fails at a site (raises, returns the wrong shape or dtype, fails while
    running) is isolated: its cells are recorded with status "crashed" and the error message,
    and the other cells run. `PlaybackResult.summary()` counts them.

    Returns:
      A `PlaybackResult` whose cells carry `local` and `effect` Diagnoses.

    Raises:
      PeatError: a bad run directory, checkpoint, selector or argument (nothing is written).
      CellTimeout: a cell ran past `cell_timeout` (it is recorded; run the campaign again).
    """
    if cell_timeout is not None and not (isinstance(cell_timeout, (int, float))
                                         and cell_timeout > 0):
        raise PeatError(f"cell_timeout must be a positive number of seconds, got {cell_timeout!r}")
    from peat_jax.analyzer import analyze
    from peat_jax.detector import detect

    rd = RunDir(run_dir)
    manifest = rd.manifest()
    wl = load_workload(manifest, workload)
    have = available_checkpoints(rd)
    final = manifest.get("steps")
    if checkpoints is None:
        checkpoints = [c for c in have if c != final] or have
    checkpoints = sorted({int(c) for c in checkpoints})
    missing = [c for c in checkpoints if c not in have]
    if missing:
        raise PeatError(f"checkpoints {missing} are not in {rd.checkpoints}; available: {have}")
    with _quiet():
        state0 = restore(rd.path, checkpoints[0], workload=wl)
    batch0 = _to_device(wl.batch(checkpoints[0]))
    tracer = Tracer(wl.train_step, regions=regions)
    traced = tracer.trace((state0, batch0), {})
    chosen = resolve(traced.sites, substitution)
    if sites is not None:
        keep = {s.index for s in select(traced.sites, sites)}
        chosen = {i: c for i, c in chosen.items() if i in keep}
        if not chosen:
            raise PeatError("sites= and the substitution's selectors have no site in common")
    grid_sites = [traced.sites[i] for i in chosen]
    name = name or _campaign_name(substitution)
    camp = rd.campaign(name)
    spec = {"candidates": sorted({getattr(c, "name", "?") for c in chosen.values()}),
            "sites": [s.index for s in grid_sites], "workload": wl.name,
            "substitution": _substitution_digest(substitution)}
    spec_path = camp / "campaign.json"
    if spec_path.exists():
        import json
        try:
            old = json.loads(spec_path.read_text())
            if not isinstance(old, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise PeatError(f"{spec_path} is damaged ({e}); move the campaign directory away to "
                            "run it afresh, or choose another name") from None
        if (old.get("candidates") != spec["candidates"] or old.get("workload") != spec["workload"]
                or old.get("substitution", spec["substitution"]) != spec["substitution"]):
            raise PeatError(f"campaign {name!r} in {camp} was run with another substitution "
                            f"(candidates {old.get('candidates')} on {old.get('workload')!r}); "
                            "choose another name")
    else:
        atomic_write_json(spec_path, spec)
    h_index, h_count = host if host is not None else (jax.process_index(), jax.process_count())
    if not (isinstance(h_count, int) and h_count >= 1 and isinstance(h_index, int)
            and 0 <= h_index < h_count):
        raise PeatError(f"host must be (index, count) with 0 <= index < count, got {host!r}")
    results_path = camp / ("results.jsonl" if h_count == 1 else f"results.host{h_index}.jsonl")
    done = {}
    for f in sorted(camp.glob("results*.jsonl")):
        for r in read_jsonl(f):
            if "checkpoint" in r and "site" in r:
                done[(int(r["checkpoint"]), int(r["site"]))] = r
    ordinal = {(c, s.index): k for k, (c, s) in
               enumerate((c, s) for c in checkpoints for s in grid_sites)}
    mine = lambda c, s: ordinal[(c, s.index)] % h_count == h_index  # noqa: E731
    replay = _Replay(wl.train_step, traced, chosen, grid_sites)
    devices = list(jax.local_devices()) if devices is None else list(devices)
    width = max(1, len(devices))
    total = len(checkpoints) * len(grid_sites)
    running = _running_path(results_path)
    cells: list[Any] = []
    spread: dict[int, float] = {}
    count = 0

    def dispatch(group, state, batch) -> dict[int, Any]:
        """Start the replays of `group` (asynchronously): site index -> (state, metrics, taps)."""
        if len(devices) > 1:
            ids = [s.index for s in group] + [-1] * (len(devices) - len(group))
            out = replay.multi(devices)(jnp.asarray(ids, jnp.int32), state, batch)
            home = jax.tree.leaves(state)[0].sharding
            return {s.index: jax.device_put(jax.tree.map(lambda x, j=j: x[j], out), home)
                    for j, s in enumerate(group)}
        return {group[0].index: replay.fn(group[0].index, state, batch)}

    for c in checkpoints:
        todo = [s for s in grid_sites if (c, s.index) not in done and mine(c, s)]
        count += len(grid_sites) - len(todo)  # resumed, or another host's
        new: dict[int, Cell] = {}

        def finish(cell: Cell) -> None:
            nonlocal count
            append_jsonl(results_path, [cell.to_record()])
            new[cell.site.index] = cell
            count += 1
            if progress is not None:
                progress(count, total)

        if todo:
            with _quiet():
                state = restore(rd.path, c, workload=wl) if c != checkpoints[0] else state0
            batch = _to_device(wl.batch(c))
            golden = replay.fn(-1, state, batch)  # compiles on first use: crashed sites known
            # The reference replayed again: where it differs from itself, the candidate is not
            # blamed for differences the reference makes on its own.
            ref_spread = _reference_spread(replay, golden, state, batch)
            spread[c] = max(jax.tree.leaves(ref_spread) or [0.0])
            ref_spread = ref_spread if spread[c] > 0 else None
            name_of = lambda s: getattr(chosen[s.index], "name", "?")  # noqa: E731
            for s in todo:
                if s.index in replay.crashed:
                    finish(_failed_cell(c, s, name_of(s), "crashed", replay.crashed[s.index]))
            runnable = [s for s in todo if s.index not in replay.crashed]
            groups = [runnable[i:i + width] for i in range(0, len(runnable), width)]
            if cell_timeout is not None and len(devices) > 1 and groups:
                jax.block_until_ready(dispatch([], state, batch))  # compile outside the limit
            ahead = None
            for gi, group in enumerate(groups):
                if cell_timeout is None:
                    # one group in flight ahead of the one being analysed: the replays overlap
                    # the analysis, and at most two groups' outputs are held
                    outs = ahead if ahead is not None else _attempt(dispatch, group, state, batch)
                    ahead = (_attempt(dispatch, groups[gi + 1], state, batch)
                             if gi + 1 < len(groups) else None)
                else:
                    # what a supervisor records if this process dies in these cells
                    atomic_write_json(running, {"records": [_failed_cell(
                        c, s, name_of(s), "crashed", "the process died while running this cell"
                    ).to_record() for s in group]})
                    outs = _with_time_limit(lambda g=group: jax.block_until_ready(
                        dispatch(g, state, batch)), cell_timeout)
                    if outs is not _TIMED_OUT:
                        running.unlink(missing_ok=True)  # the candidate's part is over
                    if outs is _TIMED_OUT:
                        msg = (f"TimeoutError: the cell ran longer than the time limit of "
                               f"{cell_timeout:g} s")
                        for s in group:
                            finish(_failed_cell(c, s, name_of(s), "timeout", msg))
                        running.unlink(missing_ok=True)
                        raise CellTimeout(
                            f"cell(s) {[(c, s.index) for s in group]} of campaign {name!r} ran "
                            f"past the time limit of {cell_timeout:g} s and are recorded as "
                            "'timeout'. The device may still be busy with them, so the campaign "
                            "stopped here: run it again in a new process to go on with the other "
                            "cells (`peat playback --cell-timeout` restarts its worker by itself)")
                for s in group:
                    try:
                        if isinstance(outs, BaseException):
                            raise outs
                        cell = _cell(analyze, detect, c, s, chosen[s.index], golden,
                                     outs[s.index], ref_spread)
                    except Exception as e:  # noqa: BLE001 - the candidate failed while running
                        cell = _failed_cell(c, s, name_of(s), "crashed", _error_line(e))
                    finish(cell)
            running.unlink(missing_ok=True)
        for s in grid_sites:
            if (c, s.index) in done:
                cells.append(_cell_from_record(done[(c, s.index)], s))
            elif s.index in new:
                cells.append(new[s.index])
    compiles = replay.fn._cache_size() + (replay._multi._cache_size() if replay._multi else 0)
    return PlaybackResult(tuple(cells), str(camp), compiles, spread)


class CellTimeout(PeatError):
    """A playback cell ran past its time limit (recorded as 'timeout'; the campaign stopped)."""


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
    import threading
    box: list[Any] = []

    def run():
        box.append(_attempt(fn))

    t = threading.Thread(target=run, daemon=True, name="peat-cell")
    t.start()
    t.join(seconds)
    return box[0] if box else _TIMED_OUT


def _running_path(results_path):
    return results_path.with_name(results_path.name + ".running")


def _failed_cell(checkpoint: int, site: Site, candidate: str, status: str, error: str) -> Cell:
    nan = float("nan")
    return Cell(checkpoint, site, candidate, None, None, (nan, nan), None, "", status, error)


def _cell_from_record(rec: dict, site: Site) -> Cell:
    """A cell read back from results.jsonl (a resumed campaign), with Diagnosis objects again."""
    from peat_jax.detector import Diagnosis

    def diag(d):
        return None if d is None else Diagnosis(d["model"], bool(d["passed"]),
                                                float(d["confidence"]), d.get("evidence", {}),
                                                d.get("summary", ""))

    return Cell(int(rec["checkpoint"]), site, rec.get("candidate", "?"), diag(rec.get("local")),
                diag(rec.get("effect")), tuple(rec.get("loss", (float("nan"), float("nan")))),
                rec.get("local_signature"), rec.get("effect_leaf", ""), _status(rec),
                rec.get("error", ""))


def _cell(analyze, detect, checkpoint: int, site: Site, cand, golden, got,
          ref_spread=None) -> Cell:
    gs, gm, _ = golden
    cs, cm, (ct, rt, found) = got
    local, compact = None, None
    if bool(found):
        n = int(np.prod(site.out_shapes[0]))
        shape, dtype = site.out_shapes[0], site.out_dtypes[0]
        # sliced on the host: the taps are one site output each, and eager device slicing
        # would compile a small program per distinct shape
        ct, rt = jax.device_get((ct, rt))
        c, r = (np.asarray(t[:n]).reshape(shape).astype(dtype) for t in (ct, rt))
        sig = analyze(c, r)
        local = detect(sig)
        if not local.passed:
            compact = _compact_signature(sig, c, r)
    effect, leaf = _effect(analyze, detect, (gs, gm), (cs, cm), ref_spread)
    return Cell(checkpoint, site, getattr(cand, "name", "?"), local, effect,
                (float(gm["loss"]), float(cm["loss"])), compact, leaf)


_MASK_SIDE = 48


def _bit_classes(dtype: str, nbits: int) -> list[str]:
    mant = {"float32": 23, "bfloat16": 7, "float16": 10, "float64": 52}.get(dtype, nbits - 9)
    return ["mantissa" if i < mant else "sign" if i == nbits - 1 else "exponent" for i in range(nbits)]


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
        out["bit_classes"] = _bit_classes(sig.dtype, len(out["bit_histogram"]))
    grid = np.asarray(_mask_grid(c, r))
    out["mask"] = [[round(float(v), 3) for v in row] for row in grid]
    rows = int(np.prod(c.shape[:-1])) if c.ndim > 1 else 1
    out["mask_note"] = f"{rows} rows x {c.shape[-1] if c.ndim else 1} cols, {grid.shape[0]}x{grid.shape[1]} blocks"
    return out
