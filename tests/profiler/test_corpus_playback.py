"""Every kernel of the corpus replayed inside a small training step (tests/corpus/step.py): at
its reference's sites, on the activations 10 steps of training made. The correct kernels pass
at every site; the buggy ones fail with the models `IN_STEP` states, or pass where the bug needs
inputs the step does not make."""
from __future__ import annotations

import needs
import pytest

from corpus import ENTRIES, by_name
from corpus.step import IN_STEP, golden_run, play

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return golden_run(tmp_path_factory.mktemp("corpus_step") / "run")


def _available(entries):
    return [pytest.param(e, id=e.name, marks=needs.skip_unless(*e.needs)) for e in entries]


@pytest.mark.parametrize("entry", _available([e for e in ENTRIES if e.kind == "correct"]))
def test_correct_kernel_passes_at_every_site_of_the_step(run_dir, entry):
    played = play(entry, run_dir)
    assert played.cells >= 1 and played.failing == 0, played


@pytest.mark.parametrize("entry", _available([e for e in ENTRIES if e.kind == "bug"]))
def test_buggy_kernel_fails_in_the_step_where_its_bug_has_inputs(run_dir, entry):
    played = play(entry, run_dir)
    assert played.cells >= 1 and played.models == IN_STEP[entry.name], played
    assert (played.failing > 0) == bool(IN_STEP[entry.name]), played


def test_every_buggy_entry_has_a_stated_outcome_in_the_step():
    assert {e.name for e in ENTRIES if e.kind == "bug"} == set(IN_STEP)


def test_a_failing_site_is_judged_with_the_op_in_float64(run_dir):
    """As `check_kernel` judges a failing output: the site's op evaluated in float64 on the
    step's operands there sets the noise and conditioning floors, and the candidate run there
    in float64 tells a different function (the tanh GELU) from rounding."""
    played = play(by_name("gelu_tanh_for_exact"), run_dir)
    (d,) = played.diagnoses
    assert d["model"] == "approximation" and d["evidence"]["rule"] == "approximation", d
    assert "conditioning_floor" in d["evidence"] and "no_float64_reference" not in d["evidence"]
    assert "run in float64 it is still" in d["summary"], d["summary"]
    for d in play(by_name("bf16_accumulation"), run_dir).diagnoses:
        assert d["model"] == "low_precision_accumulation" and "conditioning_floor" in d["evidence"]
