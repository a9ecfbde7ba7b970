"""Render a run directory: terminal table to stdout, report.html beside the records."""
from __future__ import annotations

from pathlib import Path

from ep_harness import console
from ep_harness.records import write_atomic
from ep_harness.reports import terminal
from ep_harness.reports.analysis import compare_runs, verdict
from ep_harness.reports.html import render_page
from ep_harness.reports.load import load_run


def render_run(run_dir: Path, against: Path | None = None, out: Path | None = None, quiet: bool = False,
               history: Path | None = None, show_skipped: bool = False, rows: bool = True,
               failed_run_fails: bool = False) -> int:
    """1 on a regression against `against`, and (failed_run_fails: `ep-harness report`) for a
    run that failed or was interrupted; else 0. The table and the page's path are printed
    unless the console is quiet or the caller prints its own summary (`quiet`: selftest)."""
    printer = console.current()
    run = load_run(run_dir)
    changes = None
    if against is not None:
        changes = compare_runs(run.records, load_run(against).records)
    if not quiet:
        printer.info(terminal.render(run.records, run.environment, changes, show_skipped, rows, colour=printer.colour))
    target = out or (run.path / "report.html")
    page = render_page(run, changes, str(against) if against else None, trends=_trends(history))
    write_atomic(Path(target), page)
    if not quiet:
        printer.info(f"# report: {target}")
    if any(c["kind"] == "regression" for c in changes or ()):
        return 1
    said = verdict(run.records, interrupted=run.environment.get("interrupted"))
    return 1 if failed_run_fails and said.startswith(("FAILED", "INTERRUPTED", "NOTHING RAN")) else 0


def _trends(history: Path | None) -> dict | None:
    """The trends section, from a nightly history; pandas and matplotlib (0.4 s of imports,
    most of a report's time) are loaded only for one."""
    if history is None:
        return None
    from ep_harness.reports import trends

    return trends.context(history)
