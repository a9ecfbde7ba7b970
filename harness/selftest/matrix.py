"""The selftest's verdict per check and injection (a cell), and how it is printed.

Cell states:

* `caught`: required, fired, and the check failed (unexpected or error);
* `missed`: required, fired, and the check still passed: the check is *blind* to it;
* `extra`: not required, yet caught (only when such checks were run);
* `not-fired`: required, but the defect never changed a bit in this check (fewer calls
  than the injection waits for, no batch above the size, a value that was right already);
* `not-required`: the property need not catch it (harness/selftest/expectations.py);
* `n/a`: not applicable (a control, a baseline that was not ok, a GPU-only injection on the
  CPU, a family without a wrapper);
* `broken`: the check ended in an error that is not the check's own doing: a traceback
  through the injection's wrapper, or a rank or launch that died without a Python
  traceback. Never counted as a catch; the selftest fails.

An `error` with a traceback elsewhere (the family or subject raised on the injected value)
is a catch: the run fails, as `verify` would.
"""
from __future__ import annotations

FAILED = ("unexpected", "error")
SYMBOL = {"caught": "C", "missed": "MISS", "extra": "c", "not-fired": "~", "not-required": ".", "n/a": "-",
          "broken": "ERR"}


def broken(record: dict) -> bool:
    """An error the injection machinery caused, or one nothing attributes to the check."""
    if record["status"] != "error":
        return False
    tracebacks = (record.get("detail") or {}).get("tracebacks") or {}
    return not tracebacks or any("harness/selftest/" in t for t in tracebacks.values())


def cell(required: bool | None, why: str, record: dict | None, fired: bool) -> dict:
    """One check x injection. `record`: the check's record under the injection (None when it
    was not run with it); `fired`: whether the defect changed a bit in one of its calls."""
    if required is None:
        return {"state": "n/a", "why": why}
    if record is None:
        return {"state": "not-required" if not required else "n/a", "why": why}
    out = {"status": record["status"], "mismatched": record.get("mismatched"), "total": record.get("total"),
           "reason": record.get("reason")}
    if broken(record):
        return {"state": "broken", "why": "the injected launch failed, not the check: see the reason", **out}
    caught = record["status"] in FAILED
    if caught:
        return {"state": "caught" if required else "extra", "why": why, **out}
    if not fired:
        return {"state": "not-fired" if required else "not-required", "why": "the defect never changed a bit "
                "of this check's output (too few calls, no batch above the size, or the value was right already)",
                **out}
    return {"state": "missed" if required else "not-required", "why": why, **out}


# Which placement's state a merged cell shows: the first of these any placement has.
_WORST_FIRST = ("broken", "missed", "caught", "extra", "not-fired", "not-required", "n/a")


def merged(spots: dict[str, dict]) -> dict:
    """One cell from the cells of an injection's placements (label -> cell): missed if any
    placement was missed (a check that compares a subset of each row is blind), caught only
    when no placement was missed; `spots` keeps each placement's state, `missed_at` names
    the placements the check missed."""
    if len(spots) == 1:
        return next(iter(spots.values()))
    label = min(spots, key=lambda k: _WORST_FIRST.index(spots[k]["state"]))
    out = {**spots[label], "spots": {k: c["state"] for k, c in spots.items()}}
    if out["state"] == "missed":
        out["missed_at"] = [k for k, c in spots.items() if c["state"] == "missed"]
        out["reason"] = f"missed at {', '.join(out['missed_at'])}: {out.get('reason') or ''}"
    return out


def blind(rows: list[dict]) -> list[dict]:
    """The checks with a missed cell, each with the injections it missed."""
    return [{"check": r["check"], "property": r["property"],
             "missed": [name for name, c in r["cells"].items() if c["state"] == "missed"]}
            for r in rows if any(c["state"] == "missed" for c in r["cells"].values())]


def broken_cells(rows: list[dict]) -> list[dict]:
    return [{"check": r["check"], "injection": name, "reason": c.get("reason")}
            for r in rows for name, c in r["cells"].items() if c["state"] == "broken"]


def render(rows: list[dict], injections: list[str]) -> str:
    """The terminal matrix: one row per check, one column per injection, then each
    column's totals and the blind checks."""
    width = max([len(r["check"]) for r in rows] + [5])
    cols = [max(len(n), 4) for n in injections]
    lines = ["# selftest matrix: C caught, MISS missed (the check is blind to it), c caught though not required, "
             "~ required but never fired, . not required, - not applicable, ERR the injected launch failed",
             "# " + "check".ljust(width - 2) + "  " + "  ".join(n.rjust(w) for n, w in zip(injections, cols))]
    for r in rows:
        lines.append(r["check"].ljust(width) + "  " +
                     "  ".join(SYMBOL[r["cells"][n]["state"]].rjust(w) for n, w in zip(injections, cols)))
    for state in ("caught", "missed", "extra", "not-fired", "broken"):
        counts = [sum(r["cells"][n]["state"] == state for r in rows) for n in injections]
        lines.append(("# " + state).ljust(width) + "  " + "  ".join(str(c).rjust(w) for c, w in zip(counts, cols)))
    for b in blind(rows):
        lines.append(f"# BLIND: {b['check']} ({b['property']}) missed {', '.join(b['missed'])}")
        for name in b["missed"]:
            c = next(r for r in rows if r["check"] == b["check"])["cells"][name]
            lines.append(f"#   {name}: {c['status']}, {c.get('reason') or ''}")
    for b in broken_cells(rows):
        lines.append(f"# BROKEN: {b['check']} under {b['injection']}: {b['reason']}")
    return "\n".join(lines)
