"""The machine: what it can run, the environment every launch is pinned to, and the
fingerprint that each run records."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform as pyplatform
import socket
import subprocess
import sys
from pathlib import Path

from ep_harness.cases import FORCED_ENV
from ep_harness.errors import HarnessError
from ep_harness.nccl.pins import launch_pins, log_settings, nccl_version
from ep_harness.subject import Platform, plugin_distributions
from ep_harness.version import harness_version

CPU_DEFAULT_RANKS = 4
# Variables that change bits or behaviour, recorded as each rank saw them (an allowlist:
# nothing else of the environment reaches environment.json, which CI uploads).
RECORDED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_SYMM_MEM_", "TORCH_CUDA_ARCH_LIST", "CUBLAS_", "CUDA_VISIBLE_DEVICES",
                     "CUDA_LAUNCH_BLOCKING", "CUDA_VERSION", "DG_", "NVSHMEM_", "OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA",
                     "MKL_", "PYTHONHASHSEED", "EP_HARNESS_COMMIT",
                     "EP_HARNESS_DEEPEP_VERSION")
# A name holding any of these is a credential: its value is never written anywhere.
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASS", "PASSWD", "CREDENTIAL", "AUTH")
REDACTED = "<redacted>"
# Of the recorded variables, those that name code, files or directories (NCCL_NET_PLUGIN,
# NCCL_DEBUG_FILE, DG_JIT_NVCC_COMPILER, ...) are never taken from data: a results file or
# the rendezvous store may only set variables that change how the measured code runs.
PATH_MARKERS = ("PLUGIN", "FILE", "PATH", "DIR", "LIB", "PRELOAD", "COMPILER", "NVCC", "DEST", "DUMP",
                "SCRIPT", "EXEC", "CMD", "HOME")
APPLIED_PREFIXES = tuple(p for p in RECORDED_PREFIXES if not p.startswith("EP_HARNESS_"))  # provenance is measured
LIBRARIES = ("torch", "triton", "numpy", "sgl-deep-gemm", "deep-gemm", "sgl-deep-ep", "deep-ep",
             "apache-tvm-ffi", "nvidia-nccl-cu12", "nvidia-nccl-cu13", "pandas", "matplotlib")


# What a GPU driver leaves on a machine (NVIDIA's, in containers too; ROCm's; WSL's).
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def visible_gpus() -> int:
    """The GPUs torch can use. Without a GPU driver there are none, which is known without
    importing torch (1.2 s of CPU), so a wrong GPUS on a CPU machine is reported at once."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def detect(gpus: int | None, cpu_ranks: int = CPU_DEFAULT_RANKS, emulate_hosts: bool = False) -> Platform:
    """GPUS=None: every visible GPU, or the CPU default when there is none. GPUS=0: CPU.

    emulate_hosts: GPUS ranks may exceed the visible GPUs; they share them, one emulated
    NCCL host per rank (harness/emulation.py)."""
    visible = visible_gpus()
    if emulate_hosts and visible == 0:
        raise HarnessError("--emulate-hosts runs NCCL ranks on a GPU, but no GPU is visible; "
                           "drop the flag to run the CPU default")
    if gpus is None:
        gpus = visible
    if gpus < 0:
        raise HarnessError(f"--gpus {gpus} is negative; use --gpus 0 for the CPU or a GPU count")
    if emulate_hosts and gpus == 0:
        raise HarnessError("--emulate-hosts needs --gpus N ranks (N >= 1); --gpus 0 is the CPU default")
    if gpus > visible and not emulate_hosts:
        found = f"{visible} visible GPU{'s' if visible != 1 else ''}"
        raise HarnessError(
            f"--gpus {gpus} but this machine has {found} (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --gpus {visible}"
            f"{' (the CPU)' if visible == 0 else ''}, a machine with {gpus} GPUs, or --emulate-hosts to run "
            f"{gpus} NCCL ranks as emulated hosts on the GPUs present"
        )
    if gpus == 0:
        if cpu_ranks < 1:
            raise HarnessError(f"--cpu-ranks {cpu_ranks} leaves no rank to run on; use --cpu-ranks 1 or more "
                               f"(the CPU default is {CPU_DEFAULT_RANKS})")
        return Platform(backend="gloo", device="cpu", ranks=cpu_ranks)
    import torch

    props = torch.cuda.get_device_properties(0)
    emulated = emulate_hosts and gpus > visible
    return Platform(backend="nccl", device="cuda", ranks=gpus, gpu_name=props.name,
                    capability=(props.major, props.minor), gpus=min(gpus, visible), emulated_hosts=emulated)


def platform_for(nodes, gpus: int | None, cpu_ranks: int = CPU_DEFAULT_RANKS, emulate_hosts: bool = False) -> Platform:
    """detect() for a run over nodes.nnodes x nodes.nproc_per_node ranks (ep_harness.nodes.Nodes):
    the head checks its own node (P ranks on its GPUs, or gloo on the CPU) for every node."""
    import dataclasses

    if not nodes.multi:
        return detect(gpus, cpu_ranks, emulate_hosts)
    total, per_node = nodes.ranks, nodes.nproc_per_node
    if gpus not in (None, 0, total):
        raise HarnessError(f"--gpus {gpus} cannot be given by {nodes.nnodes} nodes x {per_node} ranks = {total}; "
                           f"drop --gpus, or make it {total} (or 0 for gloo on the CPU)")
    visible = visible_gpus()
    if gpus == 0 or (visible == 0 and not emulate_hosts):
        return Platform(backend="gloo", device="cpu", ranks=total, nodes=nodes.nnodes)
    local = detect(per_node, cpu_ranks, emulate_hosts)
    return dataclasses.replace(local, ranks=total, nodes=nodes.nnodes)


