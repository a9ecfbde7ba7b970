"""A GPU check's cost is shown beside its verdict; a run without costs (the CPU) has no cost
column at all, never a zero."""
from pathlib import Path

from ep_harness.reports.html import render_page
from ep_harness.reports.load import Run
from ep_harness.reports.terminal import row
from ep_harness.reports.text import cost_text

COST = {"median_ms": 0.1787, "repeats": 20, "tflops": 769.02, "peak": "bf16", "pct_of_peak": 77.72,
        "baseline": "torch_mm", "time_vs_baseline": 1.0, "rows": 4096}


def record(cost=None):
    r = {"run_id": "r", "check": "c/batch-invariance", "case": "c", "subject": "torch_mm", "family": "gemm",
         "property": "batch-invariance", "params": {"dtype": "bfloat16", "world_size": 1}, "expect": "violated",
         "held": False, "mismatched": 1960, "total": 32768, "status": "ok", "reason": "r", "rerun": "x",
         "seconds": 1.0, "detail": {}}
    if cost:
        r["detail"]["cost"] = cost
    return r


def test_cost_text_says_rate_share_of_peak_and_ratio():
    assert cost_text(record(COST)) == "769 TFLOP/s (77.7% of bf16 peak), 1.00x torch_mm"
    assert cost_text(record({"gbps": 226.4, "pct_of_peak": 4.7, "peak": "hbm"})) == "226.4 GB/s (4.7% of hbm peak)"
    assert cost_text(record()) == "" and cost_text(record({"tflops": "nan?"})) == ""


def test_terminal_row_carries_the_cost_only_where_measured():
    assert "[769 TFLOP/s (77.7% of bf16 peak), 1.00x torch_mm]" in row(record(COST), [])
    assert "TFLOP/s" not in row(record(), [])


def test_html_has_a_cost_column_only_when_a_record_has_a_cost(tmp_path):
    env = {"backend": "nccl", "topology": {"kind": "gpus", "ranks": 1}}
    with_cost = render_page(Run(Path(tmp_path), [record(COST)], env))
    without = render_page(Run(Path(tmp_path), [record()], env))
    assert "<th>cost (GPU)</th>" in with_cost and "769 TFLOP/s" in with_cost
    assert "cost (GPU)" not in without and "TFLOP/s" not in without
