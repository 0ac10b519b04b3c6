"""The taxonomy table: every error-model and outcome name once, used by detector, faults, report."""
from __future__ import annotations

from peat_jax._src import faults, taxonomy
from peat_jax._src.detector import CHECK_MODELS, MODELS, PASSING, RULES


def test_detector_and_profiler_names_come_from_the_table():
    assert MODELS == taxonomy.MODELS and PASSING == taxonomy.PASSING
    assert {r.model for r in RULES} | set(CHECK_MODELS) == set(taxonomy.MODELS)
    assert taxonomy.OUTCOMES == taxonomy.OUTCOMES
    assert [o.name for o in taxonomy.TRAINING_OUTCOMES if o.harmless] == ["masked"]


def test_each_model_names_a_real_fault_and_a_colour():
    for model in taxonomy.ERROR_MODELS:
        assert model.kind in ("passing", "numerical", "fault", "bug"), model
        if model.fault is not None:
            assert model.fault in faults.ALL, model
        assert model.colour.startswith("#")
    assert taxonomy.colour("exact", True) != taxonomy.colour("bit_flip", False)
    assert taxonomy.colour("reduced_precision", True) == taxonomy.ALLOWED_COLOUR
    assert taxonomy.severity_rank("nan_inf") > taxonomy.severity_rank("bit_flip")
    assert taxonomy.severity_rank("not_a_model") == taxonomy.severity_rank("unknown")
    assert faults.describe(faults.zeroed(0.5)) == "zeroed(fraction=0.5)"


def test_step_effects_have_their_own_words():
    names = taxonomy.EFFECTS
    assert len(set(names)) == len(names)
    assert [e.name for e in taxonomy.STEP_EFFECTS if e.passes] == ["masked"]
    # the step's effect is not described with the local error models' precision words
    assert not {"reduced_precision", "low_precision_accumulation", "exact"} & set(names)
    assert taxonomy.effect_colour("masked") != taxonomy.effect_colour("perturbed")
    assert taxonomy.effect_colour("not_an_effect") == taxonomy.colour("unknown", False)
