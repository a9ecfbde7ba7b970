"""The machine: what it can run, the environment every launch is pinned to, and what of
the environment may be recorded (an allowlist, secrets redacted). What a run records of it
is assembled by harness/run_environment.py."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ep_harness.cases import FORCED_ENV
from ep_harness.errors import HarnessError
from ep_harness.nccl.pins import launch_pins, log_settings, nccl_version
from ep_harness.subject import Platform
from ep_harness.threads import DEFAULT_THREADS, THREADS_VAR

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


def named_by(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether one of `patterns` names the variable: one ending in `_` is a prefix (NCCL_),
    any other is a whole name (OMP_NUM_THREADS admits neither OMP_NUM_THREADSX nor OMP_NUM_THREADS_X)."""
    return any(name.startswith(p) if p.endswith("_") else name == p for p in patterns)


# What a GPU driver leaves on a machine (NVIDIA's, in containers too; ROCm's; WSL's).
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def visible_gpus() -> int:
    """The GPUs torch can use. Without a GPU driver there are none, which is known without
    importing torch (1.2 s of CPU), so a wrong GPUS on a CPU machine is reported at once."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def detect(gpus: int | None, cpu_ranks: int = CPU_DEFAULT_RANKS, emulate: str | None = None) -> Platform:
    """GPUS=None: every visible GPU, or the CPU default when there is none. GPUS=0: CPU.

    emulate: GPUS ranks may exceed the visible GPUs; they share them, each as an emulated
    NCCL host ("hosts") or all as one NCCL node ("single-node", NCCL >= 2.30;
    harness/emulation.py)."""
    from ep_harness.emulation import MODES, single_node_problem

    if emulate is not None and emulate not in MODES:
        raise HarnessError(f"--emulate {emulate}: unknown emulation; use one of {', '.join(MODES)}")
    flag = f"--emulate {emulate}"
    visible = visible_gpus()
    if emulate and visible == 0:
        raise HarnessError(f"{flag} runs NCCL ranks on a GPU, but no GPU is visible; "
                           "drop the flag to run the CPU default")
    if gpus is None:
        gpus = visible
    if gpus < 0:
        raise HarnessError(f"--gpus {gpus} is negative; use --gpus 0 for the CPU or a GPU count")
    if emulate and gpus == 0:
        raise HarnessError(f"{flag} needs --gpus N ranks (N >= 1); --gpus 0 is the CPU default")
    if gpus > visible and not emulate:
        found = f"{visible} visible GPU{'s' if visible != 1 else ''}"
        raise HarnessError(
            f"--gpus {gpus} but this machine has {found} (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --gpus {visible}"
            f"{' (the CPU)' if visible == 0 else ''}, a machine with {gpus} GPUs, or --emulate hosts "
            f"(or single-node) to run {gpus} NCCL ranks on the GPUs present"
        )
    if gpus == 0:
        if cpu_ranks < 1:
            raise HarnessError(f"--cpu-ranks {cpu_ranks} leaves no rank to run on; use --cpu-ranks 1 or more "
                               f"(the CPU default is {CPU_DEFAULT_RANKS})")
        return Platform(backend="gloo", device="cpu", ranks=cpu_ranks)
    import torch

    emulation = emulate if emulate and gpus > visible else None
    version = nccl_version()
    problem = single_node_problem(version) if emulation == "single-node" else None
    if problem:
        raise HarnessError(problem)
    props = torch.cuda.get_device_properties(0)
    return Platform(backend="nccl", device="cuda", ranks=gpus, gpu_name=props.name,
                    capability=(props.major, props.minor), gpus=min(gpus, visible), emulation=emulation,
                    nccl=".".join(map(str, version)) if version else None)


def platform_for(nodes, gpus: int | None, cpu_ranks: int = CPU_DEFAULT_RANKS, emulate: str | None = None) -> Platform:
    """detect() for a run over nodes.nnodes x nodes.nproc_per_node ranks (ep_harness.launch.nodes.Nodes):
    the head checks its own node (P ranks on its GPUs, or gloo on the CPU) for every node."""
    import dataclasses

    if not nodes.multi:
        return detect(gpus, cpu_ranks, emulate)
    total, per_node = nodes.ranks, nodes.nproc_per_node
    if gpus not in (None, 0, total):
        raise HarnessError(f"--gpus {gpus} cannot be given by {nodes.nnodes} nodes x {per_node} ranks = {total}; "
                           f"drop --gpus, or make it {total} (or 0 for gloo on the CPU)")
    visible = visible_gpus()
    if gpus == 0 or (visible == 0 and not emulate):
        return Platform(backend="gloo", device="cpu", ranks=total, nodes=nodes.nnodes)
    local = detect(per_node, cpu_ranks, emulate)
    return dataclasses.replace(local, ranks=total, nodes=nodes.nnodes)


def deep_gemm_cache_dir() -> str:
    """Where DeepGEMM keeps its compiled kernels between runs (DG_JIT_CACHE_DIR; CI caches
    this directory): the user's own setting, or ep-harness's directory under the XDG cache."""
    if os.environ.get("DG_JIT_CACHE_DIR"):
        return os.environ["DG_JIT_CACHE_DIR"]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "ep-harness", "deep_gemm")


def pinned_env(platform: Platform, overrides: dict[str, str]) -> dict[str, str]:
    """The environment every launch runs under (case overrides applied, safety keys forced).
    The ranks' thread count is pinned too: the default here, a check's own (its `env`, where
    the planner put it: harness/threads.py) in `overrides`."""
    env = {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONHASHSEED": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        THREADS_VAR: str(DEFAULT_THREADS),
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
    return redacted({k: v for k, v in sorted(environ.items()) if named_by(k, RECORDED_PREFIXES)})


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
        if not named_by(name, APPLIED_PREFIXES) or any(m in name.upper() for m in PATH_MARKERS):
            raise HarnessError(f"{where}: refusing launch variable {name[:80]!r}: only the variables the harness "
                               f"records and pins (NCCL_ALGO, NCCL_PROTO, ...; none naming code or a file) may "
                               f"come from there; set it in your own environment if you mean it")
        if len(value) > 512 or any(c in value for c in "/\\") or value.startswith("~") or \
                any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise HarnessError(f"{where}: refusing launch variable {name}: its value {value[:80]!r} is a path or "
                               f"not plain text; set it in your own environment if you mean it")
        out[name] = value
    return out


def git_commit() -> str | None:
    """The harness's commit (+dirty): EP_HARNESS_COMMIT if set, else its checkout's, else the
    one baked into an installed copy when its wheel was built (setup.py)."""
    if os.environ.get("EP_HARNESS_COMMIT"):
        return os.environ["EP_HARNESS_COMMIT"]
    from ep_harness.version import built_commit

    return _checkout_commit() or built_commit()


def _checkout_commit() -> str | None:
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
