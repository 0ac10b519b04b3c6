"""Judging one `check_kernel` run's outputs: each output's comparison (`diagnose`: analyze and
detect with the noise, conditioning and rounding floors of `peat_jax._src.judge`), analysed on
worker threads, then judged again where it fails: with the rounding floor, by the candidate's own
float64 run, within the reference's run-to-run spread, and by a narrow format that explains
it."""
from __future__ import annotations

import dataclasses
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peat_jax._src._jax import x64_enabled
from peat_jax._src.analyzer import analyze
from peat_jax._src.check.programs import (VJP_FORWARD, Pairing, is_jitted, jitted_vjp,
                                          named_outputs, named_vjp, vjp_traced)
from peat_jax._src.check.programs import bitwise_same
from peat_jax._src.check.running import (Run, conditioning_spreads, float64_outputs,
                                         outputs_again, wider_reference)
from peat_jax._src.detector import (Diagnosis, bitwise_equal, by_float64, data_race, detect,
                                    format_phrase)
from peat_jax._src.formats import NARROW_FORMATS, ROUNDING_MODES, float_format, round_to_format
from peat_jax._src.judge.conditioning import is_float_leaf
from peat_jax._src.judge.float64 import float64_evidence, max_difference
from peat_jax._src.judge.reference_spread import (REFERENCE_SPREAD_FACTOR, Spread,
                                                  within_reference_spread)
from peat_jax._src.judge.rounding import rounding_samples
from peat_jax._src.sites import REDUCING_PRIMITIVES, list_sites, reduction_length, trace_key


@dataclasses.dataclass(frozen=True)
class Options:
    """What every comparison of one `check_kernel` call takes."""

    allow: tuple[str, ...]
    atol: Optional[float]
    rtol: Optional[float]
    reduction_length: Optional[int]
    noise_factor: float
    conditioning: bool


@dataclasses.dataclass(frozen=True)
class Check:
    variant: str
    output: str
    diagnosis: Diagnosis


def race_check(variant: str) -> "Check":
    return Check(variant, "forward", data_race())


def _forgive(candidate, golden, atol: Optional[float], rtol: Optional[float]):
    """The escape hatch: candidate elements within atol + rtol * |golden| of the golden are set
    to the golden before the analysis."""
    if atol is None and rtol is None:
        return candidate
    a, r = float(atol or 0.0), float(rtol or 0.0)

    def one(c, g):
        if not jnp.issubdtype(jnp.result_type(g), jnp.floating):
            return c
        c, g = jnp.asarray(c), jnp.asarray(g)
        close = jnp.abs(c.astype(jnp.float32) - g.astype(jnp.float32)) <= \
            a + r * jnp.abs(g.astype(jnp.float32))
        return jnp.where(close, g, c)

    return jax.tree.map(one, candidate, golden)


def diagnose(cand, gold, ref64, opts: Options, comparison: str = "golden",
              conditioning=None, reduction_length: Optional[int] = None,
              rounding=None) -> Diagnosis:
    """`detect(analyze(...))` of one output; `reduction_length` (with `ref64` only) is the K
    to use when the caller gave none (`_longest_reduction`). A repeat bitwise equal to the
    first run is ``exact`` without an analysis (as `detect` would say): a deterministic
    kernel's repeats compile no statistics of their own."""
    if comparison == "repeat" and bitwise_same(cand, gold):
        return bitwise_equal(sum(np.size(x) for x in jax.tree.leaves(gold)), comparison)
    cand = _forgive(cand, gold, opts.atol, opts.rtol)
    k = opts.reduction_length
    if k is None and ref64 is not None:
        k = reduction_length
    sig = analyze(cand, gold, ref64, reduction_length=k, noise_factor=opts.noise_factor,
                  comparison=comparison, conditioning=conditioning, rounding=rounding)
    return detect(sig, allow=opts.allow)


def _longest_reduction(reference, run: Run) -> Optional[int]:
    """The most elements any op of the reference's program sums into one output element, on
    the run's inputs, forward and (with gradients) backward (`REDUCING_PRIMITIVES`; a matmul's
    K); None when it sums nothing or cannot be traced."""
    if run.positions:
        def fn(args, ct):
            return vjp_traced(reference, args, run.positions, ct)
        args = (run.args, run.cotangent)
    else:
        fn, args = reference, run.args
    try:
        sites = list_sites(fn, *args, primitives=REDUCING_PRIMITIVES)
    except Exception:  # noqa: BLE001 - only a refinement of the rounding reach
        return None
    longest = max((reduction_length(s) or 1 for s in sites), default=1)
    return longest if longest > 1 else None


