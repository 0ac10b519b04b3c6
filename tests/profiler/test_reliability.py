"""Reliability: killed campaigns and golden runs resume to the same results, damaged artifacts are
clear errors that change nothing on disk, bad arguments are one-line errors, and nothing on disk
is unpickled nor any user module imported unless named."""
from __future__ import annotations

import ast
import hashlib
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import pytest

import peat_jax as peat
from conftest import bitwise_equal
from peat_jax import models
from peat_jax._src.profiler.golden import profile, restore
from peat_jax._src.profiler.playback import playback
from peat_jax._src.profiler.rundir import read_jsonl
from peat_jax._src.profiler.runtime import runtime

PACKAGE = pathlib.Path(peat.__file__).resolve().parent
REPO = PACKAGE.parent
CONFIG = {"batch_size": 16, "width": 8, "hidden": 32}
STEPS, EVERY = 6, 2  # checkpoints 0, 2, 4, 6; playback grids replay 0, 2, 4
FAULT = "wrong_scale(2.0)"
SELECTOR = "fwd:dot_general"  # 2 sites: a grid of 3 x 2 cells


def _sub():
    return {SELECTOR: peat.faults.wrong_scale(2.0)}


@pytest.fixture(scope="module")
def vision():
    return models.get("vision", **CONFIG)


@pytest.fixture(scope="module")
def golden(vision, tmp_path_factory):
    """(GoldenRun, run dir) of an uninterrupted golden run."""
    run = tmp_path_factory.mktemp("reliability") / "run"
    return profile(vision, run, steps=STEPS, checkpoint_every=EVERY), run


@pytest.fixture(scope="module")
def straight(golden):
    """Verdicts of the uninterrupted campaign: {(checkpoint, site): verdict}."""
    _, run = golden
    return _verdicts(playback(run, _sub(), name="straight").records())


def _verdicts(records) -> dict:
    return {(r["checkpoint"], r["site"]): (r["local"]["model"], r["local"]["passed"],
                                           r["effect"]["model"], r["effect"]["passed"])
            for r in records}


