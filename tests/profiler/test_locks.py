"""Runs two processes cannot corrupt: a golden run, a playback campaign and a runtime run hold a
lock while they write; a second process gets a one-line error naming the holder, a lock left by
a dead process is taken over (saying so), and shares of one campaign split over processes do
not exclude each other unless their cells overlap."""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import peat_jax as peat
from peat_jax import models
from peat_jax._src.profiler import lock as lk
from peat_jax._src.profiler.golden import profile
from peat_jax._src.profiler.playback import playback
from peat_jax._src.profiler.runtime import runtime

CONFIG = {"batch_size": 16, "width": 8, "hidden": 32}
STEPS, EVERY = 60, 20         # the shared small vision run's (conftest.small_vision_run)
SELECTOR = "fwd:dot_general"  # 2 sites


def _sub():
    return {SELECTOR: peat.faults.wrong_scale(2.0)}


@pytest.fixture(scope="module")
def vision():
    return models.get("vision", **CONFIG)


@pytest.fixture
def run(small_vision_run):
    """The shared small vision run: the tests here leave it as they found it."""
    return small_vision_run


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True, check=True)
    return int(p.stdout)


def _stale_file(path, pid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                "started": "2026-01-01T00:00:00Z", "command": "peat playback old",
                                "token": "old"}))


@pytest.fixture(params=["flock", "o_excl"])
def mode(request, monkeypatch):
    """Both kinds of lock: flock, and the O_EXCL lock file of a filesystem without flock."""
    if request.param == "o_excl":
        def no_flock(*args):
            raise OSError(errno.ENOLCK, "No locks available")
        monkeypatch.setattr(lk.fcntl, "flock", no_flock)
    elif lk.fcntl is None:
        pytest.skip("no fcntl on this platform")
    return request.param


# ------------------------------------------------------------------------------------------
# the lock itself (no training)

def test_held_lock_is_an_error_naming_the_holder_and_is_removed_on_release(tmp_path, mode):
    path = tmp_path / "run" / "campaigns" / "c" / lk.LOCK
    first = lk.RunLock(path, "campaign 'c' of run dir R").acquire()
    holder = json.loads(path.read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", holder["started"])
    with pytest.raises(lk.LockHeld) as e:
        lk.RunLock(path, "campaign 'c' of run dir R").acquire()
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"campaign 'c' of run dir R is being written by pid {os.getpid()} "
                          f"(this process) on host {socket.gethostname()} since "
                          f"{holder['started']} (")
    first.release()
    assert not path.exists() and not (tmp_path / "run").exists()  # the dirs it made, too
    with lk.RunLock(path, "again"):
        assert path.exists()


def test_shares_of_one_campaign_exclude_each_other_only_where_their_cells_overlap(tmp_path,
                                                                                 mode):
    camp = tmp_path / "c"

    def share(i, n):
        return lk.RunLock(camp / (lk.LOCK if n == 1 else f"{lk.LOCK}.p{i}-of-{n}"), "c", (i, n))

    with share(0, 2):  # the grid's first half
        with share(1, 2):  # the second half: none of share 0 of 2's cells
            pass
        with share(2, 4), share(3, 4):
            pass
        for i, n in ((1, 4), (1, 3), (0, 1)):
            with pytest.raises(lk.LockHeld,
                               match=r"share of the grid \(process 0 of 2\) "
                                     rf"overlaps this one's \({lk.share_text((i, n))}"):
                share(i, n).acquire()
            assert not (camp / f"{lk.LOCK}.p{i}-of-{n}").exists()
    with share(0, 1):  # the whole campaign once the shares are done
        with pytest.raises(lk.LockHeld, match=r"\(the whole campaign\) overlaps"):
            share(1, 3).acquire()


def test_stale_lock_of_a_dead_process_is_taken_over_saying_so(tmp_path, mode, caplog):
    path = tmp_path / "c" / lk.LOCK
    dead = _dead_pid()
    _stale_file(path, dead)
    with caplog.at_level(logging.WARNING, logger=lk.__name__):
        with lk.RunLock(path, "campaign 'c'"):
            assert json.loads(path.read_text())["pid"] == os.getpid()
    said = [r.getMessage() for r in caplog.records if r.name == lk.__name__]
    assert len(said) == 1 and f"from pid {dead} on host {socket.gethostname()}" in said[0]
    assert said[0].startswith("taking over the lock of campaign 'c'") and "peat playback old" \
        in said[0]
    assert not path.exists()


