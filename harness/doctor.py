"""`ep-harness doctor`: one line per component of this machine, what will run and what will
be skipped (and why), with the command that closes each gap. Exit 0 when the CPU default
(`ep-harness verify`, gloo ranks on the CPU) can run, 1 when it cannot."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass

from ep_harness.errors import first_line

DEEPEP_VERSION_ENV = "EP_HARNESS_DEEPEP_VERSION"
OK, SKIP, FAIL = "ok", "skip", "FAIL"  # FAIL: the CPU default cannot run


@dataclass
class Finding:
    component: str
    status: str  # OK, SKIP (some checks are skipped here), FAIL (the CPU default cannot run)
    detail: str  # what was found, and what will run or be skipped
    fix: str = ""  # the exact command (or step) that closes the gap

    def line(self) -> str:
        text = f"{self.status:4}  {self.component:11} {self.detail}"
        return text + (f"; fix: {self.fix}" if self.fix else "")


def pip_install(extra: str, fallback: str) -> str:
    """`pip install` of an extra's pinned requirements (pyproject is the one place they are
    written); the extra itself would make pip look for ep-harness on an index."""
    from ep_harness.version import extra_requirements

    requirements = extra_requirements(extra)
    return "pip install " + (" ".join(f"'{r}'" if any(c in r for c in "<>=!~") else r for r in requirements)
                             if requirements else fallback)


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _import_error(module: str) -> str | None:
    """Why `module` does not import (first line of the error), or None when it does. Binary
    extensions built against another torch fail with OSError or RuntimeError, not ImportError."""
    try:
        importlib.import_module(module)
    except BaseException as exc:  # noqa: BLE001 - any failure to import is the finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        return first_line(exc)
    return None


def python_finding() -> Finding:
    version = sys.version.split()[0]
    if sys.version_info < (3, 11):
        return Finding("python", FAIL, f"{version} at {sys.executable}; the harness needs 3.11 or newer",
                       "install Python 3.11+ and `pip install ep-harness` into it")
    return Finding("python", OK, f"{version} at {sys.executable}")


def harness_finding() -> Finding:
    from ep_harness.version import version_line

    return Finding("ep-harness", OK, version_line().removeprefix("ep-harness "))


def torch_findings() -> tuple[list[Finding], int, bool]:
    """torch (with its CUDA build and NCCL), torch.distributed's gloo, and the GPUs; and how
    many GPUs are usable and whether NCCL is there (for the components that need them)."""
    problem = _import_error("torch")
    if problem:
        return [Finding("torch", FAIL, f"does not import ({problem}): nothing can run", "pip install torch")], 0, False
    import torch
    import torch.distributed as dist

    cuda = torch.version.cuda
    nccl = None
    if cuda and dist.is_available() and dist.is_nccl_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a CUDA build without a usable libnccl
            nccl = None
    out = [Finding("torch", OK, f"{torch.__version__}, CUDA build {cuda or 'none (a CPU build)'}, "
                                f"NCCL {nccl or 'none'}")]
    if not dist.is_available() or not dist.is_gloo_available():
        out.append(Finding("gloo", FAIL, "torch.distributed has no gloo backend: the CPU default cannot launch ranks",
                           "pip install --force-reinstall torch (a build with torch.distributed)"))
    else:
        out.append(Finding("gloo", OK, "torch.distributed gloo: the CPU default runs (ep-harness verify --gpus 0)"))
    out.append(cpu_finding())
    count = torch.cuda.device_count() if cuda and torch.cuda.is_available() else 0
    out.append(gpu_finding(torch, cuda, count))
    return out, count, bool(cuda and dist.is_available() and dist.is_nccl_available())


def cpu_finding(cpu: dict | None = None) -> Finding:
    """The CPU, its vector ISA, the thread count every rank will be pinned to, and what that
    means for the CPU GEMM checks (a oneDNN bf16 GEMM's bits depend on all three)."""
    from ep_harness.run_environment import cpu_environment
    from ep_harness.threads import DEFAULT_THREADS

    cpu = cpu_environment() if cpu is None else cpu
    isa = cpu.get("isa") or []
    cap = f", ONEDNN_MAX_CPU_ISA={cpu['onednn_max_cpu_isa']}" if cpu.get("onednn_max_cpu_isa") else ""
    if "amx_bf16" in isa:
        kernel = ("oneDNN's bf16 GEMM runs on AMX here, and on such a CPU it was measured batch-variant on one thread "
                  "and invariant on two")
    elif "avx512_bf16" in isa:
        kernel = "oneDNN's bf16 GEMM runs on AVX512-BF16 here"
    else:
        kernel = "oneDNN's (or the CPU BLAS's) bf16 GEMM runs without bf16 instructions here"
    return Finding("cpu", OK, f"{cpu.get('model') or 'unknown model'}; ISA {' '.join(isa) or 'none of note'} "
                              f"(torch dispatch {cpu.get('torch_capability') or 'unknown'}{cap}); every rank runs on "
                              f"{DEFAULT_THREADS} thread(s), pinned (--threads N); {kernel}: the CPU default asserts "
                              f"the fixed-order GEMM (invariant by construction) and reports torch.mm's and "
                              f"torch._grouped_mm's batch and position invariance as measured on this machine, "
                              f"never failing on them")


def gpu_finding(torch, cuda: str | None, count: int) -> Finding:
    if count:
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        caps = sorted({"sm%d%d" % torch.cuda.get_device_capability(i) for i in range(count)})
        return Finding("gpus", OK, f"{count} x {', '.join(names)} ({', '.join(caps)}): verify uses NCCL on all of "
                                   f"them (--gpus N for fewer, --gpus 0 for the CPU)")
    skipped = "verify runs the CPU default (gloo ranks); GPU-only checks are skipped"
    if not cuda:
        return Finding("gpus", SKIP, f"none usable: torch is a CPU build; {skipped}",
                       "pip install torch --index-url https://download.pytorch.org/whl/cu128 (on a machine with an "
                       "NVIDIA GPU and driver)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return Finding("gpus", SKIP, f"none visible (CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'}, "
                                 f"nvidia-smi {'found' if shutil.which('nvidia-smi') else 'not found'}); {skipped}",
                   "unset CUDA_VISIBLE_DEVICES and check `nvidia-smi` lists the GPUs (driver installed)")


def emulation_finding(gpus: int, nccl: bool) -> Finding:
    if gpus and nccl:
        from ep_harness.emulation import single_node_problem
        from ep_harness.nccl.pins import nccl_version

        single = single_node_problem(nccl_version())
        return Finding("emulation", OK, f"--emulate hosts --gpus N runs N NCCL ranks on the {gpus} GPU(s), one host "
                                        f"each (NET/Socket over lo); --emulate single-node: "
                                        f"{'possible (one NCCL node, P2P on the device)' if not single else single}")
    why = "no GPU visible" if not gpus else "torch has no NCCL backend"
    return Finding("emulation", SKIP, f"emulated hosts impossible ({why}): the h200-emulated suites skip",
                   "run on a machine with an NVIDIA GPU and a CUDA build of torch")


def deepgemm_finding(gpus: int) -> Finding:
    problem = _import_error("deep_gemm")
    version = _distribution_version("sgl-deep-gemm", "deep-gemm", "deep_gemm")
    if problem:
        return Finding("deepgemm", SKIP, f"deep_gemm does not import ({problem}): DeepGEMM checks are skipped",
                       pip_install("deepgemm", "sgl-deep-gemm"))
    module = sys.modules["deep_gemm"]
    version = version or getattr(module, "__version__", None) or "version unknown"
    if not gpus:
        return Finding("deepgemm", SKIP, f"deep_gemm {version} imports, but no GPU is visible: DeepGEMM checks "
                                         f"are skipped", "run on an sm90 or sm100 GPU (H100, H200, B200)")
    return Finding("deepgemm", OK, f"deep_gemm {version} imports: DeepGEMM checks run on sm90/sm100 GPUs")


def deepep_finding(gpus: int) -> Finding:
    problem = _import_error("deep_ep")
    build = ("build DeepEP from source for this torch (docs/gpu.md), put it on PYTHONPATH and "
             f"export {DEEPEP_VERSION_ENV}='<tag> (<commit>)'")
    if problem:
        return Finding("deepep", SKIP, f"deep_ep does not import ({problem}): DeepEP checks are skipped", build)
    from ep_harness.subjects.dispatch.deepep import version

    stated = version()
    detail = f"deep_ep {stated} imports"
    if not gpus:
        return Finding("deepep", SKIP, f"{detail}, but no GPU is visible: DeepEP checks are skipped",
                       "run on a machine with NVIDIA GPUs")
    if stated.startswith("unknown"):
        return Finding("deepep", OK, f"{detail}; records will not say which DeepEP ran",
                       f"export {DEEPEP_VERSION_ENV}='<tag> (<commit>)'")
    return Finding("deepep", OK, f"{detail}: DeepEP checks run")


def triton_finding(gpus: int) -> Finding:
    problem = _import_error("triton")
    if problem:
        return Finding("triton", SKIP, f"triton does not import ({problem}): the Triton batch-invariant matmul "
                                       f"checks are skipped", pip_install("gpu", "triton"))
    version = _distribution_version("triton") or getattr(sys.modules["triton"], "__version__", "version unknown")
    if not gpus:
        return Finding("triton", SKIP, f"triton {version} imports, but no GPU is visible: its checks are skipped",
                       "run on a machine with an NVIDIA GPU")
    return Finding("triton", OK, f"triton {version}: the Triton matmul checks run")


def browser_finding() -> Finding:
    """tests/test_reports.py renders report.html in headless Chromium through playwright."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    has_playwright = importlib.util.find_spec("playwright") is not None
    if exe and has_playwright:
        return Finding("chromium", OK, f"{exe} with playwright: the report's browser tests run")
    missing = [what for what, found in (("playwright", has_playwright), ("Chromium", exe)) if not found]
    fix = " && ".join(cmd for cmd, found in (("pip install playwright", has_playwright),
                                             ("apt-get install chromium", exe)) if not found)
    return Finding("chromium", SKIP, f"no {' or '.join(missing)}: the report's browser tests are skipped "
                                     f"(reports themselves render)", fix)


def findings() -> list[Finding]:
    torch_side, gpus, nccl = torch_findings()
    return [python_finding(), harness_finding(), *torch_side, emulation_finding(gpus, nccl), deepgemm_finding(gpus),
            deepep_finding(gpus), triton_finding(gpus), browser_finding()]


def doctor() -> int:
    from ep_harness import console

    out = console.current()
    found = findings()
    out.line("# ep-harness doctor: what this machine will run (ok), skip (and why), and the fix for each gap")
    for f in found:
        out.line(f.line())
    if any(f.status == FAIL for f in found):
        out.line("# FAILED: the CPU default cannot run here; apply the FAIL lines' fixes")
        return 1
    out.line("# the CPU default can run: ep-harness verify --gpus 0")
    return 0
