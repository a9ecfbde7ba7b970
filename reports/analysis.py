"""Derived views of records: verdict counts, control/fix pairs, run-to-run differences."""
from __future__ import annotations

import json
from collections import Counter

FAILING = ("unexpected", "error")  # the statuses that fail a run (exit code 1)
STATUS_ORDER = ("ok", "unexpected", "vacuous", "error", "skipped", "interrupted")


# What a reader tells apart, by expectation (pytest's words where it has them): a check that
# held, a control that violated as expected (xfail), a control that did not (xpass: a failure),
# any other failure, and a check that could not fail. Listed worst first.
OUTCOMES = ("failed", "xpass", "error", "interrupted", "vacuous", "xfail", "held", "skipped")


def outcome(r: dict) -> str:
    """One record's outcome among OUTCOMES. An `expect = "model"` check that the order model
    says violates is a control too (xfail); one it says holds is held."""
    status, expect = r["status"], r.get("expect")
    if status == "unexpected":
        return "xpass" if expect == "violated" and r.get("held") is True else "failed"
    if status == "ok":
        return "xfail" if expect == "violated" or (expect == "model" and r.get("held") is False) else "held"
    return status if status in OUTCOMES else "failed"


def worst_first(records: list[dict]) -> list[dict]:
    """Records ordered by outcome, worst first, plan order kept within one outcome."""
    return sorted(records, key=lambda r: OUTCOMES.index(outcome(r)))


def counts(records: list[dict]) -> dict[str, int]:
    c = Counter(r["status"] for r in records)
    return {s: c.get(s, 0) for s in STATUS_ORDER}


def failed(records: list[dict]) -> bool:
    return any(r["status"] in FAILING for r in records)


def nothing_shown(records: list[dict]) -> str | None:
    """Why a run whose checks ran showed nothing either way: every one of them vacuous (could
    not fail). A few vacuous checks among others are reported, not failed."""
    ran = [r for r in records if r["status"] != "skipped"]
    if ran and all(r["status"] == "vacuous" for r in ran):
        return (f"nothing was shown to hold: all {len(ran)} check(s) that ran were vacuous (could not fail); "
                f"a run must measure something that could have failed")
    return None


def run_problem(records: list[dict], environment: dict | None = None) -> str | None:
    """One line on why a run as a whole cannot pass a gate, whatever its baseline says: it was
    interrupted, nothing ran, every check that ran errored, or every one was vacuous."""
    if (environment or {}).get("interrupted") or any(r["status"] == "interrupted" for r in records):
        why = (environment or {}).get("interrupted")
        return f"the run was interrupted{f' by {why}' if why else ''}: a partial run never passes"
    ran = [r for r in records if r["status"] != "skipped"]
    if not ran:
        return f"nothing ran: all {len(records)} check(s) were skipped"
    if all(r["status"] == "error" for r in ran):
        return f"every check that ran errored ({len(ran)} of {len(ran)}): nothing was measured"
    return nothing_shown(records)


def verdict(records: list[dict], changes: list[dict] | None = None, interrupted: str | None = None) -> str:
    """FAILED (a check failed, a regression against the run compared with, or every check
    that ran was vacuous), NOTHING RAN (every check skipped, or none selected), INTERRUPTED or OK.
    `interrupted`: the signal environment.json names, which makes a run INTERRUPTED whatever
    its records say (a signal after the last check, or records edited afterwards)."""
    if any(r["status"] == "interrupted" for r in records):
        return "INTERRUPTED (partial run)"
    if interrupted:
        return f"INTERRUPTED (by {interrupted})"
    if failed(records) or any(c["kind"] == "regression" for c in changes or ()):
        return "FAILED"
    if nothing_shown(records):
        return "FAILED (nothing was shown to hold: every check that ran was vacuous)"
    return "NOTHING RAN" if all(r["status"] == "skipped" for r in records) else "OK"


# Parameters of the composed subjects (composed_moe, composed_model) that name the stage
# subject they are built of (harness/params.py): choosing one chooses what is under test, as
# choosing a subject does, so a control and its fix may differ there.
STAGE_PARAMS = ("tp_reduce", "dispatch", "gemm", "dense_gemm")


def point_key(rec: dict) -> str:
    """What a control and its fix share: family, property and every parameter but the
    stage subjects."""
    params = {k: v for k, v in rec["params"].items() if k not in STAGE_PARAMS}
    return json.dumps([rec["family"], rec["property"], params], sort_keys=True)


