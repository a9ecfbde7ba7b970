"""The nightly trends section: mismatch counts and seconds per check over time, and what
changed since the previous night, from the history store (one JSON row per check a night)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pandas as pd

from ep_harness import console
from ep_harness.reports import plots

MAX_LINES = 12


def load_history(path: Path) -> pd.DataFrame:
    """The history's rows; a corrupt line (a night cut short, a hand edit) is skipped with a
    warning naming it, so one bad night never fails every later one."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                console.current().err(f"# warning: {path}:{lineno}: skipped a line that is not valid JSON")
                continue
            problem = _row_problem(row)
            if problem:
                console.current().err(f"# warning: {path}:{lineno}: skipped a row: {problem}")
                continue
            rows.append(row)
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame["date"] = pd.to_datetime(frame["date"])
    return frame


def _row_problem(row) -> str | None:
    """What keeps a history row out of the trends: not an object, no check or run id, or a
    date that is not an ISO timestamp."""
    if not isinstance(row, dict):
        return "not a JSON object"
    for key in ("check", "run_id"):
        if not isinstance(row.get(key), str):
            return f"{key} = {row.get(key)!r} is not a string"
    try:
        datetime.fromisoformat(row.get("date"))
    except (TypeError, ValueError):
        return f"date = {row.get('date')!r} is not an ISO timestamp"
    return None


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


def context(path: Path | None) -> dict | None:
    """The trends section's values (the template escapes them), or None without a history."""
    if path is None or not Path(path).exists():
        return None
    history = load_history(path)
    if history.empty:
        return {"nights": 0, "path": str(path), "plotted": "nothing (the history is empty)", "plots": [],
                "changed": [], "unchanged": "The history is empty."}
    nights = history["run_id"].nunique()
    moving = history.groupby("check")["mismatched"].nunique()
    chosen = moving[moving > 1].index.tolist()[:MAX_LINES] or history.groupby("check")["seconds"].max() \
        .sort_values(ascending=False).index.tolist()[:MAX_LINES]
    subset = history[history["check"].isin(chosen)].sort_values("date")
    figures = []
    for value, title in (("mismatched", "mismatched elements per check"), ("seconds", "seconds per check")):
        png = plots.trend_figure(subset, value, title)
        if png:
            figures.append((png, title))
    return {"nights": nights, "path": str(path), "plots": figures, "changed": since_previous(history),
            "plotted": "checks whose mismatch count moved" if moving.max() > 1 else "the slowest checks",
            "unchanged": "Nothing changed since the previous run." if nights > 1 else "First run."}
