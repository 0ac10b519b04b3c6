"""Frequency-based runtime injection: train with the candidate switched in by a schedule, inside
one jitted step, and classify what it did to training against the golden run's own noise."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np

from peat_jax import taxonomy
from peat_jax.errors import PeatError
from peat_jax.precision import at_matmul_precision
from peat_jax.profiler.golden import load_workload, restore, scalar_metrics
from peat_jax.profiler.hostio import quiet, to_device
from peat_jax.profiler.rundir import PathLike, RunDir, atomic_write_json, recorded_precision
from peat_jax.profiler.workload import Workload
from peat_jax.schedule import Schedule, inject
from peat_jax.substitute import Substitution

__all__ = ["RuntimeResult", "runtime", "classify_outcome", "OUTCOMES"]

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
    """

    outcome: str
    losses: tuple[float, ...]
    golden_losses: tuple[float, ...]
    fired_steps: tuple[int, ...]
    band: float
    evidence: dict
    schedule: str

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


def runtime(run_dir_or_workload: Union[PathLike, Workload], substitution: Substitution,
            schedule: Schedule, *, steps: int, workload: Optional[Workload] = None,
            regions: Sequence[type] = (), name: Optional[str] = None, seed: int = 0,
            progress=None) -> RuntimeResult:
    """Train `steps` steps with `substitution` active on the steps `schedule` picks.

    From a run directory: starts from its step-0 checkpoint and compares with its recorded golden
    losses (`steps` must not exceed the golden run). From a `Workload`: initialises it with `seed`
    and runs the golden steps alongside. The injected step is one jitted `peat.inject` function:
    one compile for the whole run. With `name` (run directory only) the result is written to
    `campaigns/<name>/runtime.json`. A run directory's training runs at the matmul precision its
    golden run recorded.

    Returns:
      A `RuntimeResult`.
    """
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps <= 0:
        raise PeatError(f"steps must be a positive int, got {steps!r}")
    if not isinstance(schedule, Schedule):
        raise PeatError("runtime needs a peat schedule (peat.every / peat.at_steps / "
                        f"peat.with_probability), got {type(schedule).__name__}")
    rd, precision = None, None
    if isinstance(run_dir_or_workload, Workload):
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
    step_fn = jax.jit(inject(wl.train_step, substitution, schedule, regions=regions))
    plain = jax.jit(wl.train_step) if golden is None else None
    state, gstate = state0, state0
    losses, golden_run = [], []
    with at_matmul_precision(precision):  # a run directory's: as its golden run trained
        for i in range(steps):
            batch = to_device(wl.batch(i))
            state, metrics = step_fn(state, batch, i)
            losses.append(scalar_metrics(metrics)["loss"])
            if plain is not None:
                gstate, gm = plain(gstate, batch)
                golden_run.append(scalar_metrics(gm)["loss"])
            if progress is not None:
                progress(i + 1, steps)
    golden = golden if golden is not None else golden_run
    fired = schedule.fired_steps(range(steps))
    outcome, band, ev = classify_outcome(losses, golden, fired)
    ev["compiles"] = step_fn._cache_size()
    result = RuntimeResult(outcome, tuple(losses), tuple(golden), tuple(fired), band, ev,
                           str(schedule))
    if name is not None:
        if rd is None:
            raise PeatError("name= stores the result in a run directory; pass a run directory")
        atomic_write_json(rd.campaign(name) / "runtime.json", result.to_dict())
    return result
