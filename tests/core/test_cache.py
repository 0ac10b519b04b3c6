"""peat.enable_compilation_cache: where the persistent cache goes, and when it is left alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, sys, jax, peat_jax as peat
arg = sys.argv[1] if len(sys.argv) > 1 else None
got = peat.enable_compilation_cache(arg)
print(json.dumps({"got": got, "dir": jax.config.jax_compilation_cache_dir}))
"""


def _probe(env_extra, *args, preset=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PEAT_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(env_extra)
    code = _PROBE if preset is None else (
        f"import jax; jax.config.update('jax_compilation_cache_dir', {preset!r})\n" + _PROBE)
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_cache_directory_choice_and_opt_out(tmp_path):
    xdg = tmp_path / "xdg"
    assert _probe({"XDG_CACHE_HOME": str(xdg)}) == {"got": str(xdg / "peat_jax" / "xla"),
                                                     "dir": str(xdg / "peat_jax" / "xla")}
    assert (xdg / "peat_jax" / "xla").is_dir()
    mine = tmp_path / "mine"
    assert _probe({"PEAT_CACHE_DIR": str(mine)})["dir"] == str(mine)
    assert _probe({}, str(tmp_path / "arg"))["dir"] == str(tmp_path / "arg")
    assert _probe({"PEAT_CACHE_DIR": "off"}) == {"got": None, "dir": None}
    # a cache the user configured is kept
    assert _probe({"PEAT_CACHE_DIR": str(mine)}, preset=str(tmp_path / "user")) == {
        "got": None, "dir": str(tmp_path / "user")}
    # not creatable: no cache, no error
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert _probe({"PEAT_CACHE_DIR": str(blocker / "sub")})["got"] is None
