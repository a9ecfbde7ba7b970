"""Proof that the path under test ran: the kernels launched during a check's measured calls.

On a GPU every check is traced with torch.profiler (CUDA activity): the record lists the
CUDA kernels that ran. A subject may declare the kernels it must launch,

    def kernels(self, params) -> tuple[str, ...]:  # substrings of kernel names

(DeepGEMM's, DeepEP's, NCCL's); a check during which one of them did not run on any rank,
a silent fallback to another implementation, is an `error`. On the CPU there are no
kernels: only a subject that declares some is traced there, by the profiler's CPU events,
whose names include `torch.profiler.record_function` labels (what the test fakes emit), so
a fake that does not emit its label fails the same way.
"""
from __future__ import annotations

import contextlib

import torch

MAX_NAMES = 32  # distinct kernel names kept in a record
MAX_NAME_CHARS = 160


def declared(subject, params: dict) -> tuple[str, ...]:
    """The kernel-name substrings `subject` declares. A bare string would be taken letter by
    letter, and an empty name is in every name: either would prove any check ran its kernel."""
    hook = getattr(subject, "kernels", None)
    if not callable(hook):
        return ()
    names = hook(params)
    names = names if isinstance(names, str) else tuple(names)  # a generator is read once, here
    if isinstance(names, str) or not all(isinstance(n, str) and n.strip() for n in names):
        raise TypeError(f"{getattr(subject, 'name', subject)}.kernels(params) returned {names!r}; "
                        f"return a tuple of non-empty kernel-name substrings, e.g. ('deep_gemm::sm90_',)")
    return names


def traced(subject, params: dict, device: torch.device) -> bool:
    """Whether a check is traced: every check on a GPU, and on the CPU those whose subject
    declares kernels (the decision is the same on every rank)."""
    return device.type == "cuda" or bool(declared(subject, params))


@contextlib.contextmanager
def kernel_names(device: torch.device, enabled: bool):
    """Yields a set that holds, after the block, the names of the kernels (CUDA) or profiled
    events (CPU) that ran inside it."""
    names: set[str] = set()
    if not enabled:
        yield names
        return
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        yield names
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    names.update(e.name for e in prof.events() if e.device_type == kind)


def summarize(per_rank: list[set[str]], wanted: tuple[str, ...] = ()) -> list[str]:
    """Every rank's kernels, distinct, shortened, the declared ones first: what the record lists."""
    union = sorted(set().union(*per_rank), key=lambda n: (not any(w in n for w in wanted), n))
    return [n if len(n) <= MAX_NAME_CHARS else n[:MAX_NAME_CHARS - 3] + "..." for n in union[:MAX_NAMES]]


def missing(wanted: tuple[str, ...], per_rank: list[set[str]]) -> list[str]:
    """Declared kernels that no rank ran (matched as substrings of the full names)."""
    seen = set().union(*per_rank)
    return [w for w in wanted if not any(w in name for name in seen)]
