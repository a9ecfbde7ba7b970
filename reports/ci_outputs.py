"""Renderings of a run for CI systems: JUnit XML (one testcase per check), a short Markdown
verdict (GitHub's step summary, a pull-request comment), and GitHub Actions annotations."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from ep_harness.reports.analysis import counts, pairs, verdict
from ep_harness.reports.text import fmt_count, mismatch_text

FAILURE, ERROR, SKIPPED = ("unexpected",), ("error", "interrupted"), ("skipped", "vacuous")


# What XML 1.0 cannot hold at all, escaped or not: control characters other than tab, newline
# and carriage return, lone surrogates, U+FFFE and U+FFFF. One in an error message (a
# subject's exception text, a terminal colour code) made the whole JUnit file unparseable.
_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml(text) -> str:
    """`text` as XML can carry it: each illegal character written as a visible \\xNN / \\uNNNN."""
    return _XML_ILLEGAL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else
                            f"\\u{ord(m.group()):04x}", str(text))


def junit_xml(records: list[dict], run_id: str) -> str:
    """Failures carry the mismatch text; a vacuous check is reported skipped, with why it
    could not fail (it is not a pass)."""
    c = counts(records)
    suite = ET.Element("testsuite", name=_xml(f"ep-harness {run_id}"), tests=str(len(records)),
                       failures=str(sum(c.get(s, 0) for s in FAILURE)), errors=str(sum(c.get(s, 0) for s in ERROR)),
                       skipped=str(sum(c.get(s, 0) for s in SKIPPED)),
                       time=f"{sum(float(r.get('seconds') or 0) for r in records):.3f}")
    for r in records:
        case = ET.SubElement(suite, "testcase", classname=_xml(r["case"]), name=_xml(r["check"]),
                             time=f"{float(r.get('seconds') or 0):.3f}")
        status, reason = r["status"], _xml(r.get("reason") or "")
        if status in FAILURE:
            ET.SubElement(case, "failure", message=reason).text = _xml(mismatch_text(r))
        elif status in ERROR:
            ET.SubElement(case, "error", message=reason).text = _xml(f"{reason}\nRerun: {r.get('rerun')}")
        elif status in SKIPPED:
            ET.SubElement(case, "skipped", message=_xml(f"{status}: {reason}"))
    root = ET.Element("testsuites")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _md(text) -> str:
    """A value as Markdown table text: one line, no table or HTML syntax."""
    return "".join(c if c.isprintable() else " " for c in str(text)).replace("|", "\\|").replace("<", "&lt;")


def summary_markdown(records: list[dict], environment: dict, regressions: list[dict] = ()) -> str:
    c = counts(records)
    head = verdict(records) if not regressions else "FAILED"
    lines = [f"## ep-harness: {head}", "",
             f"{', '.join(f'{n} {s}' for s, n in c.items() if n)} - "
             f"{_md((environment.get('topology') or {}).get('describe', ''))}", ""]
    if regressions:
        lines += ["### Regressions", "", "| check | what | before | after |", "|---|---|---|---|"]
        lines += [f"| {_md(x['check'])} | {_md(x['what'])} | {_md(x['before'])} | {_md(x['after'])} |"
                  for x in regressions] + [""]
    problems = [r for r in records if r["status"] in FAILURE + ERROR]
    if problems:
        lines += ["### Failures", "", "| status | check | reason |", "|---|---|---|"]
        lines += [f"| {r['status']} | {_md(r['check'])} | {_md(r.get('reason'))} |" for r in problems[:50]] + [""]
    before_after = pairs(records)
    if before_after:
        lines += ["### Control -> fix (same inputs)", "", "| property | point | control | fixes |", "|---|---|---|---|"]
        for control, fixes in before_after[:20]:
            p = control["params"]
            lines.append(f"| {_md(control['property'])} | {_md(p.get('dtype', ''))} ws={_md(p.get('world_size', ''))} | "
                         f"{_md(control['subject'])}: {fmt_count(control['mismatched'], control['total'])} | "
                         + "; ".join(f"{_md(f['subject'])}: {fmt_count(f['mismatched'], f['total'])}" for f in fixes)
                         + " |")
    return "\n".join(lines) + "\n"


def _escape_data(text: str) -> str:
    return str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(records: list[dict]) -> list[str]:
    """`::error` workflow commands for unexpected and error checks; every value escaped, so a
    record cannot forge another command."""
    lines = []
    for r in records:
        if r["status"] in FAILURE + ERROR:
            title = _escape_property(f"ep-harness {r['check']}")
            lines.append(f"::error title={title}::{_escape_data(str(r['status']) + ': ' + str(r.get('reason')))}")
    return lines
