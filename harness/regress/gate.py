"""The nightly gate: compare a run with the reviewed baseline of its platform, and keep a
history of every night.

A baseline is a results.jsonl with the bulky detail stripped whose first line is the
bit-relevant fingerprint of the run it came from. A run is compared only with a baseline of
the same fingerprint: the same suite, backend and topology, the same versions (torch, CUDA,
NCCL, DeepGEMM, DeepEP), the same GPU model and driver, and, where the CPU computes what is
measured (gloo), the same CPU model and ISA and the same thread count per rank. One file per fingerprint,
`ci/baselines/<platform>-<suite>-<fingerprint hash>.jsonl`. A run with no comparable baseline is
neither a pass nor a regression: the gate says which baselines exist, which platform the
run is on, and how to record one (exit code 3).

The gate fails on a run that cannot pass whatever its baseline says (ep_harness.reports.analysis.run_problem:
interrupted, nothing ran, every check that ran errored, or every one vacuous), and on a
regression (ep_harness.reports.analysis.compare_runs: a held check now violated, a
new unexpected or error, `ok` now skipped, vacuous or error, a control whose count moved
for the same seeded inputs, a check that disappeared) and passes with a notice on
improvements.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ep_harness.cases import EXPECTATIONS, SUITE_NAME
from ep_harness.errors import HarnessError
from ep_harness.records import append_line, numbered_jsonl, write_json, write_jsonl
from ep_harness.reports.analysis import compare_runs, run_problem
from ep_harness.reports.load import load_run, record_problem

BASELINE_DIR = Path("ci/baselines")
HISTORY_KEYS = ("check", "subject", "property", "status", "held", "mismatched", "total", "seconds")


class NotComparable(HarnessError):
    """No baseline of this run's fingerprint (exit code 3)."""


def platform_key(environment: dict) -> str:
    """Baselines of different topologies never mix: emulated hosts are not real GPUs."""
    gpus = environment.get("gpus") or []
    topology = environment.get("topology") or {}
    nodes = f"-{topology['nodes']}-nodes" if topology.get("nodes", 1) > 1 else ""
    if gpus:
        name = re.sub(r"[^A-Za-z0-9]+", "-", gpus[0]).strip("-").lower()
        if topology.get("kind") in ("emulated-hosts", "single-node"):  # each emulation keeps its own baselines
            return f"{name}-x{len(gpus)}-{topology['kind']}-{topology.get('ranks')}{nodes}"
        return f"{name}-x{len(gpus)}{nodes}"
    return f"cpu-{environment.get('backend', 'gloo')}-{environment.get('max_ranks', 4)}{nodes}"


def suite_name(environment: dict) -> str:
    """The suite a run measured, as its baseline is named: its declared `[suite] name` (runs
    recorded before that was kept: the suite file's stem, or "unknown")."""
    if environment.get("suite_name"):
        return environment["suite_name"]
    suite = str(environment.get("suite") or "")
    if suite.endswith(".toml"):
        return Path(suite).stem
    return suite if SUITE_NAME.fullmatch(suite) else "unknown"


def selection_problem(environment: dict) -> str | None:
    """A run of selected checks (--check) is a part of its suite: compared with the whole
    suite's baseline, every check it did not select would read as disappeared."""
    selection = environment.get("selection")
    if selection:
        return (f"this run selected checks (--check {' '.join(selection)}), a part of suite "
                f"{suite_name(environment)!r}; baselines and the gate take whole-suite runs")
    return None


def fingerprint(environment: dict) -> dict:
    """What decides the bits a run measures (not the date, host name or command), and which
    suite's checks it holds: two suites on one platform (the nightly job runs h200-emulated and
    h200-deepep on the same runner) keep a baseline each."""
    libs = environment.get("libraries") or {}
    topology = environment.get("topology") or {}
    fp = {
        "platform": platform_key(environment),
        "suite": suite_name(environment),
        "backend": environment.get("backend"),
        "topology": topology.get("kind"), "ranks": topology.get("ranks", environment.get("max_ranks")),
        "torch": environment.get("torch"), "cuda": environment.get("cuda"), "nccl": environment.get("nccl"),
        "deep_gemm": libs.get("sgl-deep-gemm") or libs.get("deep-gemm"),
        "gpus": environment.get("gpus") or [], "driver": environment.get("driver"),
    }
    deep_ep = libs.get("deep_ep") or libs.get("deep-ep") or libs.get("sgl-deep-ep")
    if deep_ep:  # only where DeepEP is there, so runs without it keep their baselines
        fp["deep_ep"] = deep_ep
    if environment.get("backend") != "nccl":  # CPU GEMMs and reductions: the CPU decides the bits
        fp["cpu"] = environment.get("cpu")
        fp["threads"] = environment.get("threads")  # and so does each rank's thread count (harness/threads.py)
    if topology.get("nodes", 1) > 1:  # ranks over several nodes: other transports, other orders
        fp["nodes"] = topology["nodes"]
    return fp


def fingerprint_hash(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:10]


def describe(fp: dict) -> str:
    cpu = fp.get("cpu") or {}
    parts = [fp["platform"], f"suite {fp.get('suite')}", f"torch {fp['torch']}"]
    parts += [f"{k} {fp[k]}" for k in ("cuda", "nccl", "deep_gemm", "driver") if fp.get(k)]
    if cpu:
        parts.append(f"CPU {cpu.get('model')} ({cpu.get('torch_capability')}"
                     + (f", ONEDNN_MAX_CPU_ISA={cpu['onednn_max_cpu_isa']}" if cpu.get("onednn_max_cpu_isa") else "")
                     + (f", {fp['threads']} thread(s) per rank" if fp.get("threads") is not None else "")
                     + ")")
    return ", ".join(parts)


