"""Golden bits across processes (`verify --fresh-processes K`): the same checks launched K
times, each launch in new processes (new allocations, new communicators). A deterministic
check's bits must not depend on that, so a check whose fingerprint differs between launches
fails, with how many of the K-1 relaunches differ and where the bits first moved. In-process
repeats (run-to-run) cannot see such drift."""
from __future__ import annotations

from ep_harness.check import Check
from ep_harness.launch.launcher import Outcome


def _first_block(a: dict | None, b: dict | None) -> str:
    if not (a and b) or a.get("block") != b.get("block"):
        return ""
    for i, (x, y) in enumerate(zip(a["digests"], b["digests"])):
        if x != y:
            return f"; first differing block: compared elements {i * a['block']:,}..{(i + 1) * a['block'] - 1:,}"
    return ""


def compare_launches(record: dict, later: list[Outcome | None]) -> dict:
    """`record` (the first launch's) with the later launches' fingerprints compared to its own."""
    mine = record.get("bits_fingerprint")
    if not mine or record["status"] in ("skipped", "error", "interrupted"):
        return record
    theirs, differing, where = [], 0, ""
    for outcome in later:
        m = outcome.measured if outcome is not None and outcome.error is None else None
        if m is None or m.bits_fingerprint is None:
            return {**record, "status": "error",
                    "reason": f"a fresh-process relaunch of this check did not measure "
                              f"({outcome.error if outcome is not None else 'no outcome'}); {record['reason']}"}
        if m.error:  # measured, but not as pinned (a declared kernel that did not run): same bits prove nothing
            return {**record, "status": "error",
                    "reason": f"a fresh-process relaunch of this check: {m.error}; {record['reason']}"}
        theirs.append(m.bits_fingerprint)
        if m.bits_fingerprint != mine:
            differing += 1
            where = where or _first_block((record.get("detail") or {}).get("bits_blocks"), m.bits_blocks)
    out = {**record, "fresh_processes": {"launches": len(later) + 1, "differing": differing,
                                         "fingerprints": [mine, *theirs]}}
    if differing:
        out["status"] = "unexpected"
        out["reason"] = (f"bits differ across fresh processes: {differing} of {len(later)} relaunches differ from "
                         f"the first launch{where}; {record['reason']}")
    return out


def compared_across_launches(record: dict, check: Check, relaunched: list[dict[str, Outcome]], launches: int,
                             interrupted: BaseException | None) -> dict:
    """A --fresh-processes record: its bits compared with every relaunch's, or `interrupted`
    when a signal came before all of its relaunches finished (the first launch alone shows
    nothing about fresh processes, so it never stands as the check's verdict)."""
    later = [o.get(check.id) for o in relaunched]
    if interrupted is None or (len(later) == launches - 1 and None not in later):
        return compare_launches(record, later)
    if record["status"] in ("skipped", "interrupted"):
        return record
    done = sum(o is not None for o in later)
    return {**record, "status": "interrupted", "held": None,
            "reason": f"the run was interrupted by {interrupted} before this check's relaunches in fresh processes "
                      f"finished ({done} of {launches - 1}); its first launch was {record['status']}: {record['reason']}"}


def compared_records(records: list[dict], checks: list[Check], relaunched: list[dict[str, Outcome]], launches: int,
                     interrupted: BaseException | None) -> list[dict]:
    """The run's records, each compared across its `launches` (as they are when there was one)."""
    if launches <= 1:
        return records
    return [compared_across_launches(r, c, relaunched, launches, interrupted) for r, c in zip(records, checks)]
