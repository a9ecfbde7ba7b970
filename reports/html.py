"""One self-contained report.html: inline CSS and JS, plots as data URIs, no network.

This module turns records into plain values (strings, numbers, lists); the page itself is
reports/templates/report.html.j2, rendered by Jinja2 with autoescape, so every value that
reaches the page, numbers included, is escaped by construction.
"""
from __future__ import annotations

from pathlib import Path

import jinja2

from ep_harness.reports import bars, heatmap
from ep_harness.reports.analysis import FAILING, OUTCOMES, counts, outcome, pairs, verdict, worst_first
from ep_harness.reports.selftest import selftest_context
from ep_harness.reports.text import DASH, cost_text, fmt_count, fmt_float, fmt_int, mismatch_text

FILTERS = (("family", "family"), ("subject", "subject"), ("property", "property"), ("dtype", "dtype"),
           ("ws", "world size"), ("outcome", "outcome"))
# The words on the page for each outcome (ep_harness.reports.analysis.OUTCOMES), pytest's where it has them.
OUTCOME_WORDS = {"failed": "FAILED", "xpass": "XPASS", "error": "ERROR", "interrupted": "INTERRUPTED",
                 "vacuous": "vacuous", "xfail": "xfail", "held": "held", "skipped": "skipped"}
OUTCOME_MEANING = {"failed": "expected to hold, did not (or the order model's prediction missed)",
                   "xpass": "a control that should have shown the violation did not",
                   "error": "the check did not complete", "interrupted": "the run stopped before it",
                   "vacuous": "could not have failed: not a pass", "xfail": "a control that violated, as expected",
                   "held": "held as expected", "skipped": "not run here"}
ENVIRONMENT_KEYS = ("date", "command", "suite", "harness_version", "harness_commit", "host", "backend", "gpus",
                    "driver", "cuda", "nccl", "torch", "python", "os", "cpu")

SHOWN_PAIRS = 8  # the rest of the control -> fix pairs behind one click

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=False,
)


def _text(x) -> str:
    return DASH if x is None else str(x)


def _environment(env: dict) -> list[tuple[str, str]]:
    rows = [(k, _text(env.get(k))) for k in ENVIRONMENT_KEYS if k in env]
    rows.append(("libraries", ", ".join(f"{k} {v}" for k, v in sorted((env.get("libraries") or {}).items()))))
    first = next(iter((env.get("pinned_env") or {}).values()), {})
    rows.append(("pinned variables", " ".join(f"{k}={v}" for k, v in sorted(first.items()))))
    rows += [(f"TP reduction: {k}", _text(v)) for k, v in sorted((env.get("tp_reduction") or {}).items())]
    for job, topo in sorted((env.get("nccl_topology") or {}).items()):
        rings = sorted({tuple(r) for r in (topo.get("rings") or {}).values()})
        rows.append((f"NCCL {job}", f"NCCL {topo.get('version')}: {topo.get('nranks')} ranks, {topo.get('nnodes')} "
                                    f"nodes, {topo.get('local_ranks')} local rank(s), transports "
                                    f"{', '.join(topo.get('transports') or [])}, {topo.get('coll_channels')} channels, "
                                    f"rings {rings}, trees on {len(topo.get('trees') or {})} channels"))
    if env.get("interrupted"):
        rows.append(("interrupted", f"by {env['interrupted']}: a partial run"))
    return rows


def _rank_rows(env: dict) -> list[list[str]]:
    rows = []
    for job, infos in (env.get("ranks") or {}).items():
        for i, info in enumerate(infos):
            nccl_env = " ".join(f"{k}={v}" for k, v in sorted((info.get("env") or {}).items()) if k.startswith("NCCL_"))
            rows.append([job, str(i), _text(info.get("host")), _text(info.get("device")), _text(info.get("nccl")),
                         nccl_env])
    return rows


def _has_detail(r: dict) -> bool:
    return r["status"] in FAILING or (outcome(r) == "xfail" and bool(r.get("mismatched")))


def _row(r: dict) -> dict:
    p, tol = r["params"], r.get("tolerance") or {}
    reference = DASH if r.get("error_vs_reference") is None else \
        f"{fmt_float(r['error_vs_reference'])} (<= {fmt_float(tol.get('allowed'))})"
    seconds = r.get("seconds")
    o = outcome(r)
    return {"status": _text(r["status"]), "outcome": o, "mark": OUTCOME_WORDS[o], "check": _text(r["check"]), "family": _text(r["family"]),
            "subject": _text(r["subject"]), "property": _text(r["property"]), "dtype": _text(p.get("dtype", DASH)),
            "ws": _text(p.get("world_size", DASH)), "expect": _text(r["expect"]), "linked": _has_detail(r),
            "count": fmt_count(r.get("mismatched"), r.get("total")), "predicted": fmt_int(r.get("predicted_mismatched")),
            "max_ulp": fmt_int(r.get("max_ulp")), "max_abs": fmt_float(r.get("max_abs")), "reference": reference,
            "seconds": f"{seconds:.2f}" if isinstance(seconds, (int, float)) else _text(seconds),
            "cost": _text(cost_text(r))}


