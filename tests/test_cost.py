"""ep_harness.cost.timing and the pure parts of ep_harness.cost.bench_gemm_cost, with scripted timings (no GPU)."""
from __future__ import annotations

import math

import pytest
import torch

from ep_harness.cost import bench_gemm_cost as bench
from ep_harness.cost import timing
from ep_harness.reference.gemm import k_order_sensitive


class FakeEvent:
    def __init__(self, clock):
        self.clock, self.at = clock, None

    def record(self):
        self.at = self.clock.now


class FakeClock:
    """Time advances only when a fake subject runs; holds and syncs are logged."""

    def __init__(self):
        self.now, self.log = 0.0, []

    def event(self):
        return FakeEvent(self)

    def elapsed_ms(self, start, end):
        return end.at - start.at

    def synchronize(self):
        self.log.append("sync")

    def hold(self):
        self.log.append("hold")

    def reached(self, event):
        return False  # the host always queues ahead of this device

    def lengthen(self):
        return False


def scripted(clock, name, durations):
    """A subject whose i-th call takes durations[i] ms (warm-up calls included)."""
    calls = iter(durations)

    def run():
        clock.log.append(name)
        clock.now += next(calls)
    return run


def test_interleaved_timing_rotates_subjects_and_skips_warmup():
    clock = FakeClock()
    calls = {"a": scripted(clock, "a", [100, 100, 1, 2, 3, 4]), "b": scripted(clock, "b", [100, 100, 10, 20, 30, 40])}
    samples = timing.time_interleaved(calls, repeats=4, warmup=2, clock=clock)
    assert samples == {"a": [1, 2, 3, 4], "b": [10, 20, 30, 40]}  # the 100 ms warm-up calls are not timed
    timed = [e for e in clock.log[clock.log.index("sync") + 1:] if e in ("a", "b", "hold")]
    # one hold per round, then both subjects; the first subject alternates round by round
    assert timed == ["hold", "a", "b", "hold", "b", "a", "hold", "a", "b", "hold", "b", "a"]
    assert clock.log[:4] == ["a", "b", "a", "b"] and clock.log[-1] == "sync"


class QueueClock:
    """A host and a device on one timeline: the host spends `launch_ms` preparing each call
    before it is queued; the device runs what is queued in order, each call for `kernel_ms`
    and the hold for `hold_ms`, and reaches an event once the work before it is done and the
    event has been queued."""

    def __init__(self, launch_ms, kernel_ms, hold_ms, max_hold_ms=64.0):
        self.host = self.device = 0.0
        self.launch_ms, self.kernel_ms, self.hold_ms, self.max_hold_ms, self.redone = (
            launch_ms, kernel_ms, hold_ms, max_hold_ms, 0)

    def _queue(self, busy_ms):
        self.device = max(self.device, self.host) + busy_ms
        return self.device

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.at = clock._queue(0.0)
        return Event()

    def call(self):
        self.host += self.launch_ms
        self._queue(self.kernel_ms)

    def hold(self):
        self._queue(self.hold_ms)

    def reached(self, event):
        return event.at <= self.host

    def lengthen(self):
        if self.hold_ms >= self.max_hold_ms:
            return False
        self.hold_ms, self.redone = 2 * self.hold_ms, self.redone + 1
        return True

    def synchronize(self):
        self.host = max(self.host, self.device)

    def elapsed_ms(self, start, end):
        return end.at - start.at


