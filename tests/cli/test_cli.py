"""The `peat` command driven as a user would: subprocesses, exit codes, files, the report."""
from __future__ import annotations

import gc
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parents[1]


def peat(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "peat_jax", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    r = peat("demo", "--out", str(out), "--steps", "30", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_demo_writes_results_and_a_report_that_agrees(demo):
    out, summary = demo
    assert summary["playback"]["pallas_matmul"]["failing"] == 0
    tile_bug = summary["playback"]["tile_bug"]
    assert tile_bug["failing"] == tile_bug["cells"] > 0
    assert summary["runtime"]["outcome"] != "masked"
    html = (out / "report.html").read_text()
    for camp in ("pallas_matmul", "tile_bug"):
        results = out / "campaigns" / camp / "results.jsonl"
        records = [json.loads(x) for x in results.read_text().splitlines()]
        for r in records:
            # the grid cell of (checkpoint, site) shows the diagnosis recorded for it
            assert r["local"]["model"] in html
        assert len(records) == summary["playback"][camp]["cells"]
    assert html.count("<svg") >= 3 and "<script" not in html


@pytest.mark.slow
def test_report_renders_in_headless_chromium(demo, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (.ci/run installs it)")
    out, _ = demo
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          f"file://{out / 'report.html'}"], capture_output=True, text=True,
                         timeout=120)
    assert 'class="grid verdicts"' in dom.stdout and "tile_boundary" in dom.stdout
    assert dom.stdout.count('class="plot') >= 4
    shot = tmp_path / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    f"--screenshot={shot}", "--window-size=1200,2400",
                    f"file://{out / 'report.html'}"], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 20_000


@pytest.mark.slow
def test_check_fails_on_a_buggy_kernel_with_the_diagnosis():
    r = peat("check", "cli_kernels:wrong_scale_matmul", "--shapes", "16x8,8x4")
    assert r.returncode == 1
    assert "wrong_scale" in r.stdout and "fails" in r.stdout
    ok = peat("check", "cli_kernels:correct_matmul", "--shapes", "16x8,8x4", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["passed"] is True


def test_check_sets_its_floor_from_float64_and_prints_the_summary_as_written():
    """The command's dot_general reference runs in float64 (the noise and conditioning floors);
    the verdict's "[output, variant inputs]" is text, not a style tag to swallow."""
    r = peat("check", "cli_kernels:correct_matmul", "--shapes", "16x8,8x4")
    assert r.returncode == 0, r.stderr[-2000:]
    said = " ".join(r.stdout.split())
    assert re.search(r"\[(forward|grad\[[01]\]|repeat \w+), \w+ inputs\]", said), said
    assert "conditioning_floor" in said and "dtype bound" not in said, said


@pytest.mark.slow
def test_check_json_is_one_object_on_stdout_whatever_the_kernel_prints():
    """A racy Pallas kernel: the interpreter's race report and the kernel's own print go to
    stderr; stdout holds the verdict alone."""
    r = peat("check", "cli_kernels:racy_matmul", "--shapes", "8x16,16x8", "--json")
    assert r.returncode == 1, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["model"] == "data_race" and not d["passed"]
    assert "RACE DETECTED" in r.stderr and "racy_matmul: tracing" in r.stderr


@pytest.mark.slow
def test_check_holds_the_kernel_to_the_reference_precision():
    r = peat("check", "cli_kernels:tf32_matmul", "--shapes", "16x64,64x8", "--json")
    assert r.returncode == 1, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["model"] == "reduced_precision" and d["evidence"]["reference_precision"] == "highest"
    assert "inputs rounded to tf32" in d["summary"]
    ok = peat("check", "cli_kernels:correct_matmul", "--shapes", "16x8,8x4", "--json",
              "--reference-precision", "default")
    assert ok.returncode == 0 and json.loads(ok.stdout)["evidence"]["reference_precision"] == \
        "default"


@pytest.mark.slow
def test_check_runs_a_bundled_region_kernel_against_its_reference():
    r = peat("check", "pallas_softmax", "--shapes", "19x24", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["passed"] and d["model"] in ("exact", "numerical_noise")
    outputs = {(variant, output) for variant, output, _ in d["evidence"]["checks"]}
    assert {("example", "forward"), ("example", "grad[0]"), ("outliers", "grad[0]")} <= outputs


def test_a_command_runs_with_the_heap_it_found_frozen_and_leaves_it_as_it_was(monkeypatch):
    """A full garbage collection during a command scans only what the command made (the CLI
    freezes jax's objects for it); afterwards the heap is as before, a caller's freeze kept."""
    from peat_jax._src import cli
    from peat_jax._src.cli import parser
    if gc.get_freeze_count() > cli.FROZEN_AT_IMPORT:
        pytest.skip("something in this process froze objects already")
    seen = []
    monkeypatch.setattr(parser, "cmd_check", lambda args: seen.append(gc.get_freeze_count()) or 0)
    assert cli.main(["check", "pallas_matmul"]) == 0
    assert seen[0] > 10_000 and gc.get_freeze_count() <= cli.FROZEN_AT_IMPORT
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert cli.main(["check", "pallas_matmul"]) == 0
        assert seen[1] == frozen and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("args,needle", [
    (["bogus"], "invalid choice"),
    (["check", "pallas_layer_norm", "--shapes", "8x4"], "takes 3 operand(s)"),
    (["demo", "--steps", "0"], "positive integer"),
    (["sites", "no_such_workload"], "neither a bundled name nor one of module.path:NAME"),
    (["check", "no_such_kernel"], "unknown kernel 'no_such_kernel'"),
    (["playback", "/nonexistent/run", "--fault", "wrong_scale(2.0)"], "does not exist"),
    (["runtime", "/nonexistent/run", "--fault", "nope(1)", "--every", "5"], "unknown fault 'nope'"),
    (["runtime", "/nonexistent/run", "--fault", "wrong_scale(2.0)"], "give exactly one schedule"),
    (["check", "cli_kernels:nothing_here"], "has no attribute 'nothing_here'"),
    (["check", "pallas_matmul", "--reference-precision", "tf32"], "invalid choice: 'tf32'"),
    (["check", "pallas_matmul", "--shapes", "0x3,3x4"], "every dimension >= 1"),
    (["check", "pallas_matmul", "--shapes", "4x3"], "takes two shapes like 67x45,45x33"),
    (["profile", "vision", "--out", "/tmp/x", "--precision", "fp32"], "invalid choice: 'fp32'"),
])
def test_bad_arguments_give_one_line_error_and_no_traceback(args, needle, capsys):
    # the entry point itself in a process of its own once; the others through `cli.main` in
    # this one (the same code behind `python -m peat_jax`; ~2 s of jax's import saved a case)
    if args == ["bogus"]:
        r = peat(*args, timeout=120)
        code, err = r.returncode, r.stderr
    else:
        from peat_jax._src import cli
        try:
            code = cli.main(args)
        except SystemExit as e:   # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
    assert code == 2
    assert needle in err and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if ln.startswith("peat")]) >= 1


@pytest.mark.slow
def test_sites_json_lists_the_default_workload_sites():
    r = peat("sites", "vision", "--json", "--primitive", "dot_general")
    assert r.returncode == 0, r.stderr
    sites = json.loads(r.stdout)
    assert [s["phase"] for s in sites] == ["fwd", "fwd", "bwd", "bwd", "bwd", "bwd"]


def test_help_reads_well():
    r = peat("--help")
    assert r.returncode == 0
    for cmd in ("demo", "sites", "profile", "playback", "runtime", "check", "report"):
        assert cmd in r.stdout
