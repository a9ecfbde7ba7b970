"""The nightly gate: compare a run with the reviewed baseline of its platform, and keep a
history of every night.

A baseline is a results.jsonl with the bulky detail stripped, one file per platform
(`ci/baselines/<platform>.jsonl`): GPU model and count, or the CPU default. The gate fails
on a regression (see reports.analysis.compare_runs: a held check now violated, a new
unexpected or error, a control whose count moved for the same seeded inputs, a check that
disappeared) and passes with a notice on improvements.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from harness.errors import HarnessError
from harness.records import append_line, read_jsonl, write_json, write_jsonl
from reports.analysis import compare_runs
from reports.load import load_run

BASELINE_DIR = Path("ci/baselines")
HISTORY_KEYS = ("check", "subject", "property", "status", "held", "mismatched", "total", "seconds")


def platform_key(environment: dict) -> str:
    """Baselines of different topologies never mix: emulated hosts are not real GPUs."""
    gpus = environment.get("gpus") or []
    topology = environment.get("topology") or {}
    if gpus:
        name = re.sub(r"[^A-Za-z0-9]+", "-", gpus[0]).strip("-").lower()
        if topology.get("kind") == "emulated-hosts":
            return f"{name}-x{len(gpus)}-emulated-hosts-{topology.get('ranks')}"
        return f"{name}-x{len(gpus)}"
    return f"cpu-{environment.get('backend', 'gloo')}-{environment.get('max_ranks', 4)}"


def baseline_path(run_dir: Path, baseline: Path | None) -> Path:
    return baseline or BASELINE_DIR / f"{platform_key(load_run(run_dir).environment)}.jsonl"


def lean(record: dict) -> dict:
    """What the gate compares: verdicts and counts, without the bulky detail."""
    return {k: v for k, v in record.items() if k not in ("detail", "rerun", "run_id")}


def update_baseline(run_dir: Path, baseline: Path | None = None) -> Path:
    run = load_run(run_dir)
    target = baseline_path(run_dir, baseline)
    write_jsonl(target, [lean(r) for r in run.records if r["status"] != "skipped"])
    return target


def gate(run_dir: Path, baseline: Path | None = None) -> dict:
    """Return the gate result (also written to RUN_DIR/gate.json)."""
    run = load_run(run_dir)
    path = baseline_path(run_dir, baseline)
    if not path.exists():
        raise HarnessError(f"no baseline at {path}; review the run, then `ep-harness baseline update {run_dir}`")
    try:
        previous = read_jsonl(path)
    except json.JSONDecodeError as exc:
        raise HarnessError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg}); restore the baseline from git") from None
    changes = compare_runs(run.records, previous)
    regressions = [c for c in changes if c["kind"] == "regression"]
    result = {
        "run": str(run.path), "baseline": str(path), "passed": not regressions,
        "regressions": regressions, "improvements": [c for c in changes if c["kind"] == "improvement"],
        "new": [c for c in changes if c["kind"] == "new"],
    }
    write_json(run.path / "gate.json", result)
    return result


def append_history(run_dir: Path, history: Path) -> int:
    """Append one lean row per check, with the run's date and commit; returns rows added."""
    run = load_run(run_dir)
    env = run.environment
    for r in run.records:
        append_line(history, {"date": env.get("date"), "commit": env.get("harness_commit"), "run_id": r["run_id"],
                              **{k: r.get(k) for k in HISTORY_KEYS}})
    return len(run.records)


def render_gate(result: dict) -> str:
    lines = [f"# gate against {result['baseline']}: {'PASSED' if result['passed'] else 'FAILED'}"]
    for kind in ("regressions", "improvements", "new"):
        for c in result[kind]:
            lines.append(f"#   {c['kind']}: {c['check']}: {c['what']} ({c['before']} -> {c['after']})")
    if result["improvements"]:
        lines.append("# notice: improvements found; review them and update the baseline")
    return "\n".join(lines)
