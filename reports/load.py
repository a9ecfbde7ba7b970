"""Read a run directory, with errors that name the file and line."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ep_harness.errors import HarnessError
from ep_harness.records import REQUIRED, numbered_jsonl
from ep_harness.reports.analysis import STATUS_ORDER

RERUN = "rerun `ep-harness verify`"


@dataclass
class Run:
    path: Path
    records: list[dict]
    environment: dict

    @property
    def run_id(self) -> str:
        return self.records[0]["run_id"] if self.records else self.path.name


def load_run(path: Path) -> Run:
    path = Path(path)
    if path.is_file():
        path = path.parent
    results = path / "results.jsonl"
    if not results.exists():
        raise HarnessError(f"{results} not found; pass a run directory written by `ep-harness verify`")
    records, seen = [], {}
    for lineno, rec in numbered_jsonl(results, f"the file is truncated or corrupted, {RERUN}"):
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise HarnessError(f"{results}:{lineno}: record lacks {', '.join(missing)}; "
                               f"it was not written by this harness version")
        problem = record_problem(rec, seen, lineno)
        if problem:
            raise HarnessError(f"{results}:{lineno}: {problem}; the record was edited or damaged, {RERUN}")
        records.append(rec)
    env_path = path / "environment.json"
    if not env_path.exists():  # verify writes it last, once every check has a record
        raise HarnessError(f"{path} has no environment.json: the run did not finish (it was killed, or is still "
                           f"running), so its records are partial; {RERUN}")
    try:
        environment = json.loads(env_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise HarnessError(f"{env_path}: not UTF-8 text; {RERUN}") from None
    except json.JSONDecodeError as exc:
        raise HarnessError(f"{env_path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(environment, dict):
        raise HarnessError(f"{env_path}: not a JSON object; {RERUN}")
    return Run(path=path, records=records, environment=environment)


def record_problem(rec: dict, seen: dict, lineno: int) -> str | None:
    """What keeps one record (of a run, or a baseline's line) from being read as a verdict: no
    check id, one seen on an earlier line (`seen`: id -> line, updated), or a status the
    harness does not write."""
    check = rec.get("check")
    if not isinstance(check, str) or not check:
        return "has no check id"
    if check in seen:
        return f"check {check[:80]!r} again (first on line {seen[check]})"
    seen[check] = lineno
    status = rec.get("status")
    if not isinstance(status, str) or status not in STATUS_ORDER:
        return f"check {check[:80]!r}: status {status!r} is not one of {', '.join(STATUS_ORDER)}"
    return None
