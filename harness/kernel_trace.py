"""Proof that the path under test ran: the kernels launched during a check's measured calls.

On a GPU every check is traced with PyTorch's profiler (CUDA activity): the record lists the
CUDA kernels that ran. A subject may declare the kernels it must launch
(`kernels(params)`, ep_harness.subject.OptionalHooks); a check during which one of them did
not run on any rank, a silent fallback to another implementation, is an `error`. On the CPU there are no
kernels: only a subject that declares some is traced there, by the profiler's CPU events,
whose names include `torch.profiler.record_function` labels (what the test fakes emit), so
a fake that does not emit its label fails the same way.
"""
from __future__ import annotations

import contextlib

import torch

from ep_harness.subject import hook

MAX_NAMES = 32  # distinct kernel names kept in a record
MAX_NAME_CHARS = 160


def declared(subject, params: dict) -> tuple[str, ...]:
    """The kernel-name substrings `subject` declares. A bare string would be taken letter by
    letter, and an empty name is in every name: either would prove any check ran its kernel."""
    own = hook(subject, "kernels")
    if not callable(own):
        return ()
    names = own(params)
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
    events (CPU) that ran inside it.

    torch.autograd.profiler's profile, not torch.profiler's: the latter's start asks
    `hasattr(torch, "_inductor")`, which imports inductor, dynamo and sympy (about 900
    modules, seconds on a fresh GPU machine) in every rank that traces a check."""
    names: set[str] = set()
    if not enabled:
        yield names
        return
    from torch.autograd.profiler import profile

    cuda = device.type == "cuda"
    with profile(use_cpu=not cuda, use_device="cuda" if cuda else None, use_kineto=True) as prof:
        yield names
        if cuda:
            torch.cuda.synchronize(device)
    names.update(_event_names(prof, torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU))


def _event_names(prof, kind) -> set[str]:
    """Names of the profiled events of device `kind`. Read from the profiler's raw (Kineto)
    events where this torch has them: the FunctionEvents build a Python object per event
    and their call tree, 2.1 s for a check's 47,000 kernels on the H200 against 0.1 s raw
    (the same names).

    On a GPU, not the record_function ranges Kineto mirrors onto the GPU timeline (CUDA-device
    events named by the range): a subject's own label is no proof that a kernel ran."""
    ranges_count = kind == torch.autograd.DeviceType.CPU
    results = getattr(prof, "kineto_results", None)
    if results is not None and hasattr(results, "events"):
        return {e.name() for e in results.events() if e.device_type() == kind
                and (ranges_count or not getattr(e, "is_user_annotation", lambda: False)())}
    return {e.name for e in prof.function_events if e.device_type == kind
            and (ranges_count or not getattr(e, "is_user_annotation", False))}


TORCH_OWN = ("at::native::", "Memcpy ", "Memset ")  # PyTorch's elementwise/reduction kernels and copies


def summarize(per_rank: list[set[str]], wanted: tuple[str, ...] = ()) -> list[str]:
    """Every rank's kernels, distinct, shortened: what the record lists, at most MAX_NAMES.
    The declared ones first, then the libraries' (cuBLAS, NCCL, a subject's own), then
    PyTorch's own kernels and copies, which include the harness's input preparation on the
    device (copies, FP8 quantization of the operands) and are the first to be left out."""
    union = sorted(set().union(*per_rank), key=lambda n: (not any(w in n for w in wanted),
                                                         any(t in n for t in TORCH_OWN), n))
    return [n if len(n) <= MAX_NAME_CHARS else n[:MAX_NAME_CHARS - 3] + "..." for n in union[:MAX_NAMES]]


def missing(wanted: tuple[str, ...], per_rank: list[set[str]]) -> list[str]:
    """Declared kernels that no rank ran (matched as substrings of the full names)."""
    seen = set().union(*per_rank)
    return [w for w in wanted if not any(w in name for name in seen)]
