"""Plots as base64 PNG, embedded in the page: matplotlib without pyplot (Agg only)."""
from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

# One colour per outcome (ep_harness.reports.analysis.OUTCOMES), the same in the plot and on the page.
COLOURS = {"failed": "#c0392b", "xpass": "#c0392b", "error": "#7b241c", "interrupted": "#7b241c",
           "vacuous": "#d4ac0d", "xfail": "#95a5a6", "held": "#2e86c1", "skipped": "#d5d8dc"}
WORDS = {"failed": "FAILED", "xpass": "XPASS (control did not violate)", "error": "ERROR",
         "vacuous": "vacuous (could not fail)", "xfail": "control, violated as expected", "held": "held"}


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


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


def summary_figure(records: list[dict]) -> str | None:
    """Mismatch percentage per case and property, coloured by outcome; a failure is marked
    in words beside its bar, so a 0.2 % failure is as visible as a 30 % control."""
    bars = summary_bars(records)
    if not bars:
        return None
    pcts = [b["pct"] for b in bars]
    top = max(5.0, max(pcts) * 1.3)
    fig = Figure(figsize=(8.5, 0.26 * len(bars) + 1.3))
    ax = fig.add_subplot()
    drawn = ax.barh(range(len(bars)), pcts, color=[COLOURS[b["outcome"]] for b in bars])
    failing = ("failed", "xpass", "error")
    ax.bar_label(drawn, labels=[f"{b['pct']:.1f}%" + (f"  <- {WORDS[b['outcome']]}" if b["outcome"] in failing else "")
                                for b in bars], fontsize=7, padding=2)
    for i, b in enumerate(bars):  # a failure's row is shaded across the plot, whatever its bar's length
        if b["outcome"] in failing:
            ax.axhspan(i - 0.5, i + 0.5, color=COLOURS["failed"], alpha=0.12, linewidth=0)
    ax.set_xlim(0, top)
    ax.set_yticks(range(len(bars)), [b["label"] for b in bars], fontsize=7.5)
    for tick, b in zip(ax.get_yticklabels(), bars):
        if b["outcome"] in failing:
            tick.set_color(COLOURS["failed"])
            tick.set_fontweight("bold")
    ax.invert_yaxis()
    ax.set_xlabel("elements whose bits differ (%, worst grid point)")
    shown = [o for o in ("failed", "xpass", "error", "vacuous", "xfail", "held") if any(b["outcome"] == o for b in bars)]
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=COLOURS[o], label=WORDS[o] + (": must be 0" if o == "held" else "")) for o in shown],
              fontsize=7, loc="upper right")
    ax.set_title("failures first; held must be 0; controls must differ", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


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
