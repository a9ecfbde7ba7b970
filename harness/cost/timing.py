"""What a GEMM or a quantizer costs on the GPU, measured the same way for every subject.

Timing: CUDA events around each call, after warm-up calls; the subjects of one shape are
interleaved call by call (the first subject rotates every repeat, so none always runs
right after another's cache footprint), and each subject's median of k calls is kept.
A spin kernel holds the GPU before each round, so the round's calls queue behind it; a round
in which the GPU reached a call before the host had queued it timed the host and is timed
again under a longer hold.
Two cache states: L2-warm (operands reused between calls, as warm for one subject as for
the other) and L2-cold (`Rotation`: every call takes the next of several copies of the
operands, together larger than L2, as a model's layers evict each other's weights).

Rates: TFLOP/s for GEMMs (2*M*N*K useful products, padding rows not counted), GB/s for
the memory-bound quantizers (bytes read + written). Each is put against the H200's
spec-sheet peak (dense, no sparsity) and against a baseline measured in the same
interleaved loop: cuBLAS for GEMMs, a device copy of the same bytes for quantizers.

A cost is either measured or absent: `gemm_cost` / `quant_cost` refuse a non-positive
time, so no record ever carries a cost of zero.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Protocol

# H200 SXM spec-sheet peaks, dense (the sheet's headline figures are with 2:4 sparsity).
H200_PEAKS = {
    "bf16": 989.5e12,  # FLOP/s, tensor cores
    "fp8": 1979e12,  # FLOP/s, tensor cores
    "fp32": 67e12,  # FLOP/s, FMA units (IEEE float32, no TF32)
    "hbm": 4.8e12,  # bytes/s, HBM3e
}
PEAK_SOURCE = ("H200 SXM spec sheet, dense: bf16 989.5 TFLOP/s, fp8 1979 TFLOP/s, fp32 (no tensor cores) "
               "67 TFLOP/s, HBM3e 4.8 TB/s")
PEAK_OF_OPERANDS = {"bfloat16": "bf16", "float8_e4m3fn": "fp8", "float32": "fp32"}


class Clock(Protocol):
    """Where timestamps come from: CUDA events on the GPU, a scripted clock in tests."""

    def event(self): ...  # an object with record()

    def elapsed_ms(self, start, end) -> float: ...

    def synchronize(self) -> None: ...

    def hold(self) -> None: ...  # keep the device busy while a round of calls is queued

    def reached(self, event) -> bool: ...  # has the device already passed this recorded event?

    def lengthen(self) -> bool: ...  # a longer hold from now on; False when it is at its limit


class CudaClock:
    """CUDA events. Before each round a spin kernel holds the GPU for `hold_ms`, so the
    round's launches queue behind it and each event pair times the kernel, not the host's
    launch overhead (which for a small GEMM is longer than the GEMM itself). A round the hold
    did not cover is timed again under a hold twice as long (time_interleaved); `redone`
    counts those rounds and `hold_ms` is the hold the last round ran under."""

    MAX_HOLD_MS = 512.0

    def __init__(self, hold_ms: float = 2.0):
        import torch

        self._torch = torch
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self._clock_khz = getattr(props, "clock_rate", 0) or 1_980_000  # H200 boost clock when torch lacks it
        self.hold_ms, self.redone = hold_ms, 0

    def hold(self) -> None:
        self._torch.cuda._sleep(int(self.hold_ms * self._clock_khz))

    def event(self):
        return self._torch.cuda.Event(enable_timing=True)

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def reached(self, event) -> bool:
        return event.query()

    def lengthen(self) -> bool:
        if self.hold_ms >= self.MAX_HOLD_MS:
            return False
        self.hold_ms, self.redone = min(2 * self.hold_ms, self.MAX_HOLD_MS), self.redone + 1
        return True


class Untimeable(RuntimeError):
    """Calls the hold cannot cover: the host did not queue a round before the longest hold ran
    out (a call that waits for the device, such as one reading a size back, or host work
    longer than the hold). Their event pairs would time the host, so they are not timed."""


def cost_or_reason(time_it: Callable[[], dict]) -> dict:
    """A check's cost beside its verdict, or why it could not be timed ({"unavailable": ...}):
    the price of a check never decides its verdict."""
    try:
        return time_it()
    except Untimeable as exc:
        return {"unavailable": str(exc)}


def hold_note(clock) -> dict:
    """What a point's record says of its timing rounds: the hold they ran under, and how many
    were timed again because the host had not queued them before the hold ran out."""
    return {"hold_ms": clock.hold_ms, "rounds_redone": clock.redone}


def time_held(calls: dict[str, Callable[[], None]], repeats: int, warmup: int, hold_ms: float
              ) -> tuple[dict[str, list[float]], dict]:
    """time_interleaved on the GPU behind a hold starting at `hold_ms`: the samples, and the
    point's hold_note."""
    clock = CudaClock(hold_ms)
    return time_interleaved(calls, repeats, warmup, clock), hold_note(clock)


