"""One self-contained report.html: inline CSS and JS, plots as data URIs, no network."""
from __future__ import annotations

import html
import json

import pandas as pd

from reports import plots
from reports.analysis import counts, failed, pairs
from reports.text import DASH, fmt_count, fmt_float, fmt_int, mismatch_text

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 2em 3em;color:#222}
h1{font-size:1.4em;margin:.8em 0 .2em} h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.banner{display:flex;gap:.6em;flex-wrap:wrap;margin:.6em 0}
.pill{padding:.35em .8em;border-radius:1em;font-weight:600;background:#eee}
.pill.ok{background:#d5f5e3}.pill.unexpected,.pill.error{background:#f5b7b1}.pill.vacuous{background:#fdebd0}
.verdict{font-size:1.2em;font-weight:700;padding:.4em .8em;border-radius:.3em;display:inline-block}
.verdict.OK{background:#d5f5e3}.verdict.FAILED{background:#f5b7b1}
table{border-collapse:collapse;font-size:12.5px} td,th{border:1px solid #ddd;padding:2px 6px;text-align:left}
th{background:#f4f4f4;position:sticky;top:0} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.unexpected td,tr.error td{background:#fdedec} tr.vacuous td{background:#fef5e7}
tr.skipped td{color:#888} code,pre{font:12px ui-monospace,monospace} pre{background:#f7f7f7;padding:.6em;overflow:auto}
details{margin:.4em 0;border:1px solid #e3e3e3;border-radius:4px;padding:.3em .6em}
summary{cursor:pointer;font-weight:600} .filters select{margin-right:.6em}
img.map{image-rendering:pixelated;width:640px;border:1px solid #ccc} .hist span{display:inline-block;background:#c0392b;height:10px}
.regression{color:#b03a2e;font-weight:600}.improvement{color:#1e8449;font-weight:600}
"""

FILTER_JS = """
function applyFilters(){
  const sel=[...document.querySelectorAll('.filters select')];
  document.querySelectorAll('#summary tbody tr').forEach(tr=>{
    const show=sel.every(s=>s.value===''||tr.dataset[s.name]===s.value);
    tr.style.display=show?'':'none';});
  document.getElementById('shown').textContent=
    [...document.querySelectorAll('#summary tbody tr')].filter(t=>t.style.display!=='none').length;
}
document.querySelectorAll('.filters select').forEach(s=>s.addEventListener('change',applyFilters));
"""

FILTERS = (("family", "family"), ("subject", "subject"), ("property", "property"), ("dtype", "dtype"),
           ("ws", "world size"), ("status", "status"))


def esc(x) -> str:
    return html.escape(DASH if x is None else str(x))


def frame(records: list[dict]) -> pd.DataFrame:
    rows = [{
        "check": r["check"], "family": r["family"], "subject": r["subject"], "property": r["property"],
        "dtype": str(r["params"].get("dtype", DASH)), "ws": str(r["params"].get("world_size", DASH)),
        "status": r["status"], "expect": r["expect"], "mismatched": r.get("mismatched"),
        "total": r.get("total"),
    } for r in records]
    return pd.DataFrame(rows, columns=["check", "family", "subject", "property", "dtype", "ws", "status",
                                       "expect", "mismatched", "total"])


def _environment(env: dict) -> str:
    if not env:
        return "<p>No environment.json in this run.</p>"
    keys = ("date", "command", "suite", "harness_commit", "host", "backend", "gpus", "driver", "cuda", "nccl",
            "torch", "python", "os")
    rows = "".join(f"<tr><th>{esc(k)}</th><td><code>{esc(env.get(k))}</code></td></tr>" for k in keys if k in env)
    libs = ", ".join(f"{k} {v}" for k, v in sorted(env.get("libraries", {}).items()))
    rows += f"<tr><th>libraries</th><td>{esc(libs)}</td></tr>"
    for key, value in sorted((env.get("tp_reduction") or {}).items()):
        rows += f"<tr><th>TP reduction: {esc(key)}</th><td>{esc(value)}</td></tr>"
    for job, topo in sorted((env.get("nccl_topology") or {}).items()):
        rings = {tuple(r) for r in topo.get("rings", {}).values()}
        rows += (f"<tr><th>NCCL {esc(job)}</th><td>NCCL {esc(topo.get('version'))}: {esc(topo.get('nranks'))} ranks, "
                 f"{esc(topo.get('nnodes'))} nodes, {esc(topo.get('local_ranks'))} local rank(s), transports "
                 f"{esc(', '.join(topo.get('transports', [])))}, {esc(topo.get('coll_channels'))} channels, "
                 f"rings {esc(sorted(rings))}, trees on {len(topo.get('trees', {}))} channels</td></tr>")
    pinned = env.get("pinned_env", {})
    first = next(iter(pinned.values()), {})
    rows += "<tr><th>pinned variables</th><td><code>" + esc(" ".join(f"{k}={v}" for k, v in sorted(first.items()))) \
        + "</code></td></tr>"
    ranks = env.get("ranks", {})
    rank_rows = ""
    for job, infos in ranks.items():
        for i, info in enumerate(infos):
            env_txt = " ".join(f"{k}={v}" for k, v in sorted(info.get("env", {}).items()) if k.startswith("NCCL_"))
            rank_rows += (f"<tr><td>{esc(job)}</td><td>{i}</td><td>{esc(info.get('host'))}</td>"
                          f"<td>{esc(info.get('device'))}</td><td>{esc(info.get('nccl'))}</td>"
                          f"<td><code>{esc(env_txt)}</code></td></tr>")
    detail = ""
    if rank_rows:
        detail = ("<details><summary>as every rank saw it</summary><table><tr><th>launch</th><th>rank</th>"
                  "<th>host</th><th>device</th><th>NCCL</th><th>NCCL_* variables</th></tr>"
                  f"{rank_rows}</table></details>")
    return f"<table>{rows}</table>{detail}"


def _summary_table(records: list[dict], df: pd.DataFrame) -> str:
    selects = []
    for key, label in FILTERS:
        values = sorted(df[key].dropna().unique()) if key in df else []
        opts = "".join(f'<option value="{esc(v)}">{esc(v)}</option>' for v in values)
        selects.append(f'<label>{label} <select name="{key}"><option value="">all</option>{opts}</select></label>')
    head = ("<tr><th>status</th><th>check</th><th>expect</th><th>mismatched / total</th><th>predicted</th>"
            "<th>max ULP</th><th>max |diff|</th><th>error vs reference (tolerance)</th><th>seconds</th></tr>")
    body = []
    for r in records:
        p = r["params"]
        tol = r.get("tolerance") or {}
        ref = DASH if r.get("error_vs_reference") is None else (
            f"{fmt_float(r['error_vs_reference'])} (&le; {fmt_float(tol.get('allowed'))})")
        data = (f'data-family="{esc(r["family"])}" data-subject="{esc(r["subject"])}" '
                f'data-property="{esc(r["property"])}" data-dtype="{esc(p.get("dtype", DASH))}" '
                f'data-ws="{esc(p.get("world_size", DASH))}" data-status="{esc(r["status"])}"')
        link = f'<a href="#d-{esc(r["check"])}">{esc(r["check"])}</a>' if _has_detail(r) else esc(r["check"])
        body.append(
            f'<tr class="{esc(r["status"])}" {data}><td>{esc(r["status"])}</td><td>{link}</td>'
            f'<td>{esc(r["expect"])}</td><td class="num">{fmt_count(r.get("mismatched"), r.get("total"))}</td>'
            f'<td class="num">{fmt_int(r.get("predicted_mismatched"))}</td>'
            f'<td class="num">{fmt_int(r.get("max_ulp"))}</td><td class="num">{fmt_float(r.get("max_abs"))}</td>'
            f'<td class="num">{ref}</td><td class="num">{r.get("seconds", 0):.2f}</td></tr>')
    return (f'<div class="filters">{"".join(selects)} <span id="shown">{len(records)}</span> shown</div>'
            f'<table id="summary"><thead>{head}</thead><tbody>{"".join(body)}</tbody></table>')


def _has_detail(r: dict) -> bool:
    return r["status"] in ("unexpected", "error") or (r["expect"] == "violated" and r.get("mismatched"))


def _pairs(records: list[dict]) -> str:
    rows = []
    for control, fixes in pairs(records):
        p = control["params"]
        fix_txt = "<br>".join(f"{esc(f['subject'])}: {fmt_count(f['mismatched'], f['total'])}" for f in fixes)
        rows.append(f"<tr><td>{esc(control['property'])}</td><td>{esc(p.get('dtype'))}</td>"
                    f"<td>{esc(p.get('world_size'))}</td><td>{esc(control['subject'])}: "
                    f"{fmt_count(control['mismatched'], control['total'])}</td><td>&rarr;</td><td>{fix_txt}</td></tr>")
    if not rows:
        return "<p>No control in this run has a fix checked at the same point.</p>"
    return ("<table><tr><th>property</th><th>dtype</th><th>world size</th><th>control (before)</th><th></th>"
            f"<th>fix (after)</th></tr>{''.join(rows)}</table>")


def _histogram(hist: dict) -> str:
    if not hist:
        return ""
    top = max(hist.values()) or 1
    rows = "".join(f"<tr><td>{esc(k)} ULP</td><td class='num'>{v:,}</td><td class='hist'>"
                   f"<span style='width:{int(200 * v / top)}px'></span></td></tr>" for k, v in hist.items())
    return f"<table><tr><th>ULP distance</th><th>elements</th><th></th></tr>{rows}</table>"


def _first_mismatches(items: list[dict]) -> str:
    if not items:
        return ""
    rows = "".join(
        f"<tr><td>{esc(tuple(m['index']))}</td><td>{esc(m['row'])}</td><td>{esc(m['actual'])}</td>"
        f"<td><code>{esc(m['actual_bits'])}</code></td><td>{esc(m['expected'])}</td>"
        f"<td><code>{esc(m['expected_bits'])}</code></td><td class='num'>{m['ulp']}</td></tr>" for m in items[:6])
    return ("<table><tr><th>index</th><th>copy</th><th>actual</th><th>bits</th><th>expected</th><th>bits</th>"
            f"<th>ULP</th></tr>{rows}</table>")


def _details(records: list[dict]) -> str:
    blocks = []
    for r in records:
        if not _has_detail(r):
            continue
        d = r.get("detail", {})
        point = ", ".join(f"{k}={v}" for k, v in sorted(r["params"].items()))
        parts = [f"<p>{esc(r['reason'])}</p>", f"<p>Inputs: <code>{esc(point)}</code> (the seed fixes every value)</p>",
                 f"<pre>{esc(mismatch_text(r))}</pre>"]
        mm = d.get("mismatch_map")
        if mm:
            h = max(12, 640 * len(mm["rows"]) // max(mm["bins"], 1))
            parts.append(f"<p>Where bits differ: rows are the compared copies ({esc(', '.join(mm['rows'][:6]))}"
                         f"{', ...' if len(mm['rows']) > 6 else ''}), columns are {mm['columns']:,} elements in "
                         f"{mm['bins']} bins; darker = more differ.</p>"
                         f'<img class="map" alt="mismatch map" style="height:{min(h, 320)}px" '
                         f'src="data:image/png;base64,{plots.map_png(mm)}">')
        parts.append(_histogram(d.get("ulp_histogram")))
        parts.append(_first_mismatches(d.get("first_mismatches")))
        for key in ("tracebacks", "stacks"):
            for rank, text in sorted((d.get(key) or {}).items()):
                parts.append(f"<p>{key[:-1]} of rank {esc(rank)}:</p><pre>{esc(text)}</pre>")
        if d.get("log"):
            parts.append(f"<p>launcher log:</p><pre>{esc(d['log'])}</pre>")
        parts.append(f"<p>Rerun: <code>{esc(r['rerun'])}</code></p>")
        is_open = " open" if r["status"] in ("unexpected", "error") else ""
        blocks.append(f'<details id="d-{esc(r["check"])}"{is_open}><summary>{esc(r["status"])}: '
                      f'{esc(r["check"])}</summary>{"".join(parts)}</details>')
    return "".join(blocks) or "<p>No failing check and no measured control.</p>"


def _changes(changes: list[dict] | None, against: str | None) -> str:
    if changes is None:
        return ""
    if not changes:
        return f"<h2>Against {esc(against)}</h2><p>No change.</p>"
    rows = "".join(f"<tr><td class='{esc(c['kind'])}'>{esc(c['kind'])}</td><td>{esc(c['check'])}</td>"
                   f"<td>{esc(c['what'])}</td><td>{esc(c['before'])}</td><td>{esc(c['after'])}</td></tr>"
                   for c in changes)
    return (f"<h2>Against {esc(against)}</h2><table><tr><th>kind</th><th>check</th><th>what</th><th>before</th>"
            f"<th>after</th></tr>{rows}</table>")


def render_page(run, changes: list[dict] | None = None, against: str | None = None,
                extra_sections: str = "") -> str:
    records, env = run.records, run.environment
    df = frame(records)
    c = counts(records)
    verdict = "FAILED" if failed(records) else "OK"
    banner = "".join(f'<span class="pill {k}">{v} {k}</span>' for k, v in c.items())
    if not records:
        body = "<p><strong>This run has no records</strong>: the suite selected no check.</p>"
    else:
        fig = plots.summary_figure(df)
        fig_html = (f'<img class="plot" alt="mismatch summary" src="data:image/png;base64,{fig}">'
                    if fig else "<p>No invariance measurement to plot.</p>")
        body = (f"<h2>Mismatch summary</h2>{fig_html}"
                f"<h2>Before / after</h2>{_pairs(records)}"
                f"{_changes(changes, against)}{extra_sections}"
                f"<h2>All checks</h2>{_summary_table(records, df)}"
                f"<h2>Details: failures and controls</h2>{_details(records)}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>ep-harness {esc(run.run_id)}</title>"
            f"<style>{CSS}</style></head><body>"
            f"<h1>ep-harness run {esc(run.run_id)}</h1>"
            f"<div class='verdict {verdict}'>{verdict}</div><div class='banner'>{banner}</div>"
            f"<p>Topology: <strong>{esc((env.get('topology') or {}).get('describe'))}</strong></p>"
            f"<p>Command: <code>{esc(env.get('command'))}</code></p>"
            f"<h2>Environment</h2>{_environment(env)}{body}"
            f"<script>{FILTER_JS}</script><script type='application/json' id='counts'>"
            f"{json.dumps(c)}</script></body></html>")