def _detail(r: dict) -> dict:
    d = r.get("detail") or {}
    mm = d.get("mismatch_map")
    mapping = None
    if mm:
        try:
            mapping = {"columns": f"{mm['columns']:,}", "bins": mm["bins"], "svg": heatmap.map_svg(mm)}
        except (KeyError, TypeError, ValueError):  # a map that is not numbers (a damaged record): not drawn
            mapping = None
    hist = d.get("ulp_histogram") or {}
    top = max(hist.values(), default=0) or 1
    texts = [(f"{key[:-1]} of rank {rank}", text) for key in ("tracebacks", "stacks")
             for rank, text in sorted((d.get(key) or {}).items())]
    if d.get("log"):
        texts.append(("launcher log", d["log"]))
    first = [{**m, "index": str(tuple(m["index"]))} for m in (d.get("first_mismatches") or [])[:6]]
    o = outcome(r)
    return {"check": r["check"], "status": r["status"], "outcome": o, "mark": OUTCOME_WORDS[o],
            "open": r["status"] in FAILING,
            "reason": _text(r.get("reason")), "text": mismatch_text(r), "rerun": _text(r.get("rerun")),
            "inputs": ", ".join(f"{k}={v}" for k, v in sorted(r["params"].items())), "map": mapping,
            "histogram": [(k, f"{v:,}", int(200 * v / top)) for k, v in hist.items() if v], "first": first,
            "texts": texts}


def _name(r: dict) -> str:
    """A check as a pair names it: its case (unique in a suite) and its subject."""
    return f"{r['case']} ({r['subject']})"


def _fix(f: dict) -> str:
    """A fix's count with the evidence that its zero means something."""
    text = f"{_name(f)}: {fmt_count(f['mismatched'], f['total'])}"
    sensitive = (f.get("detail") or {}).get("order_sensitive")
    if sensitive is not None:
        text += f" ({fmt_int(sensitive)} order-sensitive probe elements)"
    return text


def _pairs(records: list[dict]) -> list[dict]:
    """Pairs whose fix failed first (worst outcome among its fixes), then plan order."""
    ranked = sorted(pairs(records), key=lambda pair: min(OUTCOMES.index(outcome(f)) for f in pair[1]))
    return [{"property": control["property"], "dtype": _text(control["params"].get("dtype")),
             "world_size": _text(control["params"].get("world_size")),
             "control": f"{_name(control)}: {fmt_count(control['mismatched'], control['total'])}",
             "fixes": [{"text": _fix(f), "outcome": outcome(f), "mark": OUTCOME_WORDS[outcome(f)]} for f in fixes]}
            for control, fixes in ranked]


def _chips(records: list[dict]) -> list[dict]:
    """The banner: one chip per outcome, coloured only where its count is not zero."""
    n = {o: 0 for o in OUTCOMES}
    for r in records:
        n[outcome(r)] += 1
    return [{"outcome": o, "n": n[o], "word": OUTCOME_WORDS[o], "meaning": OUTCOME_MEANING[o]} for o in OUTCOMES
            if n[o] or o in ("failed", "error", "vacuous", "held", "xfail")]


def render_page(run, changes: list[dict] | None = None, against: str | None = None, trends: dict | None = None) -> str:
    records, env = run.records, run.environment
    rows = [_row(r) for r in worst_first(records)]
    filters = [(key, label, sorted({r[key] for r in rows})) for key, label in FILTERS]
    context = {
        "run_id": run.run_id, "verdict": verdict(records, changes, env.get("interrupted")), "counts": counts(records),
        "topology": _text((env.get("topology") or {}).get("describe")), "command": _text(env.get("command")),
        "node_differences": [_text(line) for line in env.get("node_differences") or []],
        "environment": _environment(env), "rank_rows": _rank_rows(env), "records": records, "chips": _chips(records),
        "summary_svg": bars.summary_svg(records), "pairs": _pairs(records), "shown_pairs": SHOWN_PAIRS,
        "changes": changes, "against": _text(against), "trends": trends, "filters": filters,
        "rows": rows, "costs": any(cost_text(r) for r in records),
        "details": [_detail(r) for r in worst_first(records) if _has_detail(r)],
        "failures": [{"status": r["status"], "mark": OUTCOME_WORDS[outcome(r)], "outcome": outcome(r),
                      "check": _text(r["check"]), "reason": _text(r.get("reason"))}
                     for r in worst_first(records) if r["status"] in (*FAILING, "interrupted")],
        "selftest": selftest_context(run.path),  # only an `ep-harness selftest` run has one
    }
    return _TEMPLATES.get_template("report.html.j2").render(context)
