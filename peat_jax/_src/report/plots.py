"""Small self-contained SVG plots for the HTML report (no plotting library, no scripts)."""
from __future__ import annotations

import html
import math
from typing import Mapping, Optional, Sequence


COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
_W, _H, _PAD = 560, 220, 40


def _esc(s) -> str:
    return html.escape(str(s), quote=True)


def _finite(xs) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / n for i in range(n + 1)]


def line_chart(series: Mapping[str, Sequence[float]], *, title: str, markers: Sequence[int] = (),
               xlabel: str = "step", ylabel: str = "", log: bool = False) -> str:
    """An SVG line chart of named series over their index; vertical markers at `markers`
    (e.g. the steps an injection fired); non-finite points are drawn as red crosses at the top."""
    vals = [v for s in series.values() for v in _finite(s) if (v > 0 or not log)]
    n = max((len(s) for s in series.values()), default=1)
    if not vals:
        vals = [0.0, 1.0]
    tf = (lambda v: math.log10(v)) if log else (lambda v: v)
    lo, hi = tf(min(vals)), tf(max(vals))
    if hi - lo < 1e-12:
        lo, hi = lo - 1, hi + 1
    x = lambda i: _PAD + (_W - 2 * _PAD) * (i / max(n - 1, 1))  # noqa: E731
    y = lambda v: _H - _PAD + (-(_H - 2 * _PAD)) * ((tf(v) - lo) / (hi - lo))  # noqa: E731
    out = [f'<svg class="plot" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
           f'aria-label="{_esc(title)}"><title>{_esc(title)}</title>',
           f'<text x="{_W / 2}" y="16" text-anchor="middle" font-size="13">{_esc(title)}</text>',
           f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#999"/>',
           f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_H - _PAD}" stroke="#999"/>']
    for t in _ticks(lo, hi):
        ty = _H - _PAD - (_H - 2 * _PAD) * ((t - lo) / (hi - lo))
        label = f"{10 ** t:.3g}" if log else f"{t:.3g}"
        out.append(f'<text x="{_PAD - 4}" y="{ty + 4:.1f}" text-anchor="end" '
                   f'font-size="10">{label}</text>')
    for t in _ticks(0, n - 1):
        out.append(f'<text x="{x(t):.1f}" y="{_H - _PAD + 14}" text-anchor="middle" '
                   f'font-size="10">{int(round(t))}</text>')
    out.append(f'<text x="{_W / 2}" y="{_H - 6}" text-anchor="middle" '
               f'font-size="11">{_esc(xlabel)}</text>')
    if ylabel:
        out.append(f'<text x="12" y="{_H / 2}" font-size="11" transform="rotate(-90 12 {_H / 2})" '
                   f'text-anchor="middle">{_esc(ylabel)}</text>')
    for m in markers:
        if 0 <= m < n:
            out.append(f'<line class="fired" x1="{x(m):.1f}" y1="{_PAD}" x2="{x(m):.1f}" '
                       f'y2="{_H - _PAD}" stroke="#f5b041" stroke-dasharray="3,3"/>')
    for k, (name, s) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        pts = [f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(s)
               if v is not None and math.isfinite(v) and (v > 0 or not log)]
        if pts:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                       f'points="{" ".join(pts)}"/>')
        for i, v in enumerate(s):
            if v is None or not math.isfinite(v):
                out.append(f'<text x="{x(i):.1f}" y="{_PAD - 2}" fill="#d62728" font-size="10" '
                           'text-anchor="middle">x</text>')
        out.append(f'<text x="{_W - _PAD - 4}" y="{_PAD + 12 + 14 * k}" text-anchor="end" '
                   f'font-size="11" fill="{color}">{_esc(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def bar_chart(values: Sequence[float], *, title: str, labels: Optional[Sequence[str]] = None,
              log: bool = False, colors: Optional[Sequence[str]] = None) -> str:
    """An SVG bar chart (e.g. a ULP-distance or differing-bit histogram)."""
    n = max(len(values), 1)
    tf = (lambda v: math.log10(1 + v)) if log else (lambda v: v)
    top = max([tf(v) for v in values if v is not None and math.isfinite(v)] + [1e-12])
    bw = (_W - 2 * _PAD) / n
    out = [f'<svg class="plot" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
           f'aria-label="{_esc(title)}"><title>{_esc(title)}</title>',
           f'<text x="{_W / 2}" y="16" text-anchor="middle" font-size="13">{_esc(title)}</text>',
           f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#999"/>']
    for i, v in enumerate(values):
        v = v if v is not None and math.isfinite(v) else 0.0
        h = (_H - 2 * _PAD) * tf(v) / top
        color = (colors[i] if colors else COLORS[0])
        out.append(f'<rect x="{_PAD + i * bw + 0.5:.1f}" y="{_H - _PAD - h:.1f}" '
                   f'width="{max(bw - 1, 0.5):.1f}" height="{h:.1f}" fill="{color}">'
                   f'<title>{_esc(labels[i] if labels else i)}: {v:g}</title></rect>')
    step = max(1, n // 12)
    for i in range(0, n, step):
        lab = labels[i] if labels else str(i)
        out.append(f'<text x="{_PAD + (i + 0.5) * bw:.1f}" y="{_H - _PAD + 14}" font-size="9" '
                   f'text-anchor="middle">{_esc(lab)}</text>')
    peak = max([0] + [v for v in values if v is not None and math.isfinite(v)])
    out.append(f'<text x="{_PAD}" y="{_PAD - 6}" font-size="10">max {peak:g}'
               f'{" (log scale)" if log else ""}</text></svg>')
    return "".join(out)


def mask_image(mask: Sequence[Sequence[float]], *, title: str, cell: int = 0) -> str:
    """An SVG image of a 2-D error mask (values in [0, 1]: the fraction of wrong elements in each
    pixel's block), white = all correct, dark red = all wrong."""
    rows = len(mask)
    cols = max((len(r) for r in mask), default=0)
    if rows == 0 or cols == 0:
        return f'<svg class="plot" viewBox="0 0 10 10"><title>{_esc(title)}</title></svg>'
    cell = cell or max(2, min(12, 400 // max(rows, cols)))
    w, h = cols * cell, rows * cell + 20
    out = [f'<svg class="plot mask" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
           f'aria-label="{_esc(title)}"><title>{_esc(title)}</title>',
           f'<text x="0" y="13" font-size="12">{_esc(title)}</text>']
    for i, row in enumerate(mask):
        for j, v in enumerate(row):
            if v and v > 0:
                a = min(1.0, max(0.15, float(v)))
                out.append(f'<rect x="{j * cell}" y="{20 + i * cell}" width="{cell}" '
                           f'height="{cell}" fill="#a50f15" fill-opacity="{a:.2f}"/>')
    out.append(f'<rect x="0" y="20" width="{w}" height="{rows * cell}" fill="none" '
               'stroke="#999"/></svg>')
    return "".join(out)
