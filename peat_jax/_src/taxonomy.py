"""The taxonomy: every error-model name and training-outcome name, stated once.

`ERROR_MODELS` is the table the detector names its diagnoses from, the faults name what they
emulate from, and the report colours its cells from: one `ErrorModel` per name, with whether it
passes, how severe it is and its colour. `TRAINING_OUTCOMES` does the same for what a runtime
injection did to training, and `STEP_EFFECTS` for what a candidate at one site did to one replayed
training step (playback's effect). The order of each table is the order of the taxonomy in
docs/design.md.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional


_GREEN, _LIGHT_GREEN, _AMBER, _RED = "#2e7d32", "#66bb6a", "#f9a825", "#c62828"


@dataclasses.dataclass(frozen=True)
class ErrorModel:
    """One error model of the taxonomy.

    Attributes:
      name: the name `peat.detect` returns (``Diagnosis.model``).
      kind: "passing" (a diagnosis of this model passes without being allowed), "numerical" (a
        precision difference, failing unless allowed), "fault" (what a hardware fault does) or
        "bug" (what a kernel bug does).
      severity: sort rank of diagnoses (higher is worse): precision models milder than faults
        and bugs, ``nan_inf`` the worst.
      colour: the report's colour (CSS) of a diagnosis of this model: passing for a passing
        model, failing for the others (an allowed one is `ALLOWED_COLOUR`).
      fault: the `peat_jax._src.faults` constructor that emulates the model, None if none does.
      description: one line.
    """

    name: str
    kind: str
    severity: int
    colour: str
    fault: Optional[str]
    description: str

    @property
    def passes(self) -> bool:
        """A diagnosis of this model passes without being allowed."""
        return self.kind == "passing"


ERROR_MODELS: tuple[ErrorModel, ...] = (
    ErrorModel(name="exact", kind="passing", severity=0, colour=_GREEN,
               fault=None, description="bitwise equal to the golden"),
    ErrorModel(name="numerical_noise", kind="passing", severity=1, colour=_LIGHT_GREEN,
               fault=None, description="rounding differences within the noise floor"),
    ErrorModel(name="reduced_precision", kind="numerical", severity=5, colour=_AMBER,
               fault="reduced_precision",
               description="inputs, products or the output rounded to a narrower format"),
    ErrorModel(name="low_precision_accumulation", kind="numerical", severity=5, colour=_AMBER,
               fault="low_precision_accumulation",
               description="an accumulator kept in a narrow format"),
    ErrorModel(name="approximation", kind="numerical", severity=5, colour=_AMBER,
               fault=None,
               description="a nearby but different function (tanh-GELU, a polynomial exp)"),
    ErrorModel(name="flush_to_zero", kind="numerical", severity=4, colour=_AMBER,
               fault=None, description="differences only at subnormals, flushed to zero"),
    ErrorModel(name="bit_flip", kind="fault", severity=8, colour=_RED,
               fault="bit_flip", description="isolated elements with one differing bit"),
    ErrorModel(name="multi_bit_flip", kind="fault", severity=8, colour=_RED,
               fault="multi_bit_flip", description="isolated elements with a few differing bits"),
    ErrorModel(name="random_value", kind="fault", severity=8, colour=_RED,
               fault="random_value", description="isolated elements replaced by other values"),
    ErrorModel(name="zeroed", kind="fault", severity=8, colour=_RED,
               fault="zeroed", description="elements set to zero"),
    ErrorModel(name="operand_corruption", kind="fault", severity=8, colour=_RED,
               fault="operand_corruption",
               description="whole rows or columns wrong: a bad input row or weight column"),
    ErrorModel(name="wrong_scale", kind="bug", severity=8, colour=_RED,
               fault="wrong_scale", description="the golden times a constant"),
    ErrorModel(name="sign_flip", kind="bug", severity=8, colour=_RED,
               fault="sign_flip", description="the golden negated"),
    ErrorModel(name="permuted_layout", kind="bug", severity=8, colour=_RED,
               fault="permuted_layout", description="the right values in the wrong places"),
    ErrorModel(name="tile_boundary", kind="bug", severity=8, colour=_RED,
               fault="tile_boundary",
               description="errors aligned to block edges or the last (partial) block"),
    ErrorModel(name="nan_inf", kind="bug", severity=9, colour=_RED,
               fault="nan_inf", description="non-finite values where the golden is finite"),
    ErrorModel(name="unstable_algorithm", kind="bug", severity=7, colour=_RED,
               fault=None, description="the right function, computed so that the dtype's "
                                       "rounding is amplified: cancellation, overflow"),
    ErrorModel(name="data_race", kind="bug", severity=8, colour=_RED,
               fault=None, description="grid points racing on one block (the Pallas "
                                       "interpreter's race detector)"),
    ErrorModel(name="nondeterministic", kind="bug", severity=7, colour=_AMBER,
               fault=None, description="run-to-run differences beyond the noise floor"),
    ErrorModel(name="unknown", kind="bug", severity=8, colour=_RED,
               fault=None, description="fails, and no model fits"),
)
"""Every error model, in the taxonomy's order."""

