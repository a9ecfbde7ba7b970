"""The nightly trends section: mismatch counts and seconds per check over time, and what
changed since the previous night, from the history store (one JSON row per check a night)."""
from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd

from reports import plots

MAX_LINES = 12


def load_history(path: Path) -> pd.DataFrame:
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                from harness.errors import HarnessError

                raise HarnessError(f"{path}:{lineno}: invalid JSON in the history; remove the broken line") from None
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame["date"] = pd.to_datetime(frame["date"])
    return frame


def since_previous(history: pd.DataFrame) -> list[dict]:
    runs = history.drop_duplicates("run_id").sort_values("date")["run_id"].tolist()
    if len(runs) < 2:
        return []
    last = history[history["run_id"] == runs[-1]].set_index("check")
    prev = history[history["run_id"] == runs[-2]].set_index("check")
    changed = []
    for check in sorted(set(last.index) | set(prev.index)):
        a = prev.loc[check] if check in prev.index else None
        b = last.loc[check] if check in last.index else None
        before = "-" if a is None else f"{a['status']} {a['mismatched'] if pd.notna(a['mismatched']) else '-'}"
        after = "-" if b is None else f"{b['status']} {b['mismatched'] if pd.notna(b['mismatched']) else '-'}"
        if before != after:
            changed.append({"check": check, "before": before, "after": after})
    return changed


def section(path: Path | None) -> str:
    if path is None or not Path(path).exists():
        return ""
    history = load_history(path)
    if history.empty:
        return "<h2>Trends</h2><p>The history is empty.</p>"
    nights = history["run_id"].nunique()
    moving = history.groupby("check")["mismatched"].nunique()
    chosen = moving[moving > 1].index.tolist()[:MAX_LINES] or history.groupby("check")["seconds"].max() \
        .sort_values(ascending=False).index.tolist()[:MAX_LINES]
    subset = history[history["check"].isin(chosen)].sort_values("date")
    parts = [f"<h2>Trends</h2><p>{nights} run(s) in <code>{html.escape(str(path))}</code>; plotted: "
             f"{'checks whose mismatch count moved' if moving.max() > 1 else 'the slowest checks'}.</p>"]
    for value, title in (("mismatched", "mismatched elements per check"), ("seconds", "seconds per check")):
        png = plots.trend_figure(subset, value, title)
        if png:
            parts.append(f'<img class="plot" alt="{title}" src="data:image/png;base64,{png}">')
    changed = since_previous(history)
    if changed:
        rows = "".join(f"<tr><td>{html.escape(c['check'])}</td><td>{html.escape(c['before'])}</td>"
                       f"<td>{html.escape(c['after'])}</td></tr>" for c in changed)
        parts.append(f"<h3>Changed since the previous run</h3><table><tr><th>check</th><th>before</th>"
                     f"<th>after</th></tr>{rows}</table>")
    else:
        parts.append("<p>Nothing changed since the previous run.</p>" if nights > 1 else "<p>First run.</p>")
    return "".join(parts)
