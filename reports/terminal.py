"""The terminal table for CI logs, in the spirit of nccl-tests: aligned columns, units,
and a final OK / FAILED line."""
from __future__ import annotations

from ep_harness.reports.analysis import FAILING, STAGE_PARAMS, counts, outcome, pairs, verdict
from ep_harness.reports.text import DASH, cost_text, fmt_count, fmt_float, fmt_int

COLUMNS = (
    ("status", 10), ("case", 22), ("property", 19), ("dtype", 8), ("ws", 3),
    ("mismatched / total (%)", 24), ("predicted", 9), ("maxULP", 8), ("max|diff|", 9), ("sec", 6), ("point", 0),
)
# A control's mark, as pytest -v marks an expected failure: XFAIL where it violated as expected,
# XPASS where it did not (a failure here: a control that cannot show the defect proves nothing).
MARKS = {"xfail": "XFAIL", "xpass": "XPASS"}
SHOWN = {"dtype", "world_size", "backend"}  # parameters that have a column of their own


def paint(text: str, status: str, colour: bool) -> str:
    """`text` in its status's colour (red: failing, green: ok, yellow: vacuous) when `colour`."""
    code = "31" if status in (*FAILING, "XPASS") or status.startswith(("FAILED", "INTERRUPTED")) else \
        {"ok": "32", "OK": "32", "vacuous": "33", "XFAIL": "36"}.get(status)
    return f"\033[{code}m{text}\033[0m" if code and colour else text


def _cell(text, width: int, left: bool) -> str:
    text = _one_line(text)
    if width == 0:  # the last column takes what it needs
        return text
    if len(text) > width and left:  # a name may be cut; a number never is (it widens its cell)
        text = text[:width - 1] + "~"
    return text.ljust(width) if left else text.rjust(width)


def _one_line(value) -> str:
    """A value from a results.jsonl is data: no newline or control character reaches the log."""
    return "".join(c if c.isprintable() else "?" for c in str(value))


def _row(values) -> str:
    return "  ".join(_cell(v, w, i < 3) for i, (v, (_, w)) in enumerate(zip(values, COLUMNS))).rstrip()


def varying(records: list[dict]) -> dict[str, list[str]]:
    """Per case, the parameters whose values differ between its checks (what tells rows apart)."""
    seen: dict[str, dict[str, set]] = {}
    for r in records:
        for k, v in r["params"].items():
            seen.setdefault(r["case"], {}).setdefault(k, set()).add(repr(v))
    return {case: sorted(k for k, vs in keys.items() if len(vs) > 1 and k not in SHOWN) for case, keys in seen.items()}


def point(r: dict, keys: list[str]) -> str:
    return " ".join(f"{k}={r['params'][k]}" for k in keys if k in r["params"]) or DASH


def skipped_summary(records: list[dict]) -> list[str]:
    """Skipped checks counted by reason, most common first."""
    reasons: dict[str, int] = {}
    for r in records:
        if r["status"] == "skipped":
            reasons[r.get("reason") or "?"] = reasons.get(r.get("reason") or "?", 0) + 1
    return [f"#   {n:,} x {_one_line(reason)}" for reason, n in sorted(reasons.items(), key=lambda x: -x[1])]


def mark(r: dict) -> str:
    """The status cell: the record's status, a control's XFAIL / XPASS, or `measured` for a
    check that is reported, never asserted (its status is ok: it cannot fail the run)."""
    if measured_only(r):
        return "measured"
    return MARKS.get(outcome(r), str(r["status"]))


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def launch_line(n_checks: int, ranks: int, backend: str, tail: str = "") -> str:
    """'# launching 1 check on 1 gloo rank' (pluralised as it should be)."""
    return f"# launching {_plural(n_checks, 'check')} on {ranks} {backend} rank{'' if ranks == 1 else 's'}{tail}"


