"""GEMM and quantization cost at the shapes engines run, with each GEMM's batch-invariance verdict.

    python3 -m ep_harness.cost.bench_gemm_cost --out DIR      # one GPU; writes DIR/cost.json, DIR/cost.md

Sections, in this order (a time budget skips what is left, saying so):

* dense: cuBLAS `torch.mm`, this project's Triton matmul, DeepGEMM bf16 and
  batch_invariant_ops' matmul, at 4096 x 4096, 7168 x 7168, the thin-N control 2048 x 7168
  and DeepSeek-V3's expert down-projection 7168 x 2048, M = 1 .. 8192, each point L2-warm
  (operands reused) and L2-cold (a rotation of operand copies larger than L2); the bits
  across a wider sweep of M (`INVARIANCE_M`: tile edges and odd sizes).
* quantization: the per-token-group FP8 quantizers in GB/s against a device copy of the same
  number of bytes.
* grouped: the expert GEMMs of DeepSeek-V3 (hidden 7168, intermediate 2048, 256 experts,
  top-8) and Qwen3-30B-A3B (hidden 2048, moe intermediate 768, 128 experts, top-8), all
  experts on one GPU, gate-up (N = 2 x intermediate, K = hidden) and down (N = hidden,
  K = intermediate), M tokens routed top-8 at random (seeded) into DeepGEMM's contiguous
  layout: cuBLAS per expert, DeepGEMM BF16 and FP8, torch._grouped_mm.

Each point: the subjects timed interleaved call by call (ep_harness.cost.timing), median of k. Batch
invariance: the probe row (token 0, or row 0 of a dense A, the same values at every M, built
with the GEMM family's cancelling pair so that a K reordering shows; dense: also copied into
A's last row, so that it sits at another place in its tile) is compared bit for bit
with its output at the smallest M; a subject's verdict counts the
differing elements over all M, and is `vacuous` where no probe output is sensitive to the K
order. The cuBLAS rows are the positive control.
"""
from __future__ import annotations

import argparse
import json
import platform as host
import time
from dataclasses import dataclass
from pathlib import Path

from ep_harness import console

from ep_harness.cost import timing
from ep_harness.errors import first_line
from ep_harness.families.gemm import GemmParams
from ep_harness.families.quant import QuantParams
from ep_harness.reference.gemm import k_order_sensitive

DENSE_M = (1, 16, 64, 256, 1024, 2048, 4096, 8192)
INVARIANCE_M = (2, 3, 7, 8, 17, 31, 33, 100, 127, 129, 500, 777, 1000, 1025, 2047, 3000, 4095, 6000)  # bits only
GROUPED_M = (1, 16, 64, 256, 1024, 4096, 8192)
QUANT_ROWS = (1, 64, 1024, 8192)
QUANT_COLS = (7168, 2048)
DENSE_SHAPES = (
    ("dense 4096 x 4096 (a 4096-wide projection)", 4096, 4096),
    ("dense 7168 x 7168 (a DeepSeek-V3-wide projection)", 7168, 7168),
    ("dense 2048 x 7168 (thin N, long K: the cuBLAS control)", 2048, 7168),
    ("dense 7168 x 2048 (DeepSeek-V3's expert down-projection as one GEMM: short K)", 7168, 2048),
)
DENSE_SUBJECTS = ("torch_mm", "triton_bi_matmul", "deepgemm_bf16_dense", "batch_invariant_ops_matmul")
GROUPED_SUBJECTS = ("torch_mm", "deepgemm_bf16_contiguous", "torch_grouped_mm", "deepgemm_fp8_contiguous")
QUANT_SUBJECTS = ("torch_fp8_quant", "torch_fp8_quant_reciprocal", "deepgemm_fp8_quant")
BASELINE = "torch_mm"
ALIGNMENT = 128  # DeepGEMM's M alignment for the contiguous layout (sm90)


@dataclass(frozen=True)
class MoeModel:
    name: str
    hidden: int
    intermediate: int
    experts: int
    topk: int

    def projections(self):
        """(name, N, K) of the two expert GEMMs."""
        return (("gate-up", 2 * self.intermediate, self.hidden), ("down", self.hidden, self.intermediate))


