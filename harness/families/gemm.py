"""GEMM checks: a probe row's output while everything around it changes.

The probe is one activation row of expert `probe_group`, fixed by the seed. Runs differ in
what else is in the batch:

* batch-invariance: the probe's expert holds 1 .. thousands of rows (m_values), the other
  experts' load changes (other_loads), and for masked layouts the expected_m hint changes.
* position-invariance: the probe at the first, middle and last row of its expert.
* run-to-run: one run repeated (thread-invariance: each repeat on another thread count);
  graph-invariance: eager vs CUDA-graph replay.
* reference: the whole output against the float64 product, within tolerances.GEMM.

Vacuity: if summing the probe's K products in two different orders cannot change a single
output element (after rounding to the output dtype), no kernel reordering could show.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ep_harness import inputs as gen
from ep_harness.compare import compare_bitwise, json_float
from ep_harness.context import RankContext
from ep_harness.contracts import GemmProblem
from ep_harness.families.driver import (REPEATED, THREAD_INVARIANCE, Copy, Family, Precompile, Run, kept, repeat_labels,
                                        require_finite, subject_call)
from ep_harness.families.gemm_calls import KernelCall, compiled_ahead, gemm_call
from ep_harness.measurement import Bound, Measurement
from ep_harness.params import DATA_KINDS, CommonParams, _opt, _required
from ep_harness.subject import GemmSubject
from ep_harness.families.gemm_problem import FP8, build, dequantized, weights
from ep_harness.graphs import replay_in_graph
from ep_harness.tolerances import gemm_bound
from ep_harness.reference import gemm as ref
from ep_harness.selftest.wrap import Wrapped

PROPERTIES = ("reference", "run-to-run", "thread-invariance", "batch-invariance", "position-invariance",
              "graph-invariance")


@dataclass(frozen=True, kw_only=True)
class GemmParams(CommonParams):
    dtype: str = _required(choices=("bfloat16", "float32", "float8_e4m3fn"))
    layout: str | None = _opt(None, choices=("contiguous", "masked", "dense"))  # None: the subject's first
    n: int = _opt(256, minimum=1)
    k: int = _opt(512, minimum=2)
    groups: int = _opt(4, minimum=1)
    # None: expert 1 where there is one (dense: 0), so the probe's rows start past row 0 of A
    # once expert 0 is loaded; other_loads[0] loads the other experts during the M sweep
    # (37: not a multiple of any tile), and the sweep's later runs move the probe's row offset
    probe_group: int | None = _opt(None, minimum=0)
    m_values: list[int] = _opt([1, 3, 17, 128, 1000], minimum=1, nonempty=True)
    other_loads: list[int] = _opt([37, 0, 512], minimum=0, nonempty=True)
    expected_m_values: list[int] = _opt([1, 64, 1024], minimum=1, nonempty=True)
    # the reference's rows per expert and the position sweep's: 199 = 3 * 64 + 7 leaves a
    # partial tail tile for every power-of-two tile height from 2 to 128
    position_m: int = _opt(199, minimum=1)
    repeats: int = _opt(3, minimum=1)
    alignment: int = _opt(128, minimum=1)
    data: str = _opt("randn", choices=DATA_KINDS)
    cancel: bool = _opt(True)

    def completed(self, subject):
        p = self if self.layout is not None else replace(self, layout=subject.layouts[0])
        if p.probe_group is None:
            p = replace(p, probe_group=0 if p.layout == "dense" or p.groups == 1 else 1)
        return p

    def validate(self, subject):
        if self.layout == "dense" and self.probe_group:
            return f"probe_group = {self.probe_group} with layout = 'dense': a dense problem is one expert; use 0"
        if self.probe_group >= self.groups:
            return f"probe_group = {self.probe_group} but there are only {self.groups} groups (0..{self.groups - 1})"
        if self.layout not in subject.layouts:
            return f"layout = {self.layout!r}: {subject.name} takes {', '.join(subject.layouts)}"
        if self.dtype not in subject.dtypes:
            return f"dtype = {self.dtype!r}: {subject.name} takes {', '.join(subject.dtypes)}"
        return None


def out_dtype(dtype: str) -> torch.dtype:
    return torch.float32 if dtype == "float32" else torch.bfloat16


@dataclass(frozen=True)
class GemmRun:
    """One GEMM a property compares: rows per expert, the probe's row within its expert, the
    masked layout's expected_m hint (None: the problem's own), a label, whether in a graph."""

    counts: tuple[int, ...]
    pos: int
    expected_m: int | None
    label: str
    graph: bool = False


def runs_for(prop: str, p: GemmParams) -> list[GemmRun]:
    """Each run's problem and the probe's place in it (eager; `_runs` says which are graphs)."""
    g, groups = p.probe_group, p.groups

    def counts(m, other):
        return tuple(m if i == g else other for i in range(groups))

    base_other = p.other_loads[0]
    if prop == "batch-invariance":
        runs = [GemmRun(counts(m, base_other), 0, None, f"m={m}") for m in p.m_values]
        m0 = p.m_values[0]
        runs += [GemmRun(counts(m0, o), 0, None, f"m={m0} others={o}") for o in p.other_loads[1:]]
        if p.layout == "masked":
            runs += [GemmRun(counts(m0, base_other), 0, e, f"m={m0} expected_m={e}") for e in p.expected_m_values]
        return runs
    m = p.position_m
    if prop == "position-invariance":
        return [GemmRun(counts(m, base_other), pos, None, name)
                for pos, name in ((0, "first"), (m // 2, "middle"), (m - 1, "last"))]
    one = GemmRun(counts(m, base_other), 0, None, "")
    if prop in REPEATED:
        return [replace(one, label=label) for label in repeat_labels(prop, p.repeats)]
    if prop == "graph-invariance":
        return [replace(one, label="eager"), replace(one, label="graph")]
    if prop == "reference":  # every expert loaded, so the whole layout is checked
        return [GemmRun((m,) * groups, 0, None, "reference")]
    raise ValueError(f"gemm checks have no property {prop!r}")


CANCEL = 2.0 ** 12  # one probe product pair: +CANCEL*w and -CANCEL*w, in different K halves


def probe_row(p: GemmParams, base) -> torch.Tensor:
    """The probe activation. With cancel=true two entries, K/2 apart, carry +-CANCEL against
    equal weight columns: their products cancel exactly, but whatever was added between
    them is rounded at their magnitude, so any other K order (split-K, another tile walk)
    changes the output bits. Without it, a bf16 output hides most float32 reorderings."""
    probe = gen.values((p.k,), base, p.seed, "probe-row", data=p.data)
    if p.cancel:
        probe[1], probe[1 + p.k // 2] = CANCEL, -CANCEL
    return probe


def case_weights(p: GemmParams, ctx: RankContext):
    """The case's weights (cached) on the rank's device: its problems are built there, and
    the float64 reference is computed there (exact and IEEE-rounded operations only, or
    float64 GEMMs whose last-bit order moves the bound by far less than a bf16 ULP)."""
    return weights(p.seed, p.groups, p.n, p.k, p.dtype, p.data, p.cancel, str(ctx.device))


def make_problem(p: GemmParams, run: GemmRun, w, w_scale) -> GemmProblem:
    k, dtype = p.k, p.dtype
    base = torch.bfloat16 if dtype == FP8 else gen.dtype_of(dtype)
    probe = probe_row(p, base)
    rows = {}
    for g, c in enumerate(run.counts):
        rows[g] = gen.values((c, k), base, p.seed, "rows", g, run.counts, data=p.data)
        if g == p.probe_group:
            rows[g][run.pos] = probe
    return build(p.layout, dtype, rows, list(run.counts), w, w_scale, k, p.alignment, run.expected_m)


def output_for(problem: GemmProblem, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The output buffer (its contents are the driver's sentinel by the time a checked call runs)."""
    shape = (problem.a.shape[0], n) if problem.layout != "masked" else (*problem.a.shape[:2], n)
    return torch.zeros(shape, dtype=dtype, device=device)


