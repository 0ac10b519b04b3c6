"""Playback: replaying checkpointed steps with a candidate at one site per cell."""
from __future__ import annotations

import json

import emulated_devices
import jax
import jax.numpy as jnp
import pytest

import peat_jax as peat
from peat_jax import models
from peat_jax._src.profiler.golden import profile
from peat_jax._src.profiler.playback import playback


@pytest.fixture
def run(small_vision_run):
    return small_vision_run


def _reference_dot(a, b, **params):
    return jax.lax.dot_general(a, b, **params)


def test_playback_of_the_reference_is_exact_everywhere(run):
    res = playback(run, {"dot_general": peat.Kernel("xla_dot", _reference_dot)}, name="ref")
    recs = res.records()
    assert len(recs) == 3 * 6  # checkpoints 0, 20, 40 x 6 dot_general sites
    assert {r["local"]["model"] for r in recs} == {"exact"}
    assert {r["effect"]["model"] for r in recs} == {"masked"}
    assert res.compiles == 1 and res.first_divergence() is None


def test_fault_at_one_backward_site_is_found_there_only(run, vision_gemms):
    # a kernel that is wrong only for the shape of one backward GEMM (the head's weight grad)
    def buggy(a, b, **params):
        out = jax.lax.dot_general(a, b, **params)
        return out * 1.5 if out.shape == (10, 32) else out

    res = playback(run, {"dot_general": peat.Kernel("buggy_at_10x32", buggy)}, checkpoints=[20],
                   name="bwd-bug")
    failing = res.failing("local")
    assert [(r["site"], r["phase"], r["path"]) for r in failing] == [
        (vision_gemms.head_w, "bwd", "CNN/head")]
    assert failing[0]["local"]["model"] == "wrong_scale"
    # its effect reaches the head's updated weights but not the step's loss (adam: no constant
    # factor on the update)
    effect = failing[0]["effect"]
    assert (effect["model"], effect["moved"]) == ("perturbed", ["params/head/kernel"]), effect
    assert effect["noise_ratio"] > 100 and failing[0]["loss"][0] == failing[0]["loss"][1]
    assert res.first_divergence() == failing[0]


@pytest.mark.slow
def test_candidate_wrong_on_large_activations_fails_only_in_later_checkpoints(run):
    def saturating(a, b, **params):  # correct until |out| > 3, then clipped
        return jnp.clip(jax.lax.dot_general(a, b, **params), -3.0, 3.0)

    res = playback(run, {"dot_general": peat.Kernel("saturating", saturating)}, name="sat")
    bad_checkpoints = {r["checkpoint"] for r in res.failing("local")}
    assert bad_checkpoints == {40}
    assert res.first_divergence()["checkpoint"] == 40


def test_rerun_of_an_interrupted_campaign_appends_only_missing_cells(run):
    sub = {"fwd:dot_general": peat.faults.wrong_scale(2.0)}
    first = playback(run, sub, checkpoints=[0], name="resume")
    path = run / "campaigns" / "resume" / "results.jsonl"
    assert len(path.read_text().splitlines()) == 2
    # a kill mid-write leaves a torn last line: it is ignored and the cell redone
    with open(path, "a") as f:
        f.write('{"checkpoint": 20, "site": 5, "loc')
    again = playback(run, sub, checkpoints=[0, 20], name="resume")
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    keys = [(r["checkpoint"], r["site"]) for r in lines if "local" in r]
    assert sorted(keys) == [(0, 5), (0, 6), (20, 5), (20, 6)] and len(set(keys)) == 4
    assert [r["local"]["model"] for r in again.records()] == ["wrong_scale"] * 4
    assert first.records()[0]["local"] == again.records()[0]["local"]


def test_hosts_split_the_grid_and_read_each_others_results(run):
    sub = {"fwd:dot_general": peat.faults.sign_flip()}
    a = playback(run, sub, checkpoints=[0, 20], name="hosts", host=(0, 2))
    # host 0 of 2 takes the first half of the grid (checkpoint-major): checkpoint 0's cells
    assert [(r["checkpoint"], r["site"]) for r in a.records()] == [(0, 5), (0, 6)]
    b = playback(run, sub, checkpoints=[0, 20], name="hosts", host=(1, 2))
    assert [(r["checkpoint"], r["site"]) for r in b.records()] == [(0, 5), (0, 6), (20, 5), (20, 6)]
    files = sorted(p.name for p in (run / "campaigns" / "hosts").glob("results*"))
    assert files == ["results.p0-of-2.jsonl", "results.p1-of-2.jsonl"]
    with pytest.raises(peat.PeatError, match="host must be"):
        playback(run, sub, name="hosts", host=(2, 2))


