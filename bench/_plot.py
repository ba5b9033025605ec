"""Dependency-free SVG bar charts for benchmark and demo results.

matplotlib is not a dependency of the project; a few horizontal bars are all the
results need, and an SVG opens in any browser.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from pathlib import Path

__all__ = ["bar_chart_svg"]


def bar_chart_svg(
    path: str | Path,
    title: str,
    series: Sequence[tuple[str, Sequence[float]]],
    labels: Sequence[str],
    unit: str = "%",
    scale: float = 100.0,
) -> Path:
    """Grouped horizontal bars: one group per label, one bar per series.

    ``series`` is ``[(name, values per label)]``; values are multiplied by ``scale``
    for display (fractions shown as percent by default).
    """
    colors = ("#3b7dd8", "#e07b39", "#4aa564", "#b2559b")
    bar_h, gap, left, width = 16, 10, 170, 460
    group_h = bar_h * len(series) + gap
    top = 50
    height = top + group_h * len(labels) + 40
    vmax = max((v * scale for _, vals in series for v in vals), default=1.0) or 1.0
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 90}" '
        f'height="{height}" font-family="sans-serif" font-size="12">',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    for i, (name, _) in enumerate(series):
        x = left + i * 150
        out.append(f'<rect x="{x}" y="30" width="12" height="12" fill="{colors[i % 4]}"/>')
        out.append(f'<text x="{x + 16}" y="40">{escape(name)}</text>')
    for g, label in enumerate(labels):
        y0 = top + g * group_h
        out.append(
            f'<text x="{left - 8}" y="{y0 + group_h / 2}" text-anchor="end">{escape(label)}</text>'
        )
        for i, (_, vals) in enumerate(series):
            v = vals[g] * scale
            w = max(1.0, width * v / vmax)
            y = y0 + i * bar_h
            out.append(
                f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar_h - 2}" '
                f'fill="{colors[i % 4]}"/>'
            )
            out.append(f'<text x="{left + w + 4:.1f}" y="{y + bar_h - 5}">{v:.1f}{unit}</text>')
    out.append("</svg>")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("\n".join(out) + "\n")
    return p
