"""One pass over two tensors: mismatch count, max ULP distance and first mismatching index.

On CUDA with Triton this is a single fused kernel that reads each input once and writes
three integers, so comparing gigabytes needs no host copy and no temporaries. Elsewhere
the same statistics come from vectorized torch. Both are deterministic: integer counts,
max and min do not depend on the order blocks finish.
"""
from __future__ import annotations

import functools

import torch

from ep_harness.bits import int_view, ordered_key

BLOCK = 8192


def _triton():
    """triton, imported on first use (None where it does not import): only a comparison of
    CUDA tensors needs it, and its import costs 0.25 CPU-s in every process that loads this
    module (a CPU run's command and each launch's agent: they compare nothing on a GPU)."""
    if "triton" not in globals():
        try:
            import triton
            import triton.language
        except ImportError:  # CPU machines without triton use the torch path
            triton = None
        globals()["triton"] = triton
    return globals()["triton"]


def __getattr__(name: str):  # `bitcompare.triton`: the module (or None), imported when first asked for
    if name == "triton":
        return _triton()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _kernel():
    """The fused kernel, defined (decorated) when first launched: `tl` is the module's global
    that its source names."""
    global tl, _stats_kernel
    triton = _triton()
    tl = triton.language

    @triton.jit
    def _stats_kernel(a_ptr, b_ptr, n, stats_ptr, BLOCK: tl.constexpr, BITS: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(a_ptr + offs, mask=mask, other=0)
        b = tl.load(b_ptr + offs, mask=mask, other=0)
        diff = (a != b) & mask
        if BITS == 32:
            a, b = a.to(tl.int64), b.to(tl.int64)
        else:
            a, b = a.to(tl.int32), b.to(tl.int32)
        sign = 1 << (BITS - 1)
        ka = tl.where(a < 0, -(a + sign), a)  # ULP-ordered keys: -0 and +0 both map to 0
        kb = tl.where(b < 0, -(b + sign), b)
        ulp = tl.where(diff, tl.abs(ka - kb), 0).to(tl.int64)
        count = tl.sum(diff.to(tl.int64), axis=0)
        if count > 0:
            tl.atomic_add(stats_ptr, count)
            tl.atomic_max(stats_ptr + 1, tl.max(ulp, axis=0))
            tl.atomic_min(stats_ptr + 2, tl.min(tl.where(diff, offs, n), axis=0))

    return _stats_kernel


def _torch_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int | None]:
    ne = int_view(a) != int_view(b)
    count = int(ne.sum())
    if not count:
        return 0, 0, None
    ulp = torch.where(ne, (ordered_key(a) - ordered_key(b)).abs(), torch.zeros((), dtype=torch.int64,
                                                                              device=a.device))
    return count, int(ulp.max()), int(ne.reshape(-1).to(torch.int8).argmax())


def bitwise_stats(a: torch.Tensor, b: torch.Tensor, use_triton: bool | None = None) -> tuple[int, int, int | None]:
    """(mismatched, max ULP, flat index of the first mismatch or None) for same-shape tensors."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {tuple(a.shape)} {a.dtype} with {tuple(b.shape)} {b.dtype}")
    if use_triton is None:
        use_triton = a.is_cuda and a.element_size() in (2, 4) and _triton() is not None
    if not use_triton:
        return _torch_stats(a, b)
    a, b = int_view(a).reshape(-1), int_view(b).reshape(-1)
    n = a.numel()
    stats = torch.tensor([0, 0, n], dtype=torch.int64, device=a.device)
    grid = (_triton().cdiv(n, BLOCK),)
    _kernel()[grid](a, b, n, stats, BLOCK=BLOCK, BITS=8 * a.element_size(), num_warps=8)
    count, max_ulp, first = stats.tolist()
    return count, max_ulp, (first if count else None)