def test_lock_file_of_a_live_or_remote_holder_is_not_taken_over(tmp_path, monkeypatch):
    def no_flock(*args):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(lk.fcntl, "flock", no_flock)
    path = tmp_path / "c" / lk.LOCK
    _stale_file(path, os.getppid())  # alive
    with pytest.raises(lk.LockHeld, match=f"by pid {os.getppid()} on host"):
        lk.RunLock(path, "c").acquire()
    path.write_text(json.dumps({"pid": 1, "host": "elsewhere.example", "started": "T",
                                "command": "peat profile", "token": "t"}))
    with pytest.raises(lk.LockHeld,
                       match=rf"on host elsewhere.example since T \(peat profile\)"
                             rf".*if that process is gone, delete {re.escape(str(path))}"):
        lk.RunLock(path, "c").acquire()
    assert json.loads(path.read_text())["host"] == "elsewhere.example"  # left alone


@pytest.mark.slow
def test_a_child_inherits_the_lock_its_parent_holds_for_it(tmp_path):
    """As `peat playback --cell-timeout`'s workers do: the supervisor holds the lock."""
    path = tmp_path / "c" / lk.LOCK
    script = textwrap.dedent(f"""
        import os, sys
        from peat_jax._src.profiler import lock as lk
        env = os.environ.pop(lk.ENV)
        try:
            lk.RunLock({str(path)!r}, "c").acquire()
            sys.exit(3)
        except lk.LockHeld:
            pass
        os.environ[lk.ENV] = env
        with lk.RunLock({str(path)!r}, "c") as held:
            assert held.holder.pid == os.getppid()
    """)
    with lk.RunLock(path, "c") as held:
        r = subprocess.run([sys.executable, "-c", script], env=held.inherit_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(path.read_text())["pid"] == os.getpid()  # still ours
    assert not path.exists()


# ------------------------------------------------------------------------------------------
# the three entry points, against a second real process

_HOLDER = textwrap.dedent("""
    import sys
    from peat_jax._src.profiler import lock
    held = [lock.golden_lock(sys.argv[1]).acquire(),
            lock.campaign_lock(sys.argv[1], "busy", (0, 1)).acquire()]
    print("held", flush=True)
    sys.stdin.read()
""")


@pytest.fixture
def holder(run):
    """A process holding the golden run's lock of `run` and its campaign 'busy''s."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "held", proc.stderr.read()[-2000:]
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert not (run / lk.LOCK).exists() and not (run / "campaigns" / "busy").exists()


def test_second_process_fails_fast_naming_the_holder(run, vision, holder):
    who = (rf"is being written by pid {holder.pid} on host {re.escape(socket.gethostname())} "
           rf"since \S+Z \(python[\d.]* -c .*\): wait for it to finish")
    before = sorted(p.name for p in run.rglob("*"))
    t0 = time.monotonic()
    with pytest.raises(lk.LockHeld, match=rf"^run dir {re.escape(str(run))} {who}"):
        profile(vision, run, steps=STEPS, checkpoint_every=EVERY)
    with pytest.raises(lk.LockHeld, match=rf"^campaign 'busy' of run dir .* {who}"):
        playback(run, _sub(), name="busy")
    with pytest.raises(lk.LockHeld, match=rf"^campaign 'busy' of run dir .* {who}"):
        runtime(run, _sub(), peat.every(2), steps=STEPS, name="busy")
    with pytest.raises(lk.LockHeld, match=r"share of the grid \(the whole campaign\) overlaps "
                                          r"this one's \(process 1 of 2\)"):
        playback(run, _sub(), name="busy", host=(1, 2))
    assert time.monotonic() - t0 < 30  # nothing was replayed or trained
    assert sorted(p.name for p in run.rglob("*")) == before  # and nothing written


@pytest.mark.slow
def test_cli_second_process_prints_one_line_naming_the_holder(run, holder):
    r = subprocess.run([sys.executable, "-m", "peat_jax", "playback", str(run), "--fault",
                        "wrong_scale(2.0)", "--sites", SELECTOR, "--name", "busy", "--cell-timeout",
                        "30"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith(f"peat: error: campaign 'busy' of run dir {run} is being written "
                               f"by pid {holder.pid} on host ")


@pytest.mark.slow
def test_stale_locks_of_killed_runs_are_taken_over_and_the_run_goes_on(own_run, vision, caplog):
    run = own_run
    dead = _dead_pid()
    _stale_file(run / lk.LOCK, dead)
    _stale_file(run / "campaigns" / "stale" / lk.LOCK, dead)
    with caplog.at_level(logging.WARNING, logger=lk.__name__):
        g = profile(vision, run, steps=STEPS, checkpoint_every=EVERY)  # resumes: all done
        res = playback(run, _sub(), checkpoints=[0], name="stale")
    assert g.resumed_from == STEPS
    said = [r.getMessage() for r in caplog.records if r.name == lk.__name__]
    assert len(said) == 2 and all(f"from pid {dead} " in s for s in said)
    assert said[0].startswith(f"taking over the lock of run dir {run} ")
    assert said[1].startswith(f"taking over the lock of campaign 'stale' of run dir {run} ")
    lines = (run / "campaigns" / "stale" / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(res.cells) == 2
    assert not (run / lk.LOCK).exists() and not (run / "campaigns" / "stale" / lk.LOCK).exists()
