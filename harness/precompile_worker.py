"""One pre-compilation process (harness/precompile.py starts a pool of them):

    python -m ep_harness.precompile_worker DEVICE [PLUGIN_MODULE ...]

loads the subjects as a rank does (built-in, entry points, the run's plugin modules), says
{"ready": true} on a line of its own, then reads ep_harness.precompile.KernelCall's as JSON lines
on stdin and answers each with one JSON line, {"ok": true} or {"ok": false, "error": "..."},
after calling the subject once on
zero-valued inputs of the call's exact shapes: DeepGEMM compiles (or loads) the kernel on
that first call and keeps it in its cache directory. Anything else written to stdout, by
DeepGEMM's C++ (printf: NVCC's errors) or by Python, goes to stderr, which the pool writes to
the run's precompile.log; the answers have a descriptor of their own.
"""
from __future__ import annotations

import json
import os
import sys
import traceback


def zero_problem(call, device):
    """A GemmProblem of the call's shapes, every value zero (scales one); the rows per expert
    (`counts`) are laid out as ep_harness.families.gemm_problem.build does (ep_harness.contracts)."""
    import torch

    from ep_harness.contracts import GemmProblem, contiguous_segments
    from ep_harness.precompile import FP8

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


def make(call, device: str) -> None:
    import torch

    from ep_harness import subject as registry

    subject = registry.get(call.subject)
    out = torch.zeros(call.out, dtype=torch.bfloat16, device=device)
    subject.run(zero_problem(call, device), out)
    if device == "cuda":
        torch.cuda.synchronize()  # a kernel that fails to launch fails here, not in the check


NICENESS = 10  # added to the head's: the compile runs beside the ranks (harness/precompile.py)


def main() -> None:
    # The compile yields the CPU to the ranks measuring checks beside it (and to the head):
    # on the H200's 16 cores, 15 compile processes at equal priority slowed the rank's own
    # CPU work 2-3x. NVCC, started by DeepGEMM from here, inherits the niceness.
    os.nice(NICENESS)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else is printed goes to the log
    sys.stdout = sys.stderr
    device, plugins = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("cuda", [])
    from ep_harness import subject as registry
    from ep_harness.precompile import KernelCall
    from ep_harness.subjects.gemm.deepgemm import deep_gemm

    broken = None
    try:  # every call fails with the reason (the run's own loading reports it)
        registry.load_all(plugins)
    except Exception as exc:
        broken = f"the subjects cannot be loaded here: {(str(exc).splitlines() or [type(exc).__name__])[0]}"
    if not broken:
        try:
            deep_gemm()  # imported (and its determinism switch set) as in a rank, before the first call
        except ImportError as exc:  # every call fails with the reason (the checks are skipped for it)
            broken = f"deep_gemm cannot be imported here: {exc}"
    answers.write(json.dumps({"ready": True}) + "\n")  # the pool's limit on a call starts now
    for line in sys.stdin:
        call = KernelCall.from_json(json.loads(line))
        try:
            if broken:
                raise RuntimeError(broken)
            make(call, device)
            answer = {"ok": True}
        except Exception as exc:
            print(f"[precompile pid {os.getpid()}] {call.describe()} failed:", file=sys.stderr)
            traceback.print_exc()
            answer = {"ok": False, "error": (f"{type(exc).__name__}: {exc}".splitlines() or ["?"])[0][:300]}
        sys.stderr.flush()
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
