"""Where two golden runs of the same workload part ways, site by site (the per-step metrics
are compared by `run_metrics.compare_runs`).

`compare` compares the recorded site statistics (`peat_jax._src.profiler.site_stats`) and
localises the first step, and in it the first site in program order, whose output differs beyond
noise, with the Analyzer's signature of the two recorded samples and the Detector's model. It
reads only the two run directories.

What "beyond noise" means here:
  * a site whose statistics (checksum, sample, scalar statistics) are bitwise equal in both runs
    does not differ (identical programs on XLA:CPU are bitwise reproducible);
  * the first site that differs at all (the *first difference*) is where a difference enters: it
    is diagnosed by `detect(analyze(sample_b, sample_a))`; `exact` / `numerical_noise` are noise,
    any other model is the divergence (samples of small outputs hold a few values, too few for
    the Detector's ratio test: where it finds no model but the sampled values, abs-max and RMS
    all changed by one factor, that is `wrong_scale`);
  * downstream of the first difference the inputs of every site already differ, so its noise
    is the propagated one: a later site diverges when its difference is new non-finite values,
    or larger than `PROPAGATED_RTOL` (relative RMS of the sample difference) and its diagnosis
    fails.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src.detector import Diagnosis
from peat_jax._src.errors import PeatError
from peat_jax._src.precision import at_matmul_precision
from peat_jax._src.profiler.golden import available_checkpoints, load_workload, restore
from peat_jax._src.profiler.hostio import quiet, to_device
from peat_jax._src.profiler.rundir import PathLike, RunDir, atomic_write_json, recorded_precision
from peat_jax._src.profiler.run_metrics import same_workload
from peat_jax._src.profiler.site_stats import (STATISTICS, StatsSite, StatsStep, read_sampling,
                                               read_sites, read_step, recorded_steps, unpack)
from peat_jax._src.profiler.workload import Workload


PROPAGATED_RTOL = 1e-3
"""Relative RMS difference of a site's sample above which a difference downstream of the first
one is no longer taken for propagated noise (it is then diagnosed)."""

OUTSIDE_SAMPLE_RTOL = 1e-5
"""When two samples are equal but the checksums differ, the largest relative difference of RMS
and abs-max still called noise."""

SCALE_RTOL = 1e-4
"""Relative spread within which the sampled values, abs-max and RMS of a site output are read as
scaled by one factor, where the Detector found no model in a sample too small for its ratio
test (it needs two values above the sample's RMS). Float32 sums of a scaled output round well
below it; a factor this close to 1 is not called a scale."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One (step, site) where run b's recorded statistics differ from run a's.

    Attributes:
      step: the training step.
      site: the site, as the runs' `sites.json` describe it.
      diagnosis: the Detector's verdict on run b's sample against run a's.
      relative_difference: RMS of the sample difference over the RMS of run a's sample (or the
        relative difference of the RMS / abs-max statistics, whichever is larger; inf when the
        non-finite counts differ).
    """

    step: int
    site: StatsSite
    diagnosis: Diagnosis
    relative_difference: float

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "site": _site_dict(self.site),
                "diagnosis": _diagnosis_dict(self.diagnosis),
                "relative_difference": _finite_or_none(self.relative_difference)}


class EnvironmentRow(NamedTuple):
    """One manifest entry of both runs, side by side."""

    key: str      # dotted: "backend", "versions.jax", "environment.xla_flags", ...
    a: Any        # run a's value (None where its manifest lacks it)
    b: Any        # run b's value
    differs: bool


@dataclasses.dataclass(frozen=True)
class ReplayFinding:
    """The divergence's step replayed on this backend from run a's checkpoint, its site's output
    diagnosed against run b's recorded sample (`peat.compare(..., replay=True)`).

    Attributes:
      step: the divergence's step.
      site: the divergence's site.
      checkpoint: run a's checkpoint restored (the state before that step); the steps from it
        up to `step` were re-run here with the plain step.
      backend: this backend and device kind ("cpu (cpu)").
      diagnosis: the Detector's verdict on run b's recorded statistics of the site against the
        replay's (its sample where they differ, as `compare` does between the two runs).
      relative_difference: run b's against the replay's, as `Finding.relative_difference`.
      matches_a: whether the replay's statistics of the site are bitwise run a's recorded ones
        (False when this backend, jax release or flags differ from run a's).
      relative_difference_a: the replay's against run a's (0.0 when `matches_a`).
    """

    step: int
    site: StatsSite
    checkpoint: int
    backend: str
    diagnosis: Diagnosis
    relative_difference: float
    matches_a: bool
    relative_difference_a: float

    def summary(self) -> str:
        """One line."""
        a = "bitwise run a's" if self.matches_a else (
            f"not run a's (relative difference {self.relative_difference_a:.2g})")
        return (f"replayed on {self.backend} from checkpoint {self.checkpoint}: step {self.step}, "
                f"site {self.site.label()} vs run b: {self.diagnosis.summary}; the replay is {a}")

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "site": _site_dict(self.site), "checkpoint": self.checkpoint,
                "backend": self.backend, "diagnosis": _diagnosis_dict(self.diagnosis),
                "relative_difference": _finite_or_none(self.relative_difference),
                "matches_a": self.matches_a,
                "relative_difference_a": _finite_or_none(self.relative_difference_a),
                "summary": self.summary()}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Where two golden runs with site statistics part ways (`peat.compare`).

    Attributes:
      run_a, run_b: the run directories (run a is the reference).
      steps: the statistics steps both runs recorded, compared in order.
      sites: the recorded sites, in program (index) order.
      divergence: the first (step, site) whose difference is beyond noise, or None.
      first_difference: the first (step, site) whose statistics differ at all (noise included),
        or None when every recorded statistic is bitwise equal.
      environments: the two manifests' backend, device, versions and environment side by side.
      grid: per recorded site (rows, as `sites`) and step (columns, as `steps`), the relative
        difference (0.0: bitwise equal; inf: the non-finite counts differ).
      replay: with `compare(..., replay=True)` and a divergence, the divergence replayed on this
        backend (`ReplayFinding`); None otherwise.
    """

    run_a: str
    run_b: str
    steps: tuple[int, ...]
    sites: tuple[StatsSite, ...]
    divergence: Optional[Finding]
    first_difference: Optional[Finding]
    environments: tuple[EnvironmentRow, ...]
    grid: tuple[tuple[float, ...], ...]
    replay: Optional[ReplayFinding] = None

    @property
    def first_step(self) -> Optional[int]:
        """The step of the divergence, or None."""
        return None if self.divergence is None else self.divergence.step

    @property
    def first_site(self) -> Optional[StatsSite]:
        """The site of the divergence, or None."""
        return None if self.divergence is None else self.divergence.site

    @property
    def diagnosis(self) -> Optional[Diagnosis]:
        """The diagnosis at the divergence; without one, at the first difference (noise); None
        when nothing differs."""
        found = self.divergence or self.first_difference
        return None if found is None else found.diagnosis

    def summary(self) -> str:
        """One line (two when the first difference comes before the divergence)."""
        n = f"{len(self.steps)} recorded step(s), {len(self.sites)} sites"
        first = self.first_difference
        if first is None:
            return f"no difference: every site statistic is bitwise equal ({n})"
        where = f"first bitwise difference at step {first.step}, site {first.site.label()}"
        if self.divergence is None:
            return (f"no divergence beyond noise ({n}); {where}: {first.diagnosis.model}")
        d = self.divergence
        line = f"step {d.step}, site {d.site.label()}: {d.diagnosis.summary}"
        lines = [line] if d is first else [line, f"{where}: {first.diagnosis.model}"]
        return "\n".join(lines + ([self.replay.summary()] if self.replay else []))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: `first_step`, `first_site` (index, primitive, phase, path), `diagnosis`,
        `first_difference`, `environments`, `steps`, `sites`, `grid` (null for a non-finite
        difference), `replay` (null without one), `summary`."""
        return {"run_a": self.run_a, "run_b": self.run_b, "first_step": self.first_step,
                "first_site": None if self.first_site is None else _site_dict(self.first_site),
                "diagnosis": None if self.diagnosis is None else _diagnosis_dict(self.diagnosis),
                "first_difference": (None if self.first_difference is None
                                     else self.first_difference.to_dict()),
                "divergence": None if self.divergence is None else self.divergence.to_dict(),
                "environments": [r._asdict() for r in self.environments],
                "steps": list(self.steps), "sites": [_site_dict(s) for s in self.sites],
                "grid": [[_finite_or_none(v) for v in row] for row in self.grid],
                "replay": None if self.replay is None else self.replay.to_dict(),
                "summary": self.summary()}


def _site_dict(s: StatsSite) -> dict[str, Any]:
    return {"index": s.index, "primitive": s.primitive, "phase": s.phase, "path": s.path}


def _diagnosis_dict(d: Diagnosis) -> dict[str, Any]:
    return dataclasses.asdict(d)


def _finite_or_none(v: float) -> Optional[float]:
    return float(v) if math.isfinite(v) else None


_ENVIRONMENT_KEYS = ("backend", "device_kind", "device_count", "python", "versions",
                     "environment", "substitution", "stats_every")


def environments(ma: dict, mb: dict) -> tuple[EnvironmentRow, ...]:
    """The manifests' environment entries side by side, nested objects flattened to dotted
    keys (`versions.jax`, `environment.xla_flags`), each row marked whether it differs."""
    fa, fb = _flatten({k: ma.get(k) for k in _ENVIRONMENT_KEYS}), \
        _flatten({k: mb.get(k) for k in _ENVIRONMENT_KEYS})
    keys = list(fa) + [k for k in fb if k not in fa]
    return tuple(EnvironmentRow(key=k, a=fa.get(k), b=fb.get(k), differs=fa.get(k) != fb.get(k))
                 for k in keys)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else v
    return out


def _same_sites(ra: RunDir, rb: RunDir) -> list[StatsSite]:
    sa, sb = read_sites(ra.site_stats), read_sites(rb.site_stats)
    key = lambda s: (s.index, s.primitive, s.phase, s.path, s.shape, s.dtype, s.recorded)  # noqa: E731
    if [key(s) for s in sa] != [key(s) for s in sb]:
        diff = next((x, y) for x, y in zip(sa + [None], sb + [None]) if x is None or y is None
                    or key(x) != key(y))
        raise PeatError(f"{ra.path} and {rb.path} recorded different sites (first: "
                        f"{diff[0] and diff[0].label()} vs {diff[1] and diff[1].label()}): they "
                        "are not runs of the same train step")
    sampling = read_sampling(ra.site_stats), read_sampling(rb.site_stats)
    if sampling[0] != sampling[1]:
        raise PeatError(f"{ra.path} and {rb.path} sampled the site outputs differently "
                        f"({sampling[0]} vs {sampling[1]} in "
                        "their sites.json: one was profiled by an older peat_jax); profile "
                        "both with the same peat_jax")
    return sa


def compare(run_a: PathLike, run_b: PathLike, *, replay: bool = False,
            workload: Optional[Workload] = None) -> Comparison:
    """Where golden run `run_b` departs from golden run `run_a` (the reference), from their
    recorded site statistics (both profiled with `stats_every`; same workload, config and seed;
    backend, device, versions, flags, precision or a substitution may differ).

    Walks the statistics steps both runs recorded, and in each the sites in program order; the
    first (step, site) whose difference is beyond noise (see the module docstring) is the
    divergence, diagnosed by the Detector on the two recorded samples. Without `replay` it reads
    only the two run directories: no workload is rebuilt.

    Args:
      replay: also replay the divergence on this backend (`replay_divergence`): run a's
        workload is rebuilt (or `workload` used), so this needs a registered workload or the
        object itself. Nothing is replayed when nothing diverges.
      workload: with `replay`, run a's workload object (default: rebuilt from its manifest).

    Returns:
      A `Comparison` (its `replay` set when replayed).

    Raises:
      PeatError: runs of different workloads, no common statistics step, different sites; with
        `replay`, see `replay_divergence`.
    """
    found = _compare(run_a, run_b)
    if not replay or found.divergence is None:
        return found
    return dataclasses.replace(found, replay=replay_divergence(found, workload=workload))


def _compare(run_a: PathLike, run_b: PathLike) -> Comparison:
    ra, rb = RunDir(run_a), RunDir(run_b)
    ma, mb = same_workload(ra, rb)
    sites = [s for s in _same_sites(ra, rb) if s.recorded]
    steps = sorted(set(recorded_steps(ra.site_stats)) & set(recorded_steps(rb.site_stats)))
    if not steps:
        raise PeatError(f"{ra.path} and {rb.path} have no statistics step in common; profile "
                        "both with the same stats_every")
    grid = np.zeros((len(sites), len(steps)))
    first = divergence = None
    for col, step in enumerate(steps):
        a, b = read_step(ra.site_stats, step), read_step(rb.site_stats, step)
        for row, site in enumerate(sites):
            same, rel = _difference(site, row, a, b)
            grid[row, col] = rel
            if same or divergence is not None:
                continue
            if first is not None and not _beyond_propagated_noise(site, row, a, b, rel):
                continue
            found = Finding(step=step, site=site, diagnosis=_diagnose(site, row, a, b, rel),
                            relative_difference=rel)
            first = first or found
            if not found.diagnosis.passed:
                divergence = found
    return Comparison(run_a=str(ra.path), run_b=str(rb.path), steps=tuple(steps),
                      sites=tuple(sites), divergence=divergence, first_difference=first,
                      environments=environments(ma, mb),
                      grid=tuple(tuple(float(v) for v in r) for r in grid))


def replay_divergence(comparison: Comparison, *,
                      workload: Optional[Workload] = None) -> Optional[ReplayFinding]:
    """Replay the step of `comparison`'s divergence on this backend and diagnose its site there
    against run b's recorded statistics.

    Restores run a's latest checkpoint at or before the divergence's step, re-runs the plain
    steps up to it, and runs that step with site statistics (the same fixed-index samples the
    golden runs recorded), at the matmul precision run a trained at.

    Returns:
      The `ReplayFinding`, or None when `comparison` has no divergence (nothing to replay).

    Raises:
      PeatError: run a has no checkpoint at or before that step, its workload cannot be rebuilt
        (pass `workload=`), it trained with a substitution (the manifest names the candidate
        but cannot rebuild it), or the rebuilt workload traces other sites than were recorded.
    """
    d = comparison.divergence
    if d is None:
        return None
    ra, rb = RunDir(comparison.run_a), RunDir(comparison.run_b)
    manifest = ra.manifest()
    if manifest.get("substitution"):
        raise PeatError(f"run a ({ra.path}) trained with a substitution, which its manifest names "
                        "but cannot rebuild; replay with the reference run (no substitution) "
                        "as run a")
    wl = load_workload(manifest, workload)
    checkpoints = available_checkpoints(ra)
    before = [c for c in checkpoints if c <= d.step]
    if not before:
        raise PeatError(f"run a ({ra.path}) has no checkpoint at or before step {d.step} to "
                        f"replay from (its checkpoints: {checkpoints or 'none'}); profile it "
                        "again with a checkpoint_every that puts one there, or compare without "
                        "replay")
    start = max(before)
    with quiet(), at_matmul_precision(recorded_precision(manifest)):
        stepper = StatsStep(wl.train_step, sampling=read_sampling(ra.site_stats))
        state = restore(ra.path, start, workload=wl)
        for i in range(start, d.step):
            state, _ = stepper.plain(state, to_device(wl.batch(i)))
        batch = to_device(wl.batch(d.step))
        _check_same_sites(ra, comparison.sites, stepper.sites(state, batch))
        replayed = unpack(jax.device_get(stepper.with_stats(state, batch)[2]))
    row = comparison.sites.index(d.site)
    a, b = read_step(ra.site_stats, d.step), read_step(rb.site_stats, d.step)
    same_b, rel_b = _difference(d.site, row, replayed, b)
    same_a, rel_a = _difference(d.site, row, a, replayed)
    diagnosis = (_diagnose(d.site, row, replayed, b, rel_b) if not same_b else
                 Diagnosis(model="exact", passed=True, confidence=1.0, evidence={"bitwise": True},
                           summary="passes: exact, run b's statistics are bitwise the replay's"))
    backend = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
    return ReplayFinding(step=d.step, site=d.site, checkpoint=start, backend=backend,
                         diagnosis=diagnosis, relative_difference=rel_b, matches_a=same_a,
                         relative_difference_a=rel_a)


def _check_same_sites(ra: RunDir, recorded: tuple[StatsSite, ...], traced: list) -> None:
    if [s for s in traced if s.recorded] != list(recorded):
        raise PeatError(f"the workload rebuilt for {ra.path} traces other sites than the run "
                        "recorded: pass the workload the run was profiled with (workload=)")


def _sample(site: StatsSite, arrays: dict) -> np.ndarray:
    return arrays["sample"][site.offset:site.offset + site.sample_size]


def _difference(site: StatsSite, row: int, a: dict, b: dict) -> tuple[bool, float]:
    """(bitwise equal?, relative difference) of one site's statistics in the two runs."""
    sa, sb = _sample(site, a), _sample(site, b)
    same = sa.tobytes() == sb.tobytes() and all(
        a[k][row].tobytes() == b[k][row].tobytes() for k in STATISTICS)
    if same:
        return True, 0.0
    if a["nonfinite"][row] != b["nonfinite"][row]:
        return False, math.inf
    fa, fb = sa.astype(np.float64), sb.astype(np.float64)
    both = np.isfinite(fa) & np.isfinite(fb)
    rms_a = float(np.sqrt(np.mean(np.square(fa[both])))) if both.any() else 0.0
    diff = float(np.sqrt(np.mean(np.square(fb[both] - fa[both])))) if both.any() else 0.0
    rel = [diff / rms_a if rms_a > 0 else (0.0 if diff == 0 else math.inf)]
    for k in ("rms", "absmax"):
        x, y = float(a[k][row]), float(b[k][row])
        rel.append(abs(y - x) / abs(x) if x != 0 else (0.0 if y == 0 else math.inf))
    return False, max(rel)


def _beyond_propagated_noise(site: StatsSite, row: int, a: dict, b: dict, rel: float) -> bool:
    """Downstream of the first difference: whether this site's difference is more than
    propagated noise could be (new non-finite values, or larger than `PROPAGATED_RTOL`)."""
    return bool(a["nonfinite"][row] != b["nonfinite"][row]) or rel > PROPAGATED_RTOL


def _diagnose(site: StatsSite, row: int, a: dict, b: dict, rel: float) -> Diagnosis:
    """The Detector's verdict on run b's sample of `site` against run a's; where the samples
    are equal (the difference lies outside them), a verdict from the scalar statistics."""
    from peat_jax._src.analyzer import analyze
    from peat_jax._src.detector import detect
    na, nb = int(a["nonfinite"][row]), int(b["nonfinite"][row])
    sa, sb = _sample(site, a), _sample(site, b)
    if sa.tobytes() != sb.tobytes():
        dtype = jnp.dtype(site.dtype)
        found = detect(analyze(np.asarray(sb).astype(dtype), np.asarray(sa).astype(dtype),
                               reduction_length=site.reduction_length))
        factor = None if found.model not in ("random_value", "unknown") else \
            _common_scale(site, row, a, b)
        if factor is None:
            return found
        return Diagnosis("wrong_scale", False, 0.8,
                         {"ratio": factor, "sample_size": site.sample_size, "scalars": True},
                         f"fails: wrong_scale, the output is {factor:.6g}x the reference (every "
                         f"value of the {site.sample_size}-value sample, abs-max and RMS)")
    evidence = {"outside_sample": True, "relative_difference": _finite_or_none(rel),
                "nonfinite": [na, nb]}
    if nb > na:
        return Diagnosis("nan_inf", False, 1.0, evidence,
                         f"fails: nan_inf, {nb} non-finite values where the reference has {na} "
                         "(outside the recorded sample)")
    if rel <= OUTSIDE_SAMPLE_RTOL:
        return Diagnosis("numerical_noise", True, 0.5, evidence,
                         f"passes: numerical_noise, the sample is equal and RMS / abs-max differ "
                         f"by {rel:.2g} relative (outside the recorded sample)")
    return Diagnosis("unknown", False, 0.5, evidence,
                     f"fails: unknown, the sample is equal but RMS / abs-max differ by {rel:.2g} "
                     "relative (outside the recorded sample)")


def _common_scale(site: StatsSite, row: int, a: dict, b: dict) -> Optional[float]:
    """The factor by which run b's output of `site` is run a's, when its nonzero sampled values,
    abs-max and RMS all agree on one within `SCALE_RTOL` (and sampled zeros stay zero), and it
    is not 1; else None."""
    if not jnp.issubdtype(jnp.dtype(site.dtype), jnp.floating):
        return None
    sa, sb = _sample(site, a).astype(np.float64), _sample(site, b).astype(np.float64)
    nonzero = sa != 0
    scalars = [float(b[k][row]) / float(a[k][row]) for k in ("absmax", "rms") if a[k][row] != 0]
    ratios = np.concatenate([sb[nonzero] / sa[nonzero], scalars])
    if ratios.size < 3 or not np.all(np.isfinite(ratios)) or np.any(sb[~nonzero] != 0):
        return None
    factor = float(np.median(ratios))
    tol = max(SCALE_RTOL, 8 * float(jnp.finfo(site.dtype).eps))
    if np.max(np.abs(ratios - factor)) > tol * abs(factor) or abs(factor - 1) <= 10 * tol:
        return None
    return factor


# --------------------------------------------------------------------------------------------
# Kept with the reference run, for its report

def _comparison_name(run_b: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(run_b).rstrip("/").split("/")[-1]) or "run"
    return name.lstrip(".") or "run"


def save_comparison(comparison: Comparison) -> str:
    """Write `comparison.to_dict()` to `<run_a>/comparisons/<name of run_b>.json` (read by the
    report); returns the path."""
    name = _comparison_name(comparison.run_b)
    path = RunDir(comparison.run_a).path / "comparisons" / f"{name}.json"
    atomic_write_json(path, comparison.to_dict())
    return str(path)


def read_comparisons(run_dir: PathLike) -> dict[str, dict]:
    """The comparisons saved in `run_dir/comparisons/`, by name (damaged files skipped)."""
    root = RunDir(run_dir).path / "comparisons"
    out = {}
    for p in sorted(root.glob("*.json")) if root.exists() else []:
        try:
            out[p.stem] = json.loads(p.read_text())
        except ValueError:
            continue
    return out