class Pending(NamedTuple):
    """A check whose analysis runs on a worker thread (`Future` of its `Diagnosis`)."""

    variant: str
    output: str
    diagnosis: Future


@dataclasses.dataclass
class Found:
    """What running a check's variants finds besides the checks (`_run_variants` fills it).

    Attributes:
      skipped: variant -> why it was skipped.
      spread: (variant, output) -> the reference's run-to-run difference, where it has one.
      runs: variant -> its `Run`.
      refs64: variant -> the float64 reference's outputs ({} where there is none).
      why64: variant -> why it has no float64 reference (or only some outputs).
      reductions: `_longest_reduction` by the run's shapes (`sites.trace_key`): variants of
        one shape trace the reference's program once.
      conditioning: variant -> {output: conditioning spread} (what `comparisons` passed).
      reduction: variant -> the K `comparisons` passed (None: none).
    """

    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    spread: dict[tuple[str, str], Spread] = dataclasses.field(default_factory=dict)
    runs: dict[str, Run] = dataclasses.field(default_factory=dict)
    refs64: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    why64: dict[str, str] = dataclasses.field(default_factory=dict)
    reductions: dict[Any, Optional[int]] = dataclasses.field(default_factory=dict)
    conditioning: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    reduction: dict[str, Optional[int]] = dataclasses.field(default_factory=dict)


def comparisons(pool: ThreadPoolExecutor, reference, reference64: Callable, run: Run,
                 opts: Options, seed: int, found: Found) -> list[Pending]:
    """Candidate against reference for every output of the run, with the float64 reference
    (`reference64`, the reference or its shadow, evaluated in float64) as the noise floor where
    it exists (kept in ``found.refs64`` for `judged_by_float64`; where it does not, why in
    ``found.why64``), and its spread under 1-ULP input perturbations as the conditioning floor
    (unless ``opts.conditioning`` is off); analysed on `pool`."""
    ref64, why = wider_reference(reference64, run)
    found.refs64[run.variant] = ref64
    if why:
        found.why64[run.variant] = why
    cond = conditioning_spreads(reference64, run, ref64, seed) if opts.conditioning else {}
    k = None
    if ref64 and opts.reduction_length is None:
        shapes = trace_key((run.args, run.cotangent))
        if shapes is None:   # an unhashable static leaf: nothing to key a memo on
            k = _longest_reduction(reference, run)
        else:
            key = (shapes, run.positions)
            if key not in found.reductions:
                found.reductions[key] = _longest_reduction(reference, run)
            k = found.reductions[key]
    found.conditioning[run.variant], found.reduction[run.variant] = cond, k
    return [Pending(run.variant, output, _submit(
        pool, diagnose, run.candidate[output], gold, ref64.get(output), opts,
        conditioning=cond.get(output), reduction_length=k))
        for output, gold in run.reference.items()]


def _rounding_outputs(reference, run: Run, seed: int) -> dict[str, Any]:
    """{output: Monte Carlo samples} of the reference on the run's inputs (`judge.rounding`:
    forward and, with gradients, backward under the run's cotangent), by output name."""
    if not run.positions:
        return {"forward": rounding_samples(reference, run.args, seed)}
    both = VJP_FORWARD in run.reference
    body = jitted_vjp(reference, run.positions, both) if is_jitted(reference) else \
        named_vjp(reference, run.positions, both)
    o = rounding_samples(body, (run.args, run.cotangent), seed)
    return named_outputs(o if both else o._replace(forward=o.vjp_forward), run.positions, both)


