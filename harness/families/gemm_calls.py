"""The GEMM calls the gemm and moe_layer families plan for harness/run/precompile.py (their
Family.precompile): one call of a GEMM subject with the exact shapes of its operands, scales
and output (and `expected_m` for masked layouts), which is what a JIT such as DeepGEMM picks
its kernel configuration from (a smaller stand-in shape could build another kernel than the
check needs), and how a compile worker makes it, once, on zero-valued inputs.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from ep_harness.contracts import GemmProblem, contiguous_segments, expected_m_hint, layout_rows
from ep_harness.families.gemm_problem import FP8

CALL_LIMIT_S = 600.0  # a call's limit when no check gave one (KernelCall.timeout_s)


@dataclass(frozen=True)
class KernelCall:
    """One GEMM call as a check makes it. Equal calls build the same kernels; `counts`
    (rows per expert: runtime values, not part of the kernel), `needed_by` (the first
    check that makes it, for messages) and `timeout_s` (the largest timeout_s of the checks
    that make it: past it they would time out anyway, so the call is given up) are carried
    along but not compared."""

    family: ClassVar[str] = "gemm"  # the family whose Precompile.call this is

    subject: str
    layout: str
    dtype: str
    a: tuple[int, ...]
    b: tuple[int, ...]
    out: tuple[int, ...]
    a_scale: tuple[int, ...] | None = None
    b_scale: tuple[int, ...] | None = None
    expected_m: int | None = None  # masked layouts only
    counts: tuple[int, ...] = field(default=(), compare=False)
    alignment: int = field(default=128, compare=False)
    needed_by: str = field(default="", compare=False)
    timeout_s: float = field(default=CALL_LIMIT_S, compare=False)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> KernelCall:
        shapes = {k: (tuple(d[k]) if d.get(k) is not None else None) for k in ("a", "b", "out", "a_scale", "b_scale")}
        return cls(**{**d, **shapes, "counts": tuple(d.get("counts") or ())})

    def key(self) -> str:
        """What identifies the call in the manifest (a stable string)."""
        return json.dumps([self.subject, self.layout, self.dtype, self.a, self.b, self.out, self.a_scale,
                           self.b_scale, self.expected_m])

    def group(self) -> tuple:
        """One GEMM (subject and weight shape): its calls that differ only in M often build
        the same kernel."""
        return self.subject, self.b

    def describe(self) -> str:
        shape = lambda s: "x".join(map(str, s))  # noqa: E731
        em = f" expected_m={self.expected_m}" if self.expected_m is not None else ""
        return f"{self.subject} a={shape(self.a)} b={shape(self.b)}{em} (for {self.needed_by})"

    def make(self, subject, device: str) -> None:
        import torch

        out = torch.zeros(self.out, dtype=torch.bfloat16, device=device)
        subject.run(zero_problem(self, device), out)
        if device == "cuda":
            torch.cuda.synchronize()  # a kernel that fails to launch fails here, not in the check


def gemm_call(subject_name: str, layout: str, dtype: str, counts, n: int, k: int, groups: int,
              alignment: int, expected_m: int | None, needed_by: str) -> KernelCall:
    """The call a GEMM subject receives for experts holding `counts` rows each, with the
    shapes its operands have in the layout (ep_harness.contracts.layout_rows, which
    gemm_problem.build and the dispatchers' layouts follow; FP8 adds block scales)."""
    counts = tuple(int(c) for c in counts)
    rows = layout_rows(layout, list(counts), alignment)
    a, out = (*rows, k), (*rows, n)
    b = (n, k) if layout == "dense" else (groups, n, k)
    if layout == "masked":
        expected_m = expected_m or expected_m_hint(counts)
    scales = {}
    if dtype == FP8:
        scales = {"a_scale": (*a[:-1], k // 128), "b_scale": (*b[:-2], n // 128, k // 128)}
    return KernelCall(subject_name, layout, dtype, a, b, out, expected_m=expected_m if layout == "masked" else None,
                      counts=counts, alignment=alignment, needed_by=needed_by, **scales)


def zero_problem(call: KernelCall, device):
    """A GemmProblem of the call's shapes, every value zero (scales one); the rows per expert
    (`counts`) are laid out as ep_harness.gemm_problem.build does (ep_harness.contracts)."""
    import torch

    base = torch.float8_e4m3fn if call.dtype == FP8 else torch.bfloat16
    a = torch.zeros(call.a, dtype=base, device=device)
    b = torch.zeros(call.b, dtype=base, device=device)
    counts = list(call.counts)
    problem = GemmProblem(call.layout, a, b, counts, [0] * max(len(counts), 1))
    if call.layout == "contiguous":
        problem.starts, problem.grouped_layout = contiguous_segments(counts, call.alignment, device)
    elif call.layout == "masked":
        problem.masked_m = torch.tensor(counts, dtype=torch.int32, device=device)
        problem.expected_m = call.expected_m
    if call.a_scale is not None:
        problem.a_scale = torch.ones(call.a_scale, dtype=torch.float32, device=device)
        problem.b_scale = torch.ones(call.b_scale, dtype=torch.float32, device=device)
    return problem


def compiled_ahead(name: str) -> bool:
    """A registered subject whose JIT the harness compiles ahead (ep_harness.subject.jit_of)."""
    from ep_harness import subject as registry

    return registry.jit_of(registry.get(name)) is not None
