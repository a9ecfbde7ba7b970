"""environment.json: what a run ran on, assembled as it goes. The launcher's part
when the run is planned (versions, libraries, host, GPUs, CPU ISA; the suite, its name and
the selection run), each launch's pinned environment, what every rank reported and the
nodes they make up (and how those differ), the NCCL topology, the TP-reduction statement
(harness/nccl/statement.py), an interruption and where the time went. Each rank's own part
is `rank_environment` (harness/run/worker.py). The run's fingerprint, the part of this that decides
its bits and picks its baseline, is harness/regress/gate.py's.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform as pyplatform
import socket
import subprocess
import sys
from pathlib import Path

from ep_harness.cores import cpu_list, thread_cores
from ep_harness.environment import git_commit, recorded_env, redacted, redacted_command
from ep_harness.nccl import library as nccl_library
from ep_harness.nccl.statement import tp_reduction_statement
from ep_harness.subject import Platform, plugin_distributions
from ep_harness.threads import run_threads
from ep_harness.version import harness_version

LIBRARIES = ("torch", "triton", "numpy", "sgl-deep-gemm", "deep-gemm", "sgl-deep-ep", "deep-ep",
             "apache-tvm-ffi", "nvidia-nccl-cu12", "nvidia-nccl-cu13", "pandas", "matplotlib")


def library_versions() -> dict[str, str]:
    """Installed distributions that decide bits, and DeepEP as its builder stated it (a
    source build has no distribution metadata)."""
    out = {"deep_ep": os.environ["EP_HARNESS_DEEPEP_VERSION"]} if os.environ.get("EP_HARNESS_DEEPEP_VERSION") else {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def gpu_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def rank_environment() -> dict:
    """What one rank sees: host, device, versions, and every pinned variable."""
    import torch

    from ep_harness.launch.channel import local_node

    cores = thread_cores()
    info = {
        "host": socket.gethostname(),
        "node": local_node(),
        "pid": os.getpid(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "env": recorded_env(),
        "threads": torch.get_num_threads(),  # intra-op threads, as pinned (harness/threads.py)
        "cpus": None if cores is None else cpu_list(cores),  # where its threads may run (harness/cores.py)
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        info["device"] = torch.cuda.get_device_name(idx)
        loaded = nccl_library.loaded()  # what runs, from NCCL itself; torch's compile-time number beside it
        info["nccl"] = loaded.text or ""
        info["nccl_library"] = loaded.to_dict()
        info["driver"] = gpu_driver()
    else:
        info["device"] = "cpu"
    return info


NODE_KEYS = ("host", "torch", "cuda", "nccl", "device", "driver")
BIT_RELEVANT = ("torch", "cuda", "nccl", "device", "driver")  # what makes two nodes compute differently


def nodes_of(ranks: dict[str, list[dict]]) -> dict[str, dict]:
    """Every node of the run as its ranks saw it (first launch that reported), with its ranks."""
    nodes: dict[str, dict] = {}
    for launch in ranks.values():
        for rank, seen in enumerate(launch or []):
            node = nodes.setdefault(str(seen.get("node", "0")), {k: seen.get(k) for k in NODE_KEYS} | {"ranks": []})
            if rank not in node["ranks"]:
                node["ranks"].append(rank)
        if nodes:
            break
    return dict(sorted(nodes.items()))


def node_differences(nodes: dict[str, dict]) -> list[str]:
    """One line per bit-relevant setting that differs between nodes, e.g. `torch: node 0
    2.13.0, node 1 2.12.0`: such a run does not measure one stack."""
    lines = []
    for key in BIT_RELEVANT:
        values = {n: info.get(key) for n, info in nodes.items()}
        if len(set(map(str, values.values()))) > 1:
            lines.append(f"{key}: " + ", ".join(f"node {n} {v}" for n, v in values.items()))
    return lines


def launcher_environment(platform: Platform, command: list[str]) -> dict:
    """The launcher's part of environment.json; ranks add theirs under `ranks`."""
    import torch

    nccl = nccl_library.loaded() if platform.backend == "nccl" else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(redacted_command(list(command))),
        "harness_commit": git_commit(),
        "harness_version": harness_version(),
        "plugin_distributions": plugin_distributions(),
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "os": pyplatform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl.text if nccl else None,  # what runs, from NCCL itself
        "nccl_library": nccl.to_dict() if nccl else None,
        "driver": gpu_driver() if platform.device == "cuda" else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(platform.gpus or platform.ranks)] if platform.device == "cuda" else [],
        "backend": platform.backend,
        "max_ranks": platform.ranks,
        "libraries": library_versions(),
        "cpu": cpu_environment(),
    }


ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_environment() -> dict:
    """What decides a CPU GEMM's bits: the CPU model, its vector ISA, the kernel level torch
    dispatches to, and the oneDNN ISA cap (ONEDNN_MAX_CPU_ISA changes bits on one machine)."""
    import torch

    model, flags = pyplatform.processor() or pyplatform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = set(value.split())
    except OSError:
        pass
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        capability = None
    return {"model": model, "isa": sorted(f for f in ISA_FLAGS if f in flags), "torch_capability": capability,
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")}


def source_suite_name(records: Path) -> str | None:
    """The suite name a rerun's records came from, from their run's environment.json."""
    try:
        return json.loads((Path(records).parent / "environment.json").read_text()).get("suite_name")
    except (OSError, ValueError):
        return None


class EnvironmentRecord:
    """One run's environment.json, filled in as the run goes (`data` is what is written)."""

    def __init__(self, platform: Platform, command: list[str], suite_path, selection: list[str] | None = None,
                 suite_name: str | None = None):
        """`suite_name`: the suite's declared name, what its baselines are named by (a rerun's:
        its source run's); `selection`: the --check patterns, where the run is a part of the
        suite (never recorded or gated as the whole: harness/regress/gate.py)."""
        self.platform = platform
        self.data = launcher_environment(platform, list(command))
        self.data["suite"] = str(suite_path)
        self.data["suite_name"] = suite_name
        if selection:
            self.data["selection"] = list(selection)
        self.data["topology"] = platform.topology.to_dict()
        self.data["ranks"] = {}

    def pinned_threads(self, envs) -> int | list[int]:
        """The ranks' thread count, from the checks' launch environments (harness/threads.py):
        recorded as `threads`, one of the bits' conditions (the gate's fingerprint on the CPU)."""
        self.data["threads"] = run_threads(envs)
        return self.data["threads"]

    def launched(self, job: str, env: dict) -> None:
        """A launch's pinned environment, secrets redacted."""
        self.data.setdefault("pinned_env", {})[job] = redacted(env)

    def finish(self, reported: dict, run_dir: Path, interrupted: BaseException | None, timing: dict) -> list[str]:
        """What the ranks of each launch reported (`Head.reported`), the nodes and how they
        differ, the TP-reduction statement, an interruption and the timing; returns the node
        differences (each a line worth a warning)."""
        for launch, got in reported.items():
            if got["ranks"]:
                self.data["ranks"][launch] = got["ranks"]
            if got["nccl_topology"]:
                self.data.setdefault("nccl_topology", {})[launch] = got["nccl_topology"]
        self.data["nodes"] = nodes_of(self.data["ranks"])
        self.data["node_differences"] = node_differences(self.data["nodes"])
        self.data["tp_reduction"] = tp_reduction_statement(run_dir, self.platform.backend)
        if interrupted is not None:
            self.data["interrupted"] = str(interrupted)
        self.data["timing"] = timing
        return self.data["node_differences"]
