"""The nightly trends as base64 PNG, embedded in the page: matplotlib without pyplot (Agg only).
The mismatch summary every report has is SVG (ep_harness.reports.bars)."""
from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def trend_figure(history, value: str, title: str) -> str | None:
    """One line per check over nights: `value` (mismatched or seconds) against date."""
    if history is None or history.empty:
        return None
    fig = Figure(figsize=(7.5, 3.2))
    ax = fig.add_subplot()
    for check, rows in list(history.groupby("check"))[:20]:
        ax.plot(rows["date"], rows[value], marker="o", linewidth=1, markersize=3, label=check[-40:])
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax.grid(alpha=0.3)
    if history["check"].nunique() <= 8:
        ax.legend(fontsize=6)
    return _png(fig)