def run_header(env: dict, launches: list[tuple[int, int]] | None = None, skipped: int = 0,
               widest: int | None = None, run_id: str | None = None) -> list[str]:
    """What a run is, before any of its rows, as pytest and nccl-tests print it: the harness
    and library versions, then the topology (where a launch has more than one rank: a 1-rank
    launch has none), then the launch plan. `launches`: (world size, checks) per launch;
    `widest`: the largest world size, where no plan is given."""
    version = env.get("harness_version") or DASH
    commit = env.get("harness_commit")
    lines = [_one_line(f"# ep-harness {version}" + (f" ({commit[:12]})" if commit else "") +
                       (f"  run {run_id}" if run_id else "") + f"  suite {env.get('suite_name') or env.get('suite', DASH)}  backend {env.get('backend', DASH)}  "
                       f"torch {env.get('torch', DASH)}  nccl {env.get('nccl') or DASH}  python {env.get('python', DASH)}")]
    cpu = env.get("cpu")
    if isinstance(cpu, dict) and cpu.get("model"):
        lines.append(_one_line(f"# cpu: {cpu['model']}" + (f" ({cpu['torch_capability']})" if cpu.get("torch_capability")
                                                            else "")))
    widest = max((ws for ws, _ in launches), default=1) if launches is not None else widest
    if widest is None or widest > 1:
        lines.append(_one_line(f"# topology: {(env.get('topology') or {}).get('describe', DASH)}"))
    if launches is not None:
        backend = env.get("backend", DASH)
        plan = ", ".join(f"{_plural(n, 'check')} on {ws} {backend} rank{'' if ws == 1 else 's'}" for ws, n in launches)
        lines.append(f"# launch plan: {_plural(len(launches), 'launch', 'launches')}: {plan or 'none'}"
                     + (f"; {skipped:,} skipped" if skipped else ""))
    lines.append(f"# command: {_one_line(env.get('command', DASH))}")
    return lines


def divergence(r: dict) -> str:
    """'; first divergence: ...' of a model check (detail.note) where its reason does not say it."""
    note = (r.get("detail") or {}).get("note")
    if not (isinstance(note, str) and (r.get("detail") or {}).get("first_divergence")) or note in str(r.get("reason")):
        return ""
    return f"; {_one_line(note)}"


def changes_summary(records: list[dict], changes: list[dict]) -> str:
    """'0 regressions, 0 improvements, 0 other changes; 164 checks compared' (one line)."""
    kinds = [c["kind"] for c in changes]
    other = len(kinds) - kinds.count("regression") - kinds.count("improvement")
    return (f"{_plural(kinds.count('regression'), 'regression')}, {_plural(kinds.count('improvement'), 'improvement')}, "
            f"{other:,} other change{'' if other == 1 else 's'}; {_plural(len(records), 'check')} in this run")


def _named(r: dict) -> str:
    """A pair's member by its subject, and its case where the subject alone does not tell it
    (a composed subject is on both sides of its pair, with another stage subject)."""
    return f"{r['case']} ({r['subject']})" if any(k in r["params"] for k in STAGE_PARAMS) else r["subject"]


def header() -> str:
    return "# " + _row([name for name, _ in COLUMNS])


def row(r: dict, keys: list[str], colour: bool = False) -> str:
    """One check's line; `keys`: the parameters that tell it apart within its case; `colour`:
    the status cell in colour (callers pass their console's decision, harness/console.py)."""
    p, seconds = r["params"], r.get("seconds")
    line = "  " + _row([
        mark(r), r["case"], r["property"], p.get("dtype", DASH), p.get("world_size", DASH),
        fmt_count(r.get("mismatched"), r.get("total")), fmt_int(r.get("predicted_mismatched")),
        fmt_int(r.get("max_ulp")), fmt_float(r.get("max_abs")),
        f"{seconds:.2f}" if isinstance(seconds, (int, float)) else _one_line(seconds),
        " ".join(filter(None, [point(r, keys), cost_text(r) and f"[{cost_text(r)}]"])),
    ])
    width = COLUMNS[0][1]
    return line[:2] + paint(line[2:2 + width], mark(r), colour) + line[2 + width:]


