"""One self-contained report.html: inline CSS and JS, plots as data URIs, no network.

This module turns records into plain values (strings, numbers, lists); the page itself is
reports/templates/report.html.j2, rendered by Jinja2 with autoescape, so every value that
reaches the page, numbers included, is escaped by construction.
"""
from __future__ import annotations

from pathlib import Path

import jinja2
import pandas as pd

from ep_harness.reports import plots
from ep_harness.reports.analysis import FAILING, counts, pairs, verdict
from ep_harness.reports.selftest import selftest_context
from ep_harness.reports.text import DASH, cost_text, fmt_count, fmt_float, fmt_int, mismatch_text

FILTERS = (("family", "family"), ("subject", "subject"), ("property", "property"), ("dtype", "dtype"),
           ("ws", "world size"), ("status", "status"))
ENVIRONMENT_KEYS = ("date", "command", "suite", "harness_version", "harness_commit", "host", "backend", "gpus",
                    "driver", "cuda", "nccl", "torch", "python", "os", "cpu")

_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=False,
)


def frame(records: list[dict]) -> pd.DataFrame:
    rows = [{
        "check": r["check"], "family": r["family"], "subject": r["subject"], "property": r["property"],
        "dtype": str(r["params"].get("dtype", DASH)), "ws": str(r["params"].get("world_size", DASH)),
        "status": r["status"], "expect": r["expect"], "mismatched": r.get("mismatched"),
        "total": r.get("total"),
    } for r in records]
    df = pd.DataFrame(rows, columns=["check", "family", "subject", "property", "dtype", "ws", "status",
                                     "expect", "mismatched", "total"])
    for column in ("mismatched", "total"):  # a value that is not a number plots as missing
        df[column] = pd.to_numeric(df[column], errors="coerce")
    return df


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
    return r["status"] in FAILING or (r["expect"] == "violated" and bool(r.get("mismatched")))


def _row(r: dict) -> dict:
    p, tol = r["params"], r.get("tolerance") or {}
    reference = DASH if r.get("error_vs_reference") is None else \
        f"{fmt_float(r['error_vs_reference'])} (<= {fmt_float(tol.get('allowed'))})"
    seconds = r.get("seconds")
    return {"status": _text(r["status"]), "check": _text(r["check"]), "family": _text(r["family"]),
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
        mapping = {"rows": ", ".join(mm["rows"][:6]) + (", ..." if len(mm["rows"]) > 6 else ""),
                   "columns": f"{mm['columns']:,}", "bins": mm["bins"], "png": plots.map_png(mm),
                   "height": min(max(12, 640 * len(mm["rows"]) // max(mm["bins"], 1)), 320)}
    hist = d.get("ulp_histogram") or {}
    top = max(hist.values(), default=0) or 1
    texts = [(f"{key[:-1]} of rank {rank}", text) for key in ("tracebacks", "stacks")
             for rank, text in sorted((d.get(key) or {}).items())]
    if d.get("log"):
        texts.append(("launcher log", d["log"]))
    first = [{**m, "index": str(tuple(m["index"]))} for m in (d.get("first_mismatches") or [])[:6]]
    return {"check": r["check"], "status": r["status"], "open": r["status"] in FAILING,
            "reason": _text(r.get("reason")), "text": mismatch_text(r), "rerun": _text(r.get("rerun")),
            "inputs": ", ".join(f"{k}={v}" for k, v in sorted(r["params"].items())), "map": mapping,
            "histogram": [(k, f"{v:,}", int(200 * v / top)) for k, v in hist.items()], "first": first,
            "texts": texts}


def _fix(f: dict) -> str:
    """A fix's count with the evidence that its zero means something."""
    text = f"{f['subject']}: {fmt_count(f['mismatched'], f['total'])}"
    sensitive = (f.get("detail") or {}).get("order_sensitive")
    if sensitive is not None:
        text += f" ({fmt_int(sensitive)} probe elements would change under reordering)"
    return text


def _pairs(records: list[dict]) -> list[dict]:
    return [{"property": control["property"], "dtype": _text(control["params"].get("dtype")),
             "world_size": _text(control["params"].get("world_size")),
             "control": f"{control['subject']}: {fmt_count(control['mismatched'], control['total'])}",
             "fixes": [_fix(f) for f in fixes]}
            for control, fixes in pairs(records)]


def render_page(run, changes: list[dict] | None = None, against: str | None = None, trends: dict | None = None) -> str:
    records, env = run.records, run.environment
    df = frame(records)
    filters = [(key, label, sorted(df[key].dropna().unique()) if key in df else []) for key, label in FILTERS]
    context = {
        "run_id": run.run_id, "verdict": verdict(records, changes), "counts": counts(records),
        "topology": _text((env.get("topology") or {}).get("describe")), "command": _text(env.get("command")),
        "node_differences": [_text(line) for line in env.get("node_differences") or []],
        "environment": _environment(env), "rank_rows": _rank_rows(env), "records": records,
        "summary_png": plots.summary_figure(df) if records else None, "pairs": _pairs(records),
        "changes": changes, "against": _text(against), "trends": trends, "filters": filters,
        "rows": [_row(r) for r in records], "costs": any(cost_text(r) for r in records), "details": [_detail(r) for r in records if _has_detail(r)],
        "failures": [{"status": r["status"], "check": _text(r["check"]), "reason": _text(r.get("reason"))}
                     for r in records if r["status"] in (*FAILING, "interrupted")],
        "selftest": selftest_context(run.path),  # only an `ep-harness selftest` run has one
    }
    return _TEMPLATES.get_template("report.html.j2").render(context)