MOE_MODELS = (MoeModel("DeepSeek-V3", 7168, 2048, 256, 8), MoeModel("Qwen3-30B-A3B", 2048, 768, 128, 8))


def contiguous_layout(topk_idx, experts: int, alignment: int):
    """Route tokens into DeepGEMM's contiguous layout.

    topk_idx [T, k] (expert of each token's slots) -> (row of each (token, slot) [T, k],
    rows per expert, first row per expert, padded total rows). Within an expert, rows follow
    token order, so token 0 is the first row of each of its experts whatever T is."""
    import torch

    tokens, k = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    order = torch.argsort(flat * tokens + torch.arange(tokens, device=flat.device).repeat_interleave(k), stable=True)
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(padded, 0) - padded
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.empty_like(flat)
    rank_in_expert[order] = torch.arange(flat.numel(), device=flat.device) - first_of_expert[flat[order]]
    rows = (starts[flat] + rank_in_expert).view(tokens, k)
    return rows, counts.tolist(), starts.tolist(), int(padded.sum())


def plant_cancellation(rows, weights, k: int) -> None:
    """The GEMM family's probe construction (ep_harness.families.gemm.probe_row), in place: the
    probe row gets +-CANCEL at columns 1 and 1 + K/2 against equal weight columns, so the
    pair cancels exactly but rounds whatever was summed between them at its magnitude, and
    any other K order (split-K, another tile walk) changes output bits. rows: the probe
    row [K]; weights: [..., N, K]."""
    from ep_harness.families.gemm import CANCEL

    rows[1], rows[1 + k // 2] = CANCEL, -CANCEL
    weights[..., 1 + k // 2] = weights[..., 1]


def probe_mismatches(probes: dict[int, object]) -> dict[int, int]:
    """Differing elements of the probe output at each M against the smallest M's."""
    from ep_harness.bits import int_view

    first = probes[min(probes)]
    return {m: int((int_view(p) != int_view(first)).sum()) for m, p in sorted(probes.items())}


def summarize(subject: str, probes: dict, sensitive: int) -> dict:
    counts = probe_mismatches(probes)
    total = sum(p.numel() for p in probes.values())
    mismatched = sum(counts.values())
    return {"subject": subject, "mismatched": mismatched, "total": total, "order_sensitive": sensitive,
            "m_values": sorted(probes), "per_m": {str(m): c for m, c in counts.items()},
            "verdict": timing.invariance_verdict(mismatched, total, sensitive, len(probes))}


# --- rendering (pure; tested on the CPU) ----------------------------------------------------

def _pct(row):
    return f"{row['pct']:.1f} ({row['peak']})"


def _columns(size: str, rate: timing.Column, peak: str, baseline: str) -> list[timing.Column]:
    """A section's table: size, subject, time, rate, share of the peak, time against the baseline."""
    return [timing.Column(size, "m", lambda v: f"{v:,}"), timing.Column("subject", "subject"),
            timing.Column("median µs", "us", timing.fmt_float(1)), rate, timing.Column(peak, "pct_cell"),
            timing.Column(f"time / {baseline}", "ratio", lambda v: f"{v:.2f}x")]


GEMM_COLUMNS = [*_columns("M", timing.Column("TFLOP/s", "tflops", timing.fmt_float(1)), "% of peak", "cuBLAS"),
                timing.Column("L2-cold µs", "us_cold", timing.fmt_float(1)),
                timing.Column("cold time / cuBLAS", "ratio_cold", lambda v: f"{v:.2f}x"),
                timing.Column("probe bits ≠ smallest M", "probe")]
QUANT_COLUMNS = _columns("rows", timing.Column("GB/s", "gbps", timing.fmt_float(0)), "% of HBM peak", "copy")


def table_rows(section: dict) -> list[dict]:
    """Flatten a section's measurements into table rows; a missing cost stays missing."""
    rows = []
    for point in section["points"]:
        for subject, c in point.get("cost", {}).items():
            cold = point.get("cost_cold", {}).get(subject, {})
            row = {"m": point["m"], "subject": subject, "us": c["median_ms"] * 1e3,
                   "tflops": c.get("tflops"), "gbps": c.get("gbps"), "pct": c["pct_of_peak"], "peak": c["peak"],
                   "ratio": c.get("time_vs_baseline"), "ratio_cold": cold.get("time_vs_baseline"),
                   "us_cold": cold["median_ms"] * 1e3 if cold else None}
            row["pct_cell"] = _pct(row)
            probe = point.get("probe", {}).get(subject)
            if probe is not None:
                row["probe"] = f"{probe['mismatched']:,} / {probe['total']:,}"
            rows.append(row)
        for subject, reason in point.get("failed", {}).items():
            rows.append({"m": point["m"], "subject": subject, "probe": f"failed: {reason}"})
    return rows


def render_section(section: dict) -> str:
    lines = [f"### {section['title']}", ""]
    if section.get("skipped"):
        return "\n".join(lines + [f"Not measured: {section['skipped']}", ""])
    for subject, reason in section.get("unavailable", {}).items():
        lines.append(f"- {subject}: not run ({reason})")
    for inv in section.get("invariance", {}).values():
        lines.append(f"- {inv['subject']}: batch invariance **{inv['verdict']}**: {inv['mismatched']:,} / "
                     f"{inv['total']:,} probe outputs differ across M = {', '.join(map(str, inv['m_values']))} "
                     f"(not vacuous when > 0: {inv['order_sensitive']:,} of the probe's outputs change bits when its K "
                     f"products are summed in two halves)")
    if section.get("library_route"):
        lines.append(f"- triton_bi_matmul: M = {', '.join(map(str, section['library_route']))} ran through DeepGEMM's "
                     "bf16_gemm_nt (the tile table's library route, measured bit-identical to its unsplit walk by the "
                     "tuner); the other M through its Triton tiles")
    if section.get("library_route_failed"):
        lines.append("- triton_bi_matmul: a DeepGEMM call of the library route raised in this run (its warning is in "
                     "the log); the calls after it ran the Triton tiles")
    for subject, ref in section.get("reference", {}).items():
        lines.append(f"- {subject}: error vs float64 at M = {ref['m']}: worst {ref['worst_fraction_of_bound']:.3g} "
                     f"of the bound ({'within' if ref['within'] else 'OUTSIDE'})")
    if lines[-1] != "":
        lines.append("")
    columns = QUANT_COLUMNS if section["kind"] == "quant" else GEMM_COLUMNS
    lines += [timing.markdown_table(columns, table_rows(section)), ""]
    return "\n".join(lines)


def render(result: dict) -> str:
    env = result["environment"]
    head = [f"# GEMM and quantization cost, {env.get('gpu', '?')}", "",
            f"torch {env.get('torch')}, triton {env.get('triton')}, deep_gemm {env.get('deep_gemm')}; "
            f"{result['method']}", "", f"Peaks: {timing.PEAK_SOURCE}.", ""]
    return "\n".join(head + [render_section(s) for s in result["sections"]])


# --- measurement (GPU) ----------------------------------------------------------------------

def routed_m(n: int, k: int, m_values, before: dict) -> list[int]:
    """The M of which triton_bi_matmul calls ran through a library since `before` (a copy of
    library_route.ROUTED_CALLS): counted where each call went, so that the table says which
    kernel each row timed."""
    from ep_harness.kernels import library_route

    now = library_route.ROUTED_CALLS
    return [m for m in m_values
            if any(now[key] > before.get(key, 0) for key in now if key[1:] == (n, k, m))]


class Bench:
    def __init__(self, repeats: int, warmup: int, budget_s: float, seed: int):
        import torch

        from ep_harness.subject import Platform, load_all

        self.torch = torch
        self.repeats, self.warmup, self.budget_s, self.seed = repeats, warmup, budget_s, seed
        self.began = time.perf_counter()
        self.subjects = load_all()
        props = torch.cuda.get_device_properties(0)
        self.platform = Platform("nccl", "cuda", 1, props.name, (props.major, props.minor), gpus=1)
        self.device = torch.device("cuda", 0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def over_budget(self) -> str | None:
        if self.elapsed() > self.budget_s:
            return f"the run's time budget ({self.budget_s:.0f} s) was spent after {self.elapsed():.0f} s"
        return None

    def available(self, names, params) -> tuple[dict, dict]:
        ready, unavailable = {}, {}
        for name in names:
            subject = self.subjects.get(name)
            reason = "not registered" if subject is None else subject.unavailable(self.platform, params)
            if reason:
                unavailable[name] = reason
            else:
                ready[name] = subject
        return ready, unavailable

    def randn(self, shape, scale=1.0, dtype=None):
        g = self.torch.Generator(device=self.device).manual_seed(self.seed + sum(shape))
        x = self.torch.randn(shape, generator=g, device=self.device, dtype=self.torch.bfloat16)
        return x if scale == 1.0 else (x.float() * scale).to(dtype or self.torch.bfloat16)

    def time_point(self, calls: dict, hold_ms: float) -> tuple[dict, dict]:
        """The calls' samples and the hold they ran under (timing.time_held)."""
        return timing.time_held(calls, self.repeats, self.warmup, hold_ms)

    # dense --------------------------------------------------------------------------------
    def dense(self, title: str, n: int, k: int, m_values) -> dict:
        from ep_harness.contracts import GemmProblem
        from ep_harness.kernels import library_route

        torch = self.torch
        routed_before = dict(library_route.ROUTED_CALLS)
        section = {"kind": "dense", "title": title, "n": n, "k": k, "points": []}
        ready, section["unavailable"] = self.available(DENSE_SUBJECTS, GemmParams(layout="dense", dtype="bfloat16"))
        a_all, b = self.randn((max(m_values), k)), self.randn((n, k), k ** -0.5)
        plant_cancellation(a_all[0], b, k)
        probes = {name: {} for name in ready}
        for m in sorted(set(m_values) | {m for m in INVARIANCE_M if m <= max(m_values)}):
            a = a_all[:m].clone()
            a[m - 1] = a_all[0]  # the probe row again, at another place in its tile
            problem = GemmProblem("dense", a, b, [m], [0])
            outs = {name: torch.empty(m, n, dtype=torch.bfloat16, device=self.device) for name in ready}
            calls, failed = self._first_calls(ready, problem, outs)
            for name in calls:
                probes[name][m] = torch.stack([outs[name][0], outs[name][m - 1]])
            if m not in m_values:
                continue  # bits only
            point = {"m": m, "failed": failed}
            if calls:
                flops = timing.gemm_flops(m, n, k)
                warm, warm_timing = self.time_point(self._rotating(calls, [(problem, outs)]), hold_ms=2.0)
                cold_sets = self._operand_copies(problem, outs)
                cold, cold_timing = self.time_point(self._rotating(calls, cold_sets), hold_ms=2.0)
                point.update(cost=self._gemm_costs(warm, flops, "bf16"), cost_cold=self._gemm_costs(cold, flops, "bf16"),
                             cold_copies=len(cold_sets), timing={"warm": warm_timing, "cold": cold_timing})
                del cold_sets
            point["probe"] = self._probe_rows(probes, m)
            section["points"].append(point)
            if m == 256:
                section["reference"] = self._reference(problem, {name: outs[name] for name in calls}, n, k)
        section["library_route"] = routed_m(n, k, m_values, routed_before)
        if library_route.failed():
            section["library_route_failed"] = True
        sensitive = k_order_sensitive(a_all[0], b, torch.bfloat16)
        section["invariance"] = {name: summarize(name, p, 2 * sensitive) for name, p in probes.items() if p}
        torch.cuda.empty_cache()
        return section

    def _first_calls(self, ready: dict, problem, outs: dict) -> tuple[dict, dict]:
        """Each subject once (it compiles: Triton, DeepGEMM's JIT; a broken one shows alone);
        returns the subjects that ran, as the call to time, and why the others failed."""
        calls, failed = {}, {}
        for name, subject in ready.items():
            try:
                subject.run(problem, outs[name])
                self.torch.cuda.synchronize()
            except Exception as exc:  # reported in the table, the others still measured
                failed[name] = first_line(exc)
                continue
            # a library that allocates its own output is timed without the copy into ours
            product = getattr(subject, "product", None)
            calls[name] = (lambda p, o, f=product: f(p)) if product else \
                (lambda p, o, s=subject, n=name: s.run(p, o[n]))
        return calls, failed

    def _operand_copies(self, problem, outs: dict) -> list:
        """Enough copies of the operands (same values) and outputs that calls rotating through
        them find theirs out of L2."""
        l2 = self.torch.cuda.get_device_properties(0).L2_cache_size
        one = sum(t.numel() * t.element_size() for t in (problem.a, problem.b, *outs.values()))
        sets = [(problem, outs)]
        for _ in range(timing.Rotation.copies(one, l2) - 1):
            sets.append((problem.to(problem.a.device), {name: self.torch.empty_like(o) for name, o in outs.items()}))
        return sets

    @staticmethod
    def _rotating(calls: dict, sets: list) -> dict:
        rotation = timing.Rotation(sets)

        def call_of(fn):
            def call():
                problem, outs = rotation.take()
                fn(problem, outs)
            return call
        return {name: call_of(fn) for name, fn in calls.items()}

    def _gemm_costs(self, samples: dict, flops: int, peak_of) -> dict:
        base = samples.get(BASELINE)
        out = {}
        for name, s in samples.items():
            peak = peak_of(name) if callable(peak_of) else peak_of
            out[name] = timing.gemm_cost(s, flops, peak, base)
        return out

    @staticmethod
    def _probe_rows(probes: dict, m: int) -> dict:
        result = {}
        for name, by_m in probes.items():
            if m in by_m:
                first = by_m[min(by_m)]
                result[name] = {"mismatched": probe_mismatches({0: first, 1: by_m[m]})[1], "total": by_m[m].numel()}
        return result

    def _reference(self, problem, outs: dict, n: int, k: int, rows: int = 64) -> dict:
        """Each subject's first `rows` output rows against float64, within tolerances.GEMM."""
        from ep_harness.tolerances import gemm_bound

        a, b = problem.a[:rows].double(), problem.b.double()
        exact = a @ b.T
        tol = gemm_bound("bfloat16", k)
        bound = tol["u_out"] * exact.abs() + tol["gamma"] * (a.abs() @ b.abs().T)
        result = {}
        for name, out in outs.items():
            frac = float(((out[:rows].double() - exact).abs() / bound).max())
            result[name] = {"m": problem.a.shape[0], "rows": rows, "worst_fraction_of_bound": frac, "within": frac <= 1.0}
        return result

    # quantization -------------------------------------------------------------------------
    def quant(self, cols: int) -> dict:
        torch = self.torch
        section = {"kind": "quant", "title": f"FP8 per-token-group quantization, {cols} columns (bf16 in)",
                   "cols": cols, "points": []}
        ready, section["unavailable"] = self.available(QUANT_SUBJECTS, QuantParams(cols=cols))
        x_all = self.randn((max(QUANT_ROWS), cols))
        for rows in QUANT_ROWS:
            x = x_all[:rows]
            moved = timing.quant_bytes(rows, cols)
            calls, failed = {"copy": timing.copy_of(moved, self.device)}, {}
            for name, subject in ready.items():
                try:
                    subject.quantize(x, False)
                    torch.cuda.synchronize()
                except Exception as exc:
                    failed[name] = first_line(exc)
                    continue
                calls[name] = (lambda s=subject: s.quantize(x, False))
            samples, held = self.time_point(calls, hold_ms=1.0)
            costs = {name: timing.quant_cost(s, moved, samples["copy"]) for name, s in samples.items()}
            section["points"].append({"m": rows, "cost": costs, "failed": failed, "bytes": moved, "timing": held})
        return section

    # grouped ------------------------------------------------------------------------------
    def grouped(self, model: MoeModel, projection: str, n: int, k: int, m_values) -> dict:
        from ep_harness.contracts import GemmProblem
        from ep_harness.subjects.quant.torch_fp8 import TorchFp8QuantReciprocal
        from ep_harness.reference.quant import quantize_per_block

        torch = self.torch
        title = (f"grouped {model.name} {projection}: {model.experts} experts x [{n} x {k}], top-{model.topk}, "
                 f"contiguous layout")
        section = {"kind": "grouped", "title": title, "model": model.name, "projection": projection,
                   "n": n, "k": k, "experts": model.experts, "topk": model.topk, "points": []}
        bf16_ready, unavailable = self.available(GROUPED_SUBJECTS[:3], GemmParams(layout="contiguous", dtype="bfloat16"))
        fp8_ready, fp8_unavailable = self.available(GROUPED_SUBJECTS[3:], GemmParams(layout="contiguous",
                                                                                    dtype="float8_e4m3fn"))
        section["unavailable"] = {**unavailable, **fp8_unavailable}
        w = torch.empty(model.experts, n, k, dtype=torch.bfloat16, device=self.device)
        g = torch.Generator(device=self.device).manual_seed(self.seed + n * k)
        for e in range(model.experts):  # one expert at a time: no float32 copy of all the weights
            w[e] = torch.randn(n, k, generator=g, device=self.device, dtype=torch.bfloat16).mul_(k ** -0.5)
        tokens_all = self.randn((max(m_values), k))
        plant_cancellation(tokens_all[0], w, k)
        w_fp8 = w_scale = None
        if fp8_ready:
            w_fp8 = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=self.device)
            w_scale = torch.empty(model.experts, n // 128, k // 128, dtype=torch.float32, device=self.device)
            for e in range(model.experts):
                w_fp8[e], w_scale[e] = quantize_per_block(w[e])
        g = torch.Generator(device=self.device).manual_seed(self.seed)
        routing = torch.rand(max(m_values), model.experts, generator=g, device=self.device).topk(model.topk, 1).indices
        probe_expert = int(routing[0, 0])
        ready = {**bf16_ready, **fp8_ready}
        probes = {name: {} for name in ready}
        quantizer = TorchFp8QuantReciprocal()
        for m in m_values:
            rows, counts, starts, total = contiguous_layout(routing[:m], model.experts, ALIGNMENT)
            a = torch.zeros(total, k, dtype=torch.bfloat16, device=self.device)
            a[rows.reshape(-1)] = tokens_all[:m].repeat_interleave(model.topk, 0)
            layout = torch.full((total,), -1, dtype=torch.int32, device=self.device)
            layout[rows.reshape(-1)] = routing[:m].reshape(-1).int()
            bf16 = GemmProblem("contiguous", a, w, counts, starts, grouped_layout=layout)
            outs = {name: torch.zeros(total, n, dtype=torch.bfloat16, device=self.device) for name in ready}
            problems = {name: bf16 for name in bf16_ready}
            if fp8_ready:
                q, s = quantizer.quantize(a, False)
                fp8 = GemmProblem("contiguous", q, w_fp8, counts, starts, grouped_layout=layout,
                                  a_scale=s, b_scale=w_scale)
                problems.update({name: fp8 for name in fp8_ready})
            calls, failed = {}, {}
            for name, subject in ready.items():
                try:
                    subject.run(problems[name], outs[name])
                    torch.cuda.synchronize()
                except Exception as exc:
                    failed[name] = first_line(exc)
                    continue
                calls[name] = (lambda s=subject, p=problems[name], o=outs[name]: s.run(p, o))
            samples, held = self.time_point(calls, hold_ms=10.0) if calls else ({}, None)
            flops = timing.gemm_flops(m * model.topk, n, k)
            costs = self._gemm_costs(samples, flops, lambda name: "fp8" if name in fp8_ready else "bf16")
            point = {"m": m, "rows": m * model.topk, "padded_rows": total, "cost": costs, "failed": failed,
                     "timing": held}
            for name in samples:
                probes[name][m] = outs[name][starts[probe_expert]].clone()
            point["probe"] = self._probe_rows(probes, m)
            section["points"].append(point)
            del a, outs, problems
        sensitive = {name: k_order_sensitive(tokens_all[0], w[probe_expert], torch.bfloat16) for name in bf16_ready}
        if fp8_ready:  # the products the FP8 kernel sums: dequantized operands
            from ep_harness.reference.quant import dequantize_per_block, dequantize_per_token_group

            q, s = quantizer.quantize(tokens_all[:1], False)
            row = dequantize_per_token_group(q, s)[0]
            weight = dequantize_per_block(w_fp8[probe_expert], w_scale[probe_expert])
            sensitive.update({name: k_order_sensitive(row, weight, torch.bfloat16) for name in fp8_ready})
        section["invariance"] = {name: summarize(name, p, sensitive[name]) for name, p in probes.items() if p}
        del w, w_fp8, w_scale
        torch.cuda.empty_cache()
        return section


def environment() -> dict:
    import torch

    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": host.python_version()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    from ep_harness.subjects.gemm import deepgemm

    try:
        deepgemm.deep_gemm()
        env["deep_gemm"] = deepgemm.settings()
    except ImportError as exc:
        env["deep_gemm"] = f"unavailable: {exc}"
    from dataclasses import asdict

    from ep_harness.kernels.bi_matmul import tile_plan

    env["triton_tiles"] = {f"{n}x{k}": {m: asdict(tile_plan(m, n, k, "bfloat16")) for m in DENSE_M}
                           for _, n, k in DENSE_SHAPES}
    return env


def run(out_dir: Path, repeats: int, warmup: int, budget_s: float, seed: int, sections: tuple[str, ...]) -> dict:
    bench = Bench(repeats, warmup, budget_s, seed)
    plan = []
    if "dense" in sections:
        plan += [(title, lambda t=title, n=n, k=k: bench.dense(t, n, k, DENSE_M)) for title, n, k in DENSE_SHAPES]
    if "quant" in sections:
        plan += [(f"quant {c}", lambda c=c: bench.quant(c)) for c in QUANT_COLS]
    if "grouped" in sections:
        plan += [(f"grouped {mdl.name} {proj}", lambda mdl=mdl, p=proj, n=n, k=k: bench.grouped(mdl, p, n, k, GROUPED_M))
                 for mdl in MOE_MODELS for proj, n, k in mdl.projections()]
    result = {"environment": environment(), "peaks": timing.H200_PEAKS, "repeats": repeats, "warmup": warmup,
              "seed": seed, "method": (f"CUDA events, {warmup} warm-up calls, subjects interleaved call by call, "
                                       f"median of {repeats}; L2-warm: operands reused; dense also L2-cold: "
                                       f"every call takes the next of several operand copies, together over 3x L2"),
              "sections": []}
    for title, measure in plan:
        reason = bench.over_budget()
        began = time.perf_counter()
        if reason:
            section = {"kind": "skipped", "title": title, "skipped": reason, "points": []}
        else:
            try:
                section = measure()
            except Exception as exc:  # one broken section must not lose the others' numbers
                section = {"kind": "error", "title": title, "points": [],
                           "skipped": f"failed: {first_line(exc, 292)}"}
        section["seconds"] = round(time.perf_counter() - began, 2)
        result["sections"].append(section)
        console.current().line(f"[{bench.elapsed():6.1f} s] {title}: {section.get('skipped') or 'done'} "
                               f"({section['seconds']} s)")
        _write(out_dir, result)
    result["seconds"] = round(bench.elapsed(), 1)
    _write(out_dir, result)
    return result


def _write(out_dir: Path, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cost.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "cost.md").write_text(render(result))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ep_harness.cost.bench_gemm_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for cost.json and cost.md")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per subject and point (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per subject before timing")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="start no new section after this many seconds (the rest is listed as not measured)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sections", default="dense,quant,grouped", help="comma-separated: dense, quant, grouped")
    args = parser.parse_args(argv)
    out = console.current()
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = set(sections) - {"dense", "quant", "grouped"}
    if unknown:
        out.err(f"error: unknown section(s) {', '.join(sorted(unknown))}; choose from dense, quant, grouped")
        return 2
    if args.repeats < 1:
        out.err(f"error: --repeats {args.repeats}: need at least 1")
        return 2
    import torch

    if not torch.cuda.is_available():
        out.err("error: the cost bench needs a CUDA GPU (none is visible); run it on the GPU machine")
        return 2
    result = run(args.out, args.repeats, args.warmup, args.budget_s, args.seed, sections)
    out.line(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
