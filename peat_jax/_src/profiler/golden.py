"""The golden run: train a workload once, keep Orbax checkpoints and per-step metrics."""
from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import json
import sys
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src.errors import PeatError
from peat_jax._src.precision import at_matmul_precision, matmul_precision
from peat_jax._src.profiler.hostio import drop_abandoned_io_reports, quiet, to_device
from peat_jax._src.profiler.ioerrors import as_oserror
from peat_jax._src.profiler.lock import golden_writer
from peat_jax._src.profiler.rundir import (FORMAT, MissingCheckpoint, PathLike, RunDir,
                                           append_jsonl, atomic_write_json, environment,
                                           platform_info, recorded_precision, rewrite_jsonl,
                                           run_identity)
from peat_jax._src.profiler.site_stats import (ChunkWriter, Sampling, StatsStep, drop_steps,
                                               read_sampling, write_sites)
from peat_jax._src.profiler.workload import Workload, workload_factory


Progress = Optional[Callable[[int, int], None]]


@dataclasses.dataclass(frozen=True)
class GoldenRun:
    """What `profile` produced.

    Attributes:
      run_dir: the run directory.
      workload: the workload's name.
      steps: training steps run (metrics exist for steps 0..steps-1).
      checkpoints: steps with a checkpoint of the state *before* that step (the last one is the
        final state, at `steps`).
      losses: golden loss per step.
      eval: held-out metrics of the final state (empty if the workload has no `evaluate`).
      resumed_from: the checkpoint step training resumed from, or None for a fresh run.
    """

    run_dir: str
    workload: str
    steps: int
    checkpoints: tuple[int, ...]
    losses: tuple[float, ...]
    eval: dict
    resumed_from: Optional[int] = None


def checkpoint_steps(steps: int, every: int) -> list[int]:
    """0, every, 2*every, ... and `steps` itself."""
    return sorted(set(range(0, steps, every)) | {steps})


def _json_config(config) -> Any:
    try:
        return json.loads(json.dumps(dict(config)))
    except (TypeError, ValueError):
        return {k: repr(v) for k, v in dict(config).items()}


def load_workload(manifest: dict, workload: Optional[Workload] = None) -> Workload:
    """The workload a run was made with: `workload` if given (checked against the manifest's
    name and config), else the registered workload named in the manifest, rebuilt from its
    config (see `peat_jax._src.profiler.workload`)."""
    if workload is not None:
        return _checked_against(manifest, workload)
    name = manifest["workload"]
    factory = workload_factory(name)
    try:
        built = factory(**manifest["config"])
    except (TypeError, ValueError) as e:
        raise PeatError(f"the manifest's workload {name!r} cannot be built from its config "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); the "
                        "manifest is damaged or from another version of the workload") from None
    if not isinstance(built, Workload) or built.name != name:
        got = built.name if isinstance(built, Workload) else type(built).__name__
        raise PeatError(f"the factory registered for workload {name!r} returned {got!r}, not a "
                        f"peat.Workload named {name!r}")
    return built


def _checked_against(manifest: dict, workload: Workload) -> Workload:
    """`workload`, once it is known to be the manifest's (same name and config)."""
    name = manifest["workload"]
    if not isinstance(workload, Workload):
        raise PeatError(f"workload= must be a peat.Workload, got {type(workload).__name__}")
    if workload.name != name:
        raise PeatError(f"this run directory holds a golden run of workload {name!r}, but "
                        f"workload={workload.name!r} was given")
    config = _json_config(workload.config)
    if config != manifest["config"]:
        diff = sorted(k for k in set(config) | set(manifest["config"])
                      if config.get(k) != manifest["config"].get(k))
        run_config = manifest["config"]
        raise PeatError(f"workload={name!r} was given with another config than this run's: "
                        + ", ".join(f"{k}={config.get(k)!r} (run: {run_config.get(k)!r})"
                                    for k in diff)
                        + "; pass the workload the run was profiled with")
    return workload


def _abstract_state(workload: Workload, seed: int):
    """The train state's leaves as `jax.ShapeDtypeStruct`s, with the shardings the workload
    declares: those of a `jax.jit(init, out_shardings=...)` (None where it declares none)."""
    return jax.eval_shape(workload.init, jax.random.key(seed))