def _runs(prop: str, p: GemmParams, world_size: int) -> list[Run]:
    out = []
    for i, run in enumerate(runs_for(prop, p)):
        graph = p.mode == "graph" or (prop == "graph-invariance" and i == 1)
        placement = (run.counts, run.pos, run.expected_m)
        out.append(Run(run.label, (Copy(placement),), replace(run, graph=graph)))
    return out


def _observe(subject, ctx: RankContext, p: GemmParams, prop: str, runs: list[Run]):
    """The probe row's output per run (every rank computes the same GEMMs); for the
    reference, the whole output of the one run."""
    w, w_scale = case_weights(p, ctx)
    probes = []
    for run in runs:
        problem = make_problem(p, run.spec, w, w_scale)
        dev = problem.to(ctx.device)
        out = output_for(dev, p.n, out_dtype(p.dtype), ctx.device)
        with subject_call({"problem": dev}, [(out, _valid_mask(dev, out.shape))]):  # padding rows: no write due
            if run.spec.graph:
                replay_in_graph(lambda o, a: subject.run(dev, o), out, dev.a)
            else:
                subject.run(dev, out)
        if prop == "reference":
            return kept(out)
        probe = kept(out[dev.row_index(p.probe_group, run.spec.pos)])
        # thread-invariance: every output a call must write as well (a kernel that splits rows
        # over threads keeps the probe's row in its first part on every count)
        probes.append((probe, kept(out[_valid_mask(dev, out.shape)])) if prop == THREAD_INVARIANCE else probe)
    return probes


