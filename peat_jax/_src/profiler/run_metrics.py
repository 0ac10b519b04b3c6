"""Two golden runs of one workload compared on their per-step metrics (loss, ...):
`compare_runs`. Where they part ways site by site is `compare.compare`."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from peat_jax._src.errors import PeatError
from peat_jax._src.profiler.rundir import PathLike, RunDir


@dataclasses.dataclass(frozen=True)
class RunComparison:
    """Where two golden runs of one workload part ways.

    Attributes:
      first_step: the first step at which some metric differs by more than the tolerance, or
        None if they agree throughout.
      metric: the metric that differs first (at `first_step`, the one with the largest relative
        difference), or None.
      values: (run a, run b) values of that metric at that step.
      first_difference_step: the first step at which any metric differs at all (bitwise).
      max_relative_difference: per metric, the largest |a - b| / max(|a|, |b|) over the steps.
      steps: steps compared (the shorter run's length).
      backends: (run a, run b) backend and device kind from the manifests.
    """

    first_step: Optional[int]
    metric: Optional[str]
    values: Optional[tuple[float, float]]
    first_difference_step: Optional[int]
    max_relative_difference: dict
    steps: int
    backends: tuple[str, str]

    def summary(self) -> str:
        a, b = self.backends
        if self.first_step is None:
            return f"{a} and {b} agree within tolerance over {self.steps} steps"
        assert self.values is not None  # set together with first_step
        va, vb = self.values
        return (f"{a} and {b} diverge at step {self.first_step} on {self.metric!r}: "
                f"{va:.6g} vs {vb:.6g}")


def same_workload(ra: RunDir, rb: RunDir) -> tuple[dict, dict]:
    """Both manifests, once they are known to describe runs of one workload, config and seed."""
    ma, mb = ra.manifest(), rb.manifest()
    for key in ("workload", "config", "seed"):
        if ma.get(key) != mb.get(key):
            raise PeatError(f"{ra.path} and {rb.path} are not runs of the same workload setup: "
                            f"{key} differs ({ma.get(key)!r} vs {mb.get(key)!r})")
    return ma, mb


def _rel(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return 0.0 if (math.isnan(a) and math.isnan(b)) else math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def compare_runs(run_a: PathLike, run_b: PathLike, *, rtol: float = 1e-3) -> RunComparison:
    """Compare the per-step golden metrics of two run directories of the same workload, config
    and seed (made, e.g., on CPU and on CUDA). A metric diverges at the first step where its
    relative difference exceeds `rtol`; the first bitwise difference is reported too."""
    if not rtol >= 0:
        raise PeatError(f"rtol must be >= 0, got {rtol}")
    ra, rb = RunDir(run_a), RunDir(run_b)
    ma, mb = same_workload(ra, rb)
    a, b = ra.golden_metrics(), rb.golden_metrics()
    steps = min(len(a), len(b))
    if steps == 0:
        raise PeatError(f"no golden metrics to compare in {ra.path if not a else rb.path}")
    metrics = sorted((set(a[0]) & set(b[0])) - {"step"})
    worst: dict[str, float] = {m: 0.0 for m in metrics}
    first_diff = None
    first: Optional[tuple[int, str, tuple[float, float]]] = None
    for i in range(steps):
        rels: dict[str, float] = {}
        for m in metrics:
            va, vb = float(a[i][m]), float(b[i][m])
            r = _rel(va, vb)
            rels[m] = r
            worst[m] = max(worst[m], r)
            if first_diff is None and r > 0:
                first_diff = i
        if first is None:
            over = {m: r for m, r in rels.items() if r > rtol}
            if over:
                m = max(over, key=over.__getitem__)
                first = (i, m, (float(a[i][m]), float(b[i][m])))
    backend = lambda m: f"{m.get('backend', '?')} ({m.get('device_kind', '?')})"  # noqa: E731
    return RunComparison(first[0] if first else None, first[1] if first else None,
                         first[2] if first else None, first_diff, worst, steps,
                         (backend(ma), backend(mb)))


# --------------------------------------------------------------------------------------------
# Site statistics: the first step and site where two runs part ways
