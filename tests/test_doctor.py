"""`ep-harness doctor` on this (CPU) machine, and with components planted or broken on the path."""
import os
import subprocess
import tomllib
import types

import pytest

from ep_harness import doctor
from tests.conftest import REPO, completed, once_per_session, run_cli

EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
PINNED_DEEPGEMM = " ".join(f"'{r}'" for r in EXTRAS["deepgemm"])  # the extra's pins, each quoted for the shell
COMPONENTS = ["python", "ep-harness", "torch", "gloo", "cpu", "gpus", "emulation", "deepgemm", "deepep", "triton",
              "chromium"]


def run_doctor(tmp_path, env=None, planted=None):
    """`python -m ep_harness doctor` with `planted` modules ({name: source}) importable first."""
    site = tmp_path / "planted"
    for name, source in (planted or {}).items():
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(source)
    path = os.pathsep.join([str(site), str(REPO)])
    proc = run_cli("doctor", cwd=tmp_path, timeout=300, module=True,  # forked where it can be (conftest.run_cli)
                   env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})})
    lines = proc.stdout.strip().splitlines()
    by_component = {line.split()[1]: line for line in lines[1:-1]}
    return proc, lines, by_component


@pytest.fixture(scope="session")
def plain_doctor(tmp_path_factory):
    """`ep-harness doctor` with nothing planted, once per session: run_doctor's three values."""
    def make(folder):
        folder.mkdir(parents=True)
        return completed(run_doctor(folder)[0])

    proc = subprocess.CompletedProcess(**once_per_session(tmp_path_factory, "plain-doctor", make))
    lines = proc.stdout.strip().splitlines()
    return proc, lines, {line.split()[1]: line for line in lines[1:-1]}


def test_doctor_on_this_machine_is_one_line_per_component_and_exit_0(plain_doctor):
    import torch

    proc, lines, by_component = plain_doctor
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split()[1] for line in lines[1:-1]] == COMPONENTS  # one line each, in this order
    assert lines[-1] == "# the CPU default can run: ep-harness verify --gpus 0"
    for line in lines[1:-1]:
        status = line.split()[0]
        assert status in ("ok", "skip"), line
        if status == "skip":  # every gap names its fix
            assert "; fix: " in line and line.split("; fix: ")[1].strip(), line
    assert by_component["torch"].startswith(f"ok    torch       {torch.__version__}")
    assert by_component["gloo"].startswith("ok ")
    if not torch.cuda.is_available():
        assert by_component["gpus"].startswith("skip") and "GPU-only checks are skipped" in by_component["gpus"]
        assert by_component["emulation"].startswith("skip")


def test_a_torch_that_does_not_import_fails_the_doctor(tmp_path):
    proc, lines, by_component = run_doctor(tmp_path, planted={"torch": "raise ImportError('planted: no torch')\n"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert by_component["torch"] == ("FAIL  torch       does not import (ImportError: planted: no torch): nothing can "
                                     "run; fix: pip install torch")
    assert lines[-1].startswith("# FAILED: the CPU default cannot run here")
    assert list(by_component) == [c for c in COMPONENTS if c not in ("gloo", "cpu", "gpus")]  # the rest still reported


def test_deepgemm_and_deepep_versions_and_an_abi_mismatch(tmp_path):
    planted = {"deep_gemm": "__version__ = '9.8.7'\n", "deep_ep": "Buffer = object\n"}
    proc, _, by_component = run_doctor(tmp_path, {"EP_HARNESS_DEEPEP_VERSION": "v1.2.1 (9af0e0d)"}, planted)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "deep_gemm 9.8.7 imports" in by_component["deepgemm"]
    assert "deep_ep v1.2.1 (9af0e0d) imports" in by_component["deepep"]
    # a wheel built against another torch fails with OSError, not ImportError: still a finding, with the pins
    broken = {"deep_gemm": "raise OSError('undefined symbol: _ZN3c104cuda19CUDAErrorLogCaptureC1Ev')\n"}
    (tmp_path / "broken").mkdir()
    proc, _, by_component = run_doctor(tmp_path / "broken", planted=broken)
    assert proc.returncode == 0
    assert by_component["deepgemm"] == (
        "skip  deepgemm    deep_gemm does not import (OSError: undefined symbol: "
        "_ZN3c104cuda19CUDAErrorLogCaptureC1Ev): DeepGEMM checks are skipped; "
        f"fix: pip install {PINNED_DEEPGEMM}")


class _FakeCuda:
    @staticmethod
    def get_device_name(i):
        return "NVIDIA H200"

    @staticmethod
    def get_device_capability(i):
        return (9, 0)


def test_gpu_and_emulation_lines_when_gpus_are_there():
    fake_torch = types.SimpleNamespace(cuda=_FakeCuda)
    line = doctor.gpu_finding(fake_torch, "13.0", 8).line()
    assert line.startswith("ok    gpus        8 x NVIDIA H200 (sm90): verify uses NCCL")
    assert doctor.emulation_finding(1, True).status == "ok"
    assert doctor.emulation_finding(1, False).detail.startswith("emulated hosts impossible (torch has no NCCL backend)")
    cpu_build = doctor.gpu_finding(fake_torch, None, 0)
    assert cpu_build.status == "skip" and "download.pytorch.org/whl/cu" in cpu_build.fix


def test_the_cpu_line_names_the_model_isa_threads_and_what_it_means_for_gemms(plain_doctor):
    from ep_harness.run_environment import cpu_environment

    _, _, by_component = plain_doctor
    here = cpu_environment()
    line = by_component["cpu"]
    assert line.startswith(f"ok    cpu         {here['model']}; ISA {' '.join(here['isa'])}"), line
    assert "every rank runs on 1 thread(s), pinned (--threads N)" in line
    assert "reports torch.mm's and torch._grouped_mm's batch and position invariance as measured" in line
    amx = doctor.cpu_finding({"model": "Intel(R) Xeon(R) Platinum 8480+", "isa": ["avx2", "avx512_bf16", "amx_bf16"],
                              "torch_capability": "AVX512", "onednn_max_cpu_isa": None}).line()
    assert "Intel(R) Xeon(R) Platinum 8480+; ISA avx2 avx512_bf16 amx_bf16 (torch dispatch AVX512)" in amx
    assert "runs on AMX here" in amx and "batch-variant on one thread" in amx
    capped = doctor.cpu_finding({"model": "m", "isa": ["amx_bf16"], "torch_capability": "AVX512",
                                 "onednn_max_cpu_isa": "AVX512_CORE"}).line()
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE" in capped
