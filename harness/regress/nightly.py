"""`make nightly`: verify the nightly suite, gate it against the baseline, append to the
history, render the report with trends. The workflow in ci/nightly.yml runs exactly this."""
from __future__ import annotations

from pathlib import Path

from ep_harness import console
from ep_harness.regress.gate import NotComparable, append_history, gate, read_baseline, render_gate
from ep_harness.run.verify import RunOptions, verify, write_ci_outputs
from ep_harness.reports.load import load_run
from ep_harness.reports.render import render_run

HISTORY = Path("reports/out/history.jsonl")


def nightly(suite: str = "nightly", gpus: int | None = None, baseline: Path | None = None,
            history: Path = HISTORY, out_root: Path = Path("reports/out"), command: list[str] = (),
            emulate: str | None = None, summary_md: Path | None = None, junit_xml: Path | None = None) -> int:
    if baseline is not None and baseline.is_file():  # a damaged one refused before the run, not after it
        read_baseline(baseline)
    code, run_dir = verify(RunOptions(suite, gpus=gpus, out_root=out_root, command=command, render=False,
                                      emulate=emulate, junit_xml=junit_xml))
    if code >= 128:  # interrupted: the partial run is rendered, never gated or added to the history
        render_run(run_dir)
        return code
    added = append_history(run_dir, history)
    try:
        result = gate(run_dir, baseline)
    except NotComparable as exc:  # no baseline of this fingerprint: the run renders, exit 3 says why
        result, message = None, f"# gate: {exc}"
    render_run(run_dir, history=history)
    run = load_run(run_dir)
    write_ci_outputs(run_dir, run.records, run.environment, None, summary_md, annotate=False,
                     regressions=result["regressions"] if result else ())
    out = console.current()
    out.line(f"# history: {added} rows appended to {history}")
    out.line(render_gate(result) if result else message)
    if result is None:
        return 3
    return 0 if code == 0 and result["passed"] else 1
