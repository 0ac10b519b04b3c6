"""Detector: from a `Signature` to a `Diagnosis` (``peat.detect``): the catalogue of rules (its
machinery, the `Diagnosis` and `Rule` types and the phrasing of summaries, lives in
`peat_jax._src.detector.machinery`; the floors the signature was built with in
`peat_jax._src.judge`).

The error model is decided by an ordered tuple of rules, `RULES`. Each rule states a *sufficient
condition* over the signature's statistics (its docstring, repeated in ``docs/error_models.md``);
the first rule whose condition holds names the model. A rule returns the evidence (the numbers its
condition was decided on), a confidence and a one-line summary.

Passing models: ``exact`` and ``numerical_noise``. Every other model fails, unless the caller
allows it (``detect(sig, allow=("reduced_precision",))``).

Vocabulary used by the rules (see `peat_jax._src.analyzer` for the exact definitions):
*significant* elements are mismatched beyond the noise floor; *isolated* means at most
``max(1, min(8, 1% of the elements))`` significant elements; *single-bit* means the bit patterns
differ in exactly one position.

``stuck_at`` (a bit forced to 0 or 1) is not a taxonomy model: it is diagnosed as ``bit_flip``,
with ``evidence["pattern"] == "stuck_at"`` when many elements differ in the same bit and all now
hold the same value there (one element: an ordinary ``bit_flip``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Optional


from peat_jax._src import taxonomy
from peat_jax._src.analyzer import Counts, Signature
from peat_jax._src.detector.float64 import FLOAT64_RULES
from peat_jax._src.detector.machinery import (Diagnosis, Match, Rule, apart, axis_name, change_text,
                                              element_count, fault_bits, flip_limit, format_phrase,
                                              index_text, isolated_limit, percent, plain, severity,
                                              short, worst_all_listed)
from peat_jax._src.errors import PeatError
from peat_jax._src.formats import bit_class, float_format, narrow_formats_like, ulp_at


MODELS: tuple[str, ...] = taxonomy.MODELS
"""Every model name `detect` can return (`peat_jax._src.taxonomy`; docs/design.md)."""

PASSING: frozenset = taxonomy.PASSING

SLOPE_THRESHOLD = 0.2
"""Error slope separating rounded inputs (error independent of the value, slope ~0) from an
accumulator kept in a narrow format (error grows with the accumulated value, slope >= 0.2)."""

BIAS_T_THRESHOLD = 6.0
"""|mean signed error| / its standard error above which dense numerical error counts as biased."""

GRID_TOLERANCE = 0.01
"""Share of mismatched elements allowed beyond 0.5625 ULP of the candidate's narrow grid for
"the output is the golden rounded to that grid" (rounding noise of the golden's precision)."""


# ----------------------------------------------------------------------------------------------
# Rules (ordered). Each docstring's first paragraph is the sufficient condition.
# ----------------------------------------------------------------------------------------------

def _exact(s: Signature) -> Optional[Match]:
    """No element's bit pattern differs (NaN vs NaN counts as equal)."""
    if s.counts.mismatched:
        return None
    return _exact_match(s.counts.elements, s.comparison)


def _exact_match(elements: int, comparison: str) -> Match:
    what = "bitwise equal to the golden" if comparison == "golden" else \
        "bitwise equal to the earlier run"
    return Match({"elements": elements}, 1.0, f"{what} ({elements} elements)")


def _nondeterministic(s: Signature) -> Optional[Match]:
    """The comparison is between two runs of the candidate on the same inputs, and at least one
    element differs beyond the noise floor (or in a non-finite value)."""
    if s.comparison != "repeat" or s.counts.significant == 0:
        return None
    ev = {"significant": s.counts.significant, "mismatched": s.counts.mismatched,
          "max_floor_ratio": s.errors.max_floor_ratio}
    w = s.worst[0] if s.worst else None
    where = f", e.g. at {index_text(w)}: {' vs '.join(apart(w.candidate, w.golden))}" if w else ""
    return Match(ev, 1.0, f"{s.counts.significant} of {s.counts.elements} elements change from "
                           f"run to run beyond the noise floor{where}")


def _repeat_noise(s: Signature) -> Optional[Match]:
    """The comparison is between two runs of the candidate, they differ, and every difference is
    within the noise floor (run-to-run rounding differences, e.g. atomics; this passes)."""
    if s.comparison != "repeat":
        return None
    return Match({"mismatched": s.counts.mismatched,
                   "max_floor_ratio": s.errors.max_floor_ratio}, 0.8,
                  f"{s.counts.mismatched} elements differ from run to run, all within the noise "
                  f"floor (max {short(s.errors.max_floor_ratio)}x)")


def _systematic_flush(c: Counts) -> bool:
    """Flushes (golden subnormal, candidate +-0) that a flushing kernel would leave: one beyond
    its floor, or at least half the golden's subnormal values where the candidate has no
    subnormal value at all (a kernel that flushes its results leaves none). Zeros among
    subnormals the candidate otherwise keeps or makes, all within the floor, are rounding where
    the floor is wide (jax.nn.softmax's float16 gradient at logits near 90 against the naive
    formula: 3 of 20; 1 of 2 on jax 0.12.1, which keeps a subnormal elsewhere)."""
    significant_flushes = c.significant - c.significant_not_flushed
    every_result_flushed = c.subnormal_candidate == 0 and 2 * c.flushed >= c.subnormal_golden
    return c.flushed > 0 and (every_result_flushed or significant_flushes > 0)


def _flush_to_zero(s: Signature) -> Optional[Match]:
    """A systematic flush (`_systematic_flush`) and no significant element is anything else
    (all other differences are within the noise floor)."""
    c = s.counts
    if not _systematic_flush(c) or c.significant_not_flushed > 0 or c.new_nonfinite:
        return None
    ev = {"flushed": c.flushed, "subnormal_golden": c.subnormal_golden,
          "significant_not_flushed": 0}
    return Match(ev, min(1.0, 0.5 + 0.5 * c.flushed / max(c.subnormal_golden, 1)),
                  f"{c.flushed} of {c.subnormal_golden} subnormal golden values are 0 in the "
                  "candidate; nothing else differs beyond noise")


def _numerical_noise(s: Signature) -> Optional[Match]:
    """No significant element (every difference within the per-element noise floor), no
    systematic flush (`_systematic_flush`), and, with a float64 reference and >= 32 finite
    elements, the distribution test holds (`peat_jax._src.analyzer.noise.distribution_ok`): it
    fails only when the candidate's median ULP error is beyond 2x the golden's (F/2) or its 90th
    percentile beyond 4x (F), and its 99th percentile beyond 4x too, each + 0.5 ULP."""
    c = s.counts
    if c.significant or _systematic_flush(c):
        return None
    nz = s.noise
    ev: dict[str, Any] = {"max_floor_ratio": s.errors.max_floor_ratio,
                          "mismatched": c.mismatched, "max_ulp": s.errors.max_ulp,
                          "floor": nz.kind if nz else None}
    if nz is not None and nz.kind == "float64":
        if nz.distribution_ok is False:
            return None
        ev["candidate_ulp_quantiles"] = dict(nz.candidate_ulp_quantiles)
        ev["golden_ulp_quantiles"] = dict(nz.golden_ulp_quantiles)
    conf = max(0.5, min(1.0, 1.5 - s.errors.max_floor_ratio))
    basis = ("the golden's own error vs float64" if nz and nz.kind == "float64"
             else f"the {s.dtype} bound")
    return Match(ev, conf, f"{c.mismatched} of {c.elements} elements differ, all within the "
                            f"noise floor (max {short(s.errors.max_floor_ratio)}x the floor set "
                            f"by {basis}; max {s.errors.max_ulp} ULP)"
                            f"{_conditioning_note(nz)}")


def _conditioning_note(nz) -> str:
    """The summary's words on the conditioning floor when it made a difference (it passed
    elements beyond the noise floor, or took elements out of the distribution test). With the
    rounding floor, its spread is part of that floor's (`analyze(rounding=)`): the words name
    both."""
    k = None if nz is None else nz.conditioning
    if k is None or (k.decisive == 0 and k.dominant == 0):
        return ""
    passed = (("1 element beyond the noise floor is" if k.decisive == 1 else
               f"{k.decisive} elements beyond the noise floor are") if k.decisive
              else "the errors are")
    spread = short(k.max_spread)
    moved = (f"the problem's conditioning (inputs perturbed at 1 ULP move the float64 result by "
             f"up to {spread}" if nz.rounding is None else
             f"the problem's conditioning or the rounding floor (inputs perturbed at 1 ULP move "
             f"the float64 result, or {nz.rounding.samples} correct roundings of the reference "
             f"depart from it, by up to {spread}")
    return f", {passed} within {moved}; that floor is up to {short(k.max_ratio)}x the noise floor)"


def _stuck_pattern(s: Signature) -> Optional[tuple[int, int]]:
    """(bit, value) when >= 90% of the sampled significant elements differ in exactly one bit
    (above their noise bits: rounding noise may carry into a few), >= 95% of those
    in one and the same bit, >= 99% of those holding the same value there, and >= 5% of the
    golden values already held that value."""
    b = s.bits
    if b is None or b.significant_single_bit < 0.9:
        return None
    n_single = sum(b.single_bit_histogram)
    if n_single < 2:
        return None
    bit = max(range(len(b.single_bit_histogram)), key=lambda i: b.single_bit_histogram[i])
    n_bit = b.single_bit_histogram[bit]
    if n_bit < 0.95 * n_single:
        return None
    n_set = b.single_bit_set[bit]
    if 0.01 * n_bit < n_set < 0.99 * n_bit:
        return None
    value = 1 if n_set >= 0.99 * n_bit else 0
    held = b.golden_bit_set[bit] if value else b.finite - b.golden_bit_set[bit]
    if b.finite == 0 or held < 0.05 * b.finite:
        return None
    return bit, value


def _stuck_at(s: Signature) -> Optional[Match]:
    """More than an isolated number of significant elements, (sampled) >= 90% of them differing
    from the golden in exactly one bit (at or above their noise bits: rounding noise in other
    elements may carry into a few), >= 95% of those in the same bit, >= 99% with the same
    resulting value there, and that value already held by >= 5% of the golden values (bits that
    were already right did not change): a bit stuck at 0 or 1, reported as ``bit_flip`` with
    ``pattern="stuck_at"``."""
    c = s.counts
    if c.significant <= isolated_limit(s) or s.bits is None:
        return None
    stuck = _stuck_pattern(s)
    if stuck is None:
        return None
    bit, value = stuck
    cls = bit_class(bit, s.dtype)
    ev = {"pattern": "stuck_at", "bit": bit, "bit_class": cls, "value": value,
          "elements": c.significant, "share": c.significant / element_count(s)}
    return Match(ev, 1.0, f"bit {bit} ({cls}) is forced to {value} in {c.significant} of "
                           f"{c.elements} elements (stuck-at-{value} pattern)")


def _reach_ulps(s: Signature) -> float:
    """`_rounding_reach` in ULPs at its scale: F, times sqrt(K) with a float64 reference and a
    known reduction length K (`NoiseFloor.reduction_length`): the K partial sums of a reduction
    at that scale each round, and another correct order rounds them differently."""
    if s.noise is None:
        return 4.0
    k = s.noise.reduction_length if s.noise.kind == "float64" else None
    return s.noise.factor * math.sqrt(max(k or 1, 1))


def _rounding_reach(s: Signature, golden: float) -> float:
    """How far rounding reaches at an element of golden value `golden` (output units):
    `_reach_ulps` ULPs of the golden's dtype at the larger of the tensor's scale (rms of the
    golden) and the element's own magnitude. A computation at that scale (a sum of terms of
    that size that cancels, say) rounds by about this much, whatever the element's own
    value."""
    scale = max(s.noise.rms_golden if s.noise is not None else 0.0, abs(golden))
    return _reach_ulps(s) * ulp_at(scale if math.isfinite(scale) else 0.0,
                                   float_format(s.dtype))


def _rounding_at_scale(s: Signature) -> Optional[Match]:
    """Isolated significant elements (all listed), each smaller than the tensor's scale in both
    the golden and the candidate (|g|, |c| < rms(g)) and each within the rounding reach there
    (|c - g| <= F ULPs of the dtype at rms(g), F * sqrt(K) for a reduction of K elements
    with a float64 reference, `_rounding_reach`): small values left by a
    cancellation of terms at the tensor's scale, which another algorithm rounds differently
    (the per-element floor saw a golden that happened to cancel exactly there)."""
    c = s.counts
    if c.significant == 0 or c.significant > isolated_limit(s) or not worst_all_listed(s):
        return None
    if s.noise is None or c.new_nonfinite or not math.isfinite(s.noise.rms_golden):
        return None
    rms = s.noise.rms_golden
    reach = [_rounding_reach(s, w.golden) for w in s.worst]
    if not all(abs(w.candidate) < rms and abs(w.golden) < rms and
               abs(w.candidate - w.golden) <= r for w, r in zip(s.worst, reach)):
        return None
    w = s.worst[0]
    ev = {"elements": [list(x.index) for x in s.worst],
          "errors": [abs(x.candidate - x.golden) for x in s.worst], "rounding_reach": reach,
          "reach_ulps": _reach_ulps(s), "rms_golden": s.noise.rms_golden}
    return Match(ev, 0.6, f"{c.significant} isolated elements beyond their own floor but "
                           f"within rounding at the tensor's scale (e.g. {index_text(w)}: "
                           f"{change_text(w.golden, w.candidate)}, |error| "
                           f"{short(abs(w.candidate - w.golden))} <= {short(reach[0])}, "
                           f"{short(_reach_ulps(s))} ULPs at rms {short(s.noise.rms_golden)})")


def _beyond_rounding(s: Signature) -> Optional[list[float]]:
    """`_rounding_reach` at each listed worst element, or None unless every one of them is
    beyond it (or non-finite): the condition for calling an isolated difference a flipped bit
    rather than rounding after cancellation."""
    reach = [_rounding_reach(s, w.golden) for w in s.worst]
    if all(abs(w.candidate - w.golden) > r or not math.isfinite(w.candidate)
           for w, r in zip(s.worst, reach)):
        return reach
    return None


def _bit_flip(s: Signature) -> Optional[Match]:
    """Isolated significant elements (all listed), each the golden with exactly one bit flipped:
    differing in exactly one bit or, when other elements differ within the noise floor, turned
    back within twice its floor of the golden by flipping one bit; and each flip above what
    rounding at the tensor's scale reaches (|c - g| > F ULPs at max(rms(g), |g|), F * sqrt(K)
    for a reduction of K elements with a float64 reference,
    `_rounding_reach`): a tiny error after cancellation is not a flipped bit."""
    c = s.counts
    if c.significant == 0 or s.bits is None:
        return None
    if c.significant > isolated_limit(s) or not worst_all_listed(s):
        return None
    flips = []
    for w in s.worst:
        hb = fault_bits(w, s.dtype)
        if len(hb) != 1:
            return None
        flips.append((w, hb[0]))
    reach = _beyond_rounding(s)
    if reach is None:
        return None
    w, bit = flips[0]
    cls = bit_class(bit, s.dtype)
    ev = {"pattern": "isolated", "elements": [list(x.index) for x, _ in flips],
          "bits": [b for _, b in flips], "bit": bit, "bit_class": cls,
          "candidate": w.candidate, "golden": w.golden,
          "flip_sizes": [abs(x.candidate - x.golden) for x, _ in flips],
          "rounding_reach": reach, "reach_ulps": _reach_ulps(s)}
    more = f" (+{len(flips) - 1} more elements)" if len(flips) > 1 else ""
    return Match(ev, 1.0, f"one bit differs at {index_text(w)}: bit {bit} ({cls}), "
                           f"{change_text(w.golden, w.candidate)}{more}")


def _canonical_nonfinite(w, dtype: str) -> bool:
    """An infinity, or a NaN whose mantissa is only the quiet bit (what arithmetic produces),
    as opposed to a NaN keeping the golden's mantissa bits (an exponent bit flip)."""
    f = float_format(dtype)
    mant = w.candidate_bits & f.mantissa_mask
    return mant in (0, 1 << (f.mantissa_bits - 1))


def _nan_inf(s: Signature) -> Optional[Match]:
    """The candidate is NaN or +-inf at >= 1 element where the golden is finite, or NaN where
    the golden is +-inf (a log-sum-exp of a fully masked row: -inf - (-inf) where the reference
    returns -inf), unless every significant element is isolated and differs from the golden
    in at most T bits with a non-canonical NaN (an exponent bit flip that produced a NaN: left
    to the bit-flip rules)."""
    c = s.counts
    n = c.new_nonfinite + c.nan_for_infinite
    if n == 0:
        return None
    if (c.significant <= isolated_limit(s) and worst_all_listed(s) and all(
            len(fault_bits(w, s.dtype)) <= flip_limit(s.dtype) and not (
                math.isnan(w.candidate) and _canonical_nonfinite(w, s.dtype)) and not (
                math.isinf(w.candidate) and len(fault_bits(w, s.dtype)) > 1)
            for w in s.worst)):
        return None
    nonfinite = [x for x in s.worst if not math.isfinite(x.candidate)]
    w = next((x for x in nonfinite if math.isfinite(x.golden) or (
        math.isnan(x.candidate) and math.isinf(x.golden))), nonfinite[0] if nonfinite else None)
    at = (f", first at {index_text(w)} ({short(w.candidate)} where the golden is "
          f"{short(w.golden)})") if w else ""
    ev = {"new_nonfinite": c.new_nonfinite, "nan_for_infinite": c.nan_for_infinite,
          "nonfinite_golden": c.nonfinite_golden,
          "elements": [list(x.index) for x in nonfinite]}
    where = " and ".join(part for part, k in (
        (f"{c.new_nonfinite} non-finite values where the golden is finite", c.new_nonfinite),
        (f"{c.nan_for_infinite} NaN where the golden is infinite", c.nan_for_infinite)) if k)
    return Match(ev, 1.0, f"{where}{at}")


def _multi_bit_flip(s: Signature) -> Optional[Match]:
    """Isolated significant elements (all listed), each the golden with 2..T bits flipped (found
    as for bit_flip; T = 3 for 16-bit, 4 for 32-bit, 6 for 64-bit dtypes; a value differing in
    more bits is indistinguishable from a random value), each beyond what rounding at the
    tensor's scale reaches (as for bit_flip)."""
    c = s.counts
    if c.significant == 0 or c.significant > isolated_limit(s) or not worst_all_listed(s):
        return None
    limit = flip_limit(s.dtype)
    per = [fault_bits(w, s.dtype) for w in s.worst]
    if not all(2 <= len(h) <= limit for h in per):
        return None
    reach = _beyond_rounding(s)
    if reach is None:
        return None
    w = s.worst[0]
    classes = sorted({bit_class(b, s.dtype) for b in per[0]})
    ev = {"elements": [list(x.index) for x in s.worst], "bits": [list(h) for h in per],
          "classes": classes, "flip_sizes": [abs(x.candidate - x.golden) for x in s.worst],
          "rounding_reach": reach, "reach_ulps": _reach_ulps(s)}
    return Match(ev, 0.9, f"{len(per[0])} bits differ at {index_text(w)}: bits "
                           f"{', '.join(map(str, per[0]))} ({'/'.join(classes)}), "
                           f"{change_text(w.golden, w.candidate)}")


def _permuted_layout(s: Signature) -> Optional[Match]:
    """>= 2 significant elements and either (a) the candidate equals the golden with its last two
    axes swapped (within the floor), or (b) the sorted candidate equals the sorted golden within
    the floor, the sorted arrays differ bitwise in at most as many positions as elements are
    mismatched, >= 90% of the significant elements are off by >= 1/16 relative, and the largest
    error is >= 1/16 of the golden's rms (values moved, not perturbed: a permutation explains
    errors that are large against the values, not values that already agree)."""
    c, p = s.counts, s.permutation
    if p is None or c.significant < 2:
        return None
    if p.is_transpose:
        ev: dict[str, Any] = {"transpose": True, "significant": c.significant}
        return Match(ev, 1.0, f"the output is the golden transposed (last two axes swapped; "
                               f"{c.significant} elements out of place)")
    if not p.is_permutation or p.sorted_differ is None or p.sorted_differ > c.mismatched:
        return None
    if s.errors.large_rel_significant < 0.9:
        return None
    rms = s.noise.rms_golden if s.noise is not None else 0.0
    if not s.errors.max_abs >= rms / 16:
        return None
    ev = {"permutation": True, "sorted_differ": p.sorted_differ, "significant": c.significant}
    st = s.structure
    where = ""
    if st is not None:
        if st.span.get(-2, (-1, -1))[0] >= 0 and st.cols_with_errors == st.n_cols:
            a, b = st.span[-2]
            where = f"; rows {a}..{b} hold moved values"
        if st.period.get(-2):
            where += f", pattern repeats every {st.period[-2]} rows"
            ev["period_rows"] = st.period[-2]
    exact = " (exactly the same values)" if p.sorted_differ == 0 else ""
    return Match(ev, 1.0 if p.sorted_differ == 0 else 0.8,
                  f"same values in the wrong places{exact}: {c.significant} elements "
                  f"moved{where}")


def _tile_boundary(s: Signature) -> Optional[Match]:
    """Along axis -1 or -2 and for a block size in (8, 16, 32, 64, 128): >= 95% of the
    significant errors lie in that block pattern's indices (block edges, or the last (partial)
    block) and >= 50% of the pattern's elements are significant, the pattern being a strict
    part of the axis."""
    st = s.structure
    if st is None or s.counts.significant == 0:
        return None
    best = None
    for m in st.blocks:
        if m.precision >= 0.95 and m.recall >= 0.5:
            key = (m.recall * m.precision, m.block)
            if best is None or key > best[0]:
                best = (key, m)
    if best is None:
        return None
    m = best[1]
    ax = axis_name(m.axis)
    ev = {"axis": m.axis, "block": m.block, "pattern": m.pattern, "precision": m.precision,
          "recall": m.recall}
    if m.pattern == "last_block":
        lo, hi = m.start, m.stop - 1
        partial = (m.stop % m.block) != 0
        ev.update(start=lo, stop=hi)
        what = (f"last partial block of {m.block}" if partial
                else f"last block of {m.block}")
        detail = (f"errors only in {ax} {lo}..{hi} = {what} (axis {m.axis} has {m.stop} "
                  f"{ax})")
    else:
        detail = (f"errors on the edges of blocks of {m.block} along {ax} (first/last index of "
                  f"each block; {percent(m.recall)} of edge elements wrong)")
    others = sorted({x.block for x in st.blocks if x.pattern == m.pattern and x.axis == m.axis
                     and x.precision >= 0.95 and x.recall >= 0.5 and x.block != m.block})
    if others:
        ev["also_fits_blocks"] = others
    return Match(ev, min(1.0, m.precision * (0.5 + 0.5 * m.recall)), detail)


def _operand_corruption(s: Signature) -> Optional[Match]:
    """Significant errors fill 1 or 2 whole rows (>= 90% of each row, over the flattened leading
    axes) or 1 or 2 whole columns, those hold >= 95% of the significant errors, slices are >= 2
    long, and the leaf has more rows (columns) than that."""
    st = s.structure
    if st is None or s.counts.significant == 0:
        return None
    for kind, n_full, share, idx, total in (
            ("row", st.n_full_rows, st.in_full_rows, st.full_rows, st.n_rows),
            ("column", st.n_full_cols, st.in_full_cols, st.full_cols, st.n_cols)):
        length = st.n_cols if kind == "row" else st.n_rows
        if 1 <= n_full <= 2 and share >= 0.95 and length >= 2 and total > n_full:
            ev = {"axis": kind, "indices": list(idx), "share": share}
            hint = ("a bad input row (lhs row)" if kind == "row"
                    else "a bad weight column (rhs column)")
            names = ", ".join(map(str, idx))
            return Match(ev, share, f"whole {kind}{'s' if n_full > 1 else ''} {names} wrong "
                                     f"({percent(share)} of the errors): {hint}")
    return None


def _sign_flip(s: Signature) -> Optional[Match]:
    """>= 2 significant elements and either >= 99% of the sampled significant elements are the
    golden negated (differing only in the sign bit, or, when other elements differ within
    noise, of opposite sign with |c + g| within the floor), or the ratio candidate/golden is
    constant and -1 within the noise tolerance (the whole output negated)."""
    b, r = s.bits, s.ratio
    if b is None or s.counts.significant < 2:
        return None
    minus_one = (r is not None and r.constant and abs(r.median + 1.0) <= r.tolerance)
    if b.negated < 0.99 and not minus_one:
        return None
    ev = {"negated_share": b.negated, "significant": s.counts.significant,
          "share_of_elements": s.counts.significant / element_count(s),
          "ratio_minus_one": minus_one}
    allv = s.counts.significant >= 0.99 * (s.counts.elements - 0)
    what = "the whole output is negated" if allv else \
        f"{s.counts.significant} of {s.counts.elements} elements are negated"
    return Match(ev, max(b.negated, 0.9 if minus_one else 0.0), what)


def _zeroed(s: Signature) -> Optional[Match]:
    """>= 99% of the sampled significant elements are +-0 in the candidate (and non-zero in the
    golden, since they differ)."""
    b = s.bits
    if b is None or s.counts.significant == 0 or b.candidate_zero < 0.99:
        return None
    ev = {"zero_share": b.candidate_zero, "significant": s.counts.significant,
          "share_of_elements": s.counts.significant / element_count(s)}
    what = ("the candidate is all zeros" if s.counts.significant >= 0.99 * s.counts.elements
            else f"{s.counts.significant} of {s.counts.elements} elements are 0 in the "
                 "candidate")
    return Match(ev, b.candidate_zero, what)


def _wrong_scale(s: Signature) -> Optional[Match]:
    """Either the ratio candidate/golden over the golden values with |g| >= rms(g) is constant
    (spread within the noise tolerance) and differs from 1 by more than the tolerance; or >= 90%
    of the rows holding significant errors have their own constant ratio != 1 over two or more
    values with |g| >= rms(g) (a per-row scale)."""
    r = s.ratio
    if r is None or s.counts.significant == 0:
        return None
    if r.constant and abs(r.median - 1.0) > r.tolerance:
        ev = {"ratio": r.median, "spread": r.spread, "tolerance": r.tolerance, "n": r.n}
        return Match(ev, 1.0 if r.spread <= 0.5 * r.tolerance else 0.8,
                      f"the output is {apart(r.median, 1.0)[0]}x the golden (constant ratio, "
                      f"spread {short(r.spread)})")
    if r.rows_constant >= 0.9:
        ev = {"rows_constant": r.rows_constant, "tolerance": r.tolerance}
        return Match(ev, r.rows_constant, f"each row is the golden times its own constant "
                                           f"({percent(r.rows_constant)} of the wrong rows)")
    return None


def _dense_numerical(s: Signature) -> bool:
    """Dense small errors: >= 50% of the elements mismatched, median relative error of the
    mismatched elements <= 1/8 (effective mantissa bits >= 1), no new non-finite value, and
    the degradation is distributional: >= 10% of the elements are significant, or the float64
    distribution test fails (median ULP error beyond F/2 x the golden's or 90th percentile
    beyond F x, and 99th percentile beyond F x: the whole distribution worse, as a narrow
    accumulator makes it, not only a median that another rounding order moved)."""
    p, c = s.precision, s.counts
    if p is None or p.effective_mantissa_bits is None or p.effective_mantissa_bits < 1.0:
        return False
    if c.new_nonfinite:
        return False
    dist_fail = s.noise is not None and s.noise.distribution_ok is False
    return dist_fail or c.significant >= 0.1 * c.elements


def _format_magnitudes(s: Signature) -> tuple[float, ...]:
    """Magnitudes the candidate kept finite and within its narrow precision: the golden's rms
    (a narrow format that cannot hold it is ruled out)."""
    rms = s.noise.rms_golden if s.noise is not None else None
    return (rms,) if rms is not None and math.isfinite(rms) else ()


def _reduced_precision(s: Signature) -> Optional[Match]:
    """Dense small errors (>= 50% of the elements mismatched, median relative error <= 1/8, no
    new non-finite value, and either the float64 distribution test fails or >= 10% of the
    elements are significant) and either (a) the candidate's values use >= 2 fewer mantissa
    bits than the golden's and each is the golden rounded to that grid (<= 1% of the mismatched
    elements more than 0.5625 ULP of the grid away: output rounded), or (b) the values use the
    full grid, the error slope is < 0.2 (error independent of the value: inputs or products
    rounded) and |bias t| < 6. The narrow format is named when the mantissa bits are within 1 of
    a known one (tf32 10, bf16 7, fp16 10) whose exponent range holds the golden's rms."""
    if not _dense_numerical(s):
        return None
    p, e = s.precision, s.errors
    assert p is not None and p.effective_mantissa_bits is not None  # _dense_numerical's test
    nmant = float_format(s.dtype).mantissa_bits
    if p.on_narrow_grid:
        if p.beyond_half_ulp_on_grid > GRID_TOLERANCE:
            return None
        formats = narrow_formats_like(p.candidate_grid_bits, tolerance=0,
                                      magnitudes=_format_magnitudes(s))
        ev = {"where": "output", "effective_mantissa_bits": p.candidate_grid_bits,
              "formats": list(formats), "max_ulp_on_grid": p.max_ulp_on_grid,
              "golden_grid_bits": p.golden_grid_bits,
              "beyond_half_ulp_on_grid": p.beyond_half_ulp_on_grid}
        named = f"{format_phrase(formats)}, " if formats else ""
        return Match(ev, 1.0, f"output rounded to {named}{p.candidate_grid_bits} mantissa bits "
                               f"({s.dtype} has {nmant}): every value is the golden rounded "
                               "to that grid")
    if not (e.error_slope < SLOPE_THRESHOLD) or abs(e.bias_t) >= BIAS_T_THRESHOLD:
        return None
    bits = p.effective_mantissa_bits
    formats = narrow_formats_like(bits, magnitudes=_format_magnitudes(s))
    ev = {"where": "inputs", "effective_mantissa_bits": round(bits, 1), "formats": list(formats),
          "error_slope": e.error_slope, "bias_t": e.bias_t,
          "median_rel_error": 2.0 ** -(bits + 2)}
    conf = max(0.5, min(1.0, 0.5 + (SLOPE_THRESHOLD - e.error_slope) / (2 * SLOPE_THRESHOLD)))
    slope = f"error independent of the value, slope {short(e.error_slope)}"
    if formats:
        return Match(ev, conf, f"inputs rounded to {format_phrase(formats)} (about {bits:.0f} "
                                f"effective mantissa bits; {s.dtype} has {nmant}; {slope})")
    return Match(ev, conf, f"about {bits:.0f} effective mantissa bits ({s.dtype} has {nmant}): "
                            f"inputs or products rounded to a narrower format ({slope})")


def _low_precision_accumulation(s: Signature) -> Optional[Match]:
    """Dense small errors (`_dense_numerical`: >= 10% of the elements significant, or the
    float64 distribution test fails in its body and its 99th percentile alike) and either (a)
    the candidate's values use >= 2 fewer mantissa bits than the golden's but > 1% of the
    mismatched elements are more than 0.5625 ULP of that grid away from the golden (several
    roundings in the narrow format), or (b) the error slope is >= 0.2 (error grows with the
    accumulated value), or (c) the error is biased (|t| >= 6)."""
    if not _dense_numerical(s):
        return None
    p, e = s.precision, s.errors
    assert p is not None and p.effective_mantissa_bits is not None  # _dense_numerical's test
    nmant = float_format(s.dtype).mantissa_bits
    ev = {"effective_mantissa_bits": round(p.effective_mantissa_bits, 1),
          "error_slope": e.error_slope, "bias_t": e.bias_t,
          "candidate_grid_bits": p.candidate_grid_bits}
    if p.on_narrow_grid:
        ev["max_ulp_on_grid"] = p.max_ulp_on_grid
        ev["beyond_half_ulp_on_grid"] = p.beyond_half_ulp_on_grid
        return Match(ev, 1.0, f"accumulated in a {p.candidate_grid_bits}-mantissa-bit format "
                               f"(values on that grid, up to {short(p.max_ulp_on_grid)} of its "
                               "ULPs off: rounded at every step)")
    if e.error_slope >= SLOPE_THRESHOLD or abs(e.bias_t) >= BIAS_T_THRESHOLD:
        why = (f"error grows with the value (slope {short(e.error_slope)})"
               if e.error_slope >= SLOPE_THRESHOLD else f"biased error (t = {short(e.bias_t)})")
        conf = max(0.5, min(1.0, 0.5 + abs(e.error_slope - SLOPE_THRESHOLD) / 0.6))
        return Match(ev, conf, f"about {p.effective_mantissa_bits:.0f} effective mantissa bits "
                                f"({s.dtype} has {nmant}), {why}: a narrow accumulator")
    return None


def _random_value(s: Signature) -> Optional[Match]:
    """>= 50% of the significant elements are off by >= 1/16 relative (or non-finite), with no
    structure found by the rules above (values replaced, not rounded)."""
    c = s.counts
    if c.significant == 0 or s.errors.large_rel_significant < 0.5:
        return None
    ev = {"significant": c.significant, "share_of_elements": c.significant / element_count(s),
          "large_error_share": s.errors.large_rel_significant}
    w = s.worst[0] if s.worst else None
    ex = f", e.g. {index_text(w)}: {change_text(w.golden, w.candidate)}" if w else ""
    return Match(ev, s.errors.large_rel_significant,
                  f"{c.significant} of {c.elements} elements hold unrelated values{ex}")


def _isolated(s: Signature) -> bool:
    """At least one and at most `isolated_limit` significant elements, and no distribution test
    failing: the failure is a few elements, not dense degradation."""
    dist_failed = s.noise is not None and s.noise.distribution_ok is False
    return 0 < s.counts.significant <= isolated_limit(s) and not dist_failed


def _unknown(s: Signature) -> Optional[Match]:
    """Anything else (fails: no model fits)."""
    c = s.counts
    ev: dict[str, Any] = {"significant": c.significant, "mismatched": c.mismatched,
                          "max_floor_ratio": s.errors.max_floor_ratio}
    if c.significant == 0 and s.noise is not None and s.noise.distribution_ok is False:
        ev["candidate_ulp_quantiles"] = dict(s.noise.candidate_ulp_quantiles)
        ev["golden_ulp_quantiles"] = dict(s.noise.golden_ulp_quantiles)
        return Match(ev, 0.5, "error distribution worse than the golden's (median or 90th, "
                               "and 99th percentile ULP error) but no element beyond the "
                               "floor")
    w = s.worst[0] if s.worst else None
    at = (f"; worst {index_text(w)}: {change_text(w.golden, w.candidate)}, |error| "
          f"{short(abs(w.candidate - w.golden))} against a floor of {short(w.floor)}") if w else ""
    return Match(ev, 0.5, f"{c.significant} of {c.elements} elements beyond the noise floor "
                           f"(max {short(s.errors.max_floor_ratio)}x{at}), no model fits")


RULES: tuple[Rule, ...] = (
    Rule("exact", "exact", _exact),
    Rule("nondeterministic", "nondeterministic", _nondeterministic),
    Rule("repeat_noise", "numerical_noise", _repeat_noise),
    Rule("flush_to_zero", "flush_to_zero", _flush_to_zero),
    Rule("numerical_noise", "numerical_noise", _numerical_noise),
    Rule("rounding_at_scale", "numerical_noise", _rounding_at_scale),
    Rule("stuck_at", "bit_flip", _stuck_at),
    Rule("permuted_layout", "permuted_layout", _permuted_layout),
    Rule("tile_boundary", "tile_boundary", _tile_boundary),
    Rule("nan_inf", "nan_inf", _nan_inf),
    Rule("operand_corruption", "operand_corruption", _operand_corruption),
    Rule("sign_flip", "sign_flip", _sign_flip),
    Rule("zeroed", "zeroed", _zeroed),
    Rule("wrong_scale", "wrong_scale", _wrong_scale),
    Rule("reduced_precision", "reduced_precision", _reduced_precision),
    Rule("low_precision_accumulation", "low_precision_accumulation", _low_precision_accumulation),
    Rule("bit_flip", "bit_flip", _bit_flip),
    Rule("multi_bit_flip", "multi_bit_flip", _multi_bit_flip),
    Rule("random_value", "random_value", _random_value),
    Rule("unknown", "unknown", _unknown),
)
"""The ordered sufficient conditions; the first that holds decides the model."""


def bitwise_equal(elements: int, comparison: str = "golden") -> Diagnosis:
    """The diagnosis `detect` gives two outputs whose every element (`elements` in all) is
    bitwise equal (rule ``exact``), for a caller that compared their bytes itself: nothing
    to analyse. `comparison`: as in `peat.analyze` ("golden" or "repeat")."""
    m = _exact_match(int(elements), comparison)
    return Diagnosis(model="exact", passed=True, confidence=m.confidence,
                     evidence=plain({**m.evidence, "rule": "exact", "max_floor_ratio": 0.0}),
                     summary=f"passes: exact, {m.detail}")


def data_race() -> Diagnosis:
    """The diagnosis of a candidate the Pallas interpreter's race detector stopped: two grid
    points on different simulated cores touched one block, at least one writing (sufficient:
    the detector saw it; no comparison is needed)."""
    return Diagnosis(
        model="data_race", passed=False, confidence=1.0,
        evidence={"rule": "data_race", "max_floor_ratio": "inf"},
        summary=("fails: data_race, the Pallas interpreter's race detector saw two grid points "
                 "on different cores access one block with at least one write (is a reduction "
                 "or revisited output dimension marked 'parallel'?)"))


CHECK_MODELS: tuple[str, ...] = tuple(m for _, m, _ in FLOAT64_RULES if m not in PASSING) + (
    "data_race",)
"""The models only `check_kernel` names (from more than one signature: the candidate's float64
run, the race detector); every other model has a rule in `RULES`."""


def detect(signature: Signature, *, allow: Iterable[str] = ()) -> Diagnosis:
    """The error model of a signature: the first rule of `RULES` whose condition holds.

    Args:
      signature: from `peat.analyze`. For a pytree signature every leaf is diagnosed and the
        worst diagnosis is returned (its evidence names the leaf).
      allow: models that count as passing (e.g. ``("reduced_precision",)`` for a kernel that
        computes in TF32 on purpose).

    Returns:
      A `Diagnosis`.
    """
    allow = frozenset(allow)
    unknown = sorted(allow - set(MODELS))
    if unknown:
        raise PeatError(f"allow names unknown models {unknown}; models are {', '.join(MODELS)}")
    if not isinstance(signature, Signature):
        raise PeatError(f"detect needs a peat.Signature (from peat.analyze), got "
                        f"{type(signature).__name__}")
    if signature.leaves:
        diags = [_detect_leaf(leaf, allow) for leaf in signature.leaves]
        return max(diags, key=severity)
    return _detect_leaf(signature, allow)


def _detect_leaf(s: Signature, allow: frozenset) -> Diagnosis:
    for rule in RULES:
        if s.bits is None and rule.name not in ("exact", "nondeterministic", "unknown"):
            continue     # integer / bool leaves: exact or not
        m = rule.test(s)
        if m is None:
            continue
        model = rule.model
        passed = model in PASSING or model in allow
        ev = dict(m.evidence)
        ev["rule"] = rule.name
        ev.setdefault("max_floor_ratio", s.errors.max_floor_ratio)
        k = None if s.noise is None else s.noise.conditioning
        if k is not None:
            ev["conditioning_floor"] = dataclasses.asdict(k)
        mc = None if s.noise is None else s.noise.rounding
        if mc is not None:
            ev["rounding_floor"] = dataclasses.asdict(mc)
        if s.counts.unjudged:   # finite where the reference is not, in float64 too: not judged
            ev["unjudged"] = s.counts.unjudged
        if _isolated(s):        # what the float64 rules may read as another algorithm's rounding
            ev["isolated"] = s.counts.significant
        if s.path:
            ev["leaf"] = s.path
        if model in allow and model not in PASSING:
            ev["allowed"] = True
        verdict = "passes" if passed else "fails"
        leaf = f" [{s.path}]" if s.path else ""
        allowed = " (allowed)" if ev.get("allowed") else ""
        summary = f"{verdict}: {model}{allowed}{leaf}, {m.detail}"
        return Diagnosis(model, passed, float(round(m.confidence, 3)), plain(ev), summary)
    raise AssertionError("the unknown rule always matches")  # pragma: no cover


