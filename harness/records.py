"""The record: one JSON object per check in `results.jsonl` (docs/records.md lists the keys).

Files are written to a temporary name and renamed, so a reader never sees half a run. The
schema sits on the ground floor: it imports no harness module but errors.py, so whatever it
needs of the environment, the subject registry or the version is passed in by the caller
(harness/run/verify.py `base_record`); tests/test_records_floor.py keeps it so.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ep_harness.errors import HarnessError

REQUIRED = (
    "run_id", "check", "case", "subject", "family", "property", "params", "expect", "held",
    "mismatched", "total", "status", "reason", "rerun", "seconds",
)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; these files are meant to be shared
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # whatever the locale
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_jsonl(path: Path, records: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r, sort_keys=False) + "\n" for r in records))


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def append_line(path: Path, obj) -> None:
    """Append one record durably and whole: a single write(2) of the complete line to a
    file opened with O_APPEND, so concurrent appenders never interleave within a line."""
    data = (json.dumps(obj) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: Path, fix: str = "the file is truncated or corrupted") -> list[dict]:
    return [obj for _, obj in numbered_jsonl(path, fix)]


def numbered_jsonl(path: Path, fix: str = "the file is truncated or corrupted") -> list[tuple[int, dict]]:
    """The JSON objects of a file, one a line, with their line numbers; anything else is one
    HarnessError naming the file's own line (json.loads of one line would always say line 1)
    and `fix`."""
    if not path.exists():
        return []
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise HarnessError(f"{path}:{lineno}: not UTF-8 text (byte {exc.object[exc.start]:#04x}); {fix}") from None
    objects = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HarnessError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno}); {fix}") from None
        if not isinstance(obj, dict):
            raise HarnessError(f"{path}:{lineno}: a line must be a JSON object, not {type(obj).__name__}; {fix}")
        objects.append((lineno, obj))
    return objects


def new_record(check, run_id: str, rerun: str, *, launch_env: dict, harness_version: str,
               subject_distribution: dict | None = None) -> dict:
    """The record's fields that an ep_harness.check.Check decides, before anything is measured.
    `launch_env`: the check's environment as it may be written (credentials redacted);
    `subject_distribution`: the package and version of a third-party subject (None: built in)."""
    record = {
        "run_id": run_id,
        "check": check.id,
        "case": check.case,
        "subject": check.subject,
        "family": check.family,
        "property": check.property,
        "params": check.params_record,
        "topology": check.topology,
        **({"nccl": check.nccl} if check.nccl else {}),  # what ran, read from NCCL (every rank checks it)
        "expect": check.expect,
        "timeout_s": check.timeout_s,
        "launch_env": launch_env,
        "held": None,
        "mismatched": None,
        "total": None,
        "status": None,
        "reason": None,
        "rerun": rerun,
        "seconds": 0.0,
        "harness_version": harness_version,
    }
    if subject_distribution:  # a third-party subject: which package, at which version, was measured
        record["subject_distribution"] = subject_distribution
    return record
