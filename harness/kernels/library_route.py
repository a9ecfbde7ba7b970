"""The library route of bi_matmul's tile table: an M of an unsplit (N, K) handed to DeepGEMM's
BF16 dense GEMM (`bf16_gemm_nt`), whose Hopper kernel walks K as the unsplit tiles do.

Why the bits are the same: DeepGEMM's sm90 kernel zeroes one float32 accumulator per element
and adds the tensor cores' 16-product steps from K = 0 upward, never splitting K; its tile,
stage and multicast choices follow M, its K walk does not. That is a claim about one kernel of
one release, so the route is taken only where it was measured:

* on a Hopper GPU (compute capability 9.x: other architectures run other DeepGEMM kernels);
* with the deep_gemm version the table was tuned with (the table records it; the tuner routes
  an M only after DeepGEMM's whole output matched the unsplit reference's bit for bit at
  M = 1, 100 and 2,048 and at that M, each into a NaN-filled output);
* for bf16 operands whose rows are packed from a 16-byte aligned address, each row a whole
  number of 16 bytes (its TMA's needs).

Anywhere else the entry's own tiles run the call, with the same bits. A DeepGEMM call that
raises (its JIT compile failing, say) falls back to them too, with one warning naming the error;
the route stays off on that device for the rest of the process.
"""
from __future__ import annotations

import collections
import functools
import json
import warnings
from pathlib import Path

import torch

from ep_harness.errors import first_line

LIBRARIES = ("deepgemm",)
_FAILED: set[tuple[str, int]] = set()  # (library, device index) whose call raised: route off there
ROUTED_CALLS: collections.Counter = collections.Counter()  # (library, N, K, M): calls it ran in this process


def name_problem(name: str) -> str | None:
    """Why `name` is not a library route (None: it is)."""
    if name not in LIBRARIES:
        return f"library {name!r}: the only library route is 'deepgemm'"
    return None


def installed_version(name: str) -> str | None:
    """The importable library's version, or None where it does not import. DeepGEMM through the
    subject's loader, which also turns on its deterministic mode where that exists (newer builds
    would otherwise hand BF16 GEMMs to cuBLASLt)."""
    problem = name_problem(name)
    if problem:
        raise ValueError(problem)
    from ep_harness.subjects.gemm import deepgemm

    try:
        module = deepgemm.deep_gemm()
    except ImportError:
        return None
    return str(getattr(module, "__version__", "unknown"))


def library_gemm(name: str, device: torch.device):
    """gemm(a, b, out) computing out = a @ b.T with the library's kernel whose walk was measured,
    or None where there is none: the library does not import, names no version (a table could
    not tell it from another build), or `device` is not a Hopper GPU."""
    if installed_version(name) in (None, "unknown") or device.type != "cuda" or _capability(_index(device))[0] != 9:
        return None
    from ep_harness.subjects.gemm import deepgemm

    return getattr(deepgemm.deep_gemm(), "bf16_gemm_nt", None)


@functools.lru_cache(maxsize=None)
def table_versions(path: Path) -> dict[str, str]:
    """The library versions a tile table's routes were measured with ({} where it routes none)."""
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text()).get("libraries", {}))


def usable(name: str, device: torch.device, table: Path) -> bool:
    """Whether `table`'s routes to `name` run the library on `device`: a Hopper GPU, the version the
    table was tuned with, and no earlier call there that raised."""
    return _routed_gemm(name, device, table) is not None


def _routed_gemm(name: str, device: torch.device, table: Path):
    """The library's gemm where `usable`, else None."""
    if (name, _index(device)) in _FAILED or table_versions(table).get(name) != installed_version(name):
        return None
    return library_gemm(name, device)


def run_routed(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, name: str, table: Path) -> bool:
    """Run out = a @ b.T through the library if the route may run here (see the module's
    docstring); False: the caller's tiles must run it."""
    if a.dtype != torch.bfloat16 or a.device.type != "cuda":
        return False
    if not all(_dense_rows(t) for t in (a, b, out)):
        return False
    gemm = _routed_gemm(name, a.device, table)
    if gemm is None:
        return False
    try:
        gemm(a, b, out)
    except Exception as exc:  # raised on the host before any launch: the tiles give the same bits
        _FAILED.add((name, _index(a.device)))
        warnings.warn(f"bi_matmul: the tile table routes this M to {name}, whose call failed "
                      f"({first_line(exc)}); its Triton tiles run it instead, "
                      f"with the same bits, for the rest of this process. Fix: repair the {name} install "
                      "(`ep-harness doctor`)", RuntimeWarning, stacklevel=3)
        return False
    ROUTED_CALLS[(name, b.shape[0], a.shape[1], a.shape[0])] += 1
    return True


def failed() -> bool:
    """Whether a routed call raised in this process (the route is off where it did)."""
    return bool(_FAILED)


def _dense_rows(t: torch.Tensor) -> bool:
    """Rows packed one after another from a 16-byte aligned address. Spelled out, not
    is_contiguous(): that holds for a one-row view whatever its row stride, which TMA reads."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1] and t.data_ptr() % 16 == 0 \
        and t.shape[1] * t.element_size() % 16 == 0


def _index(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)