@pytest.mark.slow
def test_cells_spread_over_four_devices_give_the_same_verdicts(run, tmp_path):
    import textwrap
    script = textwrap.dedent(f"""
        import json, jax, peat_jax as peat
        from peat_jax._src.profiler.playback import playback
        assert len(jax.devices()) == 4
        res = playback({str(run)!r}, {{"dot_general": peat.faults.wrong_scale(2.0)}},
                       checkpoints=[20], name="four")
        print(json.dumps([[r["site"], r["local"]["model"], r["effect"]["model"]]
                          for r in res.records()]), res.compiles)
    """)
    out = emulated_devices.run(["-c", script], devices=4)
    assert out.returncode == 0, out.stderr[-2000:]
    four, compiles = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    one = playback(run, {"dot_general": peat.faults.wrong_scale(2.0)}, checkpoints=[20], name="one",
                   devices=jax.devices()[:1])
    assert json.loads(four) == [[r["site"], r["local"]["model"], r["effect"]["model"]]
                                for r in one.records()]
    assert int(compiles) == 2  # the golden replay, and the 4-device replay


@pytest.mark.slow
def test_language_workload_playback_through_scan_and_remat(tmp_path):
    wl = models.get("language", n_layers=2, d_model=16, n_heads=2, seq_len=16, batch_size=4)
    profile(wl, tmp_path / "lm", steps=4, checkpoint_every=2)
    ref = playback(tmp_path / "lm", {"dot_general": peat.Kernel("xla_dot", _reference_dot)},
                   checkpoints=[0, 2], name="ref")
    recs = ref.records()
    assert len(recs) == 2 * 34 and ref.compiles == 1
    assert {r["local"]["model"] for r in recs} == {"exact"}  # taps come out of scan and remat
    assert {r["effect"]["model"] for r in recs} == {"masked"}

    # a fault at one backward GEMM inside the scanned blocks is found there only
    def buggy(a, b, **params):
        out = jax.lax.dot_general(a, b, **params)
        return -out if out.shape == (16, 64) else out  # the MLP's first weight gradient

    res = playback(tmp_path / "lm", {"dot_general": peat.Kernel("neg_at_16x64", buggy)},
                   checkpoints=[2], name="bug")
    failing = res.failing("local")
    assert len(failing) == 1 and failing[0]["phase"] == "bwd" and "blocks" in failing[0]["path"]
    assert failing[0]["local"]["model"] == "sign_flip"
    # judged against the dtype bound only, and saying why: no float64 evidence inside a scan
    assert "inside a scan" in failing[0]["local"]["evidence"]["no_float64_reference"]


def test_resumed_cells_are_cells_with_diagnoses(run):
    sub = {"fwd:dot_general": peat.faults.zeroed()}
    first = playback(run, sub, checkpoints=[0], name="cells")
    again = playback(run, sub, checkpoints=[0], name="cells")
    for a, b in zip(first.cells, again.cells):
        assert isinstance(b.local, peat.Diagnosis) and b.site == a.site
        got = (b.local.model, b.local.passed, b.effect.model)
        assert got == (a.local.model, a.local.passed, a.effect.model)
        assert got == ("zeroed", False, b.effect.model)
    assert again.records() == first.records()


def test_campaign_name_reused_with_other_fault_parameters_is_refused(run):
    playback(run, {"fwd:dot_general": peat.faults.wrong_scale(2.0)}, checkpoints=[0], name="reuse")
    path = run / "campaigns" / "reuse" / "results.jsonl"
    before = path.read_bytes()
    # same fault kind and name ("wrong_scale"), other parameter: not the same campaign
    with pytest.raises(peat.PeatError, match="another substitution.*choose another name"):
        playback(run, {"fwd:dot_general": peat.faults.wrong_scale(1.0)}, checkpoints=[0],
                 name="reuse")
    (run / "campaigns" / "reuse" / "campaign.json").write_text('{"candidates": [')
    with pytest.raises(peat.PeatError, match="campaign.json is damaged"):
        playback(run, {"fwd:dot_general": peat.faults.wrong_scale(2.0)}, checkpoints=[0],
                 name="reuse")
    assert path.read_bytes() == before
