"""The mismatch summary as inline SVG: one bar per case and invariance property, coloured by
outcome, failures first and named in words. Text and rectangles only, so the page's search
finds every label; drawing it as a matplotlib figure took half of a report's time (the
import and the figure, 0.7 s of a 1 s report)."""
from __future__ import annotations

import math
from html import escape

# One colour per outcome (ep_harness.reports.analysis.OUTCOMES), the same in the plot and on the page.
COLOURS = {"failed": "#c0392b", "xpass": "#c0392b", "error": "#7b241c", "interrupted": "#7b241c",
           "vacuous": "#d4ac0d", "xfail": "#95a5a6", "held": "#2e86c1", "skipped": "#d5d8dc"}
WORDS = {"failed": "FAILED", "xpass": "XPASS (control did not violate)", "error": "ERROR",
         "vacuous": "vacuous (could not fail)", "xfail": "control, violated as expected", "held": "held"}
FAILING_OUTCOMES = ("failed", "xpass", "error")  # outcomes marked in words (analysis.FAILING: statuses)
# pixels: a bar's row, the plot's width, a character of the 11 px labels, the legend's rows
ROW_H, PLOT_W, CHAR_W, LEGEND_H, TOP, AXIS_H = 18, 420, 6.4, 16, 22, 34


def summary_bars(records: list[dict]) -> list[dict]:
    """One bar per case and invariance property (case names are unique in a suite, so no two
    bars share a label): the worst outcome among its grid points and, of the points with that
    outcome, the largest percentage; worst outcomes first. A property compared with a
    reference counts errors, not differences, and is left out."""
    from ep_harness.properties import needs_reference
    from ep_harness.reports.analysis import OUTCOMES, outcome

    groups: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for r in records:
        m, t = r.get("mismatched"), r.get("total")
        if not (isinstance(m, (int, float)) and isinstance(t, (int, float))) or needs_reference(r["property"]):
            continue
        groups.setdefault((r["case"], r["property"]), []).append((outcome(r), 100.0 * m / max(t, 1)))
    bars = []
    for (case, prop), points in groups.items():
        worst = min((o for o, _ in points), key=OUTCOMES.index)
        bars.append({"label": f"{case}  {prop}", "outcome": worst, "pct": max(p for o, p in points if o == worst)})
    return sorted(bars, key=lambda b: OUTCOMES.index(b["outcome"]))  # stable: plan order within an outcome


def _ticks(top: float) -> list[float]:
    """Three to six round ticks (1, 2 or 5 times a power of ten) from 0 to `top` (percent)."""
    power = 10.0 ** math.floor(math.log10(top / 5))
    step = next(power * m for m in (1, 2, 5, 10) if top / (power * m) <= 6)
    return [i * step for i in range(int(top // step) + 1)]


def summary_svg(records: list[dict]) -> str | None:
    """Mismatch percentage per case and property, coloured by outcome; a failure is marked in
    words beside its bar and its row shaded, so a 0.2 % failure is as visible as a 30 %
    control. None where no invariance was measured."""
    bars = summary_bars(records)
    if not bars:
        return None
    # a foreign or hand-edited record may count more than it compared (or NaN): its bar is
    # drawn to the axis's end and its label says what the record says
    top = max([5.0] + [b["pct"] * 1.3 for b in bars if math.isfinite(b["pct"]) and b["pct"] <= 100])
    left = 12 + CHAR_W * max(len(b["label"]) for b in bars)
    present = {b["outcome"] for b in bars}
    shown = [o for o in WORDS if o in present]  # worst first, as WORDS lists them
    legend_h = LEGEND_H * len(shown)
    plot_top = TOP + legend_h + 6
    plot_h = ROW_H * len(bars)
    width, height = left + PLOT_W + 190, plot_top + plot_h + AXIS_H

    def x(pct: float) -> float:  # a percentage's place on the plot, within it (NaN at 0)
        return left + PLOT_W * (0.0 if math.isnan(pct) else min(pct, top) / top)

    out = [f'<svg class="bars" xmlns="http://www.w3.org/2000/svg" role="img" width="{width:.0f}" height="{height}" '
           f'viewBox="0 0 {width:.0f} {height}" font-family="sans-serif" font-size="11">',
           "<title>mismatch summary: elements whose bits differ per case and property (worst grid point)</title>",
           f'<text x="{left:.1f}" y="14" font-size="12">failures first; held must be 0; controls must differ</text>']
    for i, o in enumerate(shown):
        y = TOP + i * LEGEND_H
        words = WORDS[o] + (": must be 0" if o == "held" else "")
        out.append(f'<rect x="{left:.1f}" y="{y}" width="12" height="11" fill="{COLOURS[o]}"/>'
                   f'<text x="{left + 18:.1f}" y="{y + 9}">{escape(words)}</text>')
    for tick in _ticks(top):
        out.append(f'<line x1="{x(tick):.1f}" x2="{x(tick):.1f}" y1="{plot_top}" y2="{plot_top + plot_h}" '
                   f'stroke="#ccc" stroke-width="0.5"/><text x="{x(tick):.1f}" y="{plot_top + plot_h + 13}" '
                   f'text-anchor="middle">{tick:g}</text>')
    out.append(f'<text x="{left + PLOT_W / 2:.1f}" y="{plot_top + plot_h + 29}" text-anchor="middle">'
               f'elements whose bits differ (%, worst grid point)</text>')
    for i, b in enumerate(bars):
        y, failing = plot_top + i * ROW_H, b["outcome"] in FAILING_OUTCOMES
        label, note = escape(b["label"]), f'{b["pct"]:.1f}%' + (f"  &lt;- {WORDS[b['outcome']]}" if failing else "")
        if failing:  # the row shaded across the plot, whatever its bar's length
            out.append(f'<rect x="0" y="{y}" width="{width:.0f}" height="{ROW_H}" fill="{COLOURS["failed"]}" '
                       f'fill-opacity="0.12"/>')
        style = f' fill="{COLOURS["failed"]}" font-weight="bold"' if failing else ""
        out.append(f'<g><title>{label}: {b["pct"]:.2f}% ({escape(WORDS.get(b["outcome"], b["outcome"]))})</title>'
                   f'<text x="{left - 6:.1f}" y="{y + ROW_H / 2:.1f}" text-anchor="end" dominant-baseline="central"'
                   f'{style}>{label}</text>'
                   f'<rect x="{left:.1f}" y="{y + 3}" width="{max(x(b["pct"]) - left, 0):.1f}" height="{ROW_H - 6}" '
                   f'fill="{COLOURS[b["outcome"]]}"/>'
                   f'<text x="{x(b["pct"]) + 4:.1f}" y="{y + ROW_H / 2:.1f}" dominant-baseline="central"'
                   f'{style}>{note}</text></g>')
    out.append("</svg>")
    return "".join(out)
