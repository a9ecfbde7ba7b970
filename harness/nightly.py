"""`make nightly`: verify the nightly suite, gate it against the baseline, append to the
history, render the report with trends. The workflow in ci/nightly.yml runs exactly this."""
from __future__ import annotations

from pathlib import Path

from harness.errors import HarnessError
from harness.gate import append_history, gate, render_gate
from harness.verify import verify
from reports.render import render_run

HISTORY = Path("reports/out/history.jsonl")


def nightly(suite: str = "nightly", gpus: int | None = None, baseline: Path | None = None,
            history: Path = HISTORY, out_root: Path = Path("reports/out"), command: list[str] = (),
            emulate_hosts: bool = False) -> int:
    code, run_dir = verify(suite, gpus=gpus, out_root=out_root, command=command, render=False,
                           emulate_hosts=emulate_hosts)
    added = append_history(run_dir, history)
    try:
        result = gate(run_dir, baseline)
    except HarnessError as exc:  # no baseline yet: the run renders, the gate fails with the fix
        result = None
        message = f"# gate: FAILED: {exc}"
    render_run(run_dir, history=history)
    print(f"# history: {added} rows appended to {history}")
    print(render_gate(result) if result else message)
    return 0 if code == 0 and result and result["passed"] else 1