def test_a_call_that_waits_for_the_device_is_not_timed_and_its_check_keeps_its_verdict():
    """On one H100 (2026-12-07) torch._grouped_mm waited for the device inside every call, so no
    hold covered a round, and the timing's error made three torch-grouped-mm checks `error`:
    a check's price must never decide its verdict."""
    from ep_harness.reports.text import cost_text

    clock = QueueClock(launch_ms=0.01, kernel_ms=0.05, hold_ms=2.0)

    def waits():  # queues its kernel, then blocks the host until the device is done (a sync inside)
        clock.call()
        clock.synchronize()

    cost = timing.cost_or_reason(lambda: timing.time_interleaved({"sync": waits}, repeats=3, warmup=1, clock=clock))
    assert set(cost) == {"unavailable"} and "could not queue a round of 1 calls" in cost["unavailable"]
    assert cost_text({"detail": {"cost": cost}}) == "not timed"
    fine = QueueClock(launch_ms=0.01, kernel_ms=0.05, hold_ms=2.0)  # control: a call that only queues
    samples = timing.cost_or_reason(lambda: timing.time_interleaved({"async": fine.call}, repeats=3, warmup=1,
                                                                    clock=fine))
    assert samples == {"async": [pytest.approx(0.05)] * 3}
    with pytest.raises(ValueError):  # any other failure is not turned into a reason
        timing.cost_or_reason(lambda: timing.time_interleaved({}, clock=fine))


def test_a_round_the_hold_does_not_cover_is_timed_again_under_a_longer_hold():
    # 40 subjects of 0.01 ms kernels, each 0.08 ms of host work to queue (a Python launcher):
    # a round takes the host 3.2 ms to queue, longer than a 2 ms hold.
    clock = QueueClock(launch_ms=0.08, kernel_ms=0.01, hold_ms=2.0)
    samples = timing.time_interleaved({f"s{i}": clock.call for i in range(40)}, repeats=5, warmup=1, clock=clock)
    assert clock.hold_ms == 4.0 and clock.redone == 1  # the first round was void, the rest ran under 4 ms
    assert timing.hold_note(clock) == {"hold_ms": 4.0, "rounds_redone": 1}
    assert all(s == [pytest.approx(0.01)] * 5 for s in samples.values())  # the kernels, not the launches
    # positive control: under a hold that cannot grow, the host's time is what the events would say
    starved = QueueClock(launch_ms=0.08, kernel_ms=0.01, hold_ms=2.0, max_hold_ms=2.0)
    with pytest.raises(timing.Untimeable, match="could not queue a round of 40 calls"):
        timing.time_interleaved({f"s{i}": starved.call for i in range(40)}, repeats=5, warmup=1, clock=starved)
    start, end = starved.event(), starved.event()
    starved.synchronize()
    start.record()
    starved.call()
    end.record()
    assert starved.reached(start) and starved.elapsed_ms(start, end) == pytest.approx(0.09)


def test_long_kernels_keep_the_device_ahead_without_a_longer_hold():
    clock = QueueClock(launch_ms=0.08, kernel_ms=1.0, hold_ms=2.0)
    samples = timing.time_interleaved({f"s{i}": clock.call for i in range(40)}, repeats=3, warmup=0, clock=clock)
    assert clock.redone == 0 and all(s == [pytest.approx(1.0)] * 3 for s in samples.values())


def test_interleaved_timing_rejects_nonsense():
    with pytest.raises(ValueError, match="repeats"):
        timing.time_interleaved({"a": lambda: None}, repeats=0, clock=FakeClock())
    with pytest.raises(ValueError, match="nothing to time"):
        timing.time_interleaved({}, clock=FakeClock())


def test_median_is_the_middle_and_a_zero_time_is_no_measurement():
    assert timing.median_ms([5.0, 1.0, 3.0]) == 3.0
    assert timing.median_ms([4.0, 1.0, 3.0, 2.0]) == 2.5
    for bad in ([], [0.0, 0.0, 0.0], [math.nan]):
        with pytest.raises(ValueError):
            timing.median_ms(bad)


