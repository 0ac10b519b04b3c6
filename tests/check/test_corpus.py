"""The corpus of real kernels (tests/corpus): every buggy kernel fails with its expected error
model, every correct kernel computed another way passes, through `peat.check_kernel` and, for a
few matmuls, through playback inside a small training step."""
from __future__ import annotations

import needs
import pytest

import peat_jax as peat
from peat_jax._src.kernels import pallas as pk
from corpus import ENTRIES, by_name
from corpus import bugs, correct
from peat_jax._src import taxonomy

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def check(entry) -> peat.Diagnosis:
    """`check_kernel` on an entry as the benchmark runs it (one repeat: the corpus is about
    numerics and structure; nondeterminism has its own tests)."""
    return peat.check_kernel(entry.candidate, entry.reference, *entry.args(),
                             variants=entry.variants, backward=entry.backward, repeats=1)


def _param(e):
    return pytest.param(e, id=e.name, marks=needs.skip_unless(*e.needs))


@pytest.mark.parametrize("entry", [_param(e) for e in ENTRIES if e.kind == "bug"])
def test_buggy_kernel_fails_with_its_model(entry):
    pk.reset_interpret_state()
    d = check(entry)
    assert not d.passed, d.summary
    assert d.model == entry.expected, d.summary
    ev = d.evidence
    if d.model == "unstable_algorithm":      # right in float64, lost in float32
        assert ev["error_float64"] <= 2 ** -24 * ev["reference_max"] < float(ev["error"])
    if d.model == "approximation":           # as far off in float64: another function
        assert ev["error_float64"] >= 0.5 * float(ev["error"]) > 0
    if entry.backward:                       # the forward is right, the gradient is not
        checks = {(v, o): m for v, o, m in ev["checks"]}
        assert checks[("example", "forward")] in taxonomy.PASSING
        assert ev["origin"]["output"] == "grad[0]"


@pytest.mark.parametrize("entry", [_param(e) for e in ENTRIES if e.kind == "correct"])
def test_correct_kernel_computed_another_way_passes(entry):
    d = check(entry)
    assert d.passed, d.summary


def test_the_corpus_covers_both_kinds_and_names_are_unique():
    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names))
    assert {e.kind for e in ENTRIES} == {"bug", "correct"}
    assert all(e.expected == "pass" for e in ENTRIES if e.kind == "correct")
    assert all(e.expected in taxonomy.MODELS for e in ENTRIES if e.kind == "bug")


def test_the_one_pass_variance_passes_where_nothing_cancels():
    e = by_name("one_pass_variance")
    d = peat.check_kernel(e.candidate, e.reference, *by_name("welford_layer_norm").args(),
                          variants="example", repeats=1, backward=False, conditioning=False)
    assert d.passed, d.summary


# ------------------------------------------------------------------------------------------
# Playback: the corpus' matmuls at the dot_general sites of a small CNN's training step


PLAYED = {"index_map_off_by_one": bugs.index_map_off_by_one,
          "split_k_matmul": correct.split_k_matmul}


@pytest.mark.parametrize("name", sorted(PLAYED))
def test_corpus_matmul_in_playback(small_vision_run, vision_gemms, name):
    """At a forward and a backward GEMM of the CNN's step (checkpoint 20): the buggy kernel is
    flagged at both sites, the correct one passes both."""
    entry = by_name(name)
    kernel = peat.kernels.dot_general(PLAYED[name], name=name)
    played = (vision_gemms.head, vision_gemms.head_x)
    res = peat.playback(small_vision_run, {"dot_general": kernel}, checkpoints=[20],
                        sites=lambda site: site.index in played, name=f"corpus-{name}")
    records = res.records()
    assert sorted((r["site"], r["phase"]) for r in records) == [(played[0], "fwd"),
                                                                 (played[1], "bwd")]
    failing = res.failing("local")
    if entry.expected == "pass":
        assert not failing, [r["local"]["summary"] for r in failing]
    else:
        assert len(failing) == 2, [r["local"]["summary"] for r in records]
        assert {r["local"]["model"] for r in failing} == {entry.expected}