def baseline_path(run_dir: Path, baseline: Path | None) -> Path:
    if baseline is not None:
        return baseline
    fp = fingerprint(load_run(run_dir).environment)
    return BASELINE_DIR / f"{fp['platform']}-{fp['suite']}-{fingerprint_hash(fp)}.jsonl"


def lean(record: dict) -> dict:
    """What the gate compares: verdicts, counts and the bits' fingerprints (whole and per
    block, which say where bits moved), without the bulky detail."""
    kept = {k: v for k, v in record.items() if k not in ("detail", "rerun", "run_id")}
    blocks = (record.get("detail") or {}).get("bits_blocks")
    if blocks:
        kept["detail"] = {"bits_blocks": blocks}
    return kept


def update_baseline(run_dir: Path, baseline: Path | None = None) -> Path:
    run = load_run(run_dir)
    problem = run_problem(run.records, run.environment) or selection_problem(run.environment)
    if problem:  # such a baseline would make the next interrupted, empty or partial run look unchanged
        raise HarnessError(f"{run_dir}: not recorded as a baseline: {problem}; record a complete run that measured")
    target = baseline_path(run_dir, baseline)
    kept = [lean(r) for r in run.records if r["status"] != "skipped"]
    header = {"fingerprint": fingerprint(run.environment), "checks": len(kept)}  # a truncated file is then seen
    write_jsonl(target, [header, *kept])
    return target


RESTORE = "restore the baseline from git or record it again with `ep-harness baseline update RUN_DIR`"


def _baseline_problem(record: dict, seen: dict, lineno: int) -> str | None:
    """What keeps one baseline line from being compared (a hand-edited or damaged file): what a
    run's record may not be (ep_harness.reports.load.record_problem), an expectation, params or
    counts."""
    problem = record_problem(record, seen, lineno)
    if problem:
        return problem
    if record.get("expect") not in EXPECTATIONS:
        return f"check {record['check'][:80]!r}: expect {record.get('expect')!r} is not one of {', '.join(EXPECTATIONS)}"
    if not isinstance(record.get("params"), dict):
        return f"check {record['check'][:80]!r}: params is not an object"
    for key in ("mismatched", "total"):
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f"check {record['check'][:80]!r}: {key} = {value!r} is not a count"
    return None


def read_baseline(path: Path) -> tuple[dict | None, list[dict]]:
    """The fingerprint and the checks of a baseline; a damaged one is one HarnessError naming
    its line. A baseline with no checks, or fewer than its header says it was recorded with
    (a truncated file), would make every check of a run "new" and pass it: refused."""
    lines = numbered_jsonl(path, RESTORE)
    header = lines[0][1] if lines and "fingerprint" in lines[0][1] else None
    body = lines[1:] if header is not None else lines
    if header is not None and not isinstance(header["fingerprint"], dict):
        raise HarnessError(f"{path}:1: the fingerprint is not an object; {RESTORE}")
    seen = {}
    for lineno, record in body:
        problem = _baseline_problem(record, seen, lineno)
        if problem:
            raise HarnessError(f"{path}:{lineno}: {problem}; {RESTORE}")
    records = [r for _, r in body]
    recorded = (header or {}).get("checks")
    if recorded is not None and (isinstance(recorded, bool) or not isinstance(recorded, int) or recorded < 0):
        raise HarnessError(f"{path}:1: checks = {recorded!r} is not a count; {RESTORE}")
    if not records or (isinstance(recorded, int) and len(records) != recorded):
        said = f" of the {recorded} it was recorded with" if isinstance(recorded, int) else ""
        raise HarnessError(f"{path}: the baseline holds {len(records)} check(s){said}: it is truncated or empty "
                           f"and would pass every check as new; {RESTORE}")
    return (header or {}).get("fingerprint"), records


def _not_comparable(run_dir: Path, fp: dict, path: Path, others: list[Path]) -> NotComparable:
    record = f"record one for this platform with `ep-harness baseline update {run_dir}` (make baseline)"
    if not others:
        return NotComparable(f"not comparable: no baseline at {path} for this run on {describe(fp)}; {record}")
    prints = [(o.name, read_baseline(o)[0]) for o in others[:3]]
    theirs = "; ".join(f"{name} from {describe(fp) if fp else 'an unknown platform'}" for name, fp in prints)
    return NotComparable(f"not comparable: baseline {theirs}, this run on {describe(fp)}; {record}")


def gate(run_dir: Path, baseline: Path | None = None) -> dict:
    """Return the gate result (also written to RUN_DIR/gate.json); NotComparable when no
    baseline of this run's fingerprint exists."""
    run = load_run(run_dir)
    fp = fingerprint(run.environment)
    partial = selection_problem(run.environment)
    if partial:
        raise NotComparable(f"not comparable: {partial}; run the whole suite to gate it")
    path = baseline_path(run_dir, baseline)
    if not path.exists():
        others = [o for o in sorted(path.parent.glob(f"{fp['platform']}-{fp['suite']}-*.jsonl"))
                  if (read_baseline(o)[0] or {}).get("suite") == fp["suite"]] if baseline is None else []
        raise _not_comparable(run_dir, fp, path, others)
    theirs, previous = read_baseline(path)
    if theirs != fp:
        raise _not_comparable(run_dir, fp, path, [path])
    changes = compare_runs(run.records, previous)
    problem = run_problem(run.records, run.environment)
    if problem:  # an interrupted, all-error or all-vacuous run fails whatever its baseline holds
        changes.insert(0, {"check": "(the run)", "kind": "regression", "what": problem, "before": "-",
                           "after": "interrupted" if "interrupted" in problem else "nothing shown"})
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
