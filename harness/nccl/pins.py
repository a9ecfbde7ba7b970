"""What a launch pins NCCL to, and whether the pins held in what NCCL logged.

`launch_pins` and `log_settings` are the NCCL part of every launch's environment
(harness/environment.py pins the rest); the checks below read the calls rank 0 logged
(harness/nccl/log.py) against NCCL_ALGO, the paths that escape it (NVLS, CollNet, symmetric
kernels) and the channel pin.
"""
from __future__ import annotations

from ep_harness.nccl.log import Call

DETERMINISTIC_CHANNELS = 8
# The log subsystems the algorithm, protocol and channels of every call are read from.
LOG_SUBSYS = ("INIT", "GRAPH", "TUNING", "ENV")


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL that runs here, from NCCL itself (harness/nccl/library.py), not torch's
    compile-time number: the NCCL_ALGO spelling depends on the library that reads it."""
    from ep_harness.nccl import library

    return library.version()


def nccl_algo_for_tree(version: tuple[int, int, int] | None) -> str:
    """Tree for all-reduce only. NCCL >= 2.24 reads per-collective lists; older NCCL ignores
    the `allreduce:` token and silently runs Ring, so it gets plain `Tree` instead (its other
    collectives fall back to ring). Plain `Tree` on >= 2.24 makes reduce-scatter fail."""
    if version is not None and version >= (2, 24, 0):
        return "allreduce:tree"
    return "Tree"


def launch_pins(version: tuple[int, int, int] | None) -> dict[str, str]:
    """The variables every NCCL launch starts from (a case's env may override them)."""
    channels = str(DETERMINISTIC_CHANNELS)
    return {
        "NCCL_ALGO": nccl_algo_for_tree(version),
        "NCCL_PROTO": "Simple",
        "NCCL_MIN_NCHANNELS": channels, "NCCL_MAX_NCHANNELS": channels,
        "NCCL_MIN_CTAS": channels, "NCCL_MAX_CTAS": channels,
        "NCCL_COLLNET_ENABLE": "0",
        # Symmetric-memory kernels for window-registered buffers escape NCCL_ALGO (2.27+):
        # without window support NCCL never picks them (NVLS is off through FORCED_ENV).
        "NCCL_WIN_ENABLE": "0",
    }


def log_settings(env: dict[str, str]) -> dict[str, str]:
    """NCCL_DEBUG and NCCL_DEBUG_SUBSYS as `env` must have them for the log to say what every
    call ran (applied after a case's overrides, which may only add to them)."""
    out = {}
    if env.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        out["NCCL_DEBUG"] = "INFO"
    subsys = [x for x in env.get("NCCL_DEBUG_SUBSYS", "").split(",") if x]
    out["NCCL_DEBUG_SUBSYS"] = ",".join(dict.fromkeys([*subsys, *LOG_SUBSYS]))
    return out


# torch.distributed name -> NCCL's function name in NCCL_ALGO lists and TUNING lines
FUNCTIONS = {"allreduce": "AllReduce", "reducescatter": "ReduceScatter", "allgather": "AllGather",
             "broadcast": "Broadcast", "reduce": "Reduce"}


def pinned_algorithms(nccl_algo: str | None) -> dict[str, set[str]]:
    """NCCL_ALGO as NCCL >= 2.24 reads it: function -> allowed algorithms (upper case).

    "allreduce:tree;reducescatter:ring" -> {AllReduce: {TREE}, ReduceScatter: {RING}}; a
    leading list without a function applies to every function; "^" excludes (not pinned).
    Functions the variable does not name are not pinned.
    """
    pins: dict[str, set[str]] = {}
    if not nccl_algo:
        return pins
    for i, part in enumerate(p.strip() for p in nccl_algo.split(";") if p.strip()):
        if ":" in part:
            func, algos = part.split(":", 1)
            funcs = [FUNCTIONS.get(func.strip().lower(), func.strip())]
        elif i == 0:
            funcs, algos = list(FUNCTIONS.values()), part
        else:
            continue
        if algos.strip().startswith("^"):
            continue
        names = {a.strip().upper() for a in algos.split(",") if a.strip()}
        for f in funcs:
            pins[f] = names
    return pins


def pin_violations(calls: list[Call], nccl_algo: str | None) -> list[str]:
    """Calls whose algorithm is not the one NCCL_ALGO pins for their function."""
    pins = pinned_algorithms(nccl_algo)
    out = []
    for c in calls:
        allowed = pins.get(c.function)
        if allowed and c.algorithm.upper() not in allowed:
            out.append(f"NCCL_ALGO={nccl_algo} pins {c.function} to {'/'.join(sorted(allowed))}, "
                       f"but NCCL ran {c.describe()}")
    return out


# Paths NCCL chooses without reading NCCL_ALGO, and the variables NCCL 2.28 reads to turn
# them off: NVLS and NVLS tree (NCCL_NVLS_ENABLE), symmetric-memory kernels for
# window-registered buffers (NCCL_WIN_ENABLE: no symmetric support), CollNet (NCCL_COLLNET_ENABLE).
ESCAPE_ALGORITHMS = ("NVLS", "NVLS_TREE", "COLLNET_DIRECT", "COLLNET_CHAIN")
ESCAPE_PINS = {"NCCL_NVLS_ENABLE": "0", "NCCL_WIN_ENABLE": "0", "NCCL_COLLNET_ENABLE": "0"}


def escaped_paths(calls: list[Call]) -> list[str]:
    """Calls that ran a path the pins turn off (a symmetric kernel, NVLS, CollNet)."""
    pins = ", ".join(f"{k}={v}" for k, v in ESCAPE_PINS.items())
    return [f"NCCL ran {c.describe()}{' (symmetric kernel)' if c.symmetric else ''}, a path the pins turn off "
            f"({pins})" for c in calls if c.symmetric or c.algorithm.upper() in ESCAPE_ALGORITHMS]


def channel_pin(env: dict[str, str]) -> int | None:
    """The channel count a launch pins: NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS = N (None otherwise)."""
    lo, hi = env.get("NCCL_MIN_NCHANNELS", ""), env.get("NCCL_MAX_NCHANNELS", "")
    return int(lo) if lo.strip().isdigit() and lo.strip() == hi.strip() else None


def channel_pin_violations(calls: list[Call], pinned: int | None, comm_channels: int | None = None) -> str | None:
    """Why the calls did not all use one channel range under the channel pin, or None.

    NCCL_MIN/MAX_NCHANNELS and NCCL_MIN/MAX_CTAS fix the communicator's channel count
    (src/graph/connect.cc), but NCCL still gives a small message fewer channels
    (src/enqueue.cc: its thread threshold, and at least 16 KiB of traffic per channel), so
    the pin holds only where every call used the same range."""
    if pinned is None:
        return ("channel_pin = true, but the launch pins no channel count: set NCCL_MIN_NCHANNELS = "
                "NCCL_MAX_NCHANNELS (and NCCL_MIN_CTAS = NCCL_MAX_CTAS) to one value in the case's env")
    if comm_channels is not None and comm_channels != pinned:
        return f"channel pin NCCL_MIN/MAX_NCHANNELS={pinned}, but NCCL built {comm_channels} coll channels"
    by_range: dict[tuple[int, int], list[str]] = {}
    for c in calls:
        by_range.setdefault(c.channels, []).append(f"{c.function} {c.nbytes:,} B")
    if len(by_range) <= 1:
        return None
    common = max(by_range, key=lambda r: len(by_range[r]))
    others = "; ".join(f"channels {lo}..{hi} at {', '.join(dict.fromkeys(v))}"
                       for (lo, hi), v in sorted(by_range.items()) if (lo, hi) != common)
    return (f"channel pin NCCL_MIN/MAX_NCHANNELS={pinned} does not hold one channel range: most calls used "
            f"{common[0]}..{common[1]}, but {others}")