MODEL_BY_NAME: Mapping[str, ErrorModel] = {m.name: m for m in ERROR_MODELS}

MODELS: tuple[str, ...] = tuple(m.name for m in ERROR_MODELS)
"""Every model name `peat.detect` can return."""

PASSING: frozenset = frozenset(m.name for m in ERROR_MODELS if m.passes)
"""The models that pass without being allowed."""

ALLOWED_COLOUR = _LIGHT_GREEN
"""The report's colour of a failing model the caller allowed (the diagnosis passes)."""


def severity_rank(name: str) -> int:
    """The severity of model `name` (a name outside the taxonomy ranks as ``unknown``)."""
    return MODEL_BY_NAME.get(name, MODEL_BY_NAME["unknown"]).severity


def colour(name: str, passed: bool) -> str:
    """The report's colour of a diagnosis of model `name` with verdict `passed` (CSS colour):
    a passing model's own green, `ALLOWED_COLOUR` for an allowed failing model, a failing
    model's own colour (red for a name outside the taxonomy)."""
    model = MODEL_BY_NAME.get(name)
    if passed:
        return model.colour if model is not None and model.passes else ALLOWED_COLOUR
    return model.colour if model is not None and not model.passes else _RED


def fault_constructor(name: str) -> Optional[str]:
    """The `peat_jax._src.faults` constructor that emulates model `name`, None if none does."""
    model = MODEL_BY_NAME.get(name)
    return None if model is None else model.fault


@dataclasses.dataclass(frozen=True)
class TrainingOutcome:
    """What a runtime injection did to training (``RuntimeResult.outcome``).

    Attributes:
      name: the outcome's name.
      harmless: training went on as in the golden run.
      description: one line (the rules are in `peat_jax._src.profiler.runtime.classify_outcome`).
    """

    name: str
    harmless: bool
    description: str


TRAINING_OUTCOMES: tuple[TrainingOutcome, ...] = (
    TrainingOutcome(name="masked", harmless=True,
                    description="the loss stays within the golden run's noise band"),
    TrainingOutcome(name="immediate_nan_inf", harmless=False,
                    description="the loss turns non-finite at the first fired step or the next"),
    TrainingOutcome(name="spike_and_recover", harmless=False,
                    description="the loss leaves the band, then its tail comes back into it"),
    TrainingOutcome(name="slow_degrade", harmless=False,
                    description="the loss drifts out of the band and stays out"),
    TrainingOutcome(name="sharp_degrade", harmless=False,
                    description="the loss steps out of the band and stays out"),
    TrainingOutcome(name="diverged", harmless=False,
                    description="the loss turns non-finite later, or training is lost"),
)
"""Every training outcome, in the taxonomy's order."""

OUTCOMES: tuple[str, ...] = tuple(o.name for o in TRAINING_OUTCOMES)
"""Every outcome name `peat.runtime` can return."""


@dataclasses.dataclass(frozen=True)
class StepEffect:
    """What a candidate at one site did to one replayed training step (``Effect.model``).

    Attributes:
      name: the effect's name.
      passes: the step is as the golden's within the golden's own noise.
      colour: the report's colour (CSS) of an effect of this name.
      description: one line (the sufficient conditions are in `peat_jax._src.profiler.effect`).
    """

    name: str
    passes: bool
    colour: str
    description: str


STEP_EFFECTS: tuple[StepEffect, ...] = (
    StepEffect(name="masked", passes=True, colour=_GREEN,
               description="every leaf of the step (loss, metrics, new state) within the golden's "
                           "own noise"),
    StepEffect(name="update_scaled", passes=False, colour=_RED,
               description="only state leaves moved, and each one's update is the golden's update "
                           "times one common constant"),
    StepEffect(name="sign_reversed", passes=False, colour=_RED,
               description="only state leaves moved, and each one's update is the golden's update "
                           "negated"),
    StepEffect(name="perturbed", passes=False, colour=_AMBER,
               description="leaves moved beyond the golden's noise, finite, with no simpler "
                           "relation to the golden's update"),
    StepEffect(name="nan_inf", passes=False, colour=_RED,
               description="the loss, a metric or the new state is non-finite where the "
                           "golden's is finite"),
)
"""Every step effect, in the taxonomy's order."""

EFFECTS: tuple[str, ...] = tuple(e.name for e in STEP_EFFECTS)
"""Every effect name playback's `diagnose_effect` can return."""

EFFECT_BY_NAME: Mapping[str, StepEffect] = {e.name: e for e in STEP_EFFECTS}


def effect_colour(name: str) -> str:
    """The report's colour of a step effect `name` (CSS colour; red for a name outside the
    table)."""
    effect = EFFECT_BY_NAME.get(name)
    return _RED if effect is None else effect.colour