def _off_layout(state, declared) -> Optional[str]:
    """Where `state` is not laid out as `declared` (`_abstract_state`) says: the first such
    leaf's path and both shardings, or None."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, leaf), want in zip(flat, jax.tree.leaves(declared)):
        have, want = getattr(leaf, "sharding", None), getattr(want, "sharding", None)
        if want is not None and have is not None and not have.is_equivalent_to(want, leaf.ndim):
            return f"{jax.tree_util.keystr(path)} is laid out as {have}, init declares {want}"
    return None


def _manager(rd: RunDir):
    import orbax.checkpoint as ocp
    return ocp.CheckpointManager(
        rd.checkpoints.absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False,
                                             **_on_its_own()))


def _on_its_own() -> dict:
    """Orbax options for a process of a multi-process campaign (`jax.process_count() > 1`),
    which reads checkpoints on its own: Orbax would otherwise synchronise every process at each
    restore (and wait forever on one that died). Only one process writes a run directory, so
    only one creates it."""
    if jax.process_count() == 1:
        return {"create": True}
    import orbax.checkpoint as ocp
    i = jax.process_index()
    return {"create": False, "multiprocessing_options": ocp.options.MultiprocessingOptions(
        primary_host=i, active_processes={i}, barrier_sync_key_prefix=f"peat-p{i}")}


def _local(target):
    """`target` (ShapeDtypeStructs) placed on this process's first device where several
    processes run (the checkpoint's own sharding names another process's device)."""
    if jax.process_count() == 1:
        return target
    where = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), target)


def available_checkpoints(rd: RunDir) -> list[int]:
    """Checkpoint steps that Orbax considers complete, in order."""
    if not rd.checkpoints.exists():
        return []
    with quiet():
        mgr = _manager(rd)
        try:
            return sorted(int(s) for s in mgr.all_steps())
        finally:
            mgr.close()


def state_digest(state) -> str:
    """SHA-256 of a train state's values (each leaf's path, dtype, shape and bytes; typed PRNG
    keys by their key data): recorded when a checkpoint is saved and checked when it is
    restored, so a checkpoint whose bytes changed is an error rather than silently different
    numbers (Orbax does not checksum array data)."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        leaf = jnp.asarray(leaf)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        a = np.ascontiguousarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def restore(run_dir: PathLike, step: int, *, workload: Optional[Workload] = None):
    """The train state saved before `step` (restored with the abstract target, so optimizer
    states and typed PRNG keys come back with their own types). Raises a PeatError naming the
    checkpoint if it is missing or damaged (unreadable, or its values differ from the digest
    recorded when it was saved); nothing on disk is changed.

    Each array is placed on the sharding the workload declares (`jax.eval_shape(init, key)`:
    a `jax.jit(init, out_shardings=...)` declares them), which `profile` saved it with; where
    none is declared, on the sharding Orbax saved with the checkpoint."""
    import orbax.checkpoint as ocp
    rd = RunDir(run_dir)
    m = rd.manifest()
    wl = load_workload(m, workload)
    steps = available_checkpoints(rd)
    if step not in steps:
        raise MissingCheckpoint(f"no checkpoint for step {step} in {rd.checkpoints}; available: "
                                f"{steps or 'none'}")
    others = [s for s in steps if s != step]
    remedy = f"use another checkpoint ({others}) or re-profile into a new directory"
    target = _local(jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                 _abstract_state(wl, int(m["seed"]))))
    with quiet():
        mgr = _manager(rd)
        try:
            state = mgr.restore(step, args=ocp.args.StandardRestore(target))
        except Exception as e:  # noqa: BLE001 - Orbax raises many types for damaged files
            _drop_orbax_leftovers()
            _not_damaged(rd, step, e)
            first = str(e).splitlines()[0][:200] if str(e).strip() else ""
            raise PeatError(f"checkpoint {rd.checkpoints / str(step)} cannot be restored "
                            f"({type(e).__name__}: {first}); it is damaged: {remedy}") from None
        finally:
            mgr.close()
    record = rd.checkpoint_record()
    expected = (record or {}).get("sha256", {}).get(str(step))
    if expected is not None and state_digest(state) != expected:
        raise PeatError(f"checkpoint {rd.checkpoints / str(step)} is damaged: its values differ "
                        f"from the SHA-256 recorded in {rd.checkpoint_record_path} when it was "
                        f"saved; {remedy}")
    return state


