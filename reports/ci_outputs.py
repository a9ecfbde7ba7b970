"""Renderings of a run for CI systems: JUnit XML (one testcase per check), a short Markdown
verdict (GitHub's step summary, a pull-request comment), and GitHub Actions annotations."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from ep_harness.reports.analysis import counts, nothing_shown, pairs, verdict
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
    could not fail (it is not a pass); a run whose every check that ran was vacuous, which
    fails, has one more testcase, `run`, failed with that reason (the XML and the exit code agree)."""
    c = counts(records)
    vacuous_only = nothing_shown(records)  # the run fails (exit 1) though no check did: one testcase says why
    suite = ET.Element("testsuite", name=_xml(f"ep-harness {run_id}"), tests=str(len(records) + bool(vacuous_only)),
                       failures=str(sum(c.get(s, 0) for s in FAILURE) + bool(vacuous_only)),
                       errors=str(sum(c.get(s, 0) for s in ERROR)),
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
    if vacuous_only:
        case = ET.SubElement(suite, "testcase", classname="ep-harness", name="run", time="0.000")
        ET.SubElement(case, "failure", message=_xml(vacuous_only)).text = _xml(vacuous_only)
    root = ET.Element("testsuites")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _md(text) -> str:
    """A value as Markdown table text: one line, no table or HTML syntax."""
    return "".join(c if c.isprintable() else " " for c in str(text)).replace("|", "\\|").replace("<", "&lt;")


def summary_markdown(records: list[dict], environment: dict, regressions: list[dict] = ()) -> str:
    c = counts(records)
    head = verdict(records, interrupted=environment.get("interrupted")) if not regressions else "FAILED"
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


_CASE_NAME = re.compile(r'^\s*name\s*=\s*"([^"]*)"')


def case_lines(suite_path) -> dict[str, int]:
    """Each case's name -> the line of its `name = ...` in the suite file (1-based); {} where
    the file cannot be read (a run rendered on another machine)."""
    try:
        text = open(suite_path, encoding="utf-8").read()
    except (OSError, TypeError, ValueError):
        return {}
    lines, in_case = {}, False
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("["):
            in_case = stripped == "[[case]]"
        elif in_case and (m := _CASE_NAME.match(line)):
            lines.setdefault(m.group(1), n)
            in_case = False
    return lines


def _annotation_file(suite_path) -> str | None:
    """The suite file as GitHub names it: relative to the working directory (the checkout)
    where it lies inside it."""
    import os

    if not suite_path:
        return None
    path = os.path.abspath(str(suite_path))
    rel = os.path.relpath(path, os.getcwd())
    return path if rel.startswith("..") else rel


def github_annotations(records: list[dict], environment: dict | None = None) -> list[str]:
    """`::error` workflow commands for unexpected and error checks, each on the file and line
    of its case where the suite file is at hand; every value escaped, so a record cannot
    forge another command."""
    suite = (environment or {}).get("suite")
    where = case_lines(suite) if suite else {}
    file = _annotation_file(suite) if where else None
    lines = []
    for r in records:
        if r["status"] in FAILURE + ERROR:
            title = _escape_property(f"ep-harness {r['check']}")
            place = f"file={_escape_property(file)},line={where[r['case']]}," if file and r.get("case") in where else ""
            lines.append(f"::error {place}title={title}::{_escape_data(str(r['status']) + ': ' + str(r.get('reason')))}")
    return lines
