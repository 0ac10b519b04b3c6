"""Playback campaigns split over real processes on jax.distributed (localhost, CPU): the merged
results equal a one-process run cell by cell, a killed process's share resumes without
duplicates, and commands that cannot be split refuse."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

import peat_jax as peat
from peat_jax._src import cli
from peat_jax._src.errors import PeatError
from peat_jax._src.profiler import distributed
from peat_jax._src.profiler.campaign import merged_records
from peat_jax._src.profiler.playback import playback

FAULT = "wrong_scale(2.0)"
COMPARED = ("checkpoint", "site", "candidate", "status", "local", "effect", "effect_leaf", "loss",
            "local_signature")


CHECKPOINTS = "0,20"


@pytest.fixture(scope="module")
def run(small_vision_run):
    """The shared small vision run (checkpoints 0 and 20 x its 6 dot_general sites: 12 cells),
    and the one-process campaign's records, by cell."""
    one = playback(small_vision_run, {"dot_general": peat.faults.wrong_scale(2.0)},
                   checkpoints=[0, 20], name="dist-one")
    return small_vision_run, {(r["checkpoint"], r["site"]): r for r in one.records()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(run_dir, name, *share: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "peat_jax", "playback", str(run_dir), "--fault",
                             FAULT, "--name", name, "--checkpoints", CHECKPOINTS, "--json",
                             *share], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _processes(run_dir, name, n: int) -> list[subprocess.Popen]:
    coordinator = f"localhost:{_free_port()}"
    return [_start(run_dir, name, "--coordinator", coordinator, "--num-processes", str(n),
                   "--process-id", str(i), "--init-timeout", "120", "--heartbeat-timeout", "5")
            for i in range(n)]


def _wait(procs, timeout=300.0) -> list[tuple[int, str, str]]:
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _assert_equal_to_one(campaign: pathlib.Path, one: dict) -> None:
    lines = [json.loads(x) for f in campaign.glob("results*.jsonl")
             for x in f.read_text().splitlines()]
    keys = [(r["checkpoint"], r["site"]) for r in lines]
    assert len(keys) == len(set(keys)) == len(one)  # every cell once, in one file
    merged = merged_records(campaign)
    assert [(r["checkpoint"], r["site"]) for r in merged] == list(one)  # in grid order
    for r in merged:
        want = one[(r["checkpoint"], r["site"])]
        assert {k: r[k] for k in COMPARED} == {k: want[k] for k in COMPARED}


@pytest.mark.slow
def test_two_processes_split_the_grid_and_merge_to_the_one_process_campaign(run):
    run_dir, one = run
    results = _wait(_processes(run_dir, "dist-two", 2))
    assert [rc for rc, _, _ in results] == [1, 1], [e[-2000:] for _, _, e in results]
    camp = run_dir / "campaigns" / "dist-two"
    assert sorted(p.name for p in camp.glob("results*")) == ["results.p0-of-2.jsonl",
                                                             "results.p1-of-2.jsonl"]
    _assert_equal_to_one(camp, one)
    # process 0 waited for process 1, then printed the whole campaign
    lead = json.loads(results[0][1].strip().splitlines()[-1])
    assert lead["summary"] == {"cells": 12, "passed": 0, "failed": 12, "crashed": 0, "timeout": 0}
    # and `peat report` reads it merged
    assert cli.main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.html").read_text().count("Playback campaign: dist-two") == 1


@pytest.mark.slow
def test_a_killed_process_leaves_the_others_to_finish_and_its_share_resumes(run, monkeypatch):
    run_dir, one = run
    procs = _processes(run_dir, "dist-three", 3)
    mine = run_dir / "campaigns" / "dist-three" / "results.p1-of-3.jsonl"
    deadline = time.monotonic() + 300
    try:
        while not (mine.exists() and mine.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline and procs[1].poll() is None, "no first cell"
            time.sleep(0.02)
        procs[1].send_signal(signal.SIGKILL)
    finally:
        results = _wait(procs)
    assert results[1][0] == -signal.SIGKILL
    assert [results[0][0], results[2][0]] == [1, 1], [e[-2000:] for _, _, e in results]
    done = len(mine.read_text().splitlines())
    assert 1 <= done < 4  # its share is 4 of the 12 cells
    # its share again, alone (no coordinator, so in this process): the missing cells only
    monkeypatch.setenv("PEAT_CACHE_DIR", "off")
    assert cli.main(["playback", str(run_dir), "--fault", FAULT, "--name", "dist-three",
                     "--checkpoints", CHECKPOINTS, "--num-processes", "3", "--process-id", "1",
                     "--json"]) == 1
    assert len(mine.read_text().splitlines()) == 4
    _assert_equal_to_one(run_dir / "campaigns" / "dist-three", one)


def test_coordinator_that_cannot_be_reached_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PEAT_CACHE_DIR", "off")
    rc = cli.main(["playback", str(tmp_path), "--fault", FAULT, "--coordinator",
                   f"localhost:{_free_port()}", "--num-processes", "2", "--process-id", "1",
                   "--init-timeout", "0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot be reached" in err and "start process 0" in err


@pytest.mark.parametrize("how", ["flags", "env"])
@pytest.mark.parametrize("command", ["runtime", "profile"])
def test_runtime_and_profile_refuse_to_run_as_one_of_several_processes(command, how, capsys,
                                                                       monkeypatch, tmp_path):
    monkeypatch.setenv("PEAT_CACHE_DIR", "off")
    argv = (["runtime", str(tmp_path), "--fault", "wrong_scale(2.0)", "--every", "2"]
            if command == "runtime" else ["profile", "vision", "--out", str(tmp_path / "p")])
    if how == "flags":
        argv += ["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "0"]
    else:
        monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
        monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"peat {command} runs in one process" in err and "run it once" in err
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("args, env, want", [
    ((None, None, None), {}, None),
    (("h:1", 2, 1), {}, distributed.Processes(1, 2, "h:1")),
    ((None, None, None), {"JAX_COORDINATOR_ADDRESS": "h:2", "JAX_NUM_PROCESSES": "3",
                          "JAX_PROCESS_ID": "2"}, distributed.Processes(2, 3, "h:2")),
    ((None, 4, 3), {"JAX_PROCESS_ID": "0"}, distributed.Processes(3, 4, None)),  # flags first
])
def test_processes_come_from_flags_then_environment(args, env, want):
    assert distributed.processes(*args, environ=env) == want


@pytest.mark.parametrize("args, env, match", [
    (("h:1", None, None), {}, "needs both"),
    ((None, 2, 2), {}, r"in \[0, 2\)"),
    (("nohost", 2, 0), {}, "HOST:PORT"),
    ((None, None, None), {"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "whole number"),
])
def test_bad_process_arguments_are_refused(args, env, match):
    with pytest.raises(PeatError, match=match):
        distributed.processes(*args, environ=env)


_PROBE = """
import sys
import jax, jax.numpy as jnp
import peat_jax as peat
from peat_jax._src.profiler import distributed
i, coordinator, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
distributed.start(distributed.Processes(index=i, count=2, coordinator=coordinator), timeout=60)
peat.enable_compilation_cache(cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
def f(x):
    return jnp.sin(x) * 2
f.__name__ = f"probe_{i}"
jax.jit(f)(jnp.ones(3)).block_until_ready()
distributed.finish()
"""


@pytest.mark.slow
def test_every_process_writes_its_programs_to_the_persistent_cache(tmp_path):
    """jax writes cache entries from process 0 only, and on CPU a key names the process's
    device: without peat's rule, process 1 compiled its programs afresh in every run."""
    coordinator = f"localhost:{_free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE, str(i), coordinator,
                               str(tmp_path / "xla")], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    results = _wait(procs, timeout=120)
    assert [rc for rc, _, _ in results] == [0, 0], [e[-2000:] for _, _, e in results]
    written = {p.name.split("-")[0] for p in (tmp_path / "xla").iterdir()}
    assert {"jit_probe_0", "jit_probe_1"} <= written
