"""What the commands print: rich tables and progress on a terminal, one JSON object under
--json."""
from __future__ import annotations

import json
import sys
from typing import Any, Callable

import peat_jax as peat


def rich_console():
    from rich.console import Console
    c = Console(stderr=False, highlight=False)
    if not c.is_terminal:  # piped or captured: wide enough for the tables, no wrapping
        c = Console(stderr=False, highlight=False, width=140)
    return c


class ProgressBar:
    """A rich progress bar (to stderr) that callbacks `(done, total)` can drive."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self._p = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
            self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._p.__enter__()
        return self

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)

    def task(self, description: str) -> Callable[[int, int], None]:
        if self._p is None:
            return lambda done, total: None
        tid = self._p.add_task(description, total=None)
        return lambda done, total: self._p.update(tid, completed=done, total=total)


def say(args, msg: str) -> None:
    if not args.json:
        rich_console().print(msg)


def esc(text: Any) -> str:
    """`text` as a str that rich prints as written (a summary's "[forward, large inputs]" is
    not a style tag)."""
    from rich.markup import escape
    return escape(str(text))


def print_json(args, obj, **dumps_kw) -> None:
    """`obj` as one JSON line on the command's standard output (`main` sends everything else
    printed under ``--json``, a kernel's or jax's own prints included, to stderr)."""
    print(json.dumps(obj, **dumps_kw), file=args.stdout, flush=True)


def diag_json(d) -> dict:
    return {"model": d.model, "passed": d.passed, "confidence": d.confidence,
            "evidence": d.evidence, "summary": d.summary}


def cells_table(title: str, records: list[dict]):
    from rich.table import Table
    t = Table(title=title)
    for col in ("step", "site", "phase", "primitive", "path", "local", "effect on step"):
        t.add_column(col)
    for r in records:
        loc = r.get("local") or {}
        eff = None if r.get("effect") is None else peat.Effect.from_dict(r["effect"])
        passed = loc.get("passed", eff is not None and eff.passed)
        style = "green" if passed else "red"
        effect = ("-" if eff is None else
                  f"[{'green' if eff.passed else 'red'}]{esc(eff.short())}[/]")
        t.add_row(str(r["checkpoint"]), str(r["site"]), r.get("phase", ""), r.get("primitive", ""),
                  esc(r.get("path", "")),
                  f"[{style}]{esc(loc.get('model', r.get('status', '-')))}[/]", effect)
    return t


def say_nan_origin(args, r) -> None:
    if r.nan_origin is not None:
        say(args, f"[red]NaN born at {esc(r.nan_origin)}[/]")