def _not_damaged(rd: RunDir, step: int, e: Exception) -> None:
    """Raise what a failed restore of checkpoint `step` was when it was not damage: the
    checkpoint removed while it was read (`MissingCheckpoint`), or the OSError of a file that
    could not be read (permissions, an IO error), unwrapped from Orbax's exception."""
    if not (rd.checkpoints / str(step)).is_dir():
        left = [s for s in available_checkpoints(rd) if s != step]
        raise MissingCheckpoint(f"checkpoint {rd.checkpoints / str(step)} was removed while it "
                                f"was being read; available: {left or 'none'}") from None
    cause = as_oserror(e)
    if cause is not None and cause.errno in _UNREADABLE:
        raise cause from None


# errnos of a checkpoint that cannot be read for another reason than damage
_UNREADABLE = {errno.EACCES, errno.EPERM, errno.EIO, errno.EMFILE, errno.ENFILE}


def _drop_orbax_leftovers() -> None:
    """After a failed restore, Orbax leaves the reads of the other arrays pending; when they are
    finalised (often at interpreter exit) each prints an "Exception ignored in: <coroutine ...>"
    traceback, pages of them after the one-line error. From then on, drop those reports (and
    only those: anything else goes to the hook that was installed)."""
    previous = sys.unraisablehook
    if getattr(previous, "_peat_drops_orbax", False):
        return

    def hook(unraisable):
        code = getattr(unraisable.object, "cr_code", None) or getattr(unraisable.object,
                                                                      "gi_code", None)
        if code is not None and "orbax" in code.co_filename.replace("\\", "/").split("/"):
            return
        previous(unraisable)

    setattr(hook, "_peat_drops_orbax", True)  # installed once (the getattr above)
    sys.unraisablehook = hook
    # ... and the same reads' failures, logged by asyncio when their gathering future is dropped
    drop_abandoned_io_reports()


def _record_digest(rd: RunDir, identity: dict, step: int, state) -> None:
    """Note the digest of the state about to be saved as checkpoint `step` (before the save: a
    kill between the two leaves a digest without a checkpoint, which is harmless)."""
    record = rd.checkpoint_record() or {}
    if record.get("run") != identity:
        record = {"run": identity, "sha256": {}}
    record.setdefault("sha256", {})[str(step)] = state_digest(state)
    rd.write_checkpoint_record(record)


def _manifest(wl: Workload, seed: int, steps: int, every: int, stats_every: Optional[int],
              substitution: Optional[list]) -> dict:
    """The manifest of a golden run; call it inside the run's matmul precision (its
    ``environment`` records the precision in force)."""
    env = environment()
    return {"format": FORMAT, "workload": wl.name, "config": _json_config(wl.config),
            "seed": int(seed), "steps": int(steps), "checkpoint_every": int(every),
            "stats_every": stats_every, "substitution": substitution,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **platform_info(), "backend": env["backend"], "device_kind": env["device_kind"],
            "environment": env}


def substitution_record(substitution, sites) -> Optional[list]:
    """The manifest's account of a run's substitution: one entry per selector, with the
    candidate's name and the site indices it was put at; None for no substitution."""
    if not substitution:
        return None
    from peat_jax._src.sites import select
    return [{"selector": repr(sel), "candidate": getattr(cand, "name", repr(cand)),
             "sites": [s.index for s in select(sites, sel)]}
            for sel, cand in substitution.items()]


def _same_run(old: dict, new: dict) -> Optional[str]:
    for key in ("workload", "config", "seed", "checkpoint_every", "stats_every", "substitution"):
        if old.get(key) != new.get(key):
            return f"{key} differs (on disk: {old.get(key)!r}, asked: {new.get(key)!r})"
    if recorded_precision(old) != recorded_precision(new):
        return (f"the matmul precision differs (on disk: {recorded_precision(old)!r}, asked: "
                f"{recorded_precision(new)!r}; pass precision={recorded_precision(old)!r} to "
                "resume it)")
    return None


def scalar_metrics(metrics) -> dict[str, float]:
    """The scalar entries of a step's metrics, as Python floats (on the host)."""
    return {k: float(v) for k, v in jax.device_get(dict(metrics)).items() if np.ndim(v) == 0}


