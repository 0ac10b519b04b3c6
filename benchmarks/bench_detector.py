"""Detector truth on the corpus of real kernels (tests/corpus): every entry through
`peat.check_kernel` as tests/test_corpus.py runs it.

bugs / correct: entries of each kind run here (torch entries only where torch is installed).
recall: fraction of the buggy kernels that fail. false_alarms: correct kernels that fail.
attribution: fraction of the buggy kernels named with their expected model.
without_float64: entries judged, on some variant, without a float64 reference (the dtype bound
  as the floor; `evidence["no_float64_reference"]`): none expected.
playback_recall, playback_false_alarms, playback_unseen: every entry also replayed by
  `peat.playback` at its reference's sites of a small training step (tests/corpus/step.py,
  checkpoint 10 of 20): the fraction of the buggy kernels failing at some site, the correct
  kernels failing at any, and the buggy kernels that pass everywhere there (their bug needs
  inputs the step does not make).
entries: per entry [kind, expected, diagnosed model, passed, seconds, playback models at the
  failing sites ([] : passes everywhere)].
seconds: wall time of the whole run.

Prints one JSON object on one line. Runs with no arguments in a few minutes on 2 CPU cores;
`--table PATH` also writes the Markdown table of docs/error_models.md ("The corpus").
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import pathlib
import re
import sys
import tempfile
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import peat_jax as peat  # noqa: E402
from peat_jax.kernels import pallas as pk  # noqa: E402
from corpus import ENTRIES  # noqa: E402
from corpus.step import golden_run, play  # noqa: E402


def run_entry(e) -> tuple[peat.Diagnosis, float]:
    pk.reset_interpret_state()
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):   # the race detector prints its report
        d = peat.check_kernel(e.candidate, e.reference, *e.args(), variants=e.variants,
                              backward=e.backward, repeats=1)
    return d, time.perf_counter() - t


def _evidence(d: peat.Diagnosis) -> str:
    """The diagnosis' summary without its verdict, model and check counts, short."""
    text = re.sub(r" \[[^\]]*inputs\].*$", "", d.summary.split(", ", 1)[-1])
    origin = d.evidence.get("origin", {})
    where = f" ({origin.get('output')}, {origin.get('variant')})" if origin else ""
    return (text[:140] + "..." if len(text) > 140 else text) + where


def table(rows, played) -> str:
    lines = ["| entry | kind | what | expected | diagnosis | evidence | in a training step |",
             "|---|---|---|---|---|---|---|"]
    for e, d in rows:
        verdict = f"{d.model} ({'pass' if d.passed else 'fail'})"
        p = played[e.name]
        step = (f"{', '.join(sorted(p.models))} at {p.failing} of {p.cells} sites"
                if p.failing else f"pass ({p.cells} sites)")
        lines.append(f"| `{e.name}` | {e.kind} | {e.what} | {e.expected} | {verdict} | "
                     f"{_evidence(d).replace('|', '/')} | {step} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", help="also write the corpus table (Markdown) to this path")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    rows, entries, played = [], {}, {}
    scratch = tempfile.TemporaryDirectory(prefix="peat-corpus-")
    run_dir = golden_run(pathlib.Path(scratch.name) / "run")
    for e in ENTRIES:
        if e.needs is not None and importlib.util.find_spec(e.needs) is None:
            continue
        d, secs = run_entry(e)
        with contextlib.redirect_stdout(io.StringIO()):
            played[e.name] = play(e, run_dir)
        rows.append((e, d))
        entries[e.name] = [e.kind, e.expected, d.model, d.passed, round(secs, 1),
                           sorted(played[e.name].models)]
    bugs = [(e, d) for e, d in rows if e.kind == "bug"]
    correct = [(e, d) for e, d in rows if e.kind == "correct"]
    out = {
        "bugs": len(bugs), "correct": len(correct),
        "recall": round(sum(not d.passed for _, d in bugs) / max(len(bugs), 1), 3),
        "false_alarms": sum(not d.passed for _, d in correct),
        "attribution": round(sum(d.model == e.expected and not d.passed for e, d in bugs)
                             / max(len(bugs), 1), 3),
        "misnamed": sorted(e.name for e, d in bugs if d.model != e.expected),
        "flagged_correct": sorted(e.name for e, d in correct if not d.passed),
        "without_float64": sorted(e.name for e, d in rows if "no_float64_reference" in d.evidence),
        "playback_recall": round(sum(played[e.name].failing > 0 for e, _ in bugs)
                                 / max(len(bugs), 1), 3),
        "playback_false_alarms": sum(played[e.name].failing > 0 for e, _ in correct),
        "playback_unseen": sorted(e.name for e, _ in bugs if not played[e.name].failing),
        "seconds": round(time.perf_counter() - t0, 1),
        "entries": entries,
    }
    scratch.cleanup()
    if args.table:
        pathlib.Path(args.table).write_text(table(rows, played))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
