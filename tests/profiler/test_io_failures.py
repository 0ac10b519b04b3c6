"""IO failures as one line: a full disk (also behind Orbax's own exceptions), a read-only
directory, a checkpoint removed under a running replay: a PeatError naming what failed, what is
kept and the command that resumes; what was stored stays intact and the rerun finishes."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

import peat_jax as peat
from peat_jax import models
from peat_jax._src.profiler import golden as golden_mod
from peat_jax._src.profiler import hostio
from peat_jax._src.profiler import lock as lk
from peat_jax._src.profiler.campaign import Campaign
from peat_jax._src.profiler.golden import profile, restore
from peat_jax._src.profiler.ioerrors import as_oserror
from peat_jax._src.profiler.playback import playback
from peat_jax._src.profiler.rundir import MissingCheckpoint, RunDir, read_jsonl

CONFIG = {"batch_size": 16, "width": 8, "hidden": 32}  # conftest.small_vision_run's workload
SELECTOR = "fwd:dot_general"  # 2 sites
FULL = "No space left on device (ENOSPC)"


def _sub():
    return {SELECTOR: peat.faults.wrong_scale(2.0)}


def _tensorstore_full(path: str) -> ValueError:
    """What a full disk under an Orbax save raises (tensorstore's status, as seen on a tmpfs)."""
    return ValueError(f'RESOURCE_EXHAUSTED: Error writing local file "{path}/_sharding": Failed '
                      f'writing: "{path}/_sharding.__lock": Failed to write 3575 bytes to file 17: '
                      "No space left on device [os_error_code='28']")


@pytest.fixture(scope="module")
def vision():
    return models.get("vision", **CONFIG)


def test_oserror_is_found_behind_orbax_and_tensorstore_exceptions():
    e = as_oserror(_tensorstore_full("/r/checkpoints/4.orbax-checkpoint-tmp/default"))
    want = "/r/checkpoints/4.orbax-checkpoint-tmp/default/_sharding.__lock"
    assert (e.errno, e.filename) == (errno.ENOSPC, want)
    inner = OSError(errno.EROFS, "Read-only file system", "/r/x")
    try:
        try:
            raise inner
        except OSError as cause:
            raise RuntimeError("orbax: save failed") from cause
    except RuntimeError as wrapped:
        assert as_oserror(wrapped) is inner
    assert as_oserror(ExceptionGroup("writes", [ValueError("x"), inner])) is inner
    assert as_oserror(ValueError("[Errno 13] Permission denied: '/r/y'")).errno == errno.EACCES
    assert as_oserror(ValueError("DATA_LOSS: checksum mismatch")) is None
    assert as_oserror(peat.PeatError("No space left on device [os_error_code='28']")) is None


@pytest.mark.slow
@pytest.mark.parametrize("where", ["metrics", "orbax"])
def test_full_disk_in_a_golden_run_is_one_line_and_the_rerun_resumes(where, vision, tmp_path,
                                                                     monkeypatch,
                                                                     small_vision_run):
    run = tmp_path / "run"
    if where == "metrics":  # the metrics of step 1, written before checkpoint 2
        real = golden_mod.append_jsonl

        def append(path, records):
            records = list(records)
            if any(r.get("step") == 1 for r in records):
                raise OSError(errno.ENOSPC, "No space left on device")
            real(path, records)
        monkeypatch.setattr(golden_mod, "append_jsonl", append)
    else:  # Orbax's save of checkpoint 2
        import orbax.checkpoint as ocp
        real = ocp.CheckpointManager.save

        def save(self, step, *args, **kwargs):
            if step == 2:
                raise _tensorstore_full(str(run / "checkpoints" / "2.orbax-checkpoint-tmp"))
            return real(self, step, *args, **kwargs)
        monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    with pytest.raises(peat.PeatError) as e:
        profile(vision, run, steps=3, checkpoint_every=1)
    msg = str(e.value)
    assert "\n" not in msg and FULL in msg
    assert msg.startswith(f"the golden run in {run} stopped: "
                          + (f"{run}: " if where == "metrics" else
                             f"{run}/checkpoints/2.orbax-checkpoint-tmp/_sharding.__lock: "))
    assert msg.endswith(f"free space on its filesystem (or raise the quota), then call "
                        f"peat.profile(workload, {str(run)!r}, ...) again to resume")
    assert not (run / lk.LOCK).exists()
    monkeypatch.undo()
    g = profile(vision, run, steps=3, checkpoint_every=1)
    assert g.resumed_from == 1 and g.checkpoints == (0, 1, 2, 3)
    steps = [r["step"] for r in read_jsonl(run / "golden" / "metrics.jsonl", strict=True)]
    assert steps == [0, 1, 2]
    assert list(g.losses) == RunDir(small_vision_run).golden_losses()[:3]  # bitwise


def _fail_second_record(monkeypatch, code=errno.ENOSPC, text="No space left on device"):
    real, calls = Campaign.record, []

    def record(self, records):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(code, text)
        real(self, records)
    monkeypatch.setattr(Campaign, "record", record)


@pytest.mark.slow
def test_full_disk_in_a_campaign_keeps_its_finished_cells_and_the_rerun_completes(own_run,
                                                                                  monkeypatch):
    _fail_second_record(monkeypatch)
    camp = own_run / "campaigns" / "full"
    with pytest.raises(peat.PeatError) as e:
        playback(own_run, _sub(), checkpoints=[0], name="full")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (f"campaign 'full' of run dir {own_run} stopped: {own_run}: {FULL}; its 1 "
                   f"finished cell(s) are kept in {camp}: free space on its filesystem (or raise "
                   f"the quota), then call peat.playback({str(own_run)!r}, ...) again to resume")
    first = (camp / "results.jsonl").read_text()
    assert first.count("\n") == 1 and not (camp / lk.LOCK).exists()
    monkeypatch.undo()
    res = playback(own_run, _sub(), checkpoints=[0], name="full")
    text = (camp / "results.jsonl").read_text()
    assert text.startswith(first) and text.count("\n") == 2 == len(res.cells)


@pytest.mark.slow
def test_cli_prints_one_line_for_a_full_disk(own_run, tmp_path):
    driver = textwrap.dedent("""
        import errno, sys
        from peat_jax._src import cli
        from peat_jax._src.profiler.campaign import Campaign
        real, calls = Campaign.record, []
        def record(self, records):
            calls.append(1)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(self, records)
        Campaign.record = record
        sys.argv = ["peat", *sys.argv[1:]]
        sys.exit(cli.main(sys.argv[1:]))
    """)
    argv = ["playback", str(own_run), "--fault", "wrong_scale(2.0)", "--sites", SELECTOR,
            "--checkpoints", "0", "--name", "full"]
    r = subprocess.run([sys.executable, "-c", driver, *argv], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[0].startswith(f"peat: error: campaign 'full' of run dir {own_run} stopped: ")
    assert lines[0].endswith(f"then run `peat playback {own_run} --fault 'wrong_scale(2.0)' "
                             f"--sites {SELECTOR} --checkpoints 0 --name full` again to resume")


def test_orbax_threads_failing_after_shutdown_are_dropped_and_others_kept():
    """At exit after a full disk, Orbax's save threads may write on after the interpreter shut
    its executors down: their tracebacks are dropped (the failure was said in one line); a
    thread's exception from elsewhere, or another one from Orbax, is reported as before."""
    from peat_jax._src.profiler.hostio import drop_orbax_shutdown_reports
    was, reported = threading.excepthook, []
    try:
        threading.excepthook = lambda args: reported.append(str(args.exc_value))
        drop_orbax_shutdown_reports()
        for path, message, kept in [
                ("/site-packages/orbax/checkpoint/_src/fake.py",
                 "cannot schedule new futures after shutdown", False),
                ("/site-packages/orbax/checkpoint/_src/fake.py", "another failure", True),
                ("/home/user/train.py", "cannot schedule new futures after shutdown", True)]:
            code = compile(f"def run():\n    raise RuntimeError({message!r})\n", path, "exec")
            scope: dict = {}
            exec(code, scope)
            t = threading.Thread(target=scope["run"])
            t.start()
            t.join()
            assert (reported[-1:] == [message]) == kept, (path, message, reported)
            reported.clear()
    finally:
        threading.excepthook = was


@pytest.mark.slow
def test_full_tmpfs_under_orbax_is_one_line_and_the_rerun_resumes(tmp_path, small_vision_run):
    """The real thing where this process may mount a tmpfs (root with CAP_SYS_ADMIN): Orbax's
    worker threads used to log a traceback each."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs",
                                            str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        run = mnt / "run"
        argv = [sys.executable, "-m", "peat_jax", "profile", "vision", "--out", str(run),
                "--steps", "6", "--checkpoint-every", "2", "--json"]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 2, r.stderr[-3000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr[-3000:]
        assert lines[0].startswith(f"peat: error: the golden run in {run} stopped: ")
        assert FULL in lines[0] and lines[0].endswith(" again to resume")
        subprocess.run(["mount", "-o", "remount,size=4m", str(mnt)], check=True)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["resumed_from"] is not None and out["checkpoints"] == [0, 2, 4, 6]
        steps = [x["step"] for x in read_jsonl(run / "golden" / "metrics.jsonl", strict=True)]
        assert steps == list(range(6))
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.mark.parametrize("message, dropped", [
    ("_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished "
     "exception=ValueError('RESOURCE_EXHAUSTED: Error writing \"params.head.bias/0\" in OCDBT "
     "database at local file ...: No space left on device')>", True),
    ("Task exception was never retrieved\nfuture: <Task finished exception=ValueError("
     "'while reading array index 3')>", True),
    ("Task exception was never retrieved\nfuture: <Task finished exception=KeyError('x')>",
     False),
    ("Error writing OCDBT database", False),   # not an abandoned future: kept
])
def test_quiet_drops_only_abandoned_tensorstore_io(caplog, message, dropped):
    """A full disk under Orbax: the futures it abandoned are reported by asyncio when collected
    (67 lines on one CI leg); those, and only those, are dropped."""
    import logging
    with hostio.quiet():
        pass   # the filter stays for the process: the reports come late
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        logging.getLogger("asyncio").error(message)
    assert (message not in caplog.text) == dropped


def test_read_only_directory_is_one_line_and_nothing_is_written(own_run, monkeypatch):
    real = lk.open_file

    def read_only(path, flags):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path, flags)
    monkeypatch.setattr(lk, "open_file", read_only)
    with pytest.raises(peat.PeatError) as e:
        playback(own_run, _sub(), checkpoints=[0], name="ro")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"campaign 'ro' of run dir {own_run} stopped: "
                          f"{own_run / 'campaigns' / 'ro' / lk.LOCK}: Read-only file system "
                          "(EROFS); no cell of it had finished: its filesystem is read-only: "
                          "remount it read-write")
    assert not (own_run / "campaigns").exists()


def test_read_only_directory_by_its_permissions(own_run):
    (own_run / "campaigns").mkdir()
    (own_run / "campaigns").chmod(0o555)
    try:
        if os.access(own_run / "campaigns", os.W_OK):
            pytest.skip("running as root: chmod does not make a directory read-only")
        with pytest.raises(peat.PeatError, match=r"campaign 'ro' of run dir .* stopped: .*"
                                                 r"Permission denied \(EACCES\).*make it "
                                                 r"writable for this user") as e:
            playback(own_run, _sub(), checkpoints=[0], name="ro")
        assert "\n" not in str(e.value)
    finally:
        (own_run / "campaigns").chmod(0o755)
    assert list((own_run / "campaigns").iterdir()) == []


def test_checkpoint_removed_under_a_running_replay(own_run):
    def remove_20(done, total):
        shutil.rmtree(own_run / "checkpoints" / "20", ignore_errors=True)

    camp = own_run / "campaigns" / "gone"
    with pytest.raises(peat.PeatError) as e:
        playback(own_run, _sub(), checkpoints=[0, 20], name="gone", progress=remove_20)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (f"campaign 'gone' of run dir {own_run} stopped: no checkpoint for step 20 in "
                   f"{own_run / 'checkpoints'}; available: [0, 40, 60]; its 2 finished cell(s) "
                   f"are kept in {camp}: put the checkpoint back and call "
                   f"peat.playback({str(own_run)!r}, ...) again to resume, or replay only the "
                   "others (--checkpoints, checkpoints=)")
    res = playback(own_run, _sub(), checkpoints=[0], name="gone")  # nothing recomputed
    assert len(res.cells) == 2 and (camp / "results.jsonl").read_text().count("\n") == 2


def test_checkpoint_removed_while_orbax_reads_it(own_run, monkeypatch):
    import orbax.checkpoint as ocp

    def restore_while_removed(self, step, *args, **kwargs):
        shutil.rmtree(own_run / "checkpoints" / str(step))
        raise ValueError("NOT_FOUND: Error opening file: No such file or directory")
    monkeypatch.setattr(ocp.CheckpointManager, "restore", restore_while_removed)
    with pytest.raises(MissingCheckpoint,
                       match=rf"checkpoint {own_run}/checkpoints/40 was removed "
                             r"while it was being read; available: \[0, 20, 60\]"):
        restore(own_run, 40)
