"""The golden run: train a workload once, keep Orbax checkpoints and per-step metrics."""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax.errors import PeatError
from peat_jax.profiler.rundir import (FORMAT, PathLike, RunDir, append_jsonl, atomic_write_json,
                                      environment, rewrite_jsonl)
from peat_jax.profiler.workload import Workload

__all__ = ["GoldenRun", "profile", "load_workload", "restore", "checkpoint_steps"]

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
    name), else the bundled workload named in the manifest, rebuilt from its config."""
    name = manifest["workload"]
    if workload is not None:
        if not isinstance(workload, Workload):
            raise PeatError(f"workload= must be a peat.Workload, got {type(workload).__name__}")
        if workload.name != name:
            raise PeatError(f"this run directory holds a golden run of workload {name!r}, but "
                            f"workload={workload.name!r} was given")
        return workload
    from peat_jax import models
    if name not in models.available():
        raise PeatError(f"workload {name!r} of this run is not bundled with peat_jax; pass the "
                        "same workload object with workload=")
    return models.get(name, **manifest["config"])


def _abstract_state(workload: Workload, seed: int):
    return jax.eval_shape(workload.init, jax.random.key(seed))


def _manager(rd: RunDir):
    import orbax.checkpoint as ocp
    return ocp.CheckpointManager(
        rd.checkpoints.absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False,
                                             create=True))


def available_checkpoints(rd: RunDir) -> list[int]:
    """Checkpoint steps that Orbax considers complete, in order."""
    if not rd.checkpoints.exists():
        return []
    with _quiet():
        mgr = _manager(rd)
        try:
            return sorted(int(s) for s in mgr.all_steps())
        finally:
            mgr.close()


class _quiet:
    """Silence Orbax/absl INFO logging for the duration."""

    def __enter__(self):
        self._lvl = logging.getLogger("absl").level
        logging.getLogger("absl").setLevel(logging.WARNING)

    def __exit__(self, *exc):
        logging.getLogger("absl").setLevel(self._lvl)


def restore(run_dir: PathLike, step: int, *, workload: Optional[Workload] = None):
    """The train state saved before `step` (restored with the abstract target, so optimizer
    states and typed PRNG keys come back with their own types). Raises a PeatError naming the
    checkpoint if it is missing or damaged."""
    import orbax.checkpoint as ocp
    rd = RunDir(run_dir)
    m = rd.manifest()
    wl = load_workload(m, workload)
    steps = available_checkpoints(rd)
    if step not in steps:
        raise PeatError(f"no checkpoint for step {step} in {rd.checkpoints}; available: "
                        f"{steps or 'none'}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _abstract_state(wl, int(m["seed"])))
    with _quiet():
        mgr = _manager(rd)
        try:
            return mgr.restore(step, args=ocp.args.StandardRestore(target))
        except Exception as e:  # noqa: BLE001 - Orbax raises many types for damaged files
            raise PeatError(f"checkpoint {rd.checkpoints / str(step)} cannot be restored "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); it is damaged: "
                            f"use another checkpoint ({[s for s in steps if s != step]}) or "
                            "re-profile") from None
        finally:
            mgr.close()


def _manifest(wl: Workload, seed: int, steps: int, every: int) -> dict:
    return {"format": FORMAT, "workload": wl.name, "config": _json_config(wl.config),
            "seed": int(seed), "steps": int(steps), "checkpoint_every": int(every),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **environment()}


def _same_run(old: dict, new: dict) -> Optional[str]:
    for key in ("workload", "config", "seed", "checkpoint_every"):
        if old.get(key) != new.get(key):
            return f"{key} differs (on disk: {old.get(key)!r}, asked: {new.get(key)!r})"
    return None


def _to_device(batch):
    return jax.tree.map(jnp.asarray, batch)


def _scalars(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(dict(metrics)).items() if np.ndim(v) == 0}


def profile(workload: Workload, run_dir: PathLike, *, steps: int, checkpoint_every: int,
            seed: int = 0, progress: Progress = None) -> GoldenRun:
    """Run the golden training of `workload` into `run_dir`.

    Saves an Orbax checkpoint of the full train state before steps 0, K, 2K, ... and after the
    last step, appends each step's scalar metrics to `golden/metrics.jsonl`, writes
    `manifest.json` (workload, config, seed, versions, backend, device kind) and
    `golden/eval.json`. Rerunning into a directory that holds the same run (same workload,
    config, seed and checkpoint interval) resumes from the last complete checkpoint; `steps`
    may be larger than before to extend the run. A directory holding a different run is an
    error, and nothing in it is touched.

    Returns:
      A `GoldenRun`.
    """
    import orbax.checkpoint as ocp
    if not isinstance(workload, Workload):
        raise PeatError(f"profile needs a peat.Workload, got {type(workload).__name__}")
    for name, v in (("steps", steps), ("checkpoint_every", checkpoint_every)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise PeatError(f"{name} must be a positive int, got {v!r}")
    steps, every = int(steps), int(checkpoint_every)
    rd = RunDir(run_dir, create=True)
    manifest = _manifest(workload, seed, steps, every)
    resumed_from = None
    if rd.has_manifest():
        old = rd.manifest()
        why = _same_run(old, manifest)
        if why:
            raise PeatError(f"{rd.manifest_path} belongs to another golden run: {why}; profile "
                            "into a new directory")
        done = available_checkpoints(rd)
        if done:
            resumed_from = max(done)
    wanted = checkpoint_steps(steps, every)
    train_step = jax.jit(workload.train_step)
    with _quiet():
        mgr = _manager(rd)
        try:
            if resumed_from is None:
                state = workload.init(jax.random.key(seed))
                rewrite_jsonl(rd.metrics_path, [])
                start = 0
            else:
                state = restore(rd.path, resumed_from, workload=workload)
                start = resumed_from
                # drop metrics logged after the checkpoint we resume from (a kill between checkpoints)
                rewrite_jsonl(rd.metrics_path, [r for r in rd.golden_metrics() if r["step"] < start])
            rd.write_manifest(manifest)
            if start not in available_checkpoints(rd) and start in wanted:
                mgr.save(start, args=ocp.args.StandardSave(state))
            pending = []
            for i in range(start, steps):
                state, metrics = train_step(state, _to_device(workload.batch(i)))
                pending.append({"step": i, **_scalars(metrics)})
                if (i + 1) in wanted:
                    append_jsonl(rd.metrics_path, pending)
                    pending = []
                    mgr.save(i + 1, args=ocp.args.StandardSave(state), force=True)
                    mgr.wait_until_finished()
                if progress is not None:
                    progress(i + 1, steps)
            append_jsonl(rd.metrics_path, pending)
        finally:
            mgr.close()
    evaluation = dict(workload.evaluate(state)) if workload.evaluate is not None else {}
    atomic_write_json(rd.eval_path, {"step": steps, **{k: float(v) for k, v in evaluation.items()}})
    return GoldenRun(str(rd.path), workload.name, steps, tuple(available_checkpoints(rd)),
                     tuple(rd.golden_losses()), evaluation, resumed_from)