def profile(workload: Workload, run_dir: PathLike, *, steps: int, checkpoint_every: int,
            seed: int = 0, stats_every: Optional[int] = None, substitution=None,
            progress: Progress = None, precision: Any = None) -> GoldenRun:
    """Run the golden training of `workload` into `run_dir`.

    Saves an Orbax checkpoint of the full train state before steps 0, K, 2K, ... and after the
    last step, appends each step's scalar metrics to `golden/metrics.jsonl`, writes
    `manifest.json` (workload, config, seed, versions, backend, device kind, and the
    `environment`: matmul precision, XLA_FLAGS, x64, CUDA / cuDNN versions on a GPU) and
    `golden/eval.json`. Rerunning into a directory that holds the same run (same workload,
    config, seed, checkpoint interval, statistics interval, substitution and matmul precision)
    resumes from the last complete checkpoint; `steps` may be larger than before to extend the
    run. A directory holding a different run is an error, and nothing in it is touched.

    Args:
      stats_every: K: every K-th step (0, K, 2K, ...) runs with site statistics: for every site
        output, forward and backward, a compact record computed on the device in the same
        jitted step (see `peat_jax._src.profiler.site_stats`), written to `golden/site_stats/` (one
        file per checkpoint interval); the steps in between run the plain step, and the
        trajectory is bitwise the one without statistics. `peat.compare` reads them.
      substitution: `{selector: kernel or fault}`: the candidate replaces the op at its sites
        for the whole run (a golden-style run "trained with my kernel"); the manifest records
        it, and comparing the run with a reference run shows where it departs.
      precision: the matmul precision to train at ("highest", "high", "default", jax's other
        names or a `jax.lax.Precision`; see `peat_jax._src.precision`), recorded in the manifest;
        playback and runtime of the run directory replay at the same precision, so a replay
        stays bitwise equal to the golden step. None: whatever jax is set to (recorded too).

    Returns:
      A `GoldenRun`.
    """
    steps, every, stats_every = _checked_intervals(workload, steps, checkpoint_every, stats_every)
    precision = None if precision is None else matmul_precision(precision)
    rd = RunDir(run_dir, create=True)
    with golden_writer(rd.path), at_matmul_precision(precision):
        stepper = StatsStep(workload.train_step, substitution, sampling=_sampling(rd))
        stats_sites, record = None, None
        if stats_every or substitution:  # trace the step once, on a fresh state and batch 0
            probe = (workload.init(jax.random.key(seed)), to_device(workload.batch(0)))
            stats_sites = stepper.sites(*probe) if stats_every else None
            record = substitution_record(substitution, stepper.traced(*probe)[0].sites)
        manifest = _manifest(workload, seed, steps, every, stats_every, record)
        resumed_from = _resume_point(rd, manifest, steps)
        if stats_every:
            assert stats_sites is not None  # traced above when stats_every
            write_sites(rd.site_stats, stats_sites, stepper.sampling)
        state = _train(workload, rd, manifest, _Stepper(stepper, stats_every, stats_sites),
                       seed, steps, every, resumed_from, progress)
        evaluation = dict(workload.evaluate(state)) if workload.evaluate is not None else {}
        atomic_write_json(rd.eval_path, {"step": steps,
                                         **{k: float(v) for k, v in evaluation.items()}})
    return GoldenRun(str(rd.path), workload.name, steps, tuple(available_checkpoints(rd)),
                     tuple(rd.golden_losses()), evaluation, resumed_from)


def _sampling(rd: RunDir) -> Sampling:
    """The sampling of the run that `rd` holds (a resumed run keeps sampling as it began, also
    when an older peat_jax began it), or this version's for a new run."""
    if rd.has_manifest() and (rd.site_stats / "sites.json").exists():
        return read_sampling(rd.site_stats)
    return Sampling()


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise PeatError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _checked_intervals(workload, steps, checkpoint_every, stats_every):
    """(steps, checkpoint_every, stats_every or None) as ints; PeatError for bad values."""
    if not isinstance(workload, Workload):
        raise PeatError(f"profile needs a peat.Workload, got {type(workload).__name__}")
    return (_positive_int("steps", steps), _positive_int("checkpoint_every", checkpoint_every),
            None if stats_every is None else _positive_int("stats_every", stats_every))