def time_interleaved(calls: dict[str, Callable[[], None]], repeats: int = 20, warmup: int = 3,
                     clock: Clock | None = None) -> dict[str, list[float]]:
    """Milliseconds of each call, `repeats` per subject, subjects interleaved call by call. A
    round the clock's hold did not cover is void and timed again under a longer hold
    (`clock.lengthen()`); Untimeable once the hold can grow no more."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    if not calls:
        raise ValueError("nothing to time: no calls given")
    clock = clock or CudaClock()
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    clock.synchronize()
    marks: dict[str, list[tuple]] = {name: [] for name in names}
    for r in range(repeats):
        while (round_marks := _queued_round(calls, names[r % len(names):] + names[:r % len(names)], clock)) is None:
            clock.synchronize()
            if not clock.lengthen():
                raise Untimeable(f"the host could not queue a round of {len(names)} calls within the longest "
                                 "hold: each pair of events would time the host's work, not the GPU's (a call "
                                 "that waits for the device, or more host work than the hold); time fewer "
                                 "subjects per round, or leave such a call untimed")
        for name, pair in round_marks.items():
            marks[name].append(pair)
    clock.synchronize()
    return {name: [clock.elapsed_ms(s, e) for s, e in pairs] for name, pairs in marks.items()}


def _queued_round(calls: dict, order: list[str], clock: Clock) -> dict[str, tuple] | None:
    """One round behind a hold: each call between its two events. None if the device reached a
    call's start event before the call had been queued: then the pair timed the host's work
    (argument checks, descriptors, the launch) while the GPU waited, and the round is void."""
    clock.hold()
    pairs = {}
    for name in order:
        start, end = clock.event(), clock.event()
        start.record()
        calls[name]()
        end.record()
        if clock.reached(start):
            return None
        pairs[name] = (start, end)
    return pairs


class Rotation:
    """Copies of one call's operands that calls take in turn, so that each finds its operands
    out of L2. `copies(nbytes, l2_bytes)` says how many: together at least `spill` times L2."""

    def __init__(self, sets: list):
        if not sets:
            raise ValueError("a rotation needs at least one operand set")
        self.sets, self._next = sets, 0

    @staticmethod
    def copies(set_bytes: int, l2_bytes: int, spill: float = 3.0) -> int:
        return max(2, -(-int(spill * l2_bytes) // max(1, set_bytes)))

    def take(self):
        chosen = self.sets[self._next]
        self._next = (self._next + 1) % len(self.sets)
        return chosen


def median_ms(samples: list[float]) -> float:
    if not samples:
        raise ValueError("no timing samples")
    value = statistics.median(samples)
    if not value > 0:  # also catches NaN
        raise ValueError(f"a median time of {value} ms is not a measurement; the call did not run on the device")
    return value


def gemm_flops(rows: int, n: int, k: int) -> int:
    """Useful floating-point operations of rows x K times K x N (a multiply and an add each)."""
    return 2 * rows * n * k


def rate(amount: float, ms: float) -> float:
    """amount per second, from a time in milliseconds."""
    return amount / (ms * 1e-3)


def gemm_cost(samples: list[float], flops: int, peak: str, baseline_samples: list[float] | None = None,
              baseline: str = "torch_mm") -> dict:
    """The `cost` of one GEMM: median time, TFLOP/s, % of the `peak` ("bf16" or "fp8") and
    the time relative to the baseline's median (> 1: slower than cuBLAS)."""
    ms = median_ms(samples)
    per_s = rate(flops, ms)
    out = {"median_ms": ms, "repeats": len(samples), "tflops": per_s / 1e12,
           "peak": peak, "pct_of_peak": 100.0 * per_s / H200_PEAKS[peak]}
    if baseline_samples is not None:
        out["baseline"] = baseline
        out["time_vs_baseline"] = ms / median_ms(baseline_samples)
    return out