def _measure(check, subject, ctx: RankContext, p: GemmParams, runs: list[Run], gathered) -> Measurement:
    w, w_scale = case_weights(p, ctx)
    if check.property == "reference":
        return _measure_reference(p, make_problem(p, runs[0].spec, w, w_scale), gathered[0])
    seen = gathered[0]
    if check.property == THREAD_INVARIANCE:  # every output written, each against its first run's
        probes, observed = (torch.stack(part) for part in zip(*seen))
    else:
        probes = observed = torch.stack(seen)
    m = Measurement.bitwise(compare_bitwise(observed, observed[0], [r.label for r in runs]))
    row, weight = probe_operands(p, w, w_scale)
    require_finite(m, probes, weight.double() @ row.double())
    m.sensitivity = order_sensitive(p, w, w_scale)
    m.sensitivity_what = f"probe outputs change bits when its {p.k} products are summed in another order"
    return m


def _measure_with_cost(check, subject, ctx: RankContext, p: GemmParams, runs: list[Run], gathered) -> Measurement:
    """The verdict's measurement and, on a GPU, its price: the check's largest problem timed
    against cuBLAS (ep_harness.cost.timing). Absent on the CPU, never zero."""
    m = _measure(check, subject, ctx, p, runs, gathered)
    if ctx.device.type == "cuda":
        from ep_harness.cost import timing
        from ep_harness.subject import get

        w, w_scale = case_weights(p, ctx)
        dense = p.layout == "dense"  # a dense problem holds group 0's rows only
        largest = max(runs, key=lambda r: r.spec.counts[0] if dense else sum(r.spec.counts))
        problem = make_problem(p, largest.spec, w, w_scale).to(ctx.device)
        out = output_for(problem, p.n, out_dtype(p.dtype), ctx.device)
        baseline = None if p.dtype == FP8 else get("torch_mm")
        m.detail["cost"] = timing.cost_or_reason(lambda: timing.gemm_check_cost(subject, problem, out, baseline))
    return m