def deep_gemm_cache_dir() -> str:
    """Where DeepGEMM keeps its compiled kernels between runs (DG_JIT_CACHE_DIR; CI caches
    this directory): the user's own setting, or ep-harness's directory under the XDG cache."""
    if os.environ.get("DG_JIT_CACHE_DIR"):
        return os.environ["DG_JIT_CACHE_DIR"]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "ep-harness", "deep_gemm")


def pinned_env(platform: Platform, overrides: dict[str, str]) -> dict[str, str]:
    """The environment every launch runs under (case overrides applied, safety keys forced)."""
    env = {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONHASHSEED": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    if platform.backend == "nccl":  # NCCL's pins: harness/nccl/pins.py
        env.update(launch_pins(nccl_version()))
        env["DG_JIT_CACHE_DIR"] = deep_gemm_cache_dir()
    env.update(overrides)
    if platform.backend == "nccl":
        # The algorithm, protocol and channels of every call are read from NCCL's own log.
        env.update(log_settings(env))
    env.update(FORCED_ENV)
    return env


def is_secret(name: str) -> bool:
    return any(m in name.upper() for m in SECRET_MARKERS)


def redacted(env: dict) -> dict:
    """`env` with the value of every name that looks like a credential replaced: for every
    place an environment is written (environment.json, each record's launch_env)."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in env.items()}


def recorded_env(environ=None) -> dict[str, str]:
    """The allowlisted variables; the value of any name that looks like a credential is redacted."""
    environ = os.environ if environ is None else environ
    return redacted({k: v for k, v in sorted(environ.items()) if k.startswith(RECORDED_PREFIXES)})


def redacted_command(argv: list[str]) -> list[str]:
    """A command line as recorded: the value of --run-secret (or of any option named like a
    credential) replaced."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append(REDACTED)
            hide = False
            continue
        name, eq, _ = arg.partition("=")
        if name.startswith("--") and is_secret(name.replace("-", "_")):
            out.append(f"{name}={REDACTED}" if eq else arg)
            hide = not eq
        else:
            out.append(arg)
    return out


def applicable_env(env, where: str) -> dict[str, str]:
    """The launch variables an untrusted source (a record's launch_env, a head's launch in
    the rendezvous store) may set: names the harness records and pins (NCCL_*, CUBLAS_*, ...),
    none that names code or a file, values without paths. Anything else is a one-line
    HarnessError naming the variable; a redacted value is left to this machine's environment."""
    if not isinstance(env, dict):
        raise HarnessError(f"{where}: the launch environment is not a table of variables; refusing it")
    out = {}
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise HarnessError(f"{where}: launch variable {name!r} = {value!r} is not a string; refusing it")
        if value == REDACTED:
            continue
        if not name.startswith(APPLIED_PREFIXES) or any(m in name.upper() for m in PATH_MARKERS):
            raise HarnessError(f"{where}: refusing launch variable {name[:80]!r}: only the variables the harness "
                               f"records and pins (NCCL_ALGO, NCCL_PROTO, ...; none naming code or a file) may "
                               f"come from there; set it in your own environment if you mean it")
        if len(value) > 512 or any(c in value for c in "/\\") or value.startswith("~") or \
                any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise HarnessError(f"{where}: refusing launch variable {name}: its value {value[:80]!r} is a path or "
                               f"not plain text; set it in your own environment if you mean it")
        out[name] = value
    return out


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


def git_commit() -> str | None:
    """The harness's commit (+dirty); EP_HARNESS_COMMIT names it where the tree has no .git."""
    if os.environ.get("EP_HARNESS_COMMIT"):
        return os.environ["EP_HARNESS_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5).stdout.splitlines()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    # Not a checkout: a copied tree prints the argument back or nothing, and a wheel installed
    # inside another project's work tree (its .venv) must not take that project's commit.
    if len(out) != 2 or len(out[1]) != 40 or os.path.realpath(out[0]) != str(root):
        return None
    sha = out[1]
    return sha + ("+dirty" if dirty else "")


def gpu_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def rank_fingerprint() -> dict:
    """What one rank sees: host, device, versions, and every pinned variable."""
    import torch

    from ep_harness.channel import local_node

    info = {
        "host": socket.gethostname(),
        "node": local_node(),
        "pid": os.getpid(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "env": recorded_env(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        info["device"] = torch.cuda.get_device_name(idx)
        info["nccl"] = ".".join(map(str, nccl_version() or ()))
        info["driver"] = gpu_driver()
    else:
        info["device"] = "cpu"
    return info


NODE_KEYS = ("host", "torch", "cuda", "nccl", "device", "driver")
BIT_RELEVANT = ("torch", "cuda", "nccl", "device", "driver")  # what makes two nodes compute differently


def nodes_of(ranks: dict[str, list[dict]]) -> dict[str, dict]:
    """Every node of the run as its ranks saw it (first launch that reported), with its ranks."""
    nodes: dict[str, dict] = {}
    for fingerprints in ranks.values():
        for rank, fp in enumerate(fingerprints or []):
            node = nodes.setdefault(str(fp.get("node", "0")), {k: fp.get(k) for k in NODE_KEYS} | {"ranks": []})
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


def run_fingerprint(platform: Platform, command: list[str]) -> dict:
    """The launcher's part of the fingerprint; ranks add theirs under `ranks`."""
    import torch

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
        "nccl": ".".join(map(str, nccl_version() or ())) or None,
        "driver": gpu_driver() if platform.device == "cuda" else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(platform.gpus or platform.ranks)] if platform.device == "cuda" else [],
        "backend": platform.backend,
        "max_ranks": platform.ranks,
        "libraries": library_versions(),
        "cpu": cpu_fingerprint(),
    }


ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_fingerprint() -> dict:
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