def judged_by_rounding(checks: list[Check], reference, found: Found, opts: Options,
                        seed: int) -> tuple[list[Check], dict[str, str]]:
    """`checks` with each failing output that has a float64 reference judged again with the
    rounding floor too (`judge.rounding`: `ROUNDING_SAMPLES` Monte Carlo evaluations of the
    reference, once per variant with such an output, on the calling thread), and {variant: why}
    where the reference could not be evaluated that way (the floors without it stand). A
    passing check needs no rounding floor, so a correct kernel pays nothing for it."""
    samples: dict[str, dict[str, Any]] = {}
    why: dict[str, str] = {}
    judged = []
    for c in checks:
        ref64 = found.refs64.get(c.variant, {})
        if c.diagnosis.passed or c.output not in ref64 or c.variant in why:
            judged.append(c)
            continue
        run = found.runs[c.variant]
        if c.variant not in samples:
            try:
                samples[c.variant] = _rounding_outputs(reference, run, seed)
            except Exception as e:  # noqa: BLE001 - the other floors stand; the verdict says why
                first = (str(e).strip().splitlines() or [""])[0]
                why[c.variant] = f"{type(e).__name__}: {first[:160]}"
                judged.append(c)
                continue
        d = diagnose(run.candidate[c.output], run.reference[c.output], ref64[c.output], opts,
                      conditioning=found.conditioning.get(c.variant, {}).get(c.output),
                      reduction_length=found.reduction.get(c.variant),
                      rounding=samples[c.variant][c.output])
        judged.append(Check(c.variant, c.output, d))
    return judged, why


def judged_by_float64(checks: list[Check], candidate, runs: dict[str, Run],
                       refs64: dict[str, dict[str, Any]], opts: Options) -> list[Check]:
    """`checks` with each failing output that has a float64 reference also judged by the
    candidate's own float64 evaluation (`by_float64`); the candidate runs in float64 once per
    variant with such an output, on the calling thread."""
    cand64: dict[str, dict[str, Any]] = {}
    judged = []
    for c in checks:
        ref64 = refs64.get(c.variant, {})
        if c.diagnosis.passed or c.output not in ref64:
            judged.append(c)
            continue
        run = runs[c.variant]
        if c.variant not in cand64:
            cand64[c.variant], _ = float64_outputs(candidate, run)
        judged.append(_by_float64(c, run, ref64, cand64[c.variant], opts))
    return judged


def _by_float64(c: Check, run: Run, ref64: dict[str, Any], cand64: dict[str, Any],
                opts: Options) -> Check:
    """`c` renamed by the detector's float64 rules when the candidate ran in float64 too."""
    o = c.output
    if c.diagnosis.passed or o not in ref64 or o not in cand64:
        return c
    f = float64_evidence(run.candidate[o], run.reference[o], ref64[o], cand64[o])
    return Check(c.variant, o, by_float64(c.diagnosis, f, allow=opts.allow))


def repeat_checks(pool: ThreadPoolExecutor, candidate, run: Run, repeats: int,
                   opts: Options, pairing: Optional[Pairing] = None) -> list[Pending]:
    """`repeats` more runs of the candidate, each against its first run (the dtype bound as the
    floor): ``nondeterministic`` when they differ beyond it; analysed on `pool`."""
    checks = []
    for _ in range(repeats):
        again = outputs_again(candidate, run, "candidate", pairing)
        checks += [Pending(run.variant, f"repeat {output}", _submit(
            pool, diagnose, value, run.candidate[output], None, opts, comparison="repeat"))
            for output, value in again.items()]
    return checks


def _submit(pool: ThreadPoolExecutor, fn: Callable, *args, **kwargs) -> Future:
    """`fn(*args, **kwargs)` on `pool`, under the caller's x64 setting (a ``jax.enable_x64``
    context is the calling thread's only)."""
    x64 = x64_enabled()

    def under_callers_x64():
        with jax.enable_x64(x64):
            return fn(*args, **kwargs)

    return pool.submit(under_callers_x64)


def done_future(value) -> Future:
    """A `Future` that already holds `value`."""
    f: Future = Future()
    f.set_result(value)
    return f


def analysis_workers() -> int:
    """Threads the analyses of one `check_kernel` run on: XLA compiles each new shape's
    statistics on one thread (1.5-2 s of CPU each), so compiling the outputs' programs side by
    side, while the kernels of the next variant run, uses every core."""
    return max(2, min(8, os.cpu_count() or 2))


def reference_spread(reference, run: Run) -> dict[tuple[str, str], Spread]:
    """{(variant, output): Spread} for the outputs on which the reference differs from itself
    (an atomics-based reduction, say): empty when a second run matches the first bitwise, else
    the largest difference over three runs' pairs."""
    first = run.reference
    second = outputs_again(reference, run, "reference")
    if not any(max_difference(second[o], first[o]) > 0 for o in second):
        return {}
    third = outputs_again(reference, run, "reference")
    spread = {}
    for o in second:
        own = max(max_difference(second[o], first[o]), max_difference(third[o], first[o]),
                  max_difference(third[o], second[o]))
        if own > 0:
            spread[(run.variant, o)] = Spread(
                reference=own, candidate=max_difference(run.candidate[o], first[o]))
    return spread


