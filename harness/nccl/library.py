"""The NCCL library this process runs, read from NCCL itself.

`torch.cuda.nccl.version()` is the version torch was compiled against: with torch's
`libnccl.so.2` replaced by another build (NCCL 2.30 under torch 2.11, docs/gpu.md) it
still names the old one. What ran is what the loaded library says through `ncclGetVersion`,
and which files are mapped into the process (two different copies mapped at once is how an
`LD_PRELOAD` of another NCCL looks: calls go to one, torch's copy stays loaded).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

MAPS = Path("/proc/self/maps")


@dataclass(frozen=True)
class LoadedNccl:
    """What NCCL the process holds: the version the library reports, the files mapped, and
    torch's compile-time version beside them."""

    version: tuple[int, int, int] | None  # from ncclGetVersion of the library in use
    paths: tuple[str, ...]  # every distinct libnccl file mapped into the process
    compiled: tuple[int, int, int] | None  # torch.cuda.nccl.version(): what torch was built with

    @property
    def text(self) -> str | None:
        return ".".join(map(str, self.version)) if self.version else None

    def problem(self) -> str | None:
        """Why this process's NCCL is ambiguous, or None."""
        if len(self.paths) > 1:
            return (f"{len(self.paths)} NCCL libraries are mapped into one process ({', '.join(self.paths)}): replace "
                    f"torch's nvidia/nccl/lib/libnccl.so.2 instead of preloading another (docs/gpu.md)")
        return None

    def to_dict(self) -> dict:
        return {"version": self.text, "paths": list(self.paths),
                "torch_compiled": ".".join(map(str, self.compiled)) if self.compiled else None}


def decode(code: int) -> tuple[int, int, int]:
    """NCCL's version code: major * 10000 + minor * 100 + patch since 2.9 (before: * 1000)."""
    if code >= 10000:
        return code // 10000, (code // 100) % 100, code % 100
    return code // 1000, (code // 100) % 10, code % 100


def mapped_paths(maps_text: str) -> tuple[str, ...]:
    """The distinct libnccl files in a /proc/<pid>/maps text, resolved through symlinks."""
    found: dict[str, None] = {}
    for line in maps_text.splitlines():
        path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
        if os.path.basename(path).startswith("libnccl.so"):
            found[os.path.realpath(path)] = None
    return tuple(found)


def library_version(path: str) -> tuple[int, int, int] | None:
    """ncclGetVersion of the library at `path` (already loaded: dlopen returns that copy)."""
    try:
        lib = ctypes.CDLL(path)
        code = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return decode(code.value)


def compiled_version() -> tuple[int, int, int] | None:
    """The NCCL torch was compiled against (None for a build without NCCL)."""
    try:
        import torch

        v = torch.cuda.nccl.version()
    except Exception:
        return None
    return tuple(v) if isinstance(v, tuple) else decode(int(v))


def loaded() -> LoadedNccl:
    """This process's NCCL. torch's CUDA builds map libnccl when torch is imported; a process
    whose torch maps none (a CPU build) has no NCCL (version None)."""
    import torch  # noqa: F401  (maps torch's libnccl, if it has one)

    try:
        paths = mapped_paths(MAPS.read_text())
    except OSError:  # not Linux: nothing to read the mapping from
        paths = ()
    versions = [v for v in (library_version(p) for p in paths) if v]
    return LoadedNccl(version=versions[0] if versions else None, paths=paths, compiled=compiled_version())


def version() -> tuple[int, int, int] | None:
    """The version of the NCCL that runs in this process, from NCCL; torch's compile-time
    number only where no library can be asked (no /proc maps)."""
    lib = loaded()
    return lib.version or (lib.compiled if not lib.paths else None)
