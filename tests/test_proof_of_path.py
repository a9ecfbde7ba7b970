"""Proof that the path under test ran: declared kernels must run, and every rank must see
the variables the launcher pinned."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ep_harness import kernel_trace
from ep_harness.check import single_check
from ep_harness.families import execute
from ep_harness.subject import register
from ep_harness.subjects.gemm.torch_mm import TorchMm
from tests.conftest import REPO_ON_PYTHONPATH, run_cli


class _Declaring(TorchMm):
    """torch.mm that declares a kernel; `label` is the profiler range it emits (None: none)."""

    label = None

    def kernels(self, params):
        return ("fast_gemm::grouped",)

    def run(self, problem, out):
        if self.label is None:
            return super().run(problem, out)
        with torch.profiler.record_function(self.label):
            return super().run(problem, out)


@register
class SilentFallback(_Declaring):
    name, summary = "test_silent_fallback", "declares fast_gemm::grouped, runs torch.mm"


@register
class EmitsItsKernel(_Declaring):
    name, summary, label = "test_emits_kernel", "declares and emits fast_gemm::grouped", "fast_gemm::grouped (cpu)"


def measure(subject, ctx):
    check = single_check(subject, "reference", {"dtype": "bfloat16", "layout": "contiguous"})
    return execute(check, subject, ctx)


def test_a_declared_kernel_that_did_not_run_is_an_error(one_rank):
    from ep_harness import subject as registry

    m = measure(registry.get("test_silent_fallback"), one_rank)
    assert m.error and "declares kernels ['fast_gemm::grouped'] but none ran" in m.error
    assert m.held  # the numbers were right: only the proof is missing


def test_a_declared_kernel_that_ran_is_listed(one_rank):
    from ep_harness import subject as registry

    m = measure(registry.get("test_emits_kernel"), one_rank)
    assert m.error is None and m.held
    assert any("fast_gemm::grouped" in k for k in m.kernels)


def test_undeclared_subjects_are_not_traced_on_the_cpu():
    from ep_harness import subject as registry

    assert not kernel_trace.traced(registry.get("torch_mm"), {}, torch.device("cpu"))
    assert kernel_trace.traced(registry.get("torch_mm"), {}, torch.device("cuda"))


def test_raw_event_names_are_the_profilers_own_and_the_fallback_reads_the_same():
    """The fast path (the profiler's raw Kineto events) lists what its FunctionEvents list; a
    profiler without raw events (another torch) falls back to those."""
    from torch.autograd.profiler import profile

    with profile(use_cpu=True, use_kineto=True) as prof:
        with torch.profiler.record_function("fast_gemm::grouped (cpu)"):
            torch.ones(8, 8) @ torch.ones(8, 8)
    cpu = torch.autograd.DeviceType.CPU
    expected = {e.name for e in prof.function_events if e.device_type == cpu}
    assert "fast_gemm::grouped (cpu)" in expected and "aten::mm" in expected
    assert kernel_trace._event_names(prof, cpu) == expected

    class WithoutRaw:  # what a profiler without kineto_results offers
        function_events = prof.function_events

    assert kernel_trace._event_names(WithoutRaw(), cpu) == expected
    assert kernel_trace._event_names(prof, torch.autograd.DeviceType.CUDA) == set()


def test_a_profiler_range_on_the_gpu_timeline_is_not_a_kernel():
    """Kineto mirrors a record_function range onto the GPU timeline (a CUDA-device event named
    by the range, `is_user_annotation`): on a GPU a subject could name its torch.mm fallback
    after the kernel it declares. Only kernels (and copies) count there, in both read paths;
    on the CPU the ranges are what the fakes emit, and they count (the control)."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    class Raw:  # a _KinetoEvent's accessors
        def __init__(self, name, device, annotation):
            self._name, self._device, self._annotation = name, device, annotation

        def name(self):
            return self._name

        def device_type(self):
            return self._device

        def is_user_annotation(self):
            return self._annotation

    events = [("deep_gemm::sm90_fp8_gemm_1d2d", cuda, True), ("sm90_xmma_gemm_bf16bf16_bf16f32", cuda, False),
              ("fast_gemm::grouped (cpu)", cpu, True)]

    class Profiled:
        class kineto_results:
            @staticmethod
            def events():
                return [Raw(*e) for e in events]

    class Fallback:  # FunctionEvents: attributes, not methods
        function_events = [type("E", (), {"name": n, "device_type": d, "is_user_annotation": a})() for n, d, a in events]

    for prof in (Profiled(), Fallback()):
        assert kernel_trace._event_names(prof, cuda) == {"sm90_xmma_gemm_bf16bf16_bf16f32"}
        assert kernel_trace.missing(("deep_gemm::sm90_",), [kernel_trace._event_names(prof, cuda)]) == \
            ["deep_gemm::sm90_"]
        assert kernel_trace._event_names(prof, cpu) == {"fast_gemm::grouped (cpu)"}


def test_tracing_a_check_does_not_import_inductor():
    """torch.profiler's start imports torch._inductor (dynamo, sympy: seconds per rank on a
    GPU machine); the trace must not."""
    code = ("import sys, torch; from ep_harness import kernel_trace\n"
            "with kernel_trace.kernel_names(torch.device('cpu'), True) as names:\n"
            "    torch.ones(2) + 1\n"
            "assert 'aten::add' in names, names\n"
            "print('torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **REPO_ON_PYTHONPATH},
                         check=True).stdout.split()
    assert out[-1] == "False"


def test_kernel_matching_is_by_substring_over_all_ranks():
    per_rank = [{"void deep_ep::intranode::dispatch<8>(...)"}, {"ncclDevKernel_AllReduce_Sum_bf16_RING_LL"}]
    assert kernel_trace.missing(("intranode::dispatch", "ncclDevKernel", "intranode::combine"), per_rank) == \
        ["intranode::combine"]


def test_the_record_lists_declared_then_library_then_torch_kernels():
    """At most MAX_NAMES names: PyTorch's own kernels (the harness's input preparation among
    them) are the first to be left out, never a declared or a library kernel."""
    torch_own = {f"void at::native::elementwise_kernel<{i}>(...)" for i in range(kernel_trace.MAX_NAMES)}
    ran = [torch_own | {"Memcpy DtoD (Device -> Device)", "sm90_xmma_gemm_bf16bf16_bf16f32"},
           {"void deep_gemm::sm90_bf16_gemm<128>(...)"}]
    listed = kernel_trace.summarize(ran, ("deep_gemm::sm90_",))
    assert len(listed) == kernel_trace.MAX_NAMES
    assert listed[:2] == ["void deep_gemm::sm90_bf16_gemm<128>(...)", "sm90_xmma_gemm_bf16bf16_bf16f32"]
    assert set(listed[2:]) < torch_own | {"Memcpy DtoD (Device -> Device)"}


@pytest.mark.slow
def test_a_rank_without_a_pinned_variable_makes_every_check_an_error(tmp_path, monkeypatch):
    for key, value in REPO_ON_PYTHONPATH.items():
        monkeypatch.setenv(key, value)
    proc = run_cli("verify", "--suite", "tests/cases/env_lost.toml", "--gpus", "0", "--cpu-ranks", "3",
                   "--no-report", "--out", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "latest" / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["error", "error"]
    assert all("rank 1: CUBLAS_WORKSPACE_CONFIG missing" in r["reason"] for r in records)