def _with_inputs_rounded(reference: Callable, fmt: str, mode: str = "nearest") -> Callable:
    """`reference` fed its float inputs rounded to the narrow format `fmt` (`mode` as in
    `formats.round_to_format`; straight through: the gradients flow as if unrounded), what a
    kernel computing in `fmt` would return."""
    def rounded(x):
        if not is_float_leaf(x):
            return x
        return x + jax.lax.stop_gradient(round_to_format(x, fmt, mode) - x)

    return lambda *args: reference(*jax.tree.map(rounded, args))


FORMAT_MATCH = 0.5
"""A failing reduced_precision check's narrow format F is confirmed when the candidate is this
many times closer (rms over the output) to the reference fed F-rounded inputs than to the
reference itself: a kernel that rounds its inputs to F makes the same errors element by element;
another function (tanh-GELU for the exact one) with errors of that size makes other ones."""


class FormatOutputs:
    """The reference's outputs on a run's inputs rounded to a narrow format, computed once per
    (variant, format, rounding mode) and shared by the checks that read them."""

    def __init__(self, reference: Callable):
        self.reference = reference
        self._kept: dict[tuple[str, str, str], dict[str, Any]] = {}

    def __call__(self, run: Run, fmt: str, mode: str = "nearest") -> dict[str, Any]:
        key = (run.variant, fmt, mode)
        if key not in self._kept:
            self._kept[key] = outputs_again(_with_inputs_rounded(self.reference, fmt, mode),
                                            run, "reference")
        return self._kept[key]


def confirmed_formats(checks: list[Check], runs: dict[str, Run],
                      emulated: FormatOutputs) -> list[Check]:
    """`checks`, with the narrow formats of each failing precision check decided by whether
    rounding the inputs to them reproduces its errors element by element (rounded to nearest or
    toward zero: rms |candidate - that reference| within `FORMAT_MATCH` times rms |candidate -
    reference|):

    * a ``reduced_precision`` check of the inputs keeps the formats that reproduce them and is
      stripped of the others (evidence ``formats_not_reproduced``): errors of that size from
      another function are not rounding (the float64 rules then tell an approximation apart);
    * a ``low_precision_accumulation`` check off any grid (biased errors: inputs rounded toward
      zero are biased too) becomes ``reduced_precision`` of the formats that reproduce it
      (evidence rule ``reproduced_by_format``, with the rounding mode)."""
    out = []
    for c in checks:
        d, run = c.diagnosis, runs.get(c.variant)
        named = list(d.evidence.get("formats") or ())
        precision = d.model == "reduced_precision" and d.evidence.get("where") == "inputs" \
            and named
        biased = d.model == "low_precision_accumulation" and "max_ulp_on_grid" not in d.evidence
        if d.passed or not (precision or biased) or run is None or \
                c.output not in run.reference:
            out.append(c)
            continue
        found = _reproducing(c, run, emulated, named if precision else list(NARROW_FORMATS))
        if precision:
            kept = [f for f in named if f in found]
            out.append(c if kept == named else Check(c.variant, c.output,
                                                     _formats_kept(d, kept)))
        else:
            out.append(Check(c.variant, c.output, _reproduced(d, found)) if found else c)
    return out


def _reproducing(c: Check, run: Run, emulated: FormatOutputs,
                 formats: Sequence[str]) -> dict[str, str]:
    """{format: rounding mode} of the `formats` whose rounding of the inputs reproduces the
    candidate's errors on check `c` (see `confirmed_formats`)."""
    cand, ref = run.candidate[c.output], run.reference[c.output]
    off = _rms_difference(cand, ref)
    found: dict[str, str] = {}
    if not math.isfinite(off):   # non-finite where the reference is not: no rounding did that
        return found
    for f in formats:
        for mode in ("nearest",) if f == "fp16" else ROUNDING_MODES:
            if _rms_difference(cand, emulated(run, f, mode)[c.output]) <= FORMAT_MATCH * off:
                found[f] = mode
                break
    return found