def _resume_point(rd: RunDir, manifest: dict, steps: int) -> Optional[int]:
    """The checkpoint step to resume from (None: a fresh run); PeatError when the directory holds
    another run, a shorter request, or files without their manifest (nothing is touched)."""
    if not rd.has_manifest() and (rd.metrics_path.exists() or rd.checkpoint_record_path.exists()
                                  or available_checkpoints(rd)):
        raise PeatError(f"{rd.path} holds a golden run's files but no {rd.manifest_path.name}: "
                        "put back its manifest.json to resume it, or profile into a new "
                        "directory; nothing was changed")
    if not rd.has_manifest():
        return None
    old = rd.manifest()
    why = _same_run(old, manifest)
    if why:
        raise PeatError(f"{rd.manifest_path} belongs to another golden run: {why}; profile "
                        "into a new directory")
    if steps < int(old.get("steps", 0)):
        raise PeatError(f"{rd.path} holds a golden run of {old['steps']} steps; profile it "
                        f"with steps >= {old['steps']} to resume or extend it, or profile "
                        f"{steps} steps into a new directory")
    done = available_checkpoints(rd)
    return max(done) if done else None


@dataclasses.dataclass(frozen=True)
class _Stepper:
    """One training step of a golden run: with site statistics every `stats_every` steps."""

    step: StatsStep
    stats_every: Optional[int]
    stats_sites: Any

    def __call__(self, i: int, state, batch):
        """The new state, metrics and `pack`ed statistics of step i (device arrays; None for a
        step without statistics)."""
        if not (self.stats_every and i % self.stats_every == 0):
            return (*self.step.plain(state, batch), None)
        state, metrics, stats = self.step.with_stats(state, batch)
        if len(stats["words"]) != sum(s.recorded for s in self.stats_sites):
            raise PeatError(f"site statistics of {len(stats['words'])} sites came out of the step, "
                            f"{len(self.stats_sites)} were expected: a container the statistics "
                            "cannot pass through; please report it")
        return state, metrics, stats


def _check_layout(workload: Workload, state, declared, i: int) -> None:
    """PeatError (before the checkpoint is saved) when step `i` left the state on other shardings
    than `init` declares: its checkpoints would be restored onto the declared ones, and the
    replays would not compute what the golden run did."""
    off = _off_layout(state, declared)
    if off is not None:
        raise PeatError(
            f"workload {workload.name!r}: after step {i} the train state's {off}. A sharded "
            "workload keeps its state on the shardings its init declares (end train_step "
            "with jax.lax.with_sharding_constraint(new_state, shardings)), so that a "
            "checkpoint restores onto the layout the golden run trained on; the checkpoint "
            f"of step {i + 1} was not saved")


def _train(workload: Workload, rd: RunDir, manifest: dict, stepper: _Stepper, seed: int,
           steps: int, every: int, resumed_from: Optional[int], progress: Progress):
    """`profile`'s training loop with its checkpoints and metrics; the final state."""
    import orbax.checkpoint as ocp
    identity = run_identity(manifest)
    wanted = checkpoint_steps(steps, every)
    declared = _abstract_state(workload, seed)
    with quiet():
        mgr = _manager(rd)
        try:
            if resumed_from is None:
                state = workload.init(jax.random.key(seed))
                rd.write_manifest(manifest)  # first: files without a manifest are refused above
                rewrite_jsonl(rd.metrics_path, [])
                start = 0
            else:
                state = restore(rd.path, resumed_from, workload=workload)
                start = resumed_from
                # drop metrics logged after the checkpoint we resume from (a kill between them)
                rewrite_jsonl(rd.metrics_path, rd.golden_metrics(upto=start))
                rd.write_manifest(manifest)
            drop_steps(rd.site_stats, start)  # ... and their statistics
            if start not in available_checkpoints(rd) and start in wanted:
                _record_digest(rd, identity, start, state)
                mgr.save(start, args=ocp.args.StandardSave(state))
            pending, stats = [], ChunkWriter(rd.site_stats)
            for i in range(start, steps):
                state, metrics, packed = stepper(i, state, to_device(workload.batch(i)))
                pending.append({"step": i, **scalar_metrics(metrics)})
                if packed is not None:
                    stats.add(i, packed)
                if (i + 1) in wanted:
                    _check_layout(workload, state, declared, i)
                    append_jsonl(rd.metrics_path, pending)
                    pending = []
                    stats.flush()
                    _record_digest(rd, identity, i + 1, state)
                    mgr.save(i + 1, args=ocp.args.StandardSave(state), force=True)
                    mgr.wait_until_finished()
                if progress is not None:
                    progress(i + 1, steps)
            append_jsonl(rd.metrics_path, pending)
            stats.flush()
        finally:
            mgr.close()
    return state