def measured_only(r: dict) -> bool:
    """A check whose expectation is `measure`, measured: a fact about this machine's library."""
    return r.get("expect") == "measure" and r.get("status") == "ok"


def render(records: list[dict], environment: dict, changes: list[dict] | None = None,
           show_skipped: bool = False, rows: bool = True, colour: bool = False) -> str:
    """The whole table; rows=False when they were already streamed as the checks finished."""
    env = environment or {}
    run_id = records[0]["run_id"] if records else "(empty)"
    if rows:  # streamed rows had the run's header printed before them (harness/run/verify.py)
        ran = [r for r in records if r["status"] != "skipped"]
        widest = max((r["params"].get("world_size") for r in ran if isinstance(r["params"].get("world_size"), int)),
                     default=None)
        lines = [*run_header(env, widest=widest, run_id=run_id), "#"]
    else:
        lines = []
    keys = varying(records)
    if rows:
        lines.append(header())
        lines += [row(r, keys[r["case"]], colour) for r in records if r["status"] != "skipped" or show_skipped]
    elif show_skipped:
        lines += [row(r, keys[r["case"]], colour) for r in records if r["status"] == "skipped"]
    skipped = skipped_summary(records)
    if skipped and not show_skipped:
        lines.append("# skipped (--show-skipped lists them), by reason:")
        lines += skipped
    problems = [r for r in records if r["status"] in FAILING]
    if problems:
        lines.append("#")
        lines.append("# failures:")
        for r in problems:
            lines.append(f"#   {mark(r)}: {_one_line(r['check'])}: {_one_line(r['reason'])}{divergence(r)}")
            lines.append(f"#     rerun: {_one_line(r['rerun'])}")
    vac = [r for r in records if r["status"] == "vacuous"]
    if vac:
        lines.append(f"# vacuous (could not fail, not counted as passes): {len(vac)}")
        for r in vac[:5]:
            lines.append(f"#   {_one_line(r['check'])}: {_one_line(r['reason'])}")
    measured = [r for r in records if measured_only(r)]
    if measured:
        lines.append(f"# measured, not asserted (this machine's library, CPU and thread count decide it): "
                     f"{len(measured)}")
        for r in measured[:8]:
            lines.append(f"#   {_one_line(r['check'])}: {fmt_count(r.get('mismatched'), r.get('total'))}")
        if len(measured) > 8:
            lines.append(f"#   ... {len(measured) - 8} more in report.html")
    before_after = pairs(records)
    if before_after:
        lines.append("#")
        lines.append("# before -> after (control -> fix, same inputs):")
        for control, fixes in before_after[:12]:
            fix_txt = "; ".join(f"{_named(f)}: {fmt_count(f['mismatched'], f['total'])}" for f in fixes)
            lines.append(_one_line(f"#   {control['property']} {control['params'].get('dtype', '')} "
                                   f"ws={control['params'].get('world_size', '')}: {_named(control)}: "
                                   f"{fmt_count(control['mismatched'], control['total'])} -> {fix_txt}"))
        if len(before_after) > 12:
            lines.append(f"#   ... {len(before_after) - 12} more pairs in report.html")
    if changes is not None:  # compared with an earlier run: say so, even when nothing changed
        lines.append("#")
        lines.append(f"# against the earlier run: {changes_summary(records, changes)}")
    if changes:
        lines.append("# changes against the earlier run:")
        for ch in changes:
            lines.append(_one_line(f"#   {ch['kind']}: {ch['check']}: {ch['what']} ({ch['before']} -> {ch['after']})"))
    c = counts(records)
    summary = ", ".join(f"{v} {k}" for k, v in c.items())
    if measured:
        summary += f" ({len(measured)} of the ok measured, not asserted)"
    lines.append("#")
    said = verdict(records, changes, env.get("interrupted"))
    lines.append(f"# {paint(said, said, colour)}: {summary}")
    return "\n".join(lines)
