"""Frequency-based runtime injection: train with the candidate switched in by a schedule, inside
one jitted step, and classify what it did to training against the golden run's own noise."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from peat_jax._src import taxonomy
from peat_jax._src.errors import PeatError
from peat_jax._src.precision import at_matmul_precision
from peat_jax._src.profiler.campaign import substitution_digest
from peat_jax._src.profiler.golden import load_workload, restore, scalar_metrics, state_digest
from peat_jax._src.profiler.hostio import quiet, to_device
from peat_jax._src.profiler.lock import runtime_writer
from peat_jax._src.profiler.nan_origin import NanOrigin, golden_absmax, step_nan_origin, tree_finite
from peat_jax._src.profiler.rundir import (PathLike, RunDir, atomic_write_json, recorded_precision,
                                           run_identity)
from peat_jax._src.profiler.workload import Workload
from peat_jax._src.schedule import SWITCHES, InjectedStep, Schedule, default_switch
from peat_jax._src.substitute import Substitution


OUTCOMES = taxonomy.OUTCOMES


@dataclasses.dataclass(frozen=True)
class RuntimeResult:
    """Training with the candidate switched in on scheduled steps, against the golden run.

    Attributes:
      outcome: one of OUTCOMES (rules in `classify_outcome`).
      losses: loss per step with the candidate (step 0 first).
      golden_losses: the golden loss per step.
      fired_steps: the steps at which the schedule fired.
      band: the noise band (loss units) the outcome was judged against.
      evidence: the numbers behind the outcome.
      schedule: the schedule, as text.
      nan_origin: where the first non-finite value was born (`NanOrigin`: the first site whose
        output was non-finite at the first step whose loss or new state was, and in `blew_up`
        the first site before it whose output left the golden run's range), or None.
      resumed_from: the step an interrupted run resumed from, or None for a run in one go.
    """

    outcome: str
    losses: tuple[float, ...]
    golden_losses: tuple[float, ...]
    fired_steps: tuple[int, ...]
    band: float
    evidence: dict
    schedule: str
    nan_origin: Optional[NanOrigin] = None
    resumed_from: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _noise_band(golden: np.ndarray, k: float) -> float:
    """k standard deviations of the golden loss's batch-to-batch noise, floored at 1e-6 of the
    mean loss. The noise is estimated from second differences, which cancel the training trend
    locally: for white noise of std s, g[t+1] - 2 g[t] + g[t-1] has std s * sqrt(6); the robust
    std (MAD * 1.4826) of those, over sqrt(6), estimates s."""
    finite = golden[np.isfinite(golden)]
    floor = 1e-6 * (abs(float(finite.mean())) if finite.size else 1.0)
    if finite.size < 4:
        return floor
    d2 = finite[2:] - 2 * finite[1:-1] + finite[:-2]
    sigma = float(np.median(np.abs(d2 - np.median(d2)))) * 1.4826 / np.sqrt(6.0)
    return max(k * sigma, floor)


def classify_outcome(losses: Sequence[float], golden: Sequence[float], fired: Sequence[int], *,
                     k: float = 3.0, tail: float = 0.2) -> tuple[str, float, dict]:
    """Training outcome of an injected run against the golden one, by these rules in order.

    With d_t = loss_t - golden_t, band = `k` robust std of the golden loss's batch-to-batch noise
    (see `_noise_band`), the
    tail = the last `tail` fraction of steps (at least 3), and f = the first fired step:
      1. `immediate_nan_inf`: a non-finite loss appears at step f or f+1 (the step that fired, or
         the first step that sees its update).
      2. `diverged`: a non-finite loss appears later, or the tail's mean d exceeds 10 band and the
         tail's mean loss is above the golden's first loss (training was lost).
      3. `masked`: |d_t| <= band at every step.
      4. `spike_and_recover`: |d_t| > band somewhere, but |mean d| over the tail <= band.
      5. `sharp_degrade`: |the tail's mean d| > band and |d| reached half of that level within 3
         steps of first leaving the band (a step change).
      6. `slow_degrade`: |the tail's mean d| > band, reached gradually.
      Rules 5 and 6 judge fidelity to the golden trajectory: a run that ends with a lower loss is
      still a lasting departure (the sign is in `evidence["tail_mean_difference"]`).

    Returns:
      (outcome, band, evidence).
    """
    x = np.asarray(losses, np.float64)
    g = np.asarray(golden, np.float64)
    if x.shape != g.shape or x.size == 0:
        raise PeatError(f"losses ({x.size}) and golden losses ({g.size}) must be non-empty and of "
                        "the same length")
    band = _noise_band(g, k)
    first_fired = min(fired) if len(fired) else None
    bad = np.flatnonzero(~np.isfinite(x))
    ev: dict[str, Any] = {"band": band, "k": k, "first_fired": first_fired}
    if bad.size:
        first_bad = int(bad[0])
        ev["first_non_finite_step"] = first_bad
        if first_fired is not None and first_bad - first_fired in (0, 1):
            return "immediate_nan_inf", band, ev
        return "diverged", band, ev
    d = x - g
    n_tail = max(3, int(math.ceil(tail * x.size)))
    tail_d = float(np.mean(d[-n_tail:]))
    out_of_band = np.flatnonzero(np.abs(d) > band)
    ev.update({"max_abs_difference": float(np.max(np.abs(d))), "tail_mean_difference": tail_d,
               "tail_steps": n_tail, "steps_out_of_band": int(out_of_band.size)})
    if tail_d > 10 * band and float(np.mean(x[-n_tail:])) > float(g[0]):
        return "diverged", band, ev
    if out_of_band.size == 0:
        return "masked", band, ev
    ev["first_out_of_band_step"] = int(out_of_band[0])
    if abs(tail_d) <= band:
        return "spike_and_recover", band, ev
    start = int(out_of_band[0])
    early = np.abs(d[start:start + 3])
    sharp = bool(early.size and float(np.max(early)) >= 0.5 * abs(tail_d))
    ev["sharp"] = sharp
    return ("sharp_degrade" if sharp else "slow_degrade"), band, ev


PARTIAL = "runtime.partial.json"
STATES = "runtime-state"


def runtime_spec(manifest: Mapping[str, Any], substitution: Substitution, schedule: Schedule,
                 steps: Union[int, np.integer], regions: Sequence[type],
                 switch: str) -> dict[str, Any]:
    """What a stored runtime run is: the golden run, the substitution's digest and candidates,
    the schedule, the steps, the regions and the switch (`schedule.SWITCHES`: the two need not
    agree bitwise on steps that do not fire). A run is resumed only with the same spec."""
    return {"run": run_identity(manifest), "substitution": substitution_digest(substitution),
            "candidates": sorted({getattr(c, "name", "?") for c in substitution.values()}),
            "schedule": str(schedule), "steps": int(steps),
            "regions": [r if isinstance(r, str) else f"{r.__module__}.{r.__qualname__}"
                        for r in regions], "switch": switch}


@dataclasses.dataclass(frozen=True)
class Progress:
    """A runtime run's state at the end of its last completed chunk.

    Attributes:
      done: steps completed (the state saved is the one before step `done`).
      losses: the loss of each completed step.
      origin: the NaN's origin, once found.
      searched: whether the origin was looked for (a non-finite output was seen).
      sha256: `state_digest` of the saved state.
    """

    done: int
    losses: tuple[float, ...]
    origin: Optional[NanOrigin]
    searched: bool
    sha256: str


@dataclasses.dataclass(frozen=True)
class RuntimeStore:
    """The files of a runtime run in progress under `campaigns/<name>/`: `runtime.partial.json`
    (the spec and the `Progress`, written atomically after each chunk) and `runtime-state/<step>/`
    (Orbax checkpoints of the injected run's state at the last two chunk ends; the partial file
    names one of them)."""

    path: pathlib.Path
    spec: Mapping[str, Any]

    @property
    def partial(self) -> pathlib.Path:
        return self.path / PARTIAL

    def _manager(self):
        import orbax.checkpoint as ocp
        return ocp.CheckpointManager(
            (self.path / STATES).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True,
                                                 enable_async_checkpointing=False,
                                                 cleanup_tmp_directories=True))

    def progress(self) -> Optional[Progress]:
        """The progress of an interrupted run with this spec, or None if there is none. Another
        spec's unfinished run is a PeatError (nothing is changed)."""
        if not self.partial.exists():
            return None
        try:
            rec = json.loads(self.partial.read_text())
            old, p = rec["spec"], rec["progress"]
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise PeatError(f"{self.partial} is damaged ({e}); delete it to start the runtime run "
                            "afresh") from None
        if old != dict(self.spec):
            diff = sorted(k for k in set(old) | set(self.spec) if old.get(k) != self.spec.get(k))
            raise PeatError(
                f"{self.path} holds an unfinished runtime run with another {', '.join(diff)} "
                f"({'; '.join(f'{k}: {old.get(k)!r}' for k in diff)}); rerun it with the same "
                "arguments to finish it, choose another name (--name), or delete "
                f"{self.partial} to discard it")
        return Progress(done=int(p["done"]), losses=tuple(float(x) for x in p["losses"]),
                        origin=NanOrigin.from_dict(p.get("origin")), searched=bool(p["searched"]),
                        sha256=str(p["sha256"]))

    def restore(self, progress: Progress, like) -> Any:
        """The state saved before step `progress.done`, with the types of `like`; a PeatError if
        it is missing or its values differ from the digest recorded."""
        import orbax.checkpoint as ocp
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        with quiet():
            mgr = self._manager()
            try:
                state = mgr.restore(progress.done, args=ocp.args.StandardRestore(target))
            except Exception as e:  # noqa: BLE001 - Orbax raises many types for damaged files
                raise PeatError(f"the runtime run's state at step {progress.done} in "
                                f"{self.path / STATES} cannot be restored ({type(e).__name__}); "
                                f"delete {self.partial} to start afresh") from None
            finally:
                mgr.close()
        if state_digest(state) != progress.sha256:
            raise PeatError(f"the runtime run's state at step {progress.done} in "
                            f"{self.path / STATES} is damaged (its SHA-256 differs from the one "
                            f"recorded); delete {self.partial} to start afresh")
        return state

    def save(self, progress: Progress, state) -> None:
        """Save `state` (before step `progress.done`), then the progress that names it."""
        import orbax.checkpoint as ocp
        with quiet():
            mgr = self._manager()
            try:
                if progress.done not in mgr.all_steps():
                    mgr.save(progress.done, args=ocp.args.StandardSave(state), force=True)
                    mgr.wait_until_finished()
            finally:
                mgr.close()
        atomic_write_json(self.partial, {"spec": dict(self.spec),
                                         "progress": dataclasses.asdict(progress)})

    def discard(self) -> None:
        """Remove the progress and the saved states (the run is finished)."""
        self.partial.unlink(missing_ok=True)
        shutil.rmtree(self.path / STATES, ignore_errors=True)


def runtime(run_dir_or_workload: Union[PathLike, Workload], substitution: Substitution,
            schedule: Schedule, *, steps: int, workload: Optional[Workload] = None,
            regions: Sequence[type] = (), name: Optional[str] = None, seed: int = 0,
            chunk: Optional[int] = None, progress=None,
            switch: Optional[str] = None) -> RuntimeResult:
    """Train `steps` steps with `substitution` active on the steps `schedule` picks.

    From a run directory: starts from its step-0 checkpoint and compares with its recorded golden
    losses (`steps` must not exceed the golden run). From a `Workload`: initialises it with `seed`
    and runs the golden steps alongside. The injected step is one jitted `peat.inject` function:
    one compile for the whole run.

    With `name` (run directory only) the result is written to `campaigns/<name>/runtime.json`,
    and the run keeps its progress there every `chunk` steps (default: the golden run's
    checkpoint interval): an interrupted run called again with the same arguments resumes from
    its last completed chunk, with the same result as a run in one go; other arguments while
    one is unfinished are a PeatError.

    When a step's loss or new state is non-finite (the first such step), that step is replayed
    from its input state, kept in memory, with every site watched: `nan_origin` names the first
    site whose output was non-finite, and its `blew_up` the first site before it whose finite
    output left its range: the golden run's site statistics where the run directory has them,
    else the step's own earlier sites (see `peat_jax._src.profiler.nan_origin`).
    A run directory's training runs at the matmul precision its golden run recorded.

    A named run holds its campaign's lock while it runs (`peat_jax._src.profiler.lock`): another
    process writing the same name is a PeatError naming it, and an IO failure (a full disk, a
    read-only directory) is a one-line PeatError saying how to resume.

    Returns:
      A `RuntimeResult`.
    """
    if name is not None and not isinstance(run_dir_or_workload, Workload):
        with runtime_writer(RunDir(run_dir_or_workload).path, name):
            return _runtime(run_dir_or_workload, substitution, schedule, steps=steps,
                            workload=workload, regions=regions, name=name, seed=seed,
                            chunk=chunk, progress=progress, switch=switch)
    return _runtime(run_dir_or_workload, substitution, schedule, steps=steps, workload=workload,
                    regions=regions, name=name, seed=seed, chunk=chunk, progress=progress,
                    switch=switch)


def _runtime(run_dir_or_workload, substitution, schedule, *, steps, workload, regions, name,
             seed, chunk, progress, switch) -> RuntimeResult:
    """`runtime`'s work, under its lock where it writes."""
    switch = _checked_arguments(steps, chunk, schedule, switch)
    rd = store = None
    precision = None
    if isinstance(run_dir_or_workload, Workload):
        if name is not None:
            raise PeatError("name= stores the result in a run directory; pass a run directory")
        wl = run_dir_or_workload
        state0 = wl.init(jax.random.key(seed))
        golden = None
    else:
        rd = RunDir(run_dir_or_workload)
        m = rd.manifest()
        precision = recorded_precision(m)
        wl = load_workload(m, workload)
        golden = rd.golden_losses()
        if steps > len(golden):
            raise PeatError(f"steps={steps} is beyond the golden run in {rd.path}, which has "
                            f"{len(golden)} steps; profile it longer or ask for fewer steps")
        golden = golden[:steps]
        with quiet():
            state0 = restore(rd.path, 0, workload=wl)
        if name is not None:
            store = RuntimeStore(rd.campaign(name),
                                 runtime_spec(m, substitution, schedule, steps, regions,
                                              switch))
            chunk = int(chunk or m["checkpoint_every"])
    step_fn = InjectedStep(wl.train_step, substitution, schedule, regions=regions,
                           switch=switch, wrap=_with_finite)
    plain = jax.jit(wl.train_step) if golden is None else None
    resumed = store.progress() if store is not None else None
    if store is not None and resumed is None:
        store.discard()  # states left by a run killed before its first chunk: not ours to trust
    state, gstate = state0, state0
    losses, golden_run, origin, searched = [], [], None, False
    if resumed is not None:
        losses, origin, searched = list(resumed.losses), resumed.origin, resumed.searched
        if resumed.done < steps:
            assert store is not None  # resumed is the store's progress
            state = store.restore(resumed, state0)
    with at_matmul_precision(precision):  # a run directory's: as its golden run trained
        for i in range(len(losses), steps):
            batch = to_device(wl.batch(i))
            new, metrics, finite = step_fn(state, batch, i)
            losses.append(scalar_metrics(metrics)["loss"])
            if not searched and not (np.isfinite(losses[-1]) and bool(finite)):
                origin = step_nan_origin(wl.train_step, state, batch, i, substitution=substitution,
                                         schedule=schedule, regions=regions,
                                         golden=golden_absmax(rd.path) if rd is not None else None)
                searched = True
            state = new
            if plain is not None:
                gstate, gm = plain(gstate, batch)
                golden_run.append(scalar_metrics(gm)["loss"])
            if store is not None and ((i + 1) % chunk == 0 or i + 1 == steps):
                store.save(Progress(done=i + 1, losses=tuple(losses), origin=origin,
                                    searched=searched, sha256=state_digest(state)), state)
            if progress is not None:
                progress(i + 1, steps)
    golden = golden if golden is not None else golden_run
    fired = schedule.fired_steps(range(steps))
    outcome, band, ev = classify_outcome(losses, golden, fired)
    ev["compiles"] = step_fn.compiles()
    ev["switch"] = step_fn.switch
    result = RuntimeResult(outcome=outcome, losses=tuple(losses), golden_losses=tuple(golden),
                           fired_steps=tuple(fired), band=band, evidence=ev,
                           schedule=str(schedule), nan_origin=origin,
                           resumed_from=resumed.done if resumed is not None else None)
    if store is not None:
        atomic_write_json(store.path / "runtime.json", result.to_dict())
        store.discard()
    return result


def _checked_arguments(steps, chunk, schedule, switch) -> str:
    """`runtime`'s arguments checked before anything runs (a one-line `PeatError` for each bad
    one); returns the switch to use (`switch`, or the backend's default for None)."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps <= 0:
        raise PeatError(f"steps must be a positive int, got {steps!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer))
                              or chunk <= 0):
        raise PeatError(f"chunk must be a positive int, got {chunk!r}")
    if not isinstance(schedule, Schedule):
        raise PeatError("runtime needs a peat schedule (peat.every / peat.at_steps / "
                        f"peat.with_probability), got {type(schedule).__name__}")
    switch = default_switch() if switch is None else switch
    if switch not in SWITCHES:
        raise PeatError(f"switch must be one of {', '.join(SWITCHES)} (or None: the backend's "
                        f"default, {default_switch()!r}), got {switch!r}")
    return switch


def _with_finite(step_fn: Callable) -> Callable:
    """`step_fn(state, batch, i) -> (new, metrics)` also returning whether the new state is
    finite everywhere, computed in the same program: the run reads it with the step's metrics
    instead of launching a reduction of its own every step."""
    def stepped(state, batch, i):
        new, metrics = step_fn(state, batch, i)
        return new, metrics, tree_finite(new)

    stepped.__name__ = stepped.__qualname__ = getattr(step_fn, "__name__", "step")
    return stepped
