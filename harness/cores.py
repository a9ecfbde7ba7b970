"""Which CPU cores each rank of a CPU (gloo) launch runs on.

On the CPU default's 4 ranks on 2 cores a collective waits for every rank to be scheduled, and
a rank the scheduler moved to the other core wakes up colder: placed in blocks (ranks 0-1 on
the first core, 2-3 on the second), 900 gloo all-to-alls of 4 ranks took 1.4-1.5 s instead of
2.3 s, and `make verify` 13.2 s instead of 14.3 s (BENCHMARKS.md). A core's ranks share it as
before. Where a rank runs does not change its bits (its thread count can: harness/threads.py).

The policy (`rank_cores`), over the cores the launch may use (the command's affinity):
- no more local ranks than cores: each rank a block of cores of its own, cores // ranks wide,
  if that holds its threads;
- more ranks than cores, one thread each: a core each, ranks in blocks, as evenly as they go;
- otherwise (more threads than a block holds) the scheduler places the ranks.
NCCL ranks are not placed (their CPU side belongs near their GPU). EP_HARNESS_PIN_RANKS=0 leaves
every rank to the scheduler (e.g. beside other work that holds some of the cores). Each rank
records the cores its threads may use (environment.json, `ranks.<launch>[i].cpus`, as a
list like Linux's: "0-3,8").
"""
from __future__ import annotations

import os

SWITCH = "EP_HARNESS_PIN_RANKS"


def rank_cores(local_rank: int, local_ranks: int, threads: int, allowed) -> list[int] | None:
    """The cores local rank `local_rank` of `local_ranks` on this node runs on (each computing
    with `threads` intra-op threads), out of `allowed`; None: the scheduler's choice."""
    cores = sorted(allowed)
    if not cores or not 0 <= local_rank < local_ranks:
        return None
    if local_ranks <= len(cores):
        width = len(cores) // local_ranks
        return cores[local_rank * width:(local_rank + 1) * width] if width >= threads else None
    return [cores[local_rank * len(cores) // local_ranks]] if threads == 1 else None


def cpu_list(cores) -> str:
    """Cores as Linux writes them (/proc/PID/status, Cpus_allowed_list): "0-3,8,10-11"."""
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _threads() -> list[int]:
    """This process's threads (Linux: /proc/self/task), else just the calling one (0)."""
    try:
        return [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def thread_cores() -> list[int] | None:
    """The cores any thread of this process may run on (the union of their affinities); None
    where the platform does not say."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    union: set[int] = set()
    for task in _threads():
        try:
            union |= os.sched_getaffinity(task)
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(union)


def pin_rank(local_rank: int, local_ranks: int, threads: int) -> list[int] | None:
    """Every thread of this rank (and those it starts later, which inherit it) on its
    rank_cores; the cores, or None where the rank is left to the scheduler."""
    if os.environ.get(SWITCH, "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = rank_cores(local_rank, local_ranks, threads, os.sched_getaffinity(0))
    if cores is None:
        return None
    for task in _threads():
        try:
            os.sched_setaffinity(task, cores)
        except OSError:  # a thread that ended meanwhile, or a sandbox that forbids it (the record says)
            pass
    return cores