def pairs(records: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Each measured control (expect = violated, or a model check the order model says
    violates) with the fixes checked at the same point (expect = holds, or a model check that
    holds): the model suite's native reduce-scatter beside its fold."""
    by_point: dict[str, list[dict]] = {}
    for r in records:
        if r.get("mismatched") is not None:
            by_point.setdefault(point_key(r), []).append(r)
    out = []
    for group in by_point.values():
        controls = [r for r in group if _is_control(r)]
        fixes = [r for r in group if not _is_control(r)]
        for c in controls:
            if fixes:
                out.append((c, fixes))
    return out


def _is_control(r: dict) -> bool:
    return r["expect"] == "violated" or (r["expect"] == "model" and r.get("held") is False)


def compare_runs(current: list[dict], previous: list[dict]) -> list[dict]:
    """Per check: regression, improvement, changed control count, new, or disappeared."""
    now = {r["check"]: r for r in current}
    before = {r["check"]: r for r in previous}
    changes = []
    for cid, old in before.items():
        new = now.get(cid)
        if new is None:
            if old["status"] != "skipped":
                changes.append({"check": cid, "kind": "regression", "what": "disappeared",
                                "before": old["status"], "after": "-"})
            continue
        change = _classify(old, new)
        if change:
            changes.append({"check": cid, **change})
    for cid, new in now.items():
        if cid not in before and new["status"] != "skipped":  # baselines keep no skipped checks
            failing = new["status"] in FAILING
            changes.append({"check": cid, "kind": "regression" if failing else "new",
                            "what": f"new check, {new['status']}" + (f": {new.get('reason')}" if failing else ""),
                            "before": "-", "after": new["status"]})
    return changes


def _classify(old: dict, new: dict) -> dict | None:
    bad = FAILING
    if old["expect"] == "holds" and old.get("held") is True and new.get("held") is False:
        return {"kind": "regression", "what": "held before, violated now",
                "before": _count(old), "after": _count(new)}
    if new["status"] in bad and old["status"] not in bad:
        return {"kind": "regression", "what": f"now {new['status']}: {new.get('reason')}",
                "before": old["status"], "after": new["status"]}
    if old["status"] == "ok" and new["status"] in ("skipped", "vacuous"):  # it stopped measuring
        return {"kind": "regression", "what": f"ok before, {new['status']} now: {new.get('reason')}",
                "before": old["status"], "after": new["status"]}
    if (old["expect"] == "violated" and old.get("mismatched") is not None and new.get("mismatched") is not None
            and old["mismatched"] != new["mismatched"] and old["params"] == new["params"]):
        return {"kind": "regression", "what": "control's mismatch count changed for the same inputs",
                "before": _count(old), "after": _count(new)}
    if (old.get("bits_fingerprint") and new.get("bits_fingerprint") and old["params"] == new["params"]
            and old["bits_fingerprint"] != new["bits_fingerprint"] and new["status"] not in bad
            and old["status"] not in bad):  # an error fixed is an improvement, whatever its bits
        return {"kind": "regression", "what": "same verdict, other bits: the compared outputs' fingerprint moved"
                + _first_difference(old, new), "before": _short(old["bits_fingerprint"]),
                "after": _short(new["bits_fingerprint"])}
    if (old.get("bits_fingerprint") and not new.get("bits_fingerprint") and new["status"] in ("ok", "vacuous")
            and old["status"] not in bad):
        return {"kind": "regression", "what": "the compared outputs' fingerprint is missing now: whether their "
                "bits moved cannot be told", "before": _short(old["bits_fingerprint"]), "after": "-"}
    if old["status"] in bad and new["status"] not in bad:
        return {"kind": "improvement", "what": f"was {old['status']}, now {new['status']}",
                "before": old["status"], "after": new["status"]}
    if old["expect"] == "holds" and old.get("held") is False and new.get("held") is True:
        return {"kind": "improvement", "what": "violated before, holds now",
                "before": _count(old), "after": _count(new)}
    return None


def _short(digest: str) -> str:
    return digest.split(":")[-1][:12]


def _first_difference(old: dict, new: dict) -> str:
    """Where the bits moved: the first block of compared elements whose digests differ."""
    a, b = (old.get("detail") or {}).get("bits_blocks"), (new.get("detail") or {}).get("bits_blocks")
    if not (isinstance(a, dict) and isinstance(b, dict)) or a.get("block") != b.get("block"):
        return ""
    for i, (x, y) in enumerate(zip(a.get("digests") or [], b.get("digests") or [])):
        if x != y:
            return f" (first differing block: compared elements {i * a['block']:,}..{(i + 1) * a['block'] - 1:,})"
    return ""


def _count(r: dict) -> str:
    if r.get("mismatched") is None:
        return r["status"]
    return f"{r['mismatched']:,} / {r['total']:,}"
