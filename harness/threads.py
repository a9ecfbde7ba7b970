"""How many CPU threads every rank computes with: one policy, pinned by the harness.

A CPU kernel's bits may depend on its thread count: on an Intel Xeon with AMX-BF16, oneDNN's
bf16 torch.mm is batch-variant on one thread and invariant on two (docs/threads.md). So
the count is never left to the launch: torchrun sets OMP_NUM_THREADS=1 only for launches of
several ranks (a check grouped with 4-rank checks got one thread, the same check rerun alone
got every core), and a user's OMP_NUM_THREADS would make a verdict depend on the shell.

The policy: every rank of every launch runs on `DEFAULT_THREADS` (1) intra-op threads unless
the run asks for another count (`ep-harness verify --threads N`), or a case (`env =
{ OMP_NUM_THREADS = "N" }`) or a record being rerun (its `launch_env`) pins one. The count
travels in each check's launch environment as OMP_NUM_THREADS (set before torch loads
OpenMP, harness/launch/agent/) and each rank also sets it with torch.set_num_threads (MKL and
oneDNN follow it) and reports what it got (its part of environment.json). It is in
each record's `launch_env`, in environment.json's `threads`, in the gate's fingerprint on the
CPU, and in every printed rerun command.
"""
from __future__ import annotations

import os

from ep_harness.errors import HarnessError

THREADS_VAR = "OMP_NUM_THREADS"
# One thread per rank: what torchrun gives every launch of several ranks, so the CPU default's
# 4-rank launch and a check rerun alone compute alike, and 4 ranks do not oversubscribe 2 cores.
DEFAULT_THREADS = 1
MAX_THREADS = 4096


def parse_threads(value, what: str) -> int:
    """A thread count from a flag, a case's env or a record: a positive integer, else a one-line
    HarnessError naming `what` (the flag, or where the variable was)."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not 1 <= int(text) <= MAX_THREADS:
        raise HarnessError(f"{what} {str(value)[:40]!r} is not a thread count; give a whole number from 1 to "
                           f"{MAX_THREADS} (the harness's default is {DEFAULT_THREADS} per rank)")
    return int(text)


def pinned(env: dict[str, str], threads: int | None, where: str) -> dict[str, str]:
    """A check's launch environment with its thread count pinned: `threads` when the run asks
    for one, else the count the case or record pins, else the default."""
    if threads is not None:
        count = parse_threads(threads, "--threads")
    elif THREADS_VAR in env:
        count = parse_threads(env[THREADS_VAR], f"{where}: env {THREADS_VAR} =")
    else:
        count = DEFAULT_THREADS
    return {**env, THREADS_VAR: str(count)}


def of_env(env: dict[str, str]) -> int:
    """The thread count a launch environment pins (the default where it pins none)."""
    return int(env.get(THREADS_VAR, DEFAULT_THREADS))


def run_threads(envs) -> int | list[int]:
    """What environment.json records as the run's `threads`: the one count its launches pin,
    or, where cases pin several, all of them in order."""
    counts = sorted({of_env(env) for env in envs}) or [DEFAULT_THREADS]
    return counts[0] if len(counts) == 1 else counts


def varied_counts(base: int, runs: int) -> list[int]:
    """The thread count each of thread-invariance's runs computes on: the rank's own first, then
    one more, then doubling up to max(8, 2 x its own) (1: 1, 2, 4, 8), in turn for as many runs
    as there are: an odd and an even count, one and several threads, and more threads than a
    small machine has cores, where an order that follows the count (per-thread partial sums, a
    kernel chosen by it) shows; never thousands of threads for a check of many repeats."""
    ceiling = min(MAX_THREADS, max(8, 2 * base))
    counts, more = [base], base + 1
    while more <= ceiling:
        counts.append(more)
        more *= 2
    if len(counts) == 1:  # the rank's own is the most there may be
        counts.append(base - 1)
    return [counts[i % len(counts)] for i in range(runs)]


def apply_in_rank() -> int:
    """In a rank, before its first check: intra-op threads as pinned (OMP_NUM_THREADS, which
    OpenMP read when torch loaded; set again through torch so MKL and oneDNN follow it).
    Returns the count torch reports."""
    import torch

    wanted = os.environ.get(THREADS_VAR)
    if wanted and wanted.isdigit() and int(wanted) >= 1 and torch.get_num_threads() != int(wanted):
        torch.set_num_threads(int(wanted))
    return torch.get_num_threads()


def user_setting_note(count: int, environ=None) -> str | None:
    """A line for the user whose own OMP_NUM_THREADS differs from what the ranks will run on."""
    environ = os.environ if environ is None else environ
    theirs = environ.get(THREADS_VAR)
    if theirs is None or theirs.strip() == str(count):
        return None
    return (f"{THREADS_VAR}={theirs[:20]} in your environment is not what the ranks use: each runs on {count} "
            f"thread(s), pinned by the harness so a check's bits do not depend on the shell (--threads N to choose)")
