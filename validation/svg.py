"""Small server-side SVG charts for the HTML report: plain markup, no script, no external assets, so a report
opens offline and renders the same in every browser (and in a CI artifact viewer)."""

from __future__ import annotations

import math
from html import escape
from typing import Callable

from kiln import units

WIDTH = 640
FONT = 'font-family="system-ui, sans-serif" font-size="12"'
COLORS = {"engine": "#2b6cb0", "reference": "#718096", "previous": "#b7791f", "fail": "#c53030", "pass": "#2f855a"}


def _num(v: float | None) -> str:
    return units.number(v)


def _svg(chart_id: str, title: str, height: int, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" id="{escape(chart_id)}" role="img" width="{WIDTH}" '
            f'height="{height}" viewBox="0 0 {WIDTH} {height}" {FONT}><title>{escape(title)}</title>'
            f'<text x="8" y="16" font-weight="bold">{escape(title)}</text>' + "".join(body) + "</svg>")


def vbar_chart(chart_id: str, title: str, labels: list[str], values: list[float], *, unit: str = "",
               x_label: str = "", color: str = COLORS["engine"]) -> str:
    """Vertical bars, one per label, value printed above each bar."""
    height, top, bottom, left = 240, 36, 44, 56
    plot_h, plot_w = height - top - bottom, WIDTH - left - 16
    finite = [v for v in values if v is not None and math.isfinite(v)]
    vmax = max(finite, default=1.0) or 1.0
    n = max(1, len(values))
    slot = plot_w / n
    bw = min(64.0, slot * 0.6)
    body = [f'<line x1="{left}" y1="{top + plot_h}" x2="{WIDTH - 16}" y2="{top + plot_h}" stroke="#a0aec0"/>',
            f'<text x="{left - 6}" y="{top + 4}" text-anchor="end">{escape(_num(vmax))}</text>',
            f'<text x="{left - 6}" y="{top + plot_h}" text-anchor="end">0</text>',
            f'<text x="12" y="{top + plot_h / 2}" transform="rotate(-90 12 {top + plot_h / 2})" '
            f'text-anchor="middle">{escape(unit)}</text>']
    for i, (label, v) in enumerate(zip(labels, values)):
        x = left + slot * i + (slot - bw) / 2
        h = plot_h * (min(v, vmax) / vmax) if v is not None and math.isfinite(v) and v > 0 else 0.0
        y = top + plot_h - h
        body.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{h:.1f}" fill="{color}">'
                    f'<title>{escape(label)}: {escape(_num(v))} {escape(unit)}</title></rect>')
        body.append(f'<text x="{x + bw / 2:.1f}" y="{y - 4:.1f}" text-anchor="middle">{escape(_num(v))}</text>')
        body.append(f'<text x="{x + bw / 2:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{escape(label)}</text>')
    body.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle">{escape(x_label)}</text>')
    return _svg(chart_id, title, height, body)


def hbar_chart(chart_id: str, title: str, rows: list[tuple[str, float | None, str]], *, unit: str = "",
               note: str = "", fmt: Callable[[float | None], str] | None = None) -> str:
    """Horizontal bars: rows of (label, value, color name or #hex); each value shown by ``fmt`` (a kiln.units
    formatter) or as a plain number followed by ``unit``. A value of None (not measured) has no bar."""
    top, row_h, left = 30, 28, 190
    height = top + row_h * max(1, len(rows)) + (28 if note else 12)
    plot_w = WIDTH - left - 90
    finite = [v for _, v, _ in rows if v is not None and math.isfinite(v)]
    vmax = max(finite, default=1.0) or 1.0
    body = []
    for i, (label, v, color) in enumerate(rows):
        y = top + row_h * i
        w = plot_w * (min(v, vmax) / vmax) if v is not None and math.isfinite(v) and v > 0 else 0.0
        if v == math.inf:
            w = plot_w
        fill = COLORS.get(color, color)
        shown = fmt(v) if fmt else f"{_num(v)} {unit}".rstrip()
        body.append(f'<text x="{left - 8}" y="{y + 17}" text-anchor="end">{escape(label)}</text>')
        body.append(f'<rect x="{left}" y="{y + 4}" width="{w:.1f}" height="{row_h - 10}" fill="{fill}">'
                    f'<title>{escape(label)}: {escape(shown)}</title></rect>')
        body.append(f'<text x="{left + w + 6:.1f}" y="{y + 17}">{escape(shown)}</text>')
    if note:
        body.append(f'<text x="8" y="{height - 8}" fill="#4a5568">{escape(note)}</text>')
    return _svg(chart_id, title, height, body)


def timeline(chart_id: str, title: str, stages: list[tuple[str, float, str]]) -> str:
    """Stages one after another: rows of (name, seconds, status); each bar starts where the previous ended."""
    top, row_h, left = 30, 24, 90
    total = sum(max(0.0, s) for _, s, _ in stages) or 1.0
    height = top + row_h * max(1, len(stages)) + 24
    plot_w = WIDTH - left - 110
    body, start = [], 0.0
    for i, (name, seconds, status) in enumerate(stages):
        y = top + row_h * i
        x = left + plot_w * start / total
        w = max(1.0, plot_w * max(0.0, seconds) / total)
        fill = "#a0aec0" if status == "cached" else COLORS["engine"]
        body.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end">{escape(name)}</text>')
        body.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 8}" fill="{fill}">'
                    f'<title>{escape(name)} {escape(status)}: {escape(units.duration(seconds))}</title></rect>')
        body.append(f'<text x="{x + w + 6:.1f}" y="{y + 15}">{escape(units.duration(seconds))} {escape(status)}</text>')
        start += max(0.0, seconds)
    body.append(f'<text x="{left}" y="{height - 6}" fill="#4a5568">total {escape(units.duration(total))} (publish not included: the '
                f'report is written during it)</text>')
    return _svg(chart_id, title, height, body)
