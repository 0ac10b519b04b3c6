"""A playback campaign on disk: its spec, its results, this host's share, its running markers.

A campaign is the directory `campaigns/<name>/` of a run directory:
  campaign.json                  the spec: candidates, sites, workload and a digest of the
                                 substitution; a rerun with another substitution is refused
  results.jsonl                  one JSON line per finished cell (checkpoint, site, ...),
                                 appended as cells finish, so a rerun resumes
  results.p<i>-of-<n>.jsonl      the same, for process i of n when the grid is split over
                                 processes (hosts); every reader merges all results files
  <results file>.running         while a group of cells runs under a time limit: the records to
                                 write for them if the process dies there (a supervisor writes
                                 them and removes the marker)
This module is the one that reads and writes these files.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
import time
from typing import Any, Iterable, Mapping, Optional, Sequence

import jax

from peat_jax._src.errors import PeatError
from peat_jax._src.profiler.rundir import (PathLike, RunDir, append_jsonl, atomic_write_json,
                                           read_jsonl)
from peat_jax._src.sites import Site
from peat_jax._src.substitute import Candidate, Substitution


SPEC = "campaign.json"
RUNNING = ".running"


def substitution_digest(substitution: Substitution) -> str:
    """Hex SHA-1 of the selectors, candidate names and fault parameters (two faults of one
    kind with other parameters, e.g. wrong_scale(2.0) and wrong_scale(1.0), differ)."""
    return hashlib.sha1(repr(sorted((repr(k), getattr(c, "name", "?"),
                                     repr(getattr(c, "params", "")))
                                    for k, c in substitution.items())).encode()).hexdigest()


def campaign_name(substitution: Substitution) -> str:
    """The default campaign name: the candidates' names (a file-name-safe slug of at most 48
    characters) and 8 hex digits of the substitution's digest."""
    names = "+".join(sorted(getattr(c, "name", "?") for c in substitution.values()))
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", names)[:48].strip("_") or "campaign"
    return f"{slug}-{substitution_digest(substitution)[:8]}"


def campaign_spec(substitution: Substitution, candidates: Iterable[Candidate],
                  sites: Sequence[Site], workload: str) -> dict[str, Any]:
    """The JSON object `campaign.json` holds for a grid of `sites` with `candidates`."""
    return {"candidates": sorted({getattr(c, "name", "?") for c in candidates}),
            "sites": [s.index for s in sites], "workload": workload,
            "substitution": substitution_digest(substitution)}


