"""The detector's machinery, apart from its catalogue of rules (`peat_jax._src.detector`): the
`Diagnosis` a rule's verdict becomes, `Rule` and its `Match`, helpers over a signature, the
number phrasing of summaries, and the operations on diagnoses (`narrowed`, `severity`)."""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

import numpy as np

from peat_jax._src import taxonomy
from peat_jax._src.analyzer import Signature
from peat_jax._src.formats import float_format


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """The verdict on one signature.

    Attributes:
      model: a name from `MODELS`.
      passed: True for ``exact`` / ``numerical_noise`` and for models the caller allowed.
      confidence: in [0, 1]: how clearly the deciding condition held (each rule states how).
      evidence: the conditions that held, with their numbers (JSON-able), plus ``"rule"`` (the
        rule's name) and, from `check_kernel`, ``"origin"`` (which input variant and output).
      summary: one line for a kernel author, starting with "passes:" or "fails:".
    """

    model: str
    passed: bool
    confidence: float
    evidence: Mapping[str, Any]
    summary: str

    def __str__(self) -> str:
        return self.summary


class Match(NamedTuple):
    evidence: dict
    confidence: float
    detail: str


@dataclasses.dataclass(frozen=True)
class Rule:
    """One sufficient condition: ``test(signature)`` returns a match or None.

    Attributes:
      name: the rule's name (several rules may name the same model).
      model: the model it concludes.
      test: the condition; its docstring states it.
    """

    name: str
    model: str
    test: Callable[[Signature], Optional[Match]]

    @property
    def condition(self) -> str:
        """The sufficient condition in words (the test's docstring, first paragraph)."""
        return " ".join((self.test.__doc__ or "").strip().split("\n\n")[0].split())


def element_count(s: Signature) -> int:
    return max(s.counts.elements, 1)


def isolated_limit(s: Signature) -> int:
    return max(1, min(8, int(0.01 * s.counts.elements)))


def fault_bits(w, dtype: str) -> tuple[int, ...]:
    """The bits a fault flipped in element `w`.

    Without noise (at most 1% of the elements differ within the floor), the differing bits
    themselves. With noise, the
    fewest bits (up to T) whose flip turns the candidate back into a value within twice the
    element's floor of the golden and at least halves its error (of several, the one that
    comes closest): a flipped value in a kernel with rounding noise differs from the golden in
    the fault's bits plus noise bits, and carries can spread the noise into higher bits, so the
    bits are found by value, not by XOR; and an error already near the floor is not explained
    by flipping whichever low bit keeps it there. Falls back to the differing bits at or above
    the element's noise bits.
    """
    if w.noise_bits == 0:
        return w.differing_bits
    f = float_format(dtype)
    ut, ft = f.uint, f.scalar
    tol = 2.0 * w.floor
    error = abs(w.candidate - w.golden)
    error = error if not math.isnan(error) else math.inf     # a NaN candidate
    for k in range(1, flip_limit(dtype) + 1):
        combos = list(itertools.combinations(range(f.bits), k))
        if len(combos) > 50_000:
            break
        masks: np.ndarray = np.array([sum(1 << b for b in c) for c in combos],
                                     dtype=np.uint64).astype(ut)
        with np.errstate(invalid="ignore", over="ignore"):
            back = (ut(w.candidate_bits) ^ masks).view(ft).astype(np.float64)
            left = np.where(np.isfinite(back), np.abs(back - w.golden), np.inf)
        ok = (left <= tol) & (left < 0.5 * error)
        if ok.any():
            return combos[int(np.argmin(np.where(ok, left, np.inf)))]
    return w.fault_bits


def worst_all_listed(s: Signature) -> bool:
    """True when `worst` lists every significant element (isolated errors)."""
    return 0 < s.counts.significant <= len(s.worst)


def index_text(w) -> str:
    return "[" + ", ".join(str(i) for i in w.index) + "]" if w.index else "[]"


def short(x: float) -> str:
    return f"{x:.3g}"


def apart(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` written with as many significant digits (3 to 9) as tell them apart."""
    for digits in range(3, 10):
        sa, sb = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if sa != sb:
            break
    return sa, sb


def change_text(golden: float, candidate: float) -> str:
    """"golden -> candidate", each with the digits that tell them apart."""
    return " -> ".join(apart(golden, candidate))


def percent(x: float) -> str:
    return f"{100 * x:.0f}%"


def axis_name(axis: int) -> str:
    return "columns" if axis == -1 else "rows"


def flip_limit(dtype: str) -> int:
    """Most differing bits a multi-bit flip may have (T): more is indistinguishable from a
    random value."""
    return {16: 3, 32: 4, 64: 6}.get(float_format(dtype).bits, 4)


def format_phrase(formats) -> str:
    """How a summary names the narrow formats a result fits: "tf32", "tf32/fp16-like" (two
    formats with the same mantissa that the values could not tell apart), or "" for none."""
    formats = tuple(formats)
    if not formats:
        return ""
    return formats[0] if len(formats) == 1 else "/".join(formats) + "-like"


def narrowed(d: Diagnosis, formats) -> Diagnosis:
    """A ``reduced_precision`` diagnosis `d` with its narrow formats cut down to those also in
    `formats` (other evidence, e.g. another input range that ruled float16 out); `d` itself when
    that changes nothing or leaves none."""
    old = tuple(d.evidence.get("formats") or ())
    new = tuple(f for f in old if f in tuple(formats))
    if d.model != "reduced_precision" or not new or new == old:
        return d
    return dataclasses.replace(
        d, evidence={**d.evidence, "formats": list(new)},
        summary=d.summary.replace(f"to {format_phrase(old)}", f"to {format_phrase(new)}", 1))


def severity(d: Diagnosis) -> tuple:
    """Sort key of diagnoses, worst last: failing before passing, then by model class (nan_inf
    worst; precision models milder than faults and bugs), then by the evidence's floor ratio."""
    rank = taxonomy.severity_rank(d.model)
    ratio = d.evidence.get("max_floor_ratio", 0.0)
    try:
        ratio = float(ratio)
    except (TypeError, ValueError):
        ratio = 0.0
    return (not d.passed, rank, ratio if math.isfinite(ratio) else 1e300)


def plain(x):
    """Evidence as JSON-able Python values."""
    if isinstance(x, Mapping):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return int(x)
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v
