"""The HTML report: self-contained, escapes user text, shows verdicts and plots."""
from __future__ import annotations

import json

import jax
import pytest

import peat_jax as peat
from peat_jax import models
from peat_jax._src.profiler.golden import profile
from peat_jax._src.report import render_report, write_report


def _doubling(name: str) -> peat.Kernel:
    """A dot_general kernel that returns twice the product (a `wrong_scale` candidate)."""
    return peat.Kernel(name, lambda a, b, **p: 2.0 * jax.lax.dot_general(a, b, **p))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("rep") / "run"
    profile(models.get("vision", batch_size=8, width=4, hidden=8), path, steps=6,
            checkpoint_every=3)
    return path


@pytest.mark.slow
def test_user_strings_are_escaped(run):
    evil = "<script>alert(1)</script>"
    peat.playback(run, {"fwd:dot_general": _doubling(evil)}, checkpoints=[3], name="evil")
    page = render_report(run)
    assert evil not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script" not in page  # no script of any kind: the page is static


@pytest.mark.slow
def test_report_lists_verdicts_and_runtime_curves(run):
    peat.playback(run, {"fwd:dot_general": _doubling("twice")}, checkpoints=[3], name="twice")
    peat.runtime(run, {"dot_general": peat.faults.wrong_scale(1.0)}, peat.every(2), steps=6,
                 name="same")
    path = write_report(run)
    page = path.read_text()
    assert path == run / "report.html"
    assert 'class="grid verdicts"' in page and "wrong_scale" in page
    assert "Runtime injection: same" in page and "masked" in page
    assert page.count('class="fired"') == 3  # steps 0, 2, 4 marked
    results = run / "campaigns" / "twice" / "results.jsonl"
    records = [json.loads(x) for x in results.read_text().splitlines()]
    assert all(r["local"]["model"] == "wrong_scale" for r in records)
    assert "ULP distance" in page and "error mask" in page
    # each cell also says what the candidate did to the step, in training terms
    assert "step: perturbed" in page and "Effect on the step: <b class='fail'>perturbed" in page
    assert "change / the golden&#x27;s noise" in page and "loss" in page


def test_report_of_a_missing_run_is_a_clear_error(tmp_path):
    with pytest.raises(peat.PeatError, match="does not exist"):
        write_report(tmp_path / "nope")
