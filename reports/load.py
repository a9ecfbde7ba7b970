"""Read a run directory, with errors that name the file and line."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ep_harness.errors import HarnessError
from ep_harness.records import REQUIRED, numbered_jsonl


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
    records = []
    for lineno, rec in numbered_jsonl(results, "the file is truncated or corrupted, rerun `ep-harness verify`"):
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise HarnessError(f"{results}:{lineno}: record lacks {', '.join(missing)}; "
                               f"it was not written by this harness version")
        records.append(rec)
    env_path = path / "environment.json"
    environment = {}
    if env_path.exists():
        try:
            environment = json.loads(env_path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise HarnessError(f"{env_path}: not UTF-8 text; rerun `ep-harness verify`") from None
        except json.JSONDecodeError as exc:
            raise HarnessError(f"{env_path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(environment, dict):
            raise HarnessError(f"{env_path}: not a JSON object; rerun `ep-harness verify`")
    return Run(path=path, records=records, environment=environment)
