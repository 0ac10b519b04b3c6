"""Failing candidates in playback campaigns: each bad cell is isolated and recorded, the rest
run."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peat_jax as peat
from peat_jax._src.profiler.playback import CellTimeout, playback
from peat_jax._src.profiler.rundir import to_json

TESTS = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def run(small_vision_run):
    return small_vision_run


def _host_raise(out):
    def host(x):
        raise RuntimeError("kernel launch failed: invalid configuration")

    return jax.pure_callback(host, jax.ShapeDtypeStruct(out.shape, out.dtype), out)


def _broken(a, b, **params):
    """A kernel with a different failure at each of four of the six GEMM sites."""
    out = jax.lax.dot_general(a, b, **params)
    if out.shape == (10, 32):    # head_w: raises while traced
        raise ValueError("boom: tile size 7 unsupported")
    if out.shape == (32, 64):    # hidden_w: wrong shape
        return out.T
    if out.shape == (16, 10):    # head: NaN everywhere
        return jnp.full_like(out, jnp.nan)
    if out.shape == (16, 64):    # hidden_x: fails while running
        return _host_raise(out)
    return out


def _by_site(res):
    return {r["site"]: r for r in res.records()}


@pytest.mark.slow
def test_failing_candidates_are_isolated_per_cell_and_counted(run, vision_gemms):
    g = vision_gemms
    res = playback(run, {"dot_general": peat.Kernel("broken", _broken)}, checkpoints=[20],
                   name="broken")
    cells = _by_site(res)
    assert sorted(cells) == sorted(vars(g).values())
    head_w = cells[g.head_w]
    assert head_w["status"] == "crashed" and "boom: tile size 7" in head_w["error"]
    hidden_w = cells[g.hidden_w]
    assert hidden_w["status"] == "crashed" and "returned (float32[64, 32])" in hidden_w["error"] \
        and "needs (float32[32, 64])" in hidden_w["error"]
    assert cells[g.hidden_x]["status"] == "crashed" \
        and "invalid configuration" in cells[g.hidden_x]["error"]
    assert cells[g.head]["status"] == "ok" and cells[g.head]["local"]["model"] == "nan_inf"
    assert not cells[g.head]["local"]["passed"]
    for s in (g.hidden, g.head_x):  # the correct sites still ran and passed
        assert cells[s]["status"] == "ok" and cells[s]["local"]["model"] == "exact"
    assert res.summary() == {"cells": 6, "passed": 2, "failed": 1, "crashed": 3, "timeout": 0}
    assert {r["site"] for r in res.failing()} == {g.head, g.head_w, g.hidden_w, g.hidden_x}
    assert res.first_divergence()["site"] == g.head
    # the records on disk say the same, and a rerun resumes them as they are
    again = playback(run, {"dot_general": peat.Kernel("broken", _broken)}, checkpoints=[20],
                     name="broken")
    norm = lambda recs: [json.loads(to_json(r)) for r in recs]  # noqa: E731
    assert norm(again.records()) == norm(res.records())
    lines = (run / "campaigns" / "broken" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 6


@pytest.mark.slow
def test_a_cell_past_its_time_limit_is_recorded_and_the_rerun_goes_on(run, vision_gemms):
    def slow(a, b, **params):
        out = jax.lax.dot_general(a, b, **params)
        if out.shape != (10, 32):
            return out

        def host(x):
            time.sleep(6)
            return np.asarray(x)

        return jax.pure_callback(host, jax.ShapeDtypeStruct(out.shape, out.dtype), out)

    kernel = peat.Kernel("slow_at_head_w", slow)
    t0 = time.perf_counter()
    with pytest.raises(CellTimeout, match=r"time limit of 1\.5 s.*run it again"):
        playback(run, {"dot_general": kernel}, checkpoints=[20], name="slow", cell_timeout=1.5)
    assert time.perf_counter() - t0 < 60
    path = run / "campaigns" / "slow" / "results.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    g = vision_gemms
    assert [(r["site"], r["status"]) for r in recs] == [(g.hidden, "ok"), (g.head, "ok"),
                                                        (g.head_w, "timeout")]
    assert not list(path.parent.glob("*.running"))
    res = playback(run, {"dot_general": kernel}, checkpoints=[20], name="slow", cell_timeout=30)
    assert res.summary() == {"cells": 6, "passed": 5, "failed": 0, "crashed": 0, "timeout": 1}
    assert len(path.read_text().splitlines()) == 6


@pytest.mark.slow
def test_a_kernel_past_the_time_limit_in_its_float64_run_stops_the_campaign(run, vision_gemms):
    """A failing cell is judged again with the kernel run in float64: that run is the
    candidate's code too, held to the same time limit. Its cell keeps the verdict against the
    float64 floors, says why there is no float64 rule, and the campaign stops; the rerun goes
    on from there."""
    def slow_in_float64(a, b, **params):
        out = jax.lax.dot_general(a, b, **params)
        if out.shape != (10, 32):
            return out
        if out.dtype == jnp.float64:   # hangs only in its float64 run
            def host(x):
                time.sleep(8)
                return np.asarray(x)

            out = jax.pure_callback(host, jax.ShapeDtypeStruct(out.shape, out.dtype), out)
        return out * 1.01

    kernel = peat.Kernel("slow_in_float64", slow_in_float64)
    with pytest.raises(CellTimeout, match=r"float64 run ran past the time limit of 3 s"):
        playback(run, {"dot_general": kernel}, checkpoints=[20], name="slow64", cell_timeout=3)
    path = run / "campaigns" / "slow64" / "results.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    g = vision_gemms
    assert [(r["site"], r["status"]) for r in recs] == [(g.hidden, "ok"), (g.head, "ok"),
                                                        (g.head_w, "ok")]
    local = recs[2]["local"]
    assert not local["passed"] and local["model"] == "wrong_scale", local["summary"]
    assert "conditioning_floor" in local["evidence"]            # the float64 floors were used
    assert "past the time limit of 3 s" in local["evidence"]["no_float64_candidate"]
    assert "no float64 rule" in local["summary"]
    assert not list(path.parent.glob("*.running"))
    res = playback(run, {"dot_general": kernel}, checkpoints=[20], name="slow64", cell_timeout=30)
    assert res.summary() == {"cells": 6, "passed": 5, "failed": 1, "crashed": 0, "timeout": 0}


def test_bad_cell_timeout_is_refused(run):
    with pytest.raises(peat.PeatError, match="cell_timeout must be a positive number"):
        playback(run, {"dot_general": peat.faults.wrong_scale(2.0)}, cell_timeout=0)


@pytest.mark.slow
def test_cli_worker_restarts_after_hangs_and_a_segfault(run, tmp_path, vision_gemms):
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "peat_jax", "playback", str(run), "--kernel",
                        "cli_kernels:hang_and_segfault_matmul", "--checkpoints", "20",
                        "--name", "chaos", "--cell-timeout", "5", "--json"],
                       capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "recorded as 'timeout'" in r.stderr and "SIGSEGV" in r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "worker killed" in r.stderr
    assert out["summary"] == {"cells": 6, "passed": 3, "failed": 0, "crashed": 1, "timeout": 2}
    recs = [json.loads(x) for x in
            (run / "campaigns" / "chaos" / "results.jsonl").read_text().splitlines()]
    g = vision_gemms
    assert sorted(r["site"] for r in recs) == sorted(vars(g).values())
    status = {r["site"]: (r["status"], r["error"]) for r in recs}
    assert status[g.head_w][0] == "timeout" and "5 s" in status[g.head_w][1]
    assert status[g.hidden_w][0] == "crashed" and "SIGSEGV" in status[g.hidden_w][1]
    assert status[g.hidden_x][0] == "timeout" \
        and "did not respond; killed after 20 s" in status[g.hidden_x][1]
