"""The HTML report of a run directory: one self-contained file, readable without a server.

Sections: the run manifest; the golden loss curve; for each playback campaign a site x checkpoint
grid coloured by the local diagnosis, and for its failing cells the ULP-distance histogram, the
differing-bit histogram, the error-mask image and the evidence; for each runtime campaign the loss
curves golden vs injected with the fired steps marked; for each comparison saved by `peat compare`
(`comparisons/<run>.json`) the environments side by side and a site x step heat map of how far
the other run's site outputs are from this run's. Every user-provided string is escaped.
"""
from __future__ import annotations

import dataclasses
import html
import json
import pathlib
from typing import Any, Optional

from peat_jax._src import taxonomy
from peat_jax._src.errors import PeatError
from peat_jax._src.profiler.compare import PROPAGATED_RTOL, read_comparisons
from peat_jax._src.profiler.effect import Effect
from peat_jax._src.profiler.nan_origin import NanOrigin
from peat_jax._src.profiler.campaign import merged_records
from peat_jax._src.profiler.rundir import PathLike, RunDir
from peat_jax._src.report.plots import bar_chart, line_chart, mask_image


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#222;
max-width:1200px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}h3{font-size:15px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 6px}
th{background:#f5f5f5;text-align:left}
.grid td{text-align:center;min-width:70px;color:#fff;font-size:11px}
.grid td.none{background:#bbb}.heat td{min-width:10px;height:12px;padding:0}
.pass{color:#2e7d32;font-weight:600}.fail{color:#c62828;font-weight:600}
.plot{margin:6px 12px 6px 0;border:1px solid #eee;background:#fff}
.plots{display:flex;flex-wrap:wrap;align-items:flex-start;margin-top:6px}
.cell{margin:16px 0;padding:8px;border-left:4px solid #c62828;background:#fafafa}
code{font-size:12px}.muted{color:#777}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _colour(diag: Optional[dict]) -> str:
    """The cell colour of a diagnosis (the taxonomy's colour of its verdict; grey for none)."""
    if not diag:
        return "#bbb"
    return taxonomy.colour(diag.get("model", ""), diag.get("passed", False))


def _table(rows: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return "<table>" + body + "</table>"


def _manifest_section(m: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items() if v)
    rows = [("workload", m.get("workload")),
            ("config", json.dumps(m.get("config"), sort_keys=True)),
            ("seed", m.get("seed")), ("steps", m.get("steps")),
            ("checkpoint every", m.get("checkpoint_every")), ("backend", m.get("backend")),
            ("device kind", m.get("device_kind")), ("versions", versions),
            ("created", m.get("created"))]
    return "<h2>Run</h2>" + _table(rows + _environment_rows(m.get("environment")))


def _environment_rows(env) -> list[tuple[str, Any]]:
    """The manifest's numerical environment as table rows (none for a run written before the
    manifest had one): the matmul precision ("unset" = XLA's default: TF32 for float32 dots on
    recent NVIDIA GPUs), XLA_FLAGS, x64, and the CUDA / cuDNN versions on a GPU."""
    if not isinstance(env, dict):
        return []
    rows = [("matmul precision", env.get("jax_default_matmul_precision") or "unset (XLA default)"),
            ("XLA_FLAGS", env.get("xla_flags") or "(none)"), ("x64", env.get("x64"))]
    rows += [(label, env[k]) for k, label in (("cuda_version", "CUDA"), ("cudnn_version", "cuDNN"),
                                              ("compute_capability", "compute capability"))
             if k in env]
    return rows


def _playback_section(name: str, records: list[dict]) -> str:
    if not records:
        return ""
    ckpts = sorted({r["checkpoint"] for r in records})
    sites = sorted({r["site"] for r in records})
    info = {r["site"]: r for r in records}
    by = {(r["checkpoint"], r["site"]): r for r in records}
    head = "".join(f"<th>step {c}</th>" for c in ckpts)
    rows = []
    for s in sites:
        r0 = info[s]
        cells = []
        for c in ckpts:
            r = by.get((c, s))
            if r is None:
                cells.append('<td class="none">-</td>')
                continue
            local, effect = r.get("local"), _effect(r)
            label = (local or {}).get("model", r.get("status", "?"))
            tip = "; ".join(x for x in ((local or {}).get("summary", ""), r.get("error", ""),
                                        effect.summary if effect else "") if x)
            broken = r.get("status") in ("crashed", "timeout")
            colour = ("#6a1b9a;color:#fff" if broken else _colour(local) if local else
                      taxonomy.effect_colour(effect.model) if effect else _colour(None))
            text = _e(r["status"]) if broken else "<br>".join(
                _e(x) for x in (local and label, effect and f"step: {effect.model}") if x)
            cells.append(f'<td style="background:{colour}" title="{_e(tip)}">{text}</td>')
        rows.append(f"<tr><th>#{_e(s)} {_e(r0.get('phase', ''))} {_e(r0.get('primitive', ''))}"
                    f" <span class='muted'>{_e(r0.get('path', ''))}</span></th>"
                    f"{''.join(cells)}</tr>")
    out = [f'<h2 id="campaign-{_e(name)}">Playback campaign: {_e(name)}</h2>',
           f"<p>Candidate: <code>{_e(records[0].get('candidate', '?'))}</code>. Each cell "
           "replays the checkpointed step with the candidate at one site; colour = local diagnosis "
           "at the site (green passes, amber numeric, red fault or bug, purple: the candidate "
           "crashed or timed out); below it, the effect on the step (masked: within the golden's "
           "own noise).</p>",
           f'<table class="grid verdicts"><tr><th>site</th>{head}</tr>{"".join(rows)}</table>']
    failing = [r for r in records if r.get("local") and not r["local"].get("passed", True)]
    crashed = [r for r in records if r.get("status") in ("crashed", "timeout")]
    if crashed:
        out.append("<h3>Crashed or timed-out cells</h3>" + _table(
            [(f"step {r['checkpoint']} site #{r['site']}", f"{r['status']}: {r.get('error', '')}")
             for r in crashed]))
    if failing:
        out.append(f"<h3>Failing cells ({len(failing)})</h3>")
    for r in failing[:12]:
        out.append(_failing_cell(r))
    if len(failing) > 12:
        out.append(f"<p class='muted'>{len(failing) - 12} more failing cells in results.jsonl</p>")
    return "".join(out)


def _failing_cell(r: dict) -> str:
    local = r["local"]
    parts = [f'<div class="cell"><b>step {_e(r["checkpoint"])}, site #{_e(r["site"])} '
             f'{_e(r.get("phase", ""))} {_e(r.get("primitive", ""))} '
             f'@ {_e(r.get("path", ""))}</b>: '
             f'<span class="fail">{_e(local.get("summary", local.get("model")))}</span>'
             '<div class="plots">']
    sig = r.get("local_signature") or {}
    if sig.get("ulp_histogram"):
        h = sig["ulp_histogram"]
        parts.append(bar_chart(h, title="ULP distance (log2 buckets)",
                               labels=["0"] + [f"2^{i}" for i in range(len(h) - 1)], log=True))
    if sig.get("bit_histogram"):
        b = sig["bit_histogram"]
        cls = sig.get("bit_classes") or []
        palette = {"sign": "#d62728", "exponent": "#ff7f0e"}
        colours = [palette.get(c, "#1f77b4") for c in cls] or None
        parts.append(bar_chart(b, title="differing bit positions (red sign, orange exponent)",
                               labels=[str(i) for i in range(len(b))], colors=colours))
    if sig.get("mask"):
        parts.append(mask_image(sig["mask"], title=f"error mask ({_e(sig.get('mask_note', ''))})"))
    parts.append("</div>")
    ev = local.get("evidence") or {}
    if ev:
        parts.append(_table([(k, json.dumps(v) if not isinstance(v, str) else v)
                             for k, v in list(ev.items())[:20]]))
    parts.append(_effect_part(_effect(r)))
    return "".join(parts) + "</div>"


def _effect(r: dict) -> Optional[Effect]:
    """The cell's effect, read back as an `Effect` (None where none was recorded)."""
    return None if r.get("effect") is None else Effect.from_dict(r["effect"])


def _effect_part(eff: Optional[Effect]) -> str:
    """The effect on the step: its name and summary, and where something moved, the leaves and
    the step's outputs golden vs with the candidate."""
    if eff is None:
        return "<p>Effect on the step: none recorded.</p>"
    head, _, rest = eff.summary.partition(": ")  # the summary opens with the name
    out = (f"<p>Effect on the step: <b class='{'pass' if eff.passed else 'fail'}'>"
           f"{_e(eff.model)}</b> &mdash; {_e(rest if head == eff.model else eff.summary)}</p>")
    if eff.passed or not eff.leaf:
        return out
    rows = [("moved (most first)",
             ", ".join(eff.moved[:8]) + (" ..." if len(eff.moved) > 8 else "")),
            (f"{eff.leaf}: change / the golden's noise", f"{eff.noise_ratio:.3g}x "
             f"({eff.change:.3g} vs {eff.noise:.3g} relative)")]
    if eff.update_change is not None:
        rows.append((f"{eff.leaf}: change / the golden's update", f"{eff.update_change:.3g}"))
    rows += [(name, f"{g:.6g} -> {c:.6g}") for name, (g, c) in
             [("loss", eff.loss), *eff.metrics.items()]]
    return out + _table(rows)


def _runtime_section(name: str, res: dict) -> str:
    chart = line_chart({"golden": res.get("golden_losses", []), "injected": res.get("losses", [])},
                       title=f"loss, {res.get('schedule', '')}", markers=res.get("fired_steps", []),
                       ylabel="loss")
    ok = res.get("outcome") == "masked"
    origin = NanOrigin.from_dict(res.get("nan_origin"))
    born = (f"<p class='fail'>NaN born at {_e(dataclasses.replace(origin, blew_up=None))}: the "
            "first site whose output was non-finite at the first step whose loss or new state "
            "was.</p>" if origin else "")
    if origin and origin.blew_up:
        born += (f"<p class='fail'>Values blew up at {_e(origin.blew_up)}: the first site before "
                 "it whose output, still finite, left its range (abs-max above "
                 f"{_e(f'{origin.blew_up.limit:.3g}')}).</p>")
    return (f'<h2 id="runtime-{_e(name)}">Runtime injection: {_e(name)}</h2><p>Outcome: '
            f"<span class='{'pass' if ok else 'fail'}'>{_e(res.get('outcome'))}</span>; schedule "
            f"<code>{_e(res.get('schedule'))}</code>, "
            f"fired at {len(res.get('fired_steps', []))} steps "
            f"(dashed lines); noise band {_e(round(res.get('band', 0), 6))}.</p>{born}{chart}"
            + _table([(k, v) for k, v in (res.get("evidence") or {}).items()]))


def _difference_colour(rel: Optional[float]) -> str:
    """Heat-map colour of a relative difference: the taxonomy's `exact` green for 0, its
    `numerical_noise` green up to `PROPAGATED_RTOL`, amber beyond, red when non-finite (None)."""
    if rel is None:
        return taxonomy.colour("nan_inf", False)
    if rel == 0:
        return taxonomy.colour("exact", True)
    if rel <= PROPAGATED_RTOL:
        return taxonomy.colour("numerical_noise", True)
    return taxonomy.colour("reduced_precision", False)


def _comparison_section(name: str, c: dict) -> str:
    def env_row(r: dict) -> str:
        cls = " class='fail'" if r.get("differs") else ""
        return (f"<tr><th>{_e(r['key'])}</th><td{cls}>{_e(r.get('a'))}</td>"
                f"<td{cls}>{_e(r.get('b'))}</td></tr>")

    env_rows = "".join(env_row(r) for r in c.get("environments", []))
    steps, sites, grid = c.get("steps", []), c.get("sites", []), c.get("grid", [])
    marks = {}
    for key, label in (("first_difference", "first difference"), ("divergence", "divergence")):
        f = c.get(key)
        if f:
            marks[(f["step"], f["site"]["index"])] = label
    head = "".join(f"<th>{_e(s)}</th>" for s in steps)
    rows = []
    for site, values in zip(sites, grid):
        cells = []
        for step, rel in zip(steps, values):
            mark = marks.get((step, site["index"]))
            tip = f"step {step}: " + ("non-finite" if rel is None else f"{rel:.3g} relative")
            tip += f" ({mark})" if mark else ""
            cells.append(f'<td style="background:{_difference_colour(rel)}" title="{_e(tip)}">'
                         f"{'&#9679;' if mark else ''}</td>")
        rows.append(f"<tr><th>#{_e(site['index'])} {_e(site['phase'])} {_e(site['primitive'])} "
                    f"<span class='muted'>{_e(site['path'])}</span></th>{''.join(cells)}</tr>")
    return (f'<h2 id="compare-{_e(name)}">Comparison with {_e(c.get("run_b"))}</h2>'
            f"<p>{_e(c.get('summary', ''))}</p>"
            f"<table><tr><th></th><th>this run</th><th>{_e(name)}</th></tr>{env_rows}</table>"
            "<p>Per site (rows, program order) and recorded step (columns): the relative "
            "difference of the other run's site output from this run's (dark green: bitwise "
            f"equal; light green: up to {PROPAGATED_RTOL:g}; amber: beyond; red: non-finite "
            "counts differ; &#9679;: the first difference and the divergence).</p>"
            f'<table class="grid heat"><tr><th>site \\ step</th>{head}</tr>{"".join(rows)}</table>')


def render_report(run_dir: PathLike) -> str:
    """The report of `run_dir` as an HTML string."""
    rd = RunDir(run_dir)
    m = rd.manifest()
    golden = rd.golden_losses()
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>peat_jax report: "
             f"{_e(m.get('workload'))}</title><style>{_CSS}</style></head><body>",
             f"<h1>peat_jax report: {_e(m.get('workload'))}</h1>", _manifest_section(m)]
    if golden:
        parts.append("<h2>Golden run</h2>" + line_chart({"golden loss": golden},
                                                         title="golden training loss",
                                                         ylabel="loss"))
    if rd.eval_path.exists():
        try:
            ev = json.loads(rd.eval_path.read_text())
            parts.append(_table([(f"held-out {k}", v) for k, v in ev.items()]))
        except ValueError:
            parts.append("<p class='fail'>golden/eval.json is damaged</p>")
    camp_root = rd.path / "campaigns"
    for camp in sorted(camp_root.iterdir()) if camp_root.exists() else []:
        records = merged_records(camp)
        if records:
            parts.append(_playback_section(camp.name, records))
        rt = camp / "runtime.json"
        if rt.exists():
            try:
                parts.append(_runtime_section(camp.name, json.loads(rt.read_text())))
            except ValueError:
                parts.append(f"<p class='fail'>{_e(rt)} is damaged</p>")
    for name, comparison in read_comparisons(rd.path).items():
        parts.append(_comparison_section(name, comparison))
    parts.append("</body></html>")
    return "".join(parts)


def write_report(run_dir: PathLike, path: Optional[PathLike] = None) -> pathlib.Path:
    """Write the report of `run_dir` to `path` (default `run_dir/report.html`); returns the path."""
    out = pathlib.Path(path) if path is not None else pathlib.Path(run_dir) / "report.html"
    text = render_report(run_dir)
    try:
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text)
        tmp.replace(out)
    except OSError as e:
        raise PeatError(f"cannot write the report to {out}: {e.strerror}") from None
    return out