def quant_cost(samples: list[float], bytes_moved: int, copy_samples: list[float] | None = None) -> dict:
    """The `cost` of one quantizer call: median time, GB/s of bytes read + written, % of
    HBM peak, and the time relative to a device copy moving the same number of bytes."""
    ms = median_ms(samples)
    per_s = rate(bytes_moved, ms)
    out = {"median_ms": ms, "repeats": len(samples), "gbps": per_s / 1e9,
           "peak": "hbm", "pct_of_peak": 100.0 * per_s / H200_PEAKS["hbm"]}
    if copy_samples is not None:
        out["baseline"] = "copy"
        out["time_vs_baseline"] = ms / median_ms(copy_samples)
    return out


def quant_bytes(rows: int, cols: int, group: int = 128) -> int:
    """bf16 read, e4m3 written, one float32 scale written per group."""
    return rows * cols * 2 + rows * cols + rows * (cols // group) * 4


@dataclass
class Column:
    title: str
    key: str
    fmt: Callable[[object], str] = str


def fmt_float(digits: int) -> Callable[[object], str]:
    def render(value) -> str:
        return "" if value is None else f"{value:,.{digits}f}"
    return render


def markdown_table(columns: list[Column], rows: list[dict]) -> str:
    """A GitHub Markdown table; a key a row lacks renders as an empty cell (never 0)."""
    head = "| " + " | ".join(c.title for c in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(c.fmt(row[c.key]) if row.get(c.key) is not None else "" for c in columns) + " |"
            for row in rows]
    return "\n".join([head, rule, *body])


def invariance_verdict(mismatched: int, total: int, order_sensitive: int, runs: int) -> str:
    """Batch invariance of a probe row across M: `holds` only when it could have failed (at
    least two runs, and some probe output whose bits change under another K order)."""
    if mismatched:
        return "violated"
    if runs < 2 or order_sensitive == 0 or total == 0:
        return "vacuous"
    return "holds"


def gemm_check_cost(subject, problem, out, baseline=None, repeats: int = 20, warmup: int = 3,
                    clock: Clock | None = None) -> dict:
    """The cost beside a GEMM check's verdict: `subject` on `problem` (an ep_harness.contracts.GemmProblem
    on the GPU, usually the check's largest), timed interleaved with `baseline`
    (a GEMM subject taking the same problem, cuBLAS torch_mm; None where none can, e.g. FP8)."""
    import torch

    calls = {subject.name: lambda: subject.run(problem, out)}
    if baseline is not None and baseline.name != subject.name:
        spare = torch.empty_like(out)
        calls[baseline.name] = lambda: baseline.run(problem, spare)
    samples = time_interleaved(calls, repeats, warmup, clock)
    n, k = problem.b.shape[-2], problem.b.shape[-1]
    rows = problem.a.shape[0] if problem.layout == "dense" else sum(problem.counts)  # padding not counted
    operands = "float8_e4m3fn" if problem.a_scale is not None else str(problem.a.dtype).removeprefix("torch.")
    base = None if baseline is None else samples.get(baseline.name)
    result = gemm_cost(samples[subject.name], gemm_flops(rows, n, k), PEAK_OF_OPERANDS[operands],
                       base, baseline.name if baseline is not None else "torch_mm")
    result["rows"] = rows
    return result


def copy_of(moved: int, device):
    """A device copy that reads and writes `moved` bytes in all: the baseline a memory-bound
    quantizer is compared with (bench and checks alike)."""
    import torch

    src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def quant_check_cost(subject, x, ue8m0: bool, repeats: int = 20, warmup: int = 3, clock: Clock | None = None,
                     copy: Callable[[], None] | None = None) -> dict:
    """The cost beside a quantization check's verdict: `subject` on `x` (bf16 [rows, cols] on
    the GPU, usually the check's largest batch), timed interleaved with a copy of as many bytes
    (`copy`: another baseline, for tests)."""
    rows, cols = x.shape
    moved = quant_bytes(rows, cols)
    samples = time_interleaved({subject.name: lambda: subject.quantize(x, ue8m0),
                                "copy": copy or copy_of(moved, x.device)}, repeats, warmup, clock)
    result = quant_cost(samples[subject.name], moved, samples["copy"])
    result["rows"] = rows
    return result