def test_gemm_cost_rates_peak_and_ratio():
    # 2 * 1024 * 4096 * 4096 flops in 0.05 ms: 687.19... TFLOP/s
    flops = timing.gemm_flops(1024, 4096, 4096)
    assert flops == 2 * 1024 * 4096 * 4096
    c = timing.gemm_cost([0.06, 0.05, 0.04], flops, "bf16", baseline_samples=[0.02, 0.025, 0.03])
    assert c["median_ms"] == 0.05 and c["repeats"] == 3
    assert c["tflops"] == pytest.approx(flops / 0.05e-3 / 1e12)
    assert c["pct_of_peak"] == pytest.approx(100 * c["tflops"] / 989.5)
    assert c["time_vs_baseline"] == pytest.approx(0.05 / 0.025) and c["baseline"] == "torch_mm"
    fp8 = timing.gemm_cost([0.05], flops, "fp8")
    assert fp8["pct_of_peak"] == pytest.approx(100 * fp8["tflops"] / 1979)
    assert "time_vs_baseline" not in fp8 and "baseline" not in fp8  # absent, not zero


def test_quant_cost_counts_bytes_read_and_written():
    moved = timing.quant_bytes(8192, 7168)
    assert moved == 8192 * 7168 * 2 + 8192 * 7168 + 8192 * 56 * 4
    c = timing.quant_cost([0.5, 0.7, 0.6], moved, copy_samples=[0.05, 0.06, 0.04])
    assert c["gbps"] == pytest.approx(moved / 0.6e-3 / 1e9)
    assert c["pct_of_peak"] == pytest.approx(100 * c["gbps"] * 1e9 / 4.8e12)
    assert c["time_vs_baseline"] == pytest.approx(0.6 / 0.05)


def test_markdown_table_leaves_missing_values_empty():
    cols = [timing.Column("M", "m"), timing.Column("TFLOP/s", "t", timing.fmt_float(1))]
    text = timing.markdown_table(cols, [{"m": 1, "t": 2.25}, {"m": 2}])
    assert text.splitlines() == ["| M | TFLOP/s |", "|---|---|", "| 1 | 2.2 |", "| 2 |  |"]


@pytest.mark.parametrize("mismatched,total,sensitive,runs,verdict", [
    (3, 100, 5, 4, "violated"),
    (0, 100, 5, 4, "holds"),
    (0, 100, 0, 4, "vacuous"),  # no output could change: the check had no teeth
    (0, 100, 5, 1, "vacuous"),  # one run compares nothing
    (1, 100, 0, 4, "violated"),  # a difference is a difference, sensitive or not
])
def test_invariance_verdict(mismatched, total, sensitive, runs, verdict):
    assert timing.invariance_verdict(mismatched, total, sensitive, runs) == verdict


def test_contiguous_layout_puts_token_zero_first_in_each_of_its_experts():
    g = torch.Generator().manual_seed(3)
    experts, topk = 16, 4
    routing = torch.rand(50, experts, generator=g).topk(topk, 1).indices
    for tokens in (1, 7, 50):
        rows, counts, starts, total = bench.contiguous_layout(routing[:tokens], experts, 8)
        flat = rows.reshape(-1)
        assert flat.unique().numel() == flat.numel()  # every (token, slot) has its own row
        assert counts == torch.bincount(routing[:tokens].reshape(-1), minlength=experts).tolist()
        assert all(s % 8 == 0 for s in starts) and total % 8 == 0
        for t in range(tokens):
            for j in range(topk):
                e = int(routing[t, j])
                r = int(rows[t, j])
                assert starts[e] <= r < starts[e] + counts[e]  # inside its expert's segment
                # rows follow token order within an expert
                assert r - starts[e] == int((routing[:t] == e).sum())
        assert [int(rows[0, j]) for j in range(topk)] == [starts[int(e)] for e in routing[0]]


