"""One op site's candidate output judged as `check_kernel` judges one output: against the
site's op evaluated in float64 on the golden step's operands there (the noise floor), its
spread under perturbations of the operands at their last bit (the conditioning floor), Monte
Carlo arithmetic on the op at its own precision (the rounding floor, `judge.rounding`) and, if
it still fails, the candidate's own float64 run (`detector.by_float64`). Playback calls it for a
failing site (`profiler.playback`)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from peat_jax._src.analyzer import Signature, analyze
from peat_jax._src.detector import Diagnosis, by_float64, detect
from peat_jax._src.formats import float_format, is_floating
from peat_jax._src.judge.conditioning import conditioning_spread
from peat_jax._src.judge.float64 import NO_WIDER, float64_evidence
from peat_jax._src.judge.rounding import rounding_samples


class NoFloat64Candidate(Exception):
    """The candidate's float64 run cannot serve, for a reason the verdict should state (a time
    limit); its message says why."""


@dataclasses.dataclass(frozen=True)
class SiteOp:
    """A site's op as the judge evaluates it.

    Attributes:
      float64: ``fn(*operands) -> list of outputs`` in float64 (`promote.widened_eqn`; called
        under ``jax.enable_x64(True)`` on float64 operands).
      traced: ``fn(*operands) -> list of outputs`` at the op's own dtypes, as traced (what
        Monte Carlo arithmetic evaluates); None: no rounding floor.
      output: the index of the output judged (the op's first float output).
      reduction_length: the K its outputs sum over (`sites.reduction_length`), or None.
    """

    float64: Callable
    traced: Optional[Callable] = None
    output: int = 0
    reduction_length: Optional[int] = None


def judge_site(op: SiteOp, operands: Sequence, candidate: np.ndarray, reference: np.ndarray,
               *, seed: int, candidate64: Optional[Callable[[], np.ndarray]] = None
               ) -> tuple[Signature, Diagnosis]:
    """(signature, diagnosis) of the site's output ``op.output``, `candidate`, against the golden's
    `reference` (host arrays of one shape and dtype) with the float64, conditioning and
    rounding floors of `op` on `operands` (host arrays, the golden step's at the site); where it
    still fails, ``candidate64()`` (the candidate's output computed in float64, or None: no such
    run) names what remains (``unstable_algorithm``, ``approximation``). A candidate64 that
    raises `NoFloat64Candidate` leaves the verdict with why in its summary; any other exception
    leaves it as it is. `seed` fixes the perturbations and the Monte Carlo keys."""
    if np.dtype(reference.dtype) == np.float64:
        return _by_dtype_bound(op, candidate, reference)
    k = op.output
    bits = float_format(reference.dtype).mantissa_bits
    with jax.enable_x64(True):
        x64 = [np.asarray(x, np.float64) if is_floating(x) else x for x in operands]
        ref64 = np.asarray(op.float64(*x64)[k])
        if ref64.dtype != np.float64:
            raise ValueError(f"the site's op returns {ref64.dtype} on float64 operands")
        spread = conditioning_spread(lambda moved: np.asarray(op.float64(*moved)[k]),
                                     list(operands), ref64, np.random.default_rng(seed), bits)
    sig = analyze(candidate, reference, ref64, reduction_length=op.reduction_length,
                  conditioning=spread)
    local = detect(sig)
    if local.passed:
        return sig, local
    sig, local = _with_rounding_floor(op, operands, k, candidate, reference, ref64, spread,
                                      seed, sig, local)
    if local.passed or candidate64 is None:
        return sig, local
    try:
        cand64 = candidate64()
    except NoFloat64Candidate as e:   # the verdict against the floors stands, and says why
        return sig, dataclasses.replace(
            local, evidence={**local.evidence, "no_float64_candidate": str(e)},
            summary=f"{local.summary} (no float64 rule: {e})")
    except Exception:  # noqa: BLE001 - a kernel that cannot run in float64: no float64 rule
        return sig, local
    return sig, by_float64(local, float64_evidence(candidate, reference, ref64, cand64))


def _by_dtype_bound(op: SiteOp, candidate, reference) -> tuple[Signature, Diagnosis]:
    """(signature, diagnosis) of a float64 output against the dtype bound (`NO_WIDER`): no
    float64 reference, so no conditioning, rounding or float64 rules either."""
    sig = analyze(candidate, reference, None, reduction_length=op.reduction_length)
    d = detect(sig)
    return sig, dataclasses.replace(
        d, evidence={**d.evidence, "no_float64_reference": NO_WIDER},
        summary=f"{d.summary}; note: the floor is the dtype bound: the site's op {NO_WIDER}")


def _with_rounding_floor(op: SiteOp, operands, k: int, candidate, reference, ref64, spread,
                         seed: int, sig: Signature, local: Diagnosis
                         ) -> tuple[Signature, Diagnosis]:
    """The failing verdict judged again with the rounding floor too (Monte Carlo arithmetic on
    ``op.traced``); where the op cannot be evaluated that way, the verdict as it was, with why
    in ``evidence["no_rounding_floor"]``."""
    if op.traced is None:
        return sig, local
    try:
        samples = rounding_samples(op.traced, tuple(jax.device_put(x) for x in operands), seed)
    except Exception as e:  # noqa: BLE001 - the other floors stand; the evidence says why
        first = (str(e).strip().splitlines() or [""])[0]
        why = f"{type(e).__name__}: {first[:160]}"
        return sig, dataclasses.replace(local, evidence={**local.evidence,
                                                         "no_rounding_floor": why})
    sig = analyze(candidate, reference, ref64, reduction_length=op.reduction_length,
                  conditioning=spread, rounding=samples[k])
    return sig, detect(sig)

