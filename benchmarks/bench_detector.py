"""Detector truth on the corpus of real kernels (tests/corpus): every entry through
`peat.check_kernel` as tests/check/test_corpus.py runs it.

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
third_party_*: the third-party corpus (tests/third_party: code nobody here wrote, from public
  packages), every entry over seeds 0..4 through `check_kernel`: third_party_recall, the fraction
  of the buggy (entry, seed) runs that fail; third_party_false_alarms, the correct entries that
  fail on some seed (third_party_false_alarm_runs: the (entry, seed) runs that fail);
  third_party_attribution, the fraction of the buggy runs whose bug the taxonomy names (an
  expected model) named with it; third_party_flagged_correct, third_party_missed,
  third_party_misnamed: the entries behind them; third_party_skipped: entries whose package is
  not installed; third_party_seconds: its share of the wall time.
third_party_bfloat16_*: the correct third-party entries with float32 inputs run again with them
  cast to bfloat16, as a 16-bit training has them (`third_party.in_dtype`: a candidate that
  returns float32 there is cast back, as the model would), seeds 0 and 1: the runs, the runs
  that fail (third_party_bfloat16_false_alarm_runs; third_party_bfloat16_flagged_correct: entry
  -> the failing summaries) and the entries whose check raised (third_party_bfloat16_errors:
  entry -> the one-line error; flash-attention-jax's backward does not run in bfloat16).
seconds: wall time of the whole run; rounding_floor_seconds and rounding_floor_share: the time
  spent computing rounding floors (`judge.rounding`: the Monte Carlo evaluations of the
  reference, compile included) and its share of `seconds`.

Prints one JSON object on one line. The two corpora run side by side, the third-party one in a
second process (2 CPU cores: about 10 minutes);
`--table PATH` also writes the Markdown table of docs/error_models.md ("The corpus");
`--third-party-table PATH` the third-party verdicts (entry, seed, passed, model, summary);
`--third-party-only` runs the third-party corpus alone (`--only NAME ...` some of its entries).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import peat_jax as peat  # noqa: E402
from peat_jax._src.kernels import pallas as pk  # noqa: E402
from corpus import ENTRIES  # noqa: E402
from corpus.step import golden_run, play  # noqa: E402
import needs  # noqa: E402
import third_party  # noqa: E402


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


def run_third_party(names=None, progress=False, table_path=None) -> tuple[list, list]:
    """Every third-party entry (or those in `names`) over `third_party.SEEDS`: rows of (entry,
    seed, Diagnosis, seconds), and the skipped entries with why (`progress`: a line per run on
    stderr; `table_path`: the table rewritten after each entry)."""
    rows, skipped = [], []
    for e in third_party.ENTRIES:
        if names and e.name not in names:
            continue
        why = third_party.missing(e)
        if why:
            skipped.append((e, why))
            continue
        for seed in third_party.SEEDS:
            t = time.perf_counter()
            d = third_party.check(e, seed)
            rows.append((e, seed, d, time.perf_counter() - t))
            if progress:
                print(f"{e.name} seed {seed}: {rows[-1][3]:.1f} s, {d.summary[:160]}",
                      file=sys.stderr, flush=True)
        if table_path:
            pathlib.Path(table_path).write_text(third_party_table(rows, skipped))
    return rows, skipped


BFLOAT16_SEEDS = (0, 1)


def _float32_inputs(e) -> bool:
    leaves = jax.tree.leaves(e.args(third_party.SEEDS[0]))
    floats = [x for x in leaves if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    return bool(floats) and all(jnp.result_type(x) == jnp.float32 for x in floats)


def run_bfloat16(names=None) -> dict:
    """The correct third-party entries with float32 inputs, cast to bfloat16, over
    `BFLOAT16_SEEDS`: the third_party_bfloat16_* figures."""
    runs, flagged, errors = 0, {}, {}
    for e in third_party.ENTRIES:
        if e.kind != "correct" or (names and e.name not in names) or third_party.missing(e) \
                or not _float32_inputs(e):
            continue
        try:
            e16 = third_party.in_dtype(e, jnp.bfloat16)
            for seed in BFLOAT16_SEEDS:
                d = third_party.check(e16, seed)
                runs += 1
                if not d.passed:
                    flagged.setdefault(e.name, []).append(f"seed {seed}: {d.summary[:240]}")
        except peat.PeatError as err:
            errors[e.name] = str(err)[:240]
    return {"third_party_bfloat16_runs": runs,
            "third_party_bfloat16_false_alarm_runs": sum(len(v) for v in flagged.values()),
            "third_party_bfloat16_flagged_correct": flagged,
            "third_party_bfloat16_errors": errors}


def third_party_figures(rows, skipped) -> dict:
    bugs = [(e, d) for e, _, d, _ in rows if e.kind == "bug"]
    correct = [(e, d) for e, _, d, _ in rows if e.kind == "correct"]
    named = [(e, d) for e, d in bugs if e.models]
    return {
        "third_party_bugs": len({e.name for e, _ in bugs}),
        "third_party_correct": len({e.name for e, _ in correct}),
        "third_party_seeds": len(third_party.SEEDS),
        "third_party_recall": round(sum(not d.passed for _, d in bugs) / max(len(bugs), 1), 3),
        "third_party_false_alarms": len({e.name for e, d in correct if not d.passed}),
        "third_party_false_alarm_runs": sum(not d.passed for _, d in correct),
        "third_party_attribution": round(sum(not d.passed and d.model in e.models
                                             for e, d in named) / max(len(named), 1), 3),
        "third_party_flagged_correct": sorted({e.name for e, d in correct if not d.passed}),
        "third_party_missed": sorted({e.name for e, d in bugs if d.passed}),
        "third_party_misnamed": sorted({e.name for e, d in named
                                        if not d.passed and d.model not in e.models}),
        "third_party_skipped": sorted(e.name for e, _ in skipped),
        "third_party_seconds": round(sum(s for *_, s in rows), 1),
    }


def third_party_table(rows, skipped) -> str:
    """The verdict of every (entry, seed) run, as Markdown."""
    lines = ["| entry | package | kind | expected | seed | passed | model | ok | s | summary |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e, seed, d, secs in rows:
        expected = e.expected if isinstance(e.expected, str) else " or ".join(e.expected)
        ok = "yes" if third_party.expectation_met(e, d) else "**NO**"
        summary = d.summary.replace("|", "/")
        lines.append(f"| `{e.name}` | {e.package} | {e.kind} | {expected} | {seed} | "
                     f"{d.passed} | {d.model} | {ok} | {secs:.1f} | {summary} |")
    for e, why in skipped:
        lines.append(f"| `{e.name}` | {e.package} | {e.kind} | | | | skipped | | | {why} |")
    return "\n".join(lines) + "\n"


class _Timed:
    """Wraps `check.judging.rounding_samples` (what `check_kernel` calls for the rounding
    floor) and adds up the seconds spent in it."""

    def __init__(self):
        from peat_jax._src.check import judging
        self.check, self.inner, self.seconds = judging, judging.rounding_samples, 0.0

    def __enter__(self):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        self.check.rounding_samples = timed
        return self

    def __exit__(self, *exc):
        self.check.rounding_samples = self.inner


def _rounding_figures(timer: _Timed, seconds: float) -> dict:
    return {"rounding_floor_seconds": round(timer.seconds, 1),
            "rounding_floor_share": round(timer.seconds / seconds, 3) if seconds else 0.0,
            "seconds": round(seconds, 1)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", help="also write the corpus table (Markdown) to this path")
    p.add_argument("--third-party-table", help="also write the third-party verdicts (Markdown)")
    p.add_argument("--third-party-only", action="store_true",
                   help="run the third-party corpus alone")
    p.add_argument("--only", nargs="+", metavar="NAME", help="these third-party entries only")
    p.add_argument("--rows-out", help=argparse.SUPPRESS)   # the third-party process' rows
    p.add_argument("--progress", action="store_true",
                   help="a line per third-party run on stderr")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    with _Timed() as timer:
        out = _run(args, timer)
    if out:   # (the third-party process of a full run writes its rows instead)
        print(json.dumps(out))
    return out


def _run(args, timer: _Timed) -> dict:
    t0 = time.perf_counter()
    if args.third_party_only:
        tp_rows, tp_skipped = run_third_party(args.only, args.progress, args.third_party_table)
        bf16 = run_bfloat16(args.only)
        if args.rows_out:
            _write_rows(args.rows_out, tp_rows, tp_skipped, timer.seconds, bf16)
            return {}
        return {**third_party_figures(tp_rows, tp_skipped), **bf16,
                **_rounding_figures(timer, time.perf_counter() - t0)}
    # the third-party corpus in a second process beside this one's corpus: the two halves are
    # independent, and a process each uses both cores of a small machine (XLA compiles on one)
    with tempfile.TemporaryDirectory(prefix="peat-third-party-") as tmp:
        rows_path = pathlib.Path(tmp) / "rows.json"
        child = subprocess.Popen(
            [sys.executable, __file__, "--third-party-only", "--rows-out", str(rows_path),
             *(["--progress"] if args.progress else []),
             *(["--third-party-table", args.third_party_table]
               if args.third_party_table else [])])
        try:
            own = _own_corpus(args)
        finally:
            rc = child.wait()
        if rc != 0:
            raise SystemExit(f"the third-party corpus' process failed (exit {rc})")
        tp_rows, tp_skipped, child_rounding, bf16 = _read_rows(rows_path)
    timer.seconds += child_rounding
    return {**own["figures"], **third_party_figures(tp_rows, tp_skipped), **bf16,
            **_rounding_figures(timer, time.perf_counter() - t0), "entries": own["entries"]}


def _write_rows(path: str, rows, skipped, rounding_seconds: float, bfloat16: dict) -> None:
    """The third-party runs (and the bfloat16 figures) as JSON, for the parent process
    (`_read_rows`)."""
    pathlib.Path(path).write_text(json.dumps({
        "rows": [{"entry": e.name, "seed": seed, "seconds": secs,
                  "diagnosis": dataclasses.asdict(d)} for e, seed, d, secs in rows],
        "skipped": [[e.name, why] for e, why in skipped],
        "rounding_seconds": rounding_seconds, "bfloat16": bfloat16}, default=repr))


def _read_rows(path: pathlib.Path) -> tuple[list, list, float, dict]:
    """(rows, skipped, rounding seconds) as `run_third_party` returns them, and the bfloat16
    figures, from `_write_rows`."""
    data = json.loads(path.read_text())
    by_name = {e.name: e for e in third_party.ENTRIES}
    rows = [(by_name[r["entry"]], r["seed"], peat.Diagnosis(**r["diagnosis"]), r["seconds"])
            for r in data["rows"]]
    skipped = [(by_name[name], why) for name, why in data["skipped"]]
    return rows, skipped, data["rounding_seconds"], data["bfloat16"]


def _own_corpus(args) -> dict:
    """The project's own corpus through check_kernel and playback: {"figures", "entries"}."""
    rows, entries, played = [], {}, {}
    scratch = tempfile.TemporaryDirectory(prefix="peat-corpus-")
    run_dir = golden_run(pathlib.Path(scratch.name) / "run")
    for e in ENTRIES:
        if needs.missing(e.needs):
            continue
        d, secs = run_entry(e)
        with contextlib.redirect_stdout(io.StringIO()):
            played[e.name] = play(e, run_dir)
        rows.append((e, d))
        entries[e.name] = [e.kind, e.expected, d.model, d.passed, round(secs, 1),
                           sorted(played[e.name].models)]
    bugs = [(e, d) for e, d in rows if e.kind == "bug"]
    correct = [(e, d) for e, d in rows if e.kind == "correct"]
    figures = {
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
    }
    scratch.cleanup()
    if args.table:
        pathlib.Path(args.table).write_text(table(rows, played))
    return {"figures": figures, "entries": entries}


if __name__ == "__main__":
    main()
