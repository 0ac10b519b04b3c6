"""Playback campaigns in worker processes that a supervisor restarts.

A campaign with a time limit per cell (`playback(..., cell_timeout=S)`) stops at a cell past the
limit, since a computation that hangs cannot be stopped from Python, and a kernel can kill its
process outright. `supervise` runs the campaign in a worker process and starts a new one
whenever it stops that way; each new worker resumes the campaign:
  * a worker that stopped at a timed-out cell (which it recorded) exits with `EXIT_RESTART`
    (`exit_for_restart`);
  * a worker that died inside cells left their running marker: their records are written as
    "crashed";
  * a worker too wedged to time itself out (a hang that holds the GIL) is killed once a running
    marker is older than `hard_limit(S)`, and its cells are recorded as "timeout".
The supervisor holds the campaign's lock (`peat_jax._src.profiler.lock`) from start to end; its
workers inherit it.
Messages go to stderr, one line each, prefixed "peat: ".
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import NoReturn, Sequence

from peat_jax._src.profiler.campaign import Campaign
from peat_jax._src.profiler.lock import campaign_writer


# Exit status of a worker that stopped at a timed-out cell (recorded): restart it.
EXIT_RESTART = 75
MAX_RESTARTS = 1000
POLL_SECONDS = 0.5


def hard_limit(cell_timeout: float) -> float:
    """Seconds after which a cell's worker is taken to be wedged and is killed: twice the
    cell's time limit plus 10 s (the worker times its cells itself; this is the backstop)."""
    return 2 * cell_timeout + 10


def supervise(argv: Sequence[str], campaign: Campaign, cell_timeout: float) -> int:
    """Run the worker command `argv` (the campaign `campaign`, `cell_timeout` seconds per cell)
    until it finishes, restarting it as the module says.

    Returns:
      The last worker's exit status (0, 1 or 2), or 2 when a worker died outside any cell or
      kept stopping (more than `MAX_RESTARTS` restarts).
    """
    restarts = 0
    # the campaign's lock, held here for the workers (they inherit it) and between them
    with campaign_writer(campaign.path.parent.parent, campaign.name,
                         host=(campaign.host, campaign.hosts)) as lock:
        env = lock.inherit_env()
        while True:
            for stale in _markers(campaign):  # left by an interrupted run
                stale.discard()
            rc, wedged = _watch(subprocess.Popen(list(argv), env=env), campaign,
                                hard_limit(cell_timeout))
            if rc in (0, 1, 2) and not wedged:
                return rc
            if (rc != EXIT_RESTART or wedged) and not _record_stopped(campaign, rc, wedged,
                                                                      cell_timeout):
                return 2
            restarts += 1
            if restarts > MAX_RESTARTS:
                _say("error: the playback worker kept stopping; giving up")
                return 2


def _markers(campaign: Campaign) -> list:
    """The running markers this supervisor answers for: its share's (the whole campaign's:
    every marker in the directory)."""
    if campaign.hosts == 1:
        return campaign.markers()
    return [m for m in campaign.markers() if m.path == campaign.running.path]


def exit_for_restart(message: str) -> NoReturn:
    """End a worker that stopped at a timed-out cell: `message` to stderr, then exit status
    `EXIT_RESTART` at once (a hung computation may block a normal exit)."""
    _say(message)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_RESTART)


def _watch(proc: subprocess.Popen, campaign: Campaign, limit: float) -> tuple[int, bool]:
    """Wait for the worker: its exit status, and whether it was killed for holding a running
    marker longer than `limit` seconds."""
    wedged = False
    while True:
        try:
            return proc.wait(timeout=POLL_SECONDS), wedged
        except subprocess.TimeoutExpired:
            if any(m.age() > limit for m in _markers(campaign)):
                wedged = True
                proc.kill()


def _record_stopped(campaign: Campaign, rc: int, wedged: bool, cell_timeout: float) -> bool:
    """Record the cells of a worker that died (or was killed, `wedged`) from their running
    markers. Returns False when there were none: it stopped outside any cell."""
    markers = _markers(campaign)
    if not markers:
        _say(f"error: the playback worker exited with status {rc} outside any cell; see its "
             "messages above")
        return False
    how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
    for m in markers:
        cells = m.cells()
        if wedged:
            m.settle(f"TimeoutError: the cell ran past the time limit of {cell_timeout:g} s and "
                     f"its worker did not respond; killed after {hard_limit(cell_timeout):g} s",
                     status="timeout")
            _say(f"timed out, worker killed in cells {cells}: recorded as timeout; restarting")
        else:
            m.settle(f"the worker process died ({how}) while running this cell")
            _say(f"the playback worker died ({how}) in cells {cells}: recorded as crashed; "
                 "restarting")
    return True


def _say(message: str) -> None:
    print(f"peat: {message}", file=sys.stderr)
