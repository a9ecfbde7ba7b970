"""A FAKE `deep_gemm`, for tests on a machine without a GPU. It is not DeepGEMM: it computes
nothing (the output is left as it was) and compiles nothing.

It mimics what harness/run/precompile.py relies on: the first call of a kernel (function and
shapes) in a cache directory "compiles" (sleeps FAKE_DEEP_GEMM_COMPILE_S) and leaves a file in
DG_JIT_CACHE_DIR (or in this process's memory without one); a later call finds it there.

Every call is recorded, in CALLS and, with FAKE_DEEP_GEMM_LOG set, as a JSON line in that file
(pid, start and end times, whether it compiled), so that tests can see which shapes were
called, by which process, and whether calls overlapped in time. A call whose key contains
FAKE_DEEP_GEMM_FAIL raises (after printing to stdout, as DeepGEMM's C++ printf does), one
containing FAKE_DEEP_GEMM_CRASH ends its process. FAKE_DEEP_GEMM_IMPORT_S makes importing it
take that long (a start that hangs), FAKE_DEEP_GEMM_IMPORT_ERROR makes it fail.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

__version__ = "0.0.0+fake"
CALLS: list[dict] = []
_compiled_here: set[str] = set()


def _shape(t):
    return list(t.shape)


def _call(fn: str, a, b, d, expected_m=None) -> None:
    (a, sfa), (b, sfb) = (a if isinstance(a, tuple) else (a, None)), (b if isinstance(b, tuple) else (b, None))
    record = {"fn": fn, "a": _shape(a), "b": _shape(b), "d": _shape(d),
              "sfa": None if sfa is None else _shape(sfa), "sfb": None if sfb is None else _shape(sfb),
              "expected_m": expected_m}
    key = json.dumps(record)
    record.update(pid=os.getpid(), nice=os.getpriority(os.PRIO_PROCESS, 0), start=time.time())
    if os.environ.get("FAKE_DEEP_GEMM_CRASH") and os.environ["FAKE_DEEP_GEMM_CRASH"] in key:
        os._exit(134)
    if os.environ.get("FAKE_DEEP_GEMM_FAIL") and os.environ["FAKE_DEEP_GEMM_FAIL"] in key:
        print(f"NVCC compilation failed: fake error for {fn}", flush=True)
        record.update(end=time.time(), outcome="failed")
        _record(record)
        raise RuntimeError(f"fake DeepGEMM: compilation failed for {fn}")
    cache = os.environ.get("DG_JIT_CACHE_DIR")
    marker = os.path.join(cache, "cache", "kernel." + hashlib.sha256(key.encode()).hexdigest()[:16]) if cache else None
    cached = os.path.exists(marker) if marker else key in _compiled_here
    if not cached:
        time.sleep(float(os.environ.get("FAKE_DEEP_GEMM_COMPILE_S", "0")))
        if marker:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            with open(marker, "w") as f:
                f.write(key)
        _compiled_here.add(key)
    record.update(end=time.time(), outcome="cached" if cached else "compiled")
    _record(record)


def _record(record: dict) -> None:
    CALLS.append(record)
    path = os.environ.get("FAKE_DEEP_GEMM_LOG")
    if path:
        with open(path, "a") as f:  # one short line per write: appends do not interleave
            f.write(json.dumps(record) + "\n")


def m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout):
    _call("m_grouped_bf16_gemm_nt_contiguous", a, b, d)


def m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m):
    _call("m_grouped_bf16_gemm_nt_masked", a, b, d, expected_m)


def bf16_gemm_nt(a, b, d):
    _call("bf16_gemm_nt", a, b, d)


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout):
    _call("m_grouped_fp8_gemm_nt_contiguous", a, b, d)


def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m):
    _call("m_grouped_fp8_gemm_nt_masked", a, b, d, expected_m)


def fp8_gemm_nt(a, b, d):
    _call("fp8_gemm_nt", a, b, d)


time.sleep(float(os.environ.get("FAKE_DEEP_GEMM_IMPORT_S", "0")))
if "FAKE_DEEP_GEMM_IMPORT_ERROR" in os.environ:
    raise ImportError("fake DeepGEMM: " + os.environ["FAKE_DEEP_GEMM_IMPORT_ERROR"])