@dataclasses.dataclass(frozen=True)
class Marker:
    """A `*.running` file: the records of the cells a process was running, each saying what to
    record for it if the process died there."""

    path: pathlib.Path

    @property
    def results_path(self) -> pathlib.Path:
        """The results file the marker's records belong in."""
        return self.path.with_suffix("")

    def records(self) -> list[dict]:
        return json.loads(self.path.read_text()).get("records", [])

    def cells(self) -> list[tuple[int, int]]:
        """(checkpoint, site) of each of the marker's cells."""
        return [(r["checkpoint"], r["site"]) for r in self.records()]

    def age(self) -> float:
        """Seconds since the marker was written (0.0 if it is gone)."""
        try:
            return time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def settle(self, error: str, status: Optional[str] = None) -> None:
        """Record the marker's cells with `error` (and `status`, if given, instead of the one
        the marker holds), then remove the marker."""
        recs = [{**r, "error": error, **({"status": status} if status else {})}
                for r in self.records()]
        append_jsonl(self.results_path, recs)
        self.discard()

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class Campaign:
    """One campaign's directory, seen from host `host` of `hosts`: cell number k of the N cells
    of the grid (checkpoint-major, sites in index order) is this host's when k * `hosts` // N ==
    `host`, a contiguous block, so each host restores and replays the golden step of about
    1 / `hosts` of the checkpoints (cells dealt round-robin made every host restore every
    checkpoint: a checkpoint's fixed cost, 0.16 s on the small vision run against 6 ms a
    cell, was paid once per host)."""

    path: pathlib.Path
    host: int = 0
    hosts: int = 1

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def results_path(self) -> pathlib.Path:
        """This host's results file."""
        name = ("results.jsonl" if self.hosts == 1 else
                f"results.p{self.host}-of-{self.hosts}.jsonl")
        return self.path / name

    @property
    def running(self) -> Marker:
        """This host's running marker."""
        return Marker(self.results_path.with_name(self.results_path.name + RUNNING))

    def done(self) -> dict[tuple[int, int], dict]:
        """The records of the finished cells of every host, by (checkpoint, site)."""
        return _by_cell(self.path)

    def todo(self, grid: Sequence[tuple[int, int]], done: Mapping[tuple[int, int], Any]
             ) -> set[tuple[int, int]]:
        """Of the grid's cells (checkpoint, site), listed checkpoint-major, those this host
        runs that are not in `done`."""
        n = len(grid)
        return {cell for k, cell in enumerate(grid)
                if k * self.hosts // n == self.host and cell not in done}

    def record(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Append finished cells' records to this host's results (each line survives a kill)."""
        append_jsonl(self.results_path, records)

    def mark_running(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Note that the cells of `records` are running; `records` are what a supervisor writes
        for them if this process dies before `clear_running`."""
        atomic_write_json(self.running.path, {"records": list(records)})

    def clear_running(self) -> None:
        self.running.discard()

    def markers(self) -> list[Marker]:
        """The running markers of every host and process in the directory."""
        return [Marker(p) for p in sorted(self.path.glob("*" + RUNNING))]


def merged_records(path: PathLike) -> list[dict]:
    """The campaign at `path` as one list: the records of all its results files (every process
    and host), one per cell (checkpoint, site), in grid order (checkpoint-major, sites in the
    order of `campaign.json`, else by index). Where a cell was recorded twice, the later line
    of its file wins."""
    cells = _by_cell(pathlib.Path(path))
    try:
        spec = _read_spec(pathlib.Path(path) / SPEC) or {}
    except PeatError:  # a damaged spec: the results are still readable, in index order
        spec = {}
    order = {s: k for k, s in enumerate(spec.get("sites", []))}
    return [cells[key] for key in sorted(cells, key=lambda c: (c[0], order.get(c[1], len(order)),
                                                                c[1]))]


def _by_cell(path: pathlib.Path) -> dict[tuple[int, int], dict]:
    out = {}
    for f in sorted(path.glob("results*.jsonl")):
        for r in read_jsonl(f):
            if "checkpoint" in r and "site" in r:
                out[(int(r["checkpoint"]), int(r["site"]))] = r
    return out


def open_campaign(run_dir: RunDir, name: str, spec: Mapping[str, Any],
                  host: Optional[tuple[int, int]] = None) -> Campaign:
    """The campaign `name` of `run_dir` for host `host` = (index, count) (default: this
    process's `jax.process_index()` of `jax.process_count()`), its spec written if it is new.

    Raises:
      PeatError: a bad name or host (nothing written), a damaged `campaign.json`, or one written
        for another substitution or workload.
    """
    index, count = host if host is not None else (jax.process_index(), jax.process_count())
    if not (isinstance(count, int) and count >= 1 and isinstance(index, int)
            and 0 <= index < count):
        raise PeatError(f"host must be (index, count) with 0 <= index < count, got {host!r}")
    camp = Campaign(path=run_dir.campaign(name), host=index, hosts=count)
    old = _read_spec(camp.path / SPEC)
    if old is None:
        atomic_write_json(camp.path / SPEC, dict(spec))
    elif not _same_spec(old, spec):
        raise PeatError(f"campaign {name!r} in {camp.path} was run with another substitution "
                        f"(candidates {old.get('candidates')} on {old.get('workload')!r}); "
                        "choose another name")
    return camp


def _same_spec(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    # a spec written before the digest existed has no "substitution": it is not compared
    return (old.get("candidates") == new["candidates"] and old.get("workload") == new["workload"]
            and old.get("substitution", new["substitution"]) == new["substitution"])


def _read_spec(path: pathlib.Path) -> Optional[dict]:
    """The spec at `path`, or None where there is none yet."""
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise PeatError(f"{path} is damaged ({e}); move the campaign directory away to "
                        "run it afresh, or choose another name") from None
    return old