def _formats_kept(d: Diagnosis, kept: list[str]) -> Diagnosis:
    """`d` with only the narrow formats `kept` (none: its summary no longer names one)."""
    old = format_phrase(d.evidence["formats"])
    ev = {**d.evidence, "formats": kept,
          "formats_not_reproduced": [f for f in d.evidence["formats"] if f not in kept]}
    if kept:
        summary = d.summary.replace(f"to {old}", f"to {format_phrase(kept)}", 1)
    else:
        summary = d.summary.replace(
            f"inputs rounded to {old} (", "errors the size of inputs rounded to a narrower "
            f"format, though rounding them to {old} does not reproduce them (", 1)
    return dataclasses.replace(d, evidence=ev, summary=summary)


def _reproduced(d: Diagnosis, found: dict[str, str]) -> Diagnosis:
    """`d` (biased, off any grid) relabelled ``reduced_precision`` of the formats in `found`
    ({format: rounding mode}), whose rounding of the inputs reproduces its errors."""
    formats = list(found)
    modes = sorted(set(found.values()))
    how = " and ".join(m.replace("_", " ") for m in modes)
    return Diagnosis(
        model="reduced_precision", passed=False, confidence=0.8,
        evidence={**d.evidence, "rule": "reproduced_by_format", "where": "inputs",
                  "formats": formats, "rounding": dict(found), "would_be": d.model},
        summary=(f"fails: reduced_precision, inputs rounded to {format_phrase(formats)} "
                 f"({how}): that rounding reproduces the errors element by element (the rules "
                 f"alone said {d.model})"))


def _rms_difference(a, b) -> float:
    """rms |a - b| over two float arrays (output units): inf where their non-finite elements
    differ, 0.0 when both are wholly non-finite alike."""
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ok = np.isfinite(x)
    if np.any(ok != np.isfinite(y)):
        return math.inf
    return float(np.sqrt(np.mean((x[ok] - y[ok]) ** 2))) if ok.any() else 0.0


ROW_FIT_RESIDUAL = 0.25
"""A row's errors are a scale of its golden values about a point per column when the fit
err[r, c] = a[r] * (golden[r, c] - b[c]) leaves at most this share of their rms
(`per_row_scale`)."""


def per_row_scale(checks: list[Check], runs: dict[str, Run]) -> list[Check]:
    """`checks`, with each failing ``low_precision_accumulation`` or ``unknown`` check renamed
    ``wrong_scale`` (rule ``per_row_scale``) when this sufficient condition holds: the output
    has rows (last axis >= 8 elements, >= 2 rows) and the least-squares fit err[r, c] = a[r] *
    (golden[r, c] - b[c]) (a scale per row about a point per column) leaves <= `ROW_FIT_RESIDUAL`
    of the errors' rms in >= 90% of the rows holding errors, with |a[r]| above 4 ULPs at 1 of the
    dtype there. Each row is then the golden times its own constant about an offset shared by
    the rows (a norm whose eps differs: its bias, added after the scale, keeps the ratio from
    being constant)."""
    out = []
    for c in checks:
        run = runs.get(c.variant)
        if c.diagnosis.passed or c.diagnosis.model not in ("low_precision_accumulation",
                                                           "unknown") or run is None \
                or c.output not in run.reference:
            out.append(c)
            continue
        share = _scaled_rows(run.candidate[c.output], run.reference[c.output])
        out.append(c if share is None else Check(c.variant, c.output,
                                                 _row_scaled(c.diagnosis, share)))
    return out


_FIT_ROUNDS = 8   # alternating least squares: a given b, then b given a