def _hashes(root: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _copy_run(run: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("campaigns", "report.html"))
    return dest


def _env() -> dict:
    tests = str(pathlib.Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}


def _start(script: str, run: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
    with open(log, "w") as err:  # a file, not a pipe: a chatty child never blocks on it
        return subprocess.Popen([sys.executable, "-c", script, str(run)],
                                stdout=subprocess.DEVNULL, stderr=err, env=_env())


def _kill_when(proc: subprocess.Popen, ready, delay: float, log: pathlib.Path, what: str,
               timeout: float = 240) -> None:
    """SIGKILL `proc` `delay` seconds after `ready()` first holds; fail if it ends before."""
    t0 = time.monotonic()
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"{what} ended (rc {proc.returncode}) before the kill: "
                        f"{log.read_text()[-2000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            proc.wait()
            pytest.fail(f"{what} did not get going within {timeout} s")
        time.sleep(0.02)
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"{what} ended by itself before the kill"


# ------------------------------------------------------------------------------------------
# 1. Interrupted campaigns and golden runs

@pytest.mark.slow
def test_killed_playback_campaign_resumes_with_one_record_per_cell_and_the_same_verdicts(
        golden, straight, tmp_path):
    _, run = golden
    results = run / "campaigns" / "killed" / "results.jsonl"
    # a user's campaign script; its progress callback only paces the cells so that a kill drawn
    # with a fixed seed lands mid-campaign on any machine
    script = textwrap.dedent(f"""
        import sys, time
        import peat_jax as peat
        peat.playback(sys.argv[1], {{{SELECTOR!r}: peat.faults.{FAULT}}}, name="killed",
                      progress=lambda done, total: time.sleep(0.4))
    """)
    log = tmp_path / "stderr.txt"
    proc = _start(script, run, log)
    delay = random.Random(1729).uniform(0.0, 0.8)
    _kill_when(proc, lambda: results.exists() and results.read_bytes().count(b"\n") >= 1, delay,
               log, "the playback campaign")
    text = results.read_text()
    before = text[:text.rfind("\n") + 1]  # the finished lines
    done_lines = before.splitlines()
    assert 1 <= len(done_lines) < len(straight), "the kill should land mid-campaign"
    if text == before:  # and a write torn by a kill: half a record, no newline
        with open(results, "a") as f:
            f.write(done_lines[0][:len(done_lines[0]) // 2])

    res = playback(run, _sub(), name="killed")
    text = results.read_text()
    assert text.startswith(before) and text.endswith("\n")  # finished lines kept, torn one cut
    records = [json.loads(line) for line in text.splitlines()]  # no torn or garbage line left
    keys = [(r["checkpoint"], r["site"]) for r in records]
    assert len(keys) == len(set(keys)) == len(straight) and set(keys) == set(straight)
    assert _verdicts(records) == straight
    assert _verdicts(res.records()) == straight
    assert [(c.checkpoint, c.site.index) for c in res.cells] == sorted(straight)


@pytest.mark.slow
def test_killed_golden_run_resumes_from_the_last_complete_checkpoint_bitwise(golden, vision,
                                                                              tmp_path):
    g, full = golden
    run = tmp_path / "run"
    script = textwrap.dedent(f"""
        import sys, time
        import peat_jax as peat
        from peat_jax import models
        wl = models.get("vision", **{CONFIG!r})
        peat.profile(wl, sys.argv[1], steps={STEPS}, checkpoint_every={EVERY},
                     progress=lambda done, total: time.sleep(0.3))
    """)
    log = tmp_path / "stderr.txt"
    proc = _start(script, run, log)
    delay = random.Random(4711).uniform(0.0, 0.9)
    _kill_when(proc, lambda: (run / "checkpoints" / "2").is_dir(), delay, log, "the golden run")
    complete = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert 2 in complete and STEPS not in complete and not (run / "golden" / "eval.json").exists()

    again = profile(vision, run, steps=STEPS, checkpoint_every=EVERY)
    assert again.resumed_from == max(complete)
    assert again.checkpoints == g.checkpoints and again.losses == g.losses
    steps = [r["step"] for r in read_jsonl(run / "golden" / "metrics.jsonl", strict=True)]
    assert steps == list(range(STEPS))  # each step once: metrics after the checkpoint redone
    a, b = restore(run, STEPS), restore(full, STEPS)
    assert bitwise_equal(a["params"], b["params"]) and bitwise_equal(a["opt_state"], b["opt_state"])
    assert bool((jax.random.key_data(a["rng"]) == jax.random.key_data(b["rng"])).all())


@pytest.mark.slow
def test_killed_golden_run_with_statistics_resumes_to_the_same_statistics(vision, tmp_path):
    """The statistics of the steps between the checkpoint resumed from and the kill (a chunk
    written just before its checkpoint, whose save the kill cut, included) are dropped and
    recorded again: the same files and bitwise the same statistics as an uninterrupted run."""
    from peat_jax._src.profiler.site_stats import read_step, recorded_steps
    straight = tmp_path / "straight"
    profile(vision, straight, steps=STEPS, checkpoint_every=EVERY, stats_every=1)
    killed, cut = tmp_path / "killed", tmp_path / "cut"
    script = textwrap.dedent(f"""
        import sys, time
        import peat_jax as peat
        from peat_jax import models
        wl = models.get("vision", **{CONFIG!r})
        peat.profile(wl, sys.argv[1], steps={STEPS}, checkpoint_every={EVERY}, stats_every=1,
                     progress=lambda done, total: time.sleep(0.3))
    """)
    log = tmp_path / "stderr.txt"
    proc = _start(script, killed, log)
    delay = random.Random(815).uniform(0.0, 0.9)
    _kill_when(proc, lambda: (killed / "checkpoints" / "2").is_dir(), delay, log, "the golden run")
    # a shorter run killed between writing its last chunk (step 4 alone) and saving the
    # checkpoint after it, then resumed and extended
    profile(vision, cut, steps=STEPS - 1, checkpoint_every=EVERY, stats_every=1)
    shutil.rmtree(cut / "checkpoints" / str(STEPS - 1))
    assert (cut / "golden" / "site_stats" / f"{STEPS - 2}-{STEPS - 2}.npz").exists()
    for run, resumed in ((killed, None), (cut, STEPS - 2)):
        again = profile(vision, run, steps=STEPS, checkpoint_every=EVERY, stats_every=1)
        assert resumed is None or again.resumed_from == resumed
        stats = run / "golden" / "site_stats"
        names = sorted(p.name for p in stats.iterdir())
        assert names == sorted(p.name for p in (straight / "golden" / "site_stats").iterdir())
        assert recorded_steps(stats) == list(range(STEPS))
        for step in range(STEPS):
            a, b = read_step(stats, step), read_step(straight / "golden" / "site_stats", step)
            assert all(a[k].tobytes() == b[k].tobytes() for k in a), (run.name, step)


@pytest.mark.slow
def test_killed_runtime_run_resumes_from_its_last_chunk_with_the_same_result(golden, tmp_path):
    _, run = golden
    sub, schedule = _sub(), peat.every(2)
    straight = runtime(run, sub, schedule, steps=STEPS, name="runtime-straight")
    camp = run / "campaigns" / "runtime-killed"
    # `peat runtime` as a script, its progress callback pacing the steps so that the kill lands
    # after the first chunk (2 steps: the golden run's checkpoint interval) on any machine
    script = textwrap.dedent(f"""
        import sys, time
        import peat_jax as peat
        peat.runtime(sys.argv[1], {{{SELECTOR!r}: peat.faults.{FAULT}}}, peat.every(2),
                     steps={STEPS}, name="runtime-killed",
                     progress=lambda done, total: time.sleep(0.5))
    """)
    log = tmp_path / "stderr.txt"
    proc = _start(script, run, log)
    delay = random.Random(2024).uniform(0.0, 0.8)
    _kill_when(proc, lambda: (camp / "runtime.partial.json").exists(), delay, log,
               "the runtime run")
    assert not (camp / "runtime.json").exists()
    done = json.loads((camp / "runtime.partial.json").read_text())["progress"]["done"]
    assert done in (2, 4)

    with pytest.raises(peat.PeatError, match="unfinished runtime run with another schedule"):
        runtime(run, sub, peat.every(3), steps=STEPS, name="runtime-killed")
    with pytest.raises(peat.PeatError, match="unfinished runtime run with another steps"):
        runtime(run, sub, schedule, steps=STEPS - 1, name="runtime-killed")
    with pytest.raises(peat.PeatError, match="unfinished runtime run with another switch"):
        runtime(run, sub, schedule, steps=STEPS, name="runtime-killed", switch="host")

    proc = subprocess.run([sys.executable, "-m", "peat_jax", "runtime", str(run), "--fault", FAULT,
                           "--sites", SELECTOR, "--every", "2", "--name", "runtime-killed",
                           "--json"], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    resumed = json.loads(proc.stdout.splitlines()[-1])
    assert resumed["resumed_from"] == done and straight.resumed_from is None
    assert tuple(resumed["losses"]) == straight.losses  # bitwise: JSON keeps a float's repr
    for key in ("outcome", "golden_losses", "schedule", "nan_origin"):
        assert resumed[key] == json.loads(json.dumps(straight.to_dict()[key])), key
    assert json.loads((camp / "runtime.json").read_text())["losses"] == resumed["losses"]
    assert sorted(p.name for p in camp.iterdir()) == ["runtime.json"]  # progress removed


# ------------------------------------------------------------------------------------------
# 2. Damaged artifacts

def _largest_file(step_dir: pathlib.Path) -> pathlib.Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _damage(run: pathlib.Path, how: str, step: int = 2) -> None:
    step_dir = run / "checkpoints" / str(step)
    if how == "metadata_overwritten":
        (step_dir / "default" / "_METADATA").write_text("{ not json")
        return
    f = _largest_file(step_dir)  # the array data
    data = bytearray(f.read_bytes())
    if how == "truncated":
        f.write_bytes(bytes(data[:len(data) // 2]))
    else:  # one flipped bit in the middle: Orbax itself reads it back without complaint
        data[len(data) // 2] ^= 0x10
        f.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "bit_flipped", "metadata_overwritten"])
def test_damaged_checkpoint_is_an_error_naming_it_and_nothing_is_overwritten(golden, tmp_path, how):
    _, full = golden
    run = _copy_run(full, tmp_path / "run")
    _damage(run, how)
    before = _hashes(run)
    named = (re.escape(str(run / "checkpoints" / "2"))
             + r"\b.*damaged.*use another checkpoint \(\[0, 4, 6\]\)")
    with pytest.raises(peat.PeatError, match=named):
        restore(run, 2)
    with pytest.raises(peat.PeatError, match=named):
        playback(run, _sub(), checkpoints=[2], name="on-damaged")
    assert _hashes(run) == before
    # the other checkpoints are intact
    for step in (0, 4):
        assert bitwise_equal(restore(run, step)["params"], restore(full, step)["params"])
    # extending a run whose last checkpoint is damaged would build on a bad state
    _damage(run, how, step=STEPS)
    before = _hashes(run)
    with pytest.raises(peat.PeatError, match=re.escape(str(run / "checkpoints" / str(STEPS)))
                       + r"\b.*damaged.*use another checkpoint \(\[0, 2, 4\]\)"):
        profile(models.get("vision", **CONFIG), run, steps=STEPS + 2, checkpoint_every=EVERY)
    assert _hashes(run) == before


def test_campaign_on_a_run_with_a_damaged_checkpoint_goes_on_with_the_others(golden, straight,
                                                                             tmp_path):
    _, full = golden
    run = _copy_run(full, tmp_path / "run")
    _damage(run, "bit_flipped")
    before = _hashes(run)
    with pytest.raises(peat.PeatError, match=r"checkpoints/2\b.*damaged"):
        playback(run, _sub(), name="around")  # checkpoint 0's cells are done, then 2 fails
    res = playback(run, _sub(), checkpoints=[0, 4], name="around")
    assert _verdicts(res.records()) == {k: v for k, v in straight.items() if k[0] in (0, 4)}
    after = _hashes(run)
    assert {k: after[k] for k in before} == before  # only campaign files were added
    lines = (run / "campaigns" / "around" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4  # checkpoint 0's cells were not computed twice


@pytest.mark.slow
def test_cli_on_a_damaged_checkpoint_prints_the_error_and_no_tracebacks(golden, tmp_path):
    # Orbax leaves the reads of the other arrays pending when one fails; finalised at exit,
    # each used to print an "Exception ignored in: <coroutine ...>" traceback
    _, full = golden
    run = _copy_run(full, tmp_path / "run")
    _damage(run, "truncated")
    r = subprocess.run([sys.executable, "-m", "peat_jax", "playback", str(run), "--fault", FAULT,
                        "--checkpoints", "2"], capture_output=True, text=True, timeout=300,
                       env=_env())
    assert r.returncode == 2
    # Not ours to silence: tensorstore's threads complete the abandoned reads after Orbax closed
    # its event loop and print asyncio's "Event loop is closed" traceback (in about half the
    # runs, sometimes before our line, sometimes split around it: "RuntimeError" and ": Event
    # loop is closed" are separate writes). Those fragments, and only those, are set aside here
    # (a traceback of ours would still show its "File" lines).
    noise = re.compile(r"Traceback \(most recent call last\):"
                       r"|File \"[^\"]*asyncio/base_events\.py\", "
                       r"line \d+, in (call_soon_threadsafe|_check_closed)|self\._check_closed\(\)"
                       r"|raise RuntimeError\('Event loop is closed'\)"
                       r"|RuntimeError|: Event loop is closed")
    rest = [line.strip() for line in noise.sub("", r.stderr).splitlines() if line.strip()]
    assert len(rest) == 1, r.stderr[:3000]
    assert rest[0].startswith(f"peat: error: checkpoint {run / 'checkpoints' / '2'} ")
    assert "Exception ignored" not in r.stderr, r.stderr[:3000]


def test_missing_manifest_is_an_error_naming_it_and_nothing_is_changed(golden, vision, tmp_path):
    _, full = golden
    run = _copy_run(full, tmp_path / "run")
    (run / "manifest.json").unlink()
    before = _hashes(run)
    for call in (lambda: restore(run, 0),
                 lambda: playback(run, _sub()),
                 lambda: runtime(run, _sub(), peat.every(2), steps=2),
                 lambda: profile(vision, run, steps=STEPS, checkpoint_every=EVERY)):
        with pytest.raises(peat.PeatError, match=re.escape(str(run)) + r".*manifest\.json"):
            call()
    assert _hashes(run) == before


@pytest.mark.parametrize("change", [
    {"config": {**models.defaults("vision"), **CONFIG, "batch_size": 8}},  # same shapes
    {"config": {**models.defaults("vision"), **CONFIG, "width": 16}},
    {"workload": "language"},
    {"seed": 3},
])
def test_manifest_of_another_run_is_an_error_and_nothing_is_changed(golden, vision, tmp_path,
                                                                    change):
    _, full = golden
    run = _copy_run(full, tmp_path / "run")
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, **change}))
    before = _hashes(run)
    key = next(iter(change))
    msg = r"manifest\.json does not describe the checkpoints .*" + key + " differs"
    for call in (lambda: restore(run, 2),
                 lambda: playback(run, _sub(), checkpoints=[2]),
                 lambda: runtime(run, _sub(), peat.every(2), steps=2),
                 lambda: profile(vision, run, steps=STEPS + 2, checkpoint_every=EVERY)):
        with pytest.raises(peat.PeatError, match=msg):
            call()
    assert _hashes(run) == before


def test_profile_with_fewer_steps_than_the_run_is_an_error_and_changes_nothing(golden, vision,
                                                                              tmp_path):
    _, full = golden
    run = _copy_run(full, tmp_path / "run")
    before = _hashes(run)
    with pytest.raises(peat.PeatError, match=f"holds a golden run of {STEPS} steps"):
        profile(vision, run, steps=STEPS - 2, checkpoint_every=EVERY)
    assert _hashes(run) == before


def test_workload_with_another_config_than_the_run_is_an_error(golden):
    _, run = golden
    other = models.get("vision", **{**CONFIG, "batch_size": 8})  # same shapes: would restore
    for call in (lambda: restore(run, 2, workload=other),
                 lambda: playback(run, _sub(), workload=other, name="other-config"),
                 lambda: runtime(run, _sub(), peat.every(2), steps=2, workload=other)):
        with pytest.raises(peat.PeatError, match=r"another config .*batch_size=8 \(run: 16\)"):
            call()
    assert not (run / "campaigns" / "other-config").exists()


def test_garbage_line_in_results_is_named_when_strict_and_skipped_with_a_warning(tmp_path):
    path = tmp_path / "results.jsonl"
    good = [{"checkpoint": 0, "site": 5}, {"checkpoint": 0, "site": 6}]
    path.write_bytes(json.dumps(good[0]).encode() + b"\n" + b"\x00\xff{\"checkpoint\": 0, \"si\n"
                     + json.dumps(good[1]).encode() + b"\n" + b"[1, 2]\n" + b'{"torn": ')
    with pytest.raises(peat.PeatError,
                       match=re.escape(str(path)) + r": line 2 is not a JSON object"):
        read_jsonl(path, strict=True)
    with pytest.warns(UserWarning) as caught:
        assert read_jsonl(path) == good
    assert [str(w.message) for w in caught] == [
        f"{path}: line {n} is not a JSON object (damaged); skipped" for n in (2, 4)]


def test_resumed_campaign_with_a_garbage_middle_line_recomputes_that_cell_only(golden, straight):
    _, run = golden
    src, camp = run / "campaigns" / "straight", run / "campaigns" / "garbled"
    camp.mkdir()
    shutil.copy(src / "campaign.json", camp / "campaign.json")
    lines = (src / "results.jsonl").read_bytes().splitlines(keepends=True)
    lost = json.loads(lines[2])
    lines[2] = b'{"checkpoint": 2, "site": \x00\x00\xfe garbage\n'  # damaged in place
    (camp / "results.jsonl").write_bytes(b"".join(lines))
    before = (camp / "results.jsonl").read_bytes()
    with pytest.warns(UserWarning, match=r"results\.jsonl: line 3 is not a JSON object"):
        res = playback(run, _sub(), name="garbled")
    assert _verdicts(res.records()) == straight
    after = (camp / "results.jsonl").read_bytes()
    assert after.startswith(before)  # nothing rewritten
    added = [json.loads(x) for x in after[len(before):].splitlines()]
    assert [(r["checkpoint"], r["site"]) for r in added] == [(lost["checkpoint"], lost["site"])]


def test_golden_metrics_with_a_damaged_line_is_an_error_not_a_shifted_curve(golden, vision,
                                                                              tmp_path):
    _, full = golden
    run = _copy_run(full, tmp_path / "run")
    metrics = run / "golden" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    lines[3] = "#garbage\n"
    metrics.write_text("".join(lines))
    before = _hashes(run)
    with pytest.warns(UserWarning), pytest.raises(peat.PeatError,
                                                  match=r"metrics\.jsonl lacks .* step\(s\) 3 "):
        runtime(run, _sub(), peat.every(2), steps=4)
    with pytest.warns(UserWarning), pytest.raises(peat.PeatError, match=r"step\(s\) 3 "):
        profile(vision, run, steps=STEPS + 2, checkpoint_every=EVERY)  # extending it
    assert _hashes(run) == before


# ------------------------------------------------------------------------------------------
# 3. Bad arguments (those not already covered in test_cli / test_profiler / test_schedule)

_CLI_DRIVER = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    from peat_jax._src.cli import main
    for argv in json.loads(sys.argv[1]):
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code
            except BaseException:
                traceback.print_exc()
                rc = "raised"
        print(json.dumps({"rc": rc, "stderr": err.getvalue()}))
""")


def _cli_cases(run: pathlib.Path, scratch: pathlib.Path) -> list[tuple[list[str], str]]:
    a_file = scratch / "a_file"
    a_file.write_text("not a directory\n")
    (scratch / "empty").mkdir()
    r = str(run)
    return [
        (["playback", r, "--fault", FAULT, "--sites", "NoSuchModule/*"],
         "selector 'NoSuchModule/*' matches no site. Sites that exist: "),
        (["playback", r, "--fault", FAULT, "--checkpoints", "0,7"],
         "checkpoints [7] are not in"),
        (["playback", str(scratch / "empty"), "--fault", FAULT], "manifest.json is missing"),
        (["runtime", r, "--fault", FAULT, "--every", "2", "--steps", str(STEPS + 1)],
         "is beyond the golden run"),
        (["runtime", r, "--fault", FAULT, "--every", "0"], "expected a positive integer, got 0"),
        (["runtime", r, "--fault", FAULT, "--every", "3", "--offset", "3"],
         "offset must be in [0, 3)"),
        (["runtime", r, "--fault", FAULT, "--probability", "1.5"], "p must be in [0, 1]"),
        (["runtime", r, "--fault", FAULT, "--probability", "-0.1"], "p must be in [0, 1]"),
        (["runtime", r, "--fault", FAULT, "--at-steps", "1,-2"], "steps must be >= 0"),
        (["profile", "no_such_workload", "--out", str(scratch / "x")],
         "workload 'no_such_workload' is neither a bundled name"),
        (["profile", "vision", "--out", str(a_file), "--steps", "2"],
         "cannot create run directory"),
    ]


@pytest.mark.slow
def test_cli_bad_arguments_exit_2_with_one_error_line(golden, tmp_path):
    _, run = golden
    cases = _cli_cases(run, tmp_path)
    proc = subprocess.run([sys.executable, "-c", _CLI_DRIVER, json.dumps([a for a, _ in cases])],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases)
    for (argv, needle), got in zip(cases, results):
        errors = [ln for ln in got["stderr"].splitlines() if "error:" in ln]
        assert got["rc"] == 2, (argv, got)
        assert "Traceback" not in got["stderr"], (argv, got["stderr"])
        assert len(errors) == 1 and needle in errors[0], (argv, got["stderr"])
    assert not (tmp_path / "x").exists()


def test_api_bad_arguments_are_one_line_errors_and_write_nothing(golden, tmp_path):
    _, run = golden
    before = _hashes(run)
    cases = [
        (lambda: playback(run, _sub(), checkpoints=[0, 7]), r"checkpoints \[7\] are not in"),
        (lambda: playback(run, _sub(), checkpoints=[STEPS + 2]),
         r"are not in .*available: \[0, 2, 4, 6\]"),
        (lambda: playback(tmp_path / "nope", _sub()), "does not exist"),
        (lambda: restore(run, 3), r"no checkpoint for step 3 .*available: \[0, 2, 4, 6\]"),
        (lambda: playback(run, {"NoSuchModule/*": peat.faults.zeroed()}, name="nothing"),
         "selector 'NoSuchModule/\\*' matches no site"),
        (lambda: playback(run, _sub(), sites="bwd:NoSuchModule/*", name="nothing"),
         "matches no site"),
        (lambda: profile("vision", tmp_path / "r", steps=2, checkpoint_every=1),
         "profile needs a peat.Workload"),
        (lambda: runtime(run, _sub(), peat.every(2), steps=2, name="nothing", switch=""),
         "switch must be one of site, host"),
    ]
    for call, match in cases:
        with pytest.raises(peat.PeatError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    assert _hashes(run) == before and not (run / "campaigns" / "nothing").exists()


def test_run_directory_that_cannot_be_written_is_a_clear_error(vision, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(peat.PeatError, match="cannot create run directory .*a_file/run"):
        profile(vision, a_file / "run", steps=2, checkpoint_every=1)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: chmod does not make a directory read-only")
        with pytest.raises(peat.PeatError, match="cannot create run directory .*locked/run"):
            profile(vision, locked / "run", steps=2, checkpoint_every=1)
        with pytest.raises(peat.PeatError, match="locked is not writable"):
            profile(vision, locked, steps=2, checkpoint_every=1)
    finally:
        locked.chmod(0o700)


# ------------------------------------------------------------------------------------------
# 4. Security: nothing on disk is unpickled or evaluated; user code is imported only when named

_UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                   "joblib"}


def _unsafe_uses(source: str, filename: str) -> list[str]:
    """Lines that unpickle or evaluate: imports of pickle-like modules, `eval` / `exec` /
    `__import__` calls, `allow_pickle=True`, `torch.load`, and Orbax restores without a target."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if a.name.split(".")[0] in _UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and \
                (node.module or "").split(".")[0] in _UNSAFE_MODULES:
            found.append(f"{where} from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in {"eval", "exec", "__import__"}:
                found.append(f"{where} {f.id}(")
            if isinstance(f, ast.Attribute) and f.attr == "load" and \
                    isinstance(f.value, ast.Name) and f.value.id == "torch":
                found.append(f"{where} torch.load(")
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant)
                                                     and kw.value.value is False):
                    found.append(f"{where} allow_pickle={ast.unparse(kw.value)}")
            if isinstance(f, ast.Attribute) and f.attr == "restore" and \
                    any(kw.arg == "args" for kw in node.keywords):
                args = next(kw.value for kw in node.keywords if kw.arg == "args")
                if not (isinstance(args, ast.Call) and ast.unparse(args.func).endswith("Restore")
                        and (args.args or any(k.arg == "item" for k in args.keywords))):
                    found.append(f"{where} Orbax restore without an abstract target")
    return found


def test_package_never_unpickles_or_evaluates():
    # the scanner itself flags what it should (so this test can fail)
    bad = ("import pickle\nfrom dill import loads\nnp.load(p, allow_pickle=True)\neval(s)\n"
           "torch.load(f)\nmgr.restore(1, args=ocp.args.StandardRestore())\n")
    assert len(_unsafe_uses(bad, "bad.py")) == 6
    assert _unsafe_uses("ast.literal_eval(s)\nnp.load(p)\n_eval(x)\n", "ok.py") == []
    files = sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "models").rglob("*.py"))
    assert len(files) > 20
    found = [hit for f in files for hit in _unsafe_uses(f.read_text(), str(f.relative_to(REPO)))]
    assert found == []
    # Orbax restores take the abstract target of the workload's state (shapes, dtypes, key types)
    golden_src = (PACKAGE / "_src" / "profiler" / "golden.py").read_text()
    restores = re.findall(r"\.restore\(([^)]*\)?)\)", golden_src)
    assert restores and all("StandardRestore(target)" in r for r in restores), restores
    assert "_abstract_state(wl" in golden_src and "jax.eval_shape(workload.init" in golden_src


_SENTINEL_DRIVER = textwrap.dedent("""
    import contextlib, io, json, os, sys
    from peat_jax._src.cli import main
    out = []
    for argv in json.loads(sys.argv[1]):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc = main(argv)
        out.append({"rc": rc, "imported": sorted(m for m in ("vision", "pallas_matmul")
                                                  if m in sys.modules),
                    "pwned": os.path.exists("pwned")})
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_cli_imports_user_code_only_when_named_as_module_attribute(tmp_path):
    # modules that shadow bundled names, in the directory the user runs `peat` from
    for name in ("vision", "pallas_matmul"):
        (tmp_path / f"{name}.py").write_text("open('imported_' + __name__, 'w').close()\n")
    argvs = [
        ["sites", "vision", "--json", "--primitive", "dot_general"],
        ["playback", str(tmp_path / "nope"), "--kernel", "pallas_matmul"],
        ["runtime", str(tmp_path / "nope"), "--fault",
         "wrong_scale(__import__('os').system('touch pwned'))", "--every", "2"],
        ["sites", "vision:no_such_attribute"],  # named: imported (the sentinel works)
    ]
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _SENTINEL_DRIVER, json.dumps(argvs)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [g["rc"] for g in got] == [0, 2, 2, 2]
    assert [g["imported"] for g in got] == [[], [], [], ["vision"]]
    assert not any(g["pwned"] for g in got) and not (tmp_path / "pwned").exists()
    assert sorted(p.name for p in tmp_path.glob("imported_*")) == ["imported_vision"]


def test_atomic_write_leaves_the_old_file_whole_when_the_writer_fails(tmp_path):
    from peat_jax._src.profiler.rundir import atomic_write
    path = tmp_path / "f.bin"
    atomic_write(path, lambda f: f.write(b"old"), binary=True)

    def half_then_fail(f):
        f.write(b"half a new fi")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, half_then_fail, binary=True)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]   # no temporary file left behind
    atomic_write(path, lambda f: f.write("new"))
    assert path.read_text() == "new"
