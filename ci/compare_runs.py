"""Whether two runs of the same suite gave the same answers, check by check: the gate for a
refactor that must not change behaviour.

    python ci/compare_runs.py OLD_RESULTS NEW_RESULTS

OLD_RESULTS and NEW_RESULTS are results.jsonl files (or the run directories holding them).
Every check whose status, mismatched, predicted_mismatched or bits_fingerprint differ, or
that only one run has, is printed on its own line; the exit code is 1 if any is, 0 if none,
2 for input that cannot be read.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

COMPARED = ("status", "mismatched", "predicted_mismatched", "bits_fingerprint")
MISSING = "<absent>"


def load(path: Path) -> dict[str, dict]:
    """check id -> record; a run directory stands for its results.jsonl."""
    if path.is_dir():
        path = path / "results.jsonl"
    records: dict[str, dict] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SystemExit(f"{path}: cannot read it ({exc.strerror}); pass a run's results.jsonl") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            check = record["check"]
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"{path}:{n}: not a check record (JSON with a `check` field); "
                             f"pass a run's results.jsonl") from None
        if check in records:
            raise SystemExit(f"{path}:{n}: check {check} appears twice; pass one run's results.jsonl")
        records[check] = record
    return records


def differences(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
    """One line per check that differs between the runs (plan order of the old run, then
    checks only the new run has)."""
    lines = []
    for check in [*old, *(c for c in new if c not in old)]:
        if check not in new or check not in old:
            lines.append(f"{check}: only in the {'old' if check in old else 'new'} run")
            continue
        changed = [f"{key} {old[check].get(key, MISSING)} -> {new[check].get(key, MISSING)}"
                   for key in COMPARED if old[check].get(key) != new[check].get(key)]
        if changed:
            lines.append(f"{check}: {'; '.join(changed)}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python ci/compare_runs.py OLD_RESULTS NEW_RESULTS (two results.jsonl files)", file=sys.stderr)
        return 2
    try:
        old, new = (load(Path(a)) for a in argv)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    lines = differences(old, new)
    for line in lines:
        print(line)
    print(f"{len(lines)} of {len(set(old) | set(new))} checks differ "
          f"(compared: {', '.join(COMPARED)})")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
