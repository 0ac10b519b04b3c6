"""Child processes with emulated CPU devices (``--xla_force_host_platform_device_count``): the
device count is fixed when jax starts, and the rest of the suite runs on one device."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional, Sequence

# XLA:CPU's in-process collectives abort the whole process when one emulated device's thread
# reaches a collective 40 s after the others ("Expected 4 threads to join the rendezvous, but
# only 3 of them arrived on time"). On 2 cores shared with the suite's other worker that happened
# once (test_playback, CI emulation of 2026-12-02): a starved thread, not a result, so such a
# child runs once more; any other failure is returned as it is.
_STARVED = "arrived on time"


def run(argv: Sequence[str], devices: int, *, env: Optional[dict] = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """`python argv...` with `devices` emulated CPU devices (on top of `env`'s XLA_FLAGS;
    `env` defaults to this process's environment); its CompletedProcess, text output
    captured."""
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + f" --xla_force_host_platform_device_count={devices}").strip()
    for _ in range(2):
        proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode == 0 or _STARVED not in proc.stderr:
            break
    return proc