def test_cancelling_probe_makes_the_order_sensitivity_non_zero():
    g = torch.Generator().manual_seed(0)
    k, n = 4096, 256
    row = torch.randn(k, generator=g).bfloat16()
    weight = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
    bench.plant_cancellation(row, weight, k)
    # about 4 % of bf16 outputs cross a rounding boundary when the two halves are summed
    # apart (float32 errors at the +-4096 magnitude against a bf16 ULP of the O(1) result)
    assert 0 < k_order_sensitive(row, weight, torch.bfloat16) < n
    assert torch.equal(weight[:, 1], weight[:, 1 + k // 2]) and float(row[1]) == -float(row[1 + k // 2])
    # a row of zeros has no order at all
    assert k_order_sensitive(torch.zeros(k), weight, torch.bfloat16) == 0


def test_probe_summary_counts_differences_against_the_smallest_m():
    base = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    moved = base.clone()
    moved.view(torch.int16)[2] += 1  # the next bf16 up: one ULP
    probes = {1: base, 64: base.clone(), 4096: moved}
    summary = bench.summarize("x", probes, sensitive=3)
    assert summary["per_m"] == {"1": 0, "64": 0, "4096": 1}
    assert (summary["mismatched"], summary["total"], summary["verdict"]) == (1, 9, "violated")
    assert bench.summarize("x", {1: base, 64: base.clone()}, sensitive=3)["verdict"] == "holds"


def _section():
    c = timing.gemm_cost([0.1], timing.gemm_flops(256, 64, 64), "bf16", [0.05])
    cold = timing.gemm_cost([0.12], timing.gemm_flops(256, 64, 64), "bf16", [0.04])
    return {"kind": "dense", "title": "dense 64 x 64", "unavailable": {"deepgemm_bf16_dense": "needs sm90"},
            "points": [{"m": 256, "cost": {"triton_bi_matmul": c}, "cost_cold": {"triton_bi_matmul": cold},
                        "failed": {"other": "RuntimeError: boom"},
                        "probe": {"triton_bi_matmul": {"mismatched": 0, "total": 64}}}],
            "invariance": {"triton_bi_matmul": bench.summarize("triton_bi_matmul", {1: torch.ones(64),
                                                                                     256: torch.ones(64)}, 5)}}


def test_rendered_section_shows_verdict_cost_and_what_did_not_run():
    text = bench.render_section(_section())
    assert "triton_bi_matmul: batch invariance **holds**: 0 / 128" in text
    assert "deepgemm_bf16_dense: not run (needs sm90)" in text
    row = next(line for line in text.splitlines() if "| triton_bi_matmul |" in line)
    assert "| 256 | triton_bi_matmul | 100.0 |" in row and "| 2.00x | 120.0 | 3.00x | 0 / 64 |" in row
    failed = next(line for line in text.splitlines() if "| other |" in line)
    assert "failed: RuntimeError: boom" in failed and "0.0" not in failed  # no cost, not a zero cost
    skipped = bench.render_section({"kind": "skipped", "title": "t", "skipped": "budget spent", "points": []})
    assert "Not measured: budget spent" in skipped


def test_bench_refuses_bad_input_and_a_machine_without_gpu(capsys):
    assert bench.main(["--out", "x", "--sections", "dense,bogus"]) == 2
    assert "unknown section(s) bogus" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(["--out", "x"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


class FakeGemm:
    """A GEMM subject whose every call takes `ms` on the fake clock (and really multiplies)."""

    def __init__(self, name, clock, ms):
        self.name, self.clock, self.ms, self.calls = name, clock, ms, 0

    def run(self, problem, out):
        torch.mm(problem.a, problem.b.t(), out=out)
        self.calls += 1
        self.clock.now += self.ms


def test_gemm_check_cost_times_subject_against_baseline():
    from ep_harness.contracts import GemmProblem

    clock = FakeClock()
    problem = GemmProblem("dense", torch.ones(6, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16),
                          [6, 100], [0])  # a dense problem multiplies its 6 rows, whatever the other counts
    out = torch.zeros(6, 4, dtype=torch.bfloat16)
    subject, baseline = FakeGemm("fix", clock, 3.0), FakeGemm("torch_mm", clock, 2.0)
    c = timing.gemm_check_cost(subject, problem, out, baseline, repeats=5, warmup=2, clock=clock)
    assert (subject.calls, baseline.calls) == (7, 7)
    assert c["median_ms"] == 3.0 and c["time_vs_baseline"] == 1.5 and c["baseline"] == "torch_mm"
    assert c["rows"] == 6 and c["tflops"] == pytest.approx(2 * 6 * 4 * 8 / 3e-3 / 1e12) and c["peak"] == "bf16"
    assert torch.equal(out, torch.full((6, 4), 8.0, dtype=torch.bfloat16))  # the subject's own output
    own = timing.gemm_check_cost(baseline, problem, out, baseline, repeats=3, warmup=0, clock=clock)
    assert own["time_vs_baseline"] == 1.0  # cuBLAS against itself
    problem.a_scale = torch.ones(6, 1)  # FP8 operands: fp8 peak, and no cuBLAS to compare with
    fp8 = timing.gemm_check_cost(subject, problem, out, None, repeats=3, warmup=0, clock=clock)
    assert fp8["peak"] == "fp8" and "time_vs_baseline" not in fp8 and "baseline" not in fp8


def test_gemm_checks_on_the_cpu_carry_no_cost():
    from types import SimpleNamespace

    from ep_harness.check import typed_params
    from ep_harness.families import gemm as family
    from ep_harness.subject import load_all

    subject = load_all()["torch_mm"]
    p = typed_params("gemm", {"dtype": "float32", "layout": "dense", "n": 16, "k": 32, "m_values": [1, 5]},
                     subject, "test")
    ctx = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    runs = family.FAMILY.runs("batch-invariance", p, 1)
    gathered = [family.FAMILY.observe(subject, ctx, p, "batch-invariance", runs)]
    m = family.FAMILY.measure(SimpleNamespace(property="batch-invariance"), subject, ctx, p, runs, gathered)
    assert m.total > 0 and "cost" not in m.detail  # absent, not zero


def test_contiguous_cost_counts_valid_rows_not_padding():
    from ep_harness.contracts import GemmProblem

    clock = FakeClock()
    a = torch.zeros(256, 8, dtype=torch.bfloat16)  # two experts of 3 and 5 rows, each padded to 128
    problem = GemmProblem("contiguous", a, torch.ones(2, 4, 8, dtype=torch.bfloat16), [3, 5], [0, 128])
    subject = FakeGemm("x", clock, 1.0)
    subject.run = lambda prob, out: setattr(clock, "now", clock.now + 1.0)
    c = timing.gemm_check_cost(subject, problem, torch.zeros(256, 4, dtype=torch.bfloat16), None,
                             repeats=3, warmup=0, clock=clock)
    assert c["rows"] == 8 and c["tflops"] == pytest.approx(2 * 8 * 4 * 8 / 1e-3 / 1e12)


def test_quant_check_cost_times_the_quantizer_against_a_copy_of_as_many_bytes():
    from types import SimpleNamespace

    clock = FakeClock()
    x = torch.ones(4, 256, dtype=torch.bfloat16)
    step = scripted(clock, "q", [2.0] * 7)
    quantizer = SimpleNamespace(name="q", quantize=lambda x, ue8m0: step())
    c = timing.quant_check_cost(quantizer, x, True, repeats=5, warmup=2, clock=clock,
                              copy=scripted(clock, "copy", [0.5] * 7))
    assert c["median_ms"] == 2.0 and c["baseline"] == "copy" and c["time_vs_baseline"] == 4.0
    assert c["rows"] == 4 and c["gbps"] == pytest.approx(timing.quant_bytes(4, 256) / 2e-3 / 1e9)


def test_quant_checks_on_the_cpu_carry_no_cost():
    from types import SimpleNamespace

    from ep_harness.check import typed_params
    from ep_harness.families import quant as family
    from ep_harness.subject import load_all

    subject = load_all()["torch_fp8_quant"]
    p = typed_params("quant", {"ue8m0": True, "batch_sizes": [1, 7]}, subject, "test")
    ctx = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    runs = family.FAMILY.runs("batch-invariance", p, 1)
    gathered = [family.FAMILY.observe(subject, ctx, p, "batch-invariance", runs)]
    m = family.FAMILY.measure(SimpleNamespace(property="batch-invariance"), subject, ctx, p, runs, gathered)
    assert m.total > 0 and "cost" not in m.detail  # absent, not zero
