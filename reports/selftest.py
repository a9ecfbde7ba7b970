"""The selftest's matrix for report.html, from a run directory's selftest.json (written by
`ep-harness selftest`; other runs have none and the report shows no such section)."""
from __future__ import annotations

import json
from pathlib import Path

SYMBOL = {"caught": "caught", "missed": "MISSED", "extra": "caught (extra)", "not-fired": "did not fire",
          "not-required": "", "n/a": "n/a", "broken": "ERROR (selftest)"}


def selftest_context(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "selftest.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    names = [i["name"] for i in data.get("injections", [])]
    rows = [{"check": r["check"], "baseline": r.get("baseline"),
             "cells": [{"state": r["cells"][n]["state"], "text": SYMBOL.get(r["cells"][n]["state"], "?"),
                        "title": str(r["cells"][n].get("reason") or r["cells"][n].get("why") or "")} for n in names]}
            for r in data.get("checks", [])]
    return {"injections": [i.get("describe", i["name"]) for i in data.get("injections", [])], "names": names,
            "rows": rows, "blind": data.get("blind", []), "tested": data.get("tested"),
            "wall_s": data.get("wall_s")}