# `ep-harness explore`: the parameters a search varies (st: hypothesis.strategies); it draws
# the family's searchable properties (harness/properties.py).
def _search_space(st):
    return {"m_values": st.lists(st.integers(1, 512), min_size=2, max_size=4, unique=True),
            "position_m": st.integers(1, 256), "seed": st.integers(0, 10_000), "dtype": st.just("bfloat16")}


class _Injected(Wrapped):
    """`ep-harness selftest`: the defect in run's output, or in the operand `a`."""

    def run(self, problem, out):
        self._subject.run(problem, out)
        self._inject(out, getattr(problem, "a", None))


def _kernel_calls(check) -> list[KernelCall]:
    """The calls of a check whose subject's JIT compiles ahead (harness/run/precompile.py)."""
    if not compiled_ahead(check.subject):
        return []
    p = check.params
    return [gemm_call(check.subject, p.layout, p.dtype, run.counts, p.n, p.k, p.groups, p.alignment, run.expected_m,
                      check.id)
            for run in runs_for(check.property, p)]


FAMILY = Family("gemm", PROPERTIES, GemmParams, _runs, _observe, _measure_with_cost,
                protocol=GemmSubject, precompile=Precompile(_kernel_calls, call=KernelCall),
                search_space=_search_space, selftest_wrapper=_Injected)


def probe_operands(p: GemmParams, w, w_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe row [K] and its expert's weight [N, K], dequantized."""
    run = runs_for("position-invariance", p)[0]
    problem = make_problem(p, run, w, w_scale)
    a, b = dequantized(problem)
    return a[problem.row_index(p.probe_group, 0)], (b if problem.layout == "dense" else b[p.probe_group])


def order_sensitive(p: GemmParams, w, w_scale) -> int:
    """Output elements of the probe whose bits depend on the K summation order."""
    row, weight = probe_operands(p, w, w_scale)
    return ref.k_order_sensitive(row, weight, out_dtype(p.dtype))


def _measure_reference(p: GemmParams, problem: GemmProblem, out: torch.Tensor) -> dict:
    a, b = dequantized(problem)
    if problem.layout == "dense":
        exact, scale = a @ b.T, ref.abs_products(a, b)
    elif problem.layout == "contiguous":
        exact = ref.grouped_contiguous(a, b, problem.grouped_layout)
        scale = torch.zeros_like(exact)
        for g in range(b.shape[0]):
            rows = (problem.grouped_layout == g).nonzero().flatten()
            if rows.numel():
                scale[rows] = ref.abs_products(a[rows], b[g])
    else:
        exact = ref.grouped_masked(a, b, problem.masked_m)
        scale = torch.zeros_like(exact)
        for g in range(b.shape[0]):
            m = int(problem.masked_m[g])
            scale[g, :m] = ref.abs_products(a[g, :m], b[g])
    tol = gemm_bound(p.dtype, p.k)
    bound = tol["u_out"] * exact.abs() + tol["gamma"] * scale
    valid = _valid_mask(problem, exact.shape)
    rule = Bound(rule=tol["rule"], terms={k: v for k, v in tol.items() if k != "rule"})
    got = out.to(exact.device, torch.float64)
    return Measurement.within(out, exact, bound, rule, valid,
                              detail={"calc_diff": json_float(_calc_diff(got[valid], exact[valid]))})


def _valid_mask(problem: GemmProblem, shape) -> torch.Tensor:
    if problem.layout == "dense":
        return torch.ones(shape, dtype=torch.bool, device=problem.a.device)
    if problem.layout == "contiguous":
        return (problem.grouped_layout >= 0).unsqueeze(1).expand(shape)
    rows = torch.arange(shape[1], device=problem.masked_m.device).unsqueeze(0) < problem.masked_m.unsqueeze(1)
    return rows.unsqueeze(2).expand(shape)


def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's global similarity 1 - 2<x,y>/(|x|^2+|y|^2), for comparison with its thresholds."""
    denom = float((x * x + y * y).sum())
    return 0.0 if denom == 0 else 1.0 - 2.0 * float((x * y).sum()) / denom
