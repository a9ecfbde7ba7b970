"""Plots as base64 PNG, embedded in the page: matplotlib without pyplot (Agg only)."""
from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.image  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

CONTROL, FIX = "#c0392b", "#2e86c1"


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def summary_figure(frame) -> str | None:
    """Mismatch percentage per subject and invariance property (controls red, fixes blue); a
    property compared with a reference counts errors, not differences, and is left out."""
    from ep_harness.properties import needs_reference

    measured = frame[frame["mismatched"].notna() & ~frame["property"].map(needs_reference).astype(bool)]
    if measured.empty:
        return None
    grouped = (measured.assign(pct=100.0 * measured["mismatched"] / measured["total"].clip(lower=1))
               .groupby(["subject", "property", "expect"], sort=True)["pct"].max().reset_index())
    labels = [f"{s}  {p}" for s, p in zip(grouped["subject"], grouped["property"])]
    fig = Figure(figsize=(7.5, 0.28 * len(labels) + 1.0))
    ax = fig.add_subplot()
    colors = [CONTROL if e == "violated" else FIX for e in grouped["expect"]]
    bars = ax.barh(range(len(labels)), grouped["pct"], color=colors)
    ax.bar_label(bars, labels=[f"{v:.1f}%" for v in grouped["pct"]], fontsize=7, padding=2)
    ax.set_xlim(0, max(5.0, float(grouped["pct"].max()) * 1.15))
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("elements whose bits differ (%, worst grid point)")
    ax.set_title("controls (red) must differ; fixes (blue) must be 0", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def map_png(mismatch_map: dict) -> str:
    """Rows x bins fraction of differing elements, as a tiny image scaled up by CSS."""
    buf = io.BytesIO()
    matplotlib.image.imsave(buf, mismatch_map["fraction"], cmap="Reds", vmin=0.0, vmax=1.0, format="png")
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