def _scaled_rows(candidate, golden) -> Optional[float]:
    """The share of the rows holding errors that `per_row_scale`'s fit explains, when it is
    >= 90%; else None."""
    c, g = (np.asarray(x, np.float64) for x in (candidate, golden))
    if c.ndim < 1 or c.shape[-1] < 8 or c.size // c.shape[-1] < 2 or \
            not (np.isfinite(c).all() and np.isfinite(g).all()):
        return None
    eps = 4 * 2.0 ** -float_format(np.asarray(golden).dtype).mantissa_bits
    g2 = g.reshape(-1, g.shape[-1])
    e2 = c.reshape(g2.shape) - g2
    err_rms = np.sqrt(np.mean(e2 ** 2, axis=1))
    held = err_rms > 0
    if held.sum() < 2:
        return None
    e2, g2, err_rms = e2[held], g2[held], err_rms[held]
    b = np.zeros(g2.shape[1])
    for _ in range(_FIT_ROUNDS):
        moved = g2 - b
        a = (moved * e2).sum(axis=1) / np.maximum((moved ** 2).sum(axis=1), np.finfo(float).tiny)
        b = (a[:, None] * (a[:, None] * g2 - e2)).sum(axis=0) / max(float((a ** 2).sum()),
                                                                     np.finfo(float).tiny)
    residual = np.sqrt(np.mean((e2 - a[:, None] * (g2 - b)) ** 2, axis=1))
    scaled = (residual <= ROW_FIT_RESIDUAL * err_rms) & (np.abs(a) > eps)
    share = float(scaled.mean())
    return share if share >= 0.9 else None


def _row_scaled(d: Diagnosis, share: float) -> Diagnosis:
    return Diagnosis(
        model="wrong_scale", passed=False, confidence=0.8,
        evidence={**d.evidence, "rule": "per_row_scale", "rows_scaled": share,
                  "would_be": d.model},
        summary=(f"fails: wrong_scale, each row is the golden times its own constant about an "
                 f"offset shared by the rows ({100 * share:.0f}% of the rows with errors; a "
                 f"norm's eps, say; the rules alone said {d.model})"))


def explained_by_format(checks: list[Check], runs: dict[str, Run],
                        emulated: FormatOutputs) -> list[Check]:
    """`checks`, with each failing check of another model relabelled ``reduced_precision`` when
    some check names a narrow format F and the candidate's max |error| there is within
    `REFERENCE_SPREAD_FACTOR` times that of the reference fed F-rounded inputs: rounding to F
    explains it (an outlier input rounded to TF32 shifts every output it dominates by one
    constant factor, which the rules alone would call ``wrong_scale``)."""
    formats = narrowest_formats(checks)
    if not formats:
        return checks
    out = []
    for c in checks:
        run = runs.get(c.variant)
        if c.diagnosis.passed or c.diagnosis.model == "reduced_precision" or run is None or \
                c.output not in run.reference:
            out.append(c)
            continue
        error = max_difference(run.candidate[c.output], run.reference[c.output])
        for fmt in formats:
            own = max_difference(emulated(run, fmt)[c.output], run.reference[c.output])
            if 0 < own and error <= REFERENCE_SPREAD_FACTOR * own:
                out.append(Check(c.variant, c.output, _format_explains(c.diagnosis, fmt, error,
                                                                        own)))
                break
        else:
            out.append(c)
    return out


def _format_explains(d: Diagnosis, fmt: str, error: float, own: float) -> Diagnosis:
    """`d` relabelled ``reduced_precision``: its error is what inputs rounded to `fmt` give (no
    ``max_floor_ratio``: a check the rules named directly is the better one to report)."""
    return Diagnosis(
        model="reduced_precision", passed=False, confidence=0.5,
        evidence={"rule": "explained_by_format", "formats": [fmt], "max_abs_error": error,
                  "format_error": own, "would_be": d.model,
                  "would_be_floor_ratio": d.evidence.get("max_floor_ratio")},
        summary=(f"fails: reduced_precision, inputs rounded to {fmt} explain the error (max "
                 f"|error| {error:.3g}, within {REFERENCE_SPREAD_FACTOR:g}x the reference's own "
                 f"with {fmt} inputs, {own:.3g}; the rules alone said {d.model})"))


def within_spread(c: Check, spread: Optional[Spread]) -> Check:
    """`c` passing as ``numerical_noise`` where the reference's own run-to-run difference
    covers it (`judge.reference_spread.within_reference_spread`)."""
    return Check(c.variant, c.output, within_reference_spread(c.diagnosis, spread))


def narrowest_formats(checks: Sequence[Check]) -> tuple[str, ...]:
    """The narrow formats every failing ``reduced_precision`` check fits (each check's own
    values rule formats out by their exponent range: float16 cannot hold the "large" inputs)."""
    sets = [set(c.diagnosis.evidence.get("formats") or ()) for c in checks
            if c.diagnosis.model == "reduced_precision" and not c.diagnosis.passed]
    sets = [x for x in sets if x]
    return tuple(set.intersection(*sets)) if sets else ()
