"""The terminal table for CI logs, in the spirit of nccl-tests: aligned columns, units,
and a final OK / FAILED line."""
from __future__ import annotations

from reports.analysis import counts, pairs, verdict
from reports.text import DASH, fmt_count, fmt_float, fmt_int

COLUMNS = (
    ("status", 10), ("case", 26), ("property", 19), ("dtype", 8), ("ws", 3),
    ("mismatched / total (%)", 26), ("predicted", 9), ("maxULP", 7), ("max|diff|", 9), ("sec", 6),
)


def _cell(text, width: int, left: bool) -> str:
    text = str(text)
    if len(text) > width:
        text = text[:width - 1] + "~"
    return text.ljust(width) if left else text.rjust(width)


def _row(values) -> str:
    return "  ".join(_cell(v, w, i < 3) for i, (v, (_, w)) in enumerate(zip(values, COLUMNS)))


def render(records: list[dict], environment: dict, changes: list[dict] | None = None) -> str:
    env = environment or {}
    lines = [
        f"# ep-harness run {records[0]['run_id'] if records else '(empty)'}  suite {env.get('suite', DASH)}  "
        f"backend {env.get('backend', DASH)}  torch {env.get('torch', DASH)}  nccl {env.get('nccl') or DASH}",
        f"# topology: {(env.get('topology') or {}).get('describe', DASH)}",
        f"# command: {env.get('command', DASH)}",
        "#",
        "# " + _row([name for name, _ in COLUMNS]),
    ]
    for r in records:
        p = r["params"]
        lines.append("  " + _row([
            r["status"], r["case"], r["property"], p.get("dtype", DASH), p.get("world_size", DASH),
            fmt_count(r.get("mismatched"), r.get("total")), fmt_int(r.get("predicted_mismatched")),
            fmt_int(r.get("max_ulp")), fmt_float(r.get("max_abs")), f"{r.get('seconds', 0):.2f}",
        ]))
    problems = [r for r in records if r["status"] in ("unexpected", "error")]
    if problems:
        lines.append("#")
        lines.append("# failures:")
        for r in problems:
            lines.append(f"#   {r['status']}: {r['check']}: {r['reason']}")
            lines.append(f"#     rerun: {r['rerun']}")
    vac = [r for r in records if r["status"] == "vacuous"]
    if vac:
        lines.append(f"# vacuous (could not fail, not counted as passes): {len(vac)}")
        for r in vac[:5]:
            lines.append(f"#   {r['check']}: {r['reason']}")
    before_after = pairs(records)
    if before_after:
        lines.append("#")
        lines.append("# before -> after (control -> fix, same inputs):")
        for control, fixes in before_after[:12]:
            fix_txt = "; ".join(f"{f['subject']}: {fmt_count(f['mismatched'], f['total'])}" for f in fixes)
            lines.append(f"#   {control['property']} {control['params'].get('dtype', '')} "
                         f"ws={control['params'].get('world_size', '')}: {control['subject']}: "
                         f"{fmt_count(control['mismatched'], control['total'])} -> {fix_txt}")
        if len(before_after) > 12:
            lines.append(f"#   ... {len(before_after) - 12} more pairs in report.html")
    if changes:
        lines.append("#")
        lines.append("# changes against the earlier run:")
        for ch in changes:
            lines.append(f"#   {ch['kind']}: {ch['check']}: {ch['what']} ({ch['before']} -> {ch['after']})")
    c = counts(records)
    summary = ", ".join(f"{v} {k}" for k, v in c.items())
    lines.append("#")
    lines.append(f"# {verdict(records)}: {summary}")
    return "\n".join(lines)
