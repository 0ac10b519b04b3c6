"""Sufficient conditions on which of `check_kernel`'s input variants fail: a failing verdict
renamed by where it fails (the checks' variants), not by what one signature shows."""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

from peat_jax._src.detector.machinery import Diagnosis, plain


def _only(variant: str, failing_variants: Iterable[str],
          passing_variants: Iterable[str]) -> bool:
    """Every failing check is on `variant` and the example inputs' checks pass."""
    return set(failing_variants) == {variant} and "example" in set(passing_variants)


def _only_on(variant: str, rule: str, model: str, confidence: float, keep: Iterable[str],
             why: str, d: Diagnosis, failing_variants: Iterable[str],
             passing_variants: Iterable[str]) -> Diagnosis:
    """`d` renamed `model` by `rule` when every failing check is on `variant` and every check
    on the example inputs passes, unless `d` passes or its model is in `keep`; `why` opens the
    summary's reason (the would-be model and its summary close it)."""
    if d.passed or not _only(variant, failing_variants, passing_variants) or d.model in keep:
        return d
    ev = {**d.evidence, "rule": rule, "would_be": d.model}
    return Diagnosis(model, False, confidence, plain(ev),
                     f"fails: {model}, {why}; the rules alone said {d.model}: "
                     f"{d.summary.split(', ', 1)[-1]})")


def only_on_odd_shapes(d: Diagnosis, failing_variants: Iterable[str],
                       passing_variants: Iterable[str]) -> Diagnosis:
    """`d` (the worst check of a `check_kernel` call) renamed ``tile_boundary`` when this
    sufficient condition holds: every failing check is on the "odd_shape" variant (each
    dimension made indivisible by any block size 8..128) and every check on the example inputs
    passes (the same code is right when the shapes divide: the partial blocks are
    mishandled, e.g. a loop or grid that rounds the block count down). `d` itself otherwise,
    and when it already names a bug of layout or a race."""
    return _only_on("odd_shape", "only_on_odd_shapes", "tile_boundary", 0.8,
                    ("tile_boundary", "permuted_layout", "data_race"),
                    "wrong only when a dimension is not a multiple of the block (passes on the "
                    "example shapes", d, failing_variants, passing_variants)


_RANGE_FAILURES = frozenset({"unstable_algorithm", "nan_inf", "flush_to_zero"})
"""Models that say what went wrong with the values' range."""

_RANGE_MODELS = _RANGE_FAILURES | {"nondeterministic", "data_race", "tile_boundary"}
"""Models `only_near_overflow` keeps: they already say what went wrong with the values' range,
or name what no input magnitude causes."""


def only_near_overflow(d: Diagnosis, failing_variants: Iterable[str],
                       passing_variants: Iterable[str]) -> Diagnosis:
    """`d` (the worst check of a `check_kernel` call) renamed ``unstable_algorithm`` when this
    sufficient condition holds: every failing check is on the "near_overflow" variant (inputs
    scaled to max |x| ~ 2**(emax/2 - 1), whose squares and products reach the dtype's
    largest values) and every check on the example inputs passes: the code computes the right
    function at ordinary magnitudes, and an intermediate leaves the dtype's range at extreme
    ones where the reference's formula stays inside it (keras' and haiku's RMSNorm and
    LayerNorm gradients, where jax's rsqrt derivative -ans / (2 x) underflows float32, against
    x / sqrt(mean(x * x)); the signature rules called them bit_flip, permuted_layout or
    reduced_precision). `d` itself otherwise, and when its model is one of `_RANGE_MODELS`."""
    return _only_on("near_overflow", "only_near_overflow", "unstable_algorithm", 0.6,
                    _RANGE_MODELS,
                    "wrong only at inputs near overflow (an intermediate leaves the dtype's "
                    "range where the reference's formula does not; passes on the example inputs",
                    d, failing_variants, passing_variants)


_SCALED_PRECISION = frozenset({"reduced_precision", "low_precision_accumulation"})
"""Models of too few bits per element: what `swamped_by_outliers` keeps as the verdict."""

_SWAMPED = _SCALED_PRECISION | {"random_value", "zeroed"}
"""What the errors of such a kernel with a shared scale look like on the outliers inputs:
another precision model, or values quantized to nothing (zeros, or values unrelated to the
golden's)."""


def swamped_by_outliers(d: Diagnosis, variant: str, example: Optional[Diagnosis],
                        failing_models: Mapping[str, Iterable[str]]) -> Optional[Diagnosis]:
    """The example inputs' diagnosis `example`, noted, in place of `d` (the worst check of a
    `check_kernel` call, on input variant `variant`) when this sufficient condition holds: `d`
    is on the "outliers" variant (1% of the elements scaled up by 2**10) and names another
    model than `example`, one of `_SWAMPED`; the example inputs fail with a model of too few
    bits (`_SCALED_PRECISION`), and so does every other failing variant (`failing_models`: the
    models of the failing checks, by variant). A format that keeps each element's own
    exponent (bfloat16 inputs, a narrow accumulator) rounds each value the same whatever the
    others hold, and says the same model on every variant; here a few large values change how
    the others are rounded: a scale shared by many elements (a row, a block, the tensor) and
    set by the largest of them, as integer or fp8 quantization has. aqtp's `dot_general`:
    reduced_precision on the example inputs and, on the outliers, random_value in int8's
    gradients (every value lost) and low_precision_accumulation in 12- and 16-bit's forward
    (the rows holding an outlier err more, and their values are larger). The kernel is what
    it is on ordinary inputs, not a fault nor a narrow accumulator. None where the condition
    does not hold."""
    if (d.passed or variant != "outliers" or d.model not in _SWAMPED or example is None
            or example.passed or example.model not in _SCALED_PRECISION
            or d.model == example.model):
        return None
    others = {m for v, models in failing_models.items() if v != "outliers" for m in models}
    if not others <= _SCALED_PRECISION:
        return None
    ev = {**example.evidence, "rule": "swamped_by_outliers", "would_be": d.model,
          "on_outliers": {"model": d.model, "summary": d.summary}}
    return Diagnosis(example.model, False, example.confidence, plain(ev),
                     f"{example.summary}; on the outliers inputs it errs as {d.model}: a few "
                     "large values change how the others are rounded, as a scale shared by a "
                     "row, a block or the tensor does (integer or fp8 quantization)")


TRAINING_RANGE_LOG2 = 32
"""log2 of the largest magnitude `beyond_training_range` counts as one training reaches: 2**32
(4.3e9), the "large" variant's in float32 and bfloat16, far above activations and gradients
(float16's whole range ends at 2**16; loss scaling multiplies gradients by at most 2**24)."""


def beyond_training_range(d: Diagnosis, failing_variants: Iterable[str],
                          passing_variants: Iterable[str], near_overflow_log2: float) -> bool:
    """Whether `d` (the worst check's diagnosis, after `only_near_overflow`) fails only where
    no training goes: every failing check is on "near_overflow", the example inputs' checks
    pass, `d` names a failure of range (``unstable_algorithm``, ``nan_inf``,
    ``flush_to_zero``) and the variant's inputs reach max |x| ~ 2**near_overflow_log2 beyond
    2**TRAINING_RANGE_LOG2 (float32 and bfloat16: 2**62.5; float16's 2**6.5 is within it).
    keras' RMSNorm and LayerNorm gradients lose a row there (jax's rsqrt derivative
    underflows), right at every magnitude below: `check_kernel` then passes, with a note."""
    return (not d.passed and _only("near_overflow", failing_variants, passing_variants)
            and d.model in _RANGE_FAILURES and near_overflow_log2 > TRAINING_RANGE_LOG2)
