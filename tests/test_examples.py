"""Every example runs as a script, in a small setting, and prints what it promises."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import needs
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(name: str, *args: str, timeout: int = 300) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_sites_and_substitution():
    out = _run("sites_and_substitution.py")
    assert "[LayerNorm] @ MLP/LayerNorm_0" in out and "(1 compile for the sweep)" in out
    assert "Equinox MLP:" in out


@pytest.mark.slow
def test_pallas_in_training(tmp_path):
    out = _run("pallas_in_training.py", "--out", str(tmp_path / "run"), "--steps", "30")
    assert "pallas_matmul(block_m=32, block_n=32, block_k=32): 18/18 cells pass locally" in out
    assert "fails: tile_boundary, errors only in rows 8..11 = last partial block of 8" in out
    assert (tmp_path / "run" / "report.html").exists()


@pytest.mark.slow
def test_ffi_kernel():
    out = _run("ffi_kernel.py", "--quick")
    assert "ffi_matmul vs XLA dot" in out and "passes:" in out.splitlines()[0]
    assert "ffi_matmul_tile_bug: fails: tile_boundary, errors only in rows 64..66" in out


@pytest.mark.slow
@needs.skip_unless("torch")
def test_torch_port():
    out = _run("torch_port.py")
    lines = out.splitlines()
    assert any("gelu(approximate='tanh') vs jax.nn.gelu: passes" in ln for ln in lines)
    assert any("gelu(approximate='none') vs jax.nn.gelu: fails" in ln for ln in lines)
    assert "20 training steps with the torch ops" in out


@pytest.mark.slow
def test_kernels_in_training():
    out = _run("kernels_in_training.py", "--steps", "5")
    assert "pallas_matmul" in out and "ffi_matmul" in out and "data race" in out
