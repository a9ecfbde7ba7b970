"""DeepGEMM adapters: BF16 and FP8 grouped GEMMs (contiguous, masked) and dense GEMMs.

Handles the sgl-deep-gemm 0.1.x / 0.2.x differences: 0.1.x lacks the
`m_grouped_fp8_gemm_nt_masked` alias (its `m_grouped_fp8_fp4_*` names exist everywhere),
and newer builds route some BF16 GEMMs to cuBLASLt unless
`use_deterministic_algorithms(True)` is called, which these adapters do where it exists.
"""
from __future__ import annotations

import importlib

from ep_harness.errors import first_line
from ep_harness.subject import register
from ep_harness.subjects.gemm.common import unsupported

_state: dict = {}


def deep_gemm():
    """The imported module, or raise ImportError with the reason (cached)."""
    if "module" not in _state:
        try:
            module = importlib.import_module("deep_gemm")
        except Exception as exc:  # an ABI mismatch raises OSError/ImportError/RuntimeError
            _state["error"] = first_line(exc, None)
            _state["module"] = None
        else:
            if hasattr(module, "use_deterministic_algorithms"):
                module.use_deterministic_algorithms(True)
            _state["module"] = module
    if _state["module"] is None:
        raise ImportError(_state["error"])
    return _state["module"]


def settings() -> dict:
    """DeepGEMM's version and determinism settings, for the fingerprint."""
    dg = _state.get("module")
    if dg is None:
        return {}
    out = {"version": getattr(dg, "__version__", None)}
    for name in ("get_num_sms", "get_deterministic_algorithms", "get_mk_alignment_for_contiguous_layout", "get_tc_util"):
        if hasattr(dg, name):
            try:
                out[name[4:]] = getattr(dg, name)()
            except Exception as exc:  # some getters need an initialised device
                out[name[4:]] = f"unavailable: {exc}"
    return out


def _first(*names):
    dg = deep_gemm()
    for name in names:
        if hasattr(dg, name):
            return getattr(dg, name)
    raise AttributeError(f"deep_gemm {getattr(dg, '__version__', '?')} has none of {', '.join(names)}")


def import_refusal() -> str | None:
    """Why a DeepGEMM subject cannot run here because deep_gemm does not import, or None."""
    try:
        deep_gemm()
    except ImportError as exc:
        return f"deep_gemm cannot be imported ({exc}); pip install 'ep-harness[deepgemm]'"
    return None


class DeepGemmJit:
    """DeepGEMM's JIT as ep_harness.subject.jit_of sees it: a kernel per shape, compiled on the
    first call into DG_JIT_CACHE_DIR, which every process of a run shares (harness/run/precompile.py
    compiles the planned calls there before the checks)."""

    @staticmethod
    def ready() -> str | None:
        """In a compile worker, before its first call: deep_gemm imported (and its determinism
        switch set) as in a rank; why no call can be made there, or None."""
        try:
            deep_gemm()
        except ImportError as exc:
            return f"deep_gemm cannot be imported here: {exc}"
        return None

    @staticmethod
    def identity(platform) -> dict:
        """What decides which kernel a call builds, besides its shapes."""
        import os

        import torch

        return {"deep_gemm": settings().get("version"), "gpu": platform.gpu_name,
                "capability": list(platform.capability or ()), "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DG_") and k != "DG_JIT_CACHE_DIR"}}


class _DeepGemm:
    family = "gemm"
    jit = DeepGemmJit()

    def unavailable(self, platform, params):
        reason = unsupported(self, params)
        if reason:
            return reason
        if platform.device != "cuda":
            return "DeepGEMM needs an NVIDIA GPU (sm90 or sm100); this run is on the CPU"
        if platform.capability and platform.capability[0] not in (9, 10):
            return f"DeepGEMM needs sm90 or sm100; this GPU is sm{platform.capability[0]}{platform.capability[1]}"
        return import_refusal()

    def compiles_kernels(self, params):  # DeepGEMM JIT-compiles a kernel per shape on first use
        return True

    def kernels(self, params):
        """Every GEMM kernel DeepGEMM builds for this GPU is named deep_gemm::sm<arch>_... (sm90_ on
        Hopper, sm100_ on Blackwell, which unavailable() also accepts)."""
        import torch

        major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 9
        return (f"deep_gemm::sm{major}0_",)

    def describe(self, params) -> dict:
        return {"deep_gemm": settings()}


def _fp8(problem):
    return (problem.a, problem.a_scale), (problem.b, problem.b_scale)


@register
class DeepGemmBf16Contiguous(_DeepGemm):
    name = "deepgemm_bf16_contiguous"
    summary = "DeepGEMM m_grouped_bf16_gemm_nt_contiguous"
    layouts, dtypes = ("contiguous",), ("bfloat16",)

    def run(self, problem, out):
        _first("m_grouped_bf16_gemm_nt_contiguous")(problem.a, problem.b, out, problem.grouped_layout)


@register
class DeepGemmBf16Masked(_DeepGemm):
    name = "deepgemm_bf16_masked"
    summary = "DeepGEMM m_grouped_bf16_gemm_nt_masked"
    layouts, dtypes = ("masked",), ("bfloat16",)

    def run(self, problem, out):
        _first("m_grouped_bf16_gemm_nt_masked", "bf16_m_grouped_gemm_nt_masked")(
            problem.a, problem.b, out, problem.masked_m, problem.expected_m)


@register
class DeepGemmBf16Dense(_DeepGemm):
    name = "deepgemm_bf16_dense"
    summary = "DeepGEMM bf16_gemm_nt"
    layouts, dtypes = ("dense",), ("bfloat16",)

    def run(self, problem, out):
        _first("bf16_gemm_nt")(problem.a, problem.b, out)


@register
class DeepGemmFp8Contiguous(_DeepGemm):
    name = "deepgemm_fp8_contiguous"
    summary = "DeepGEMM m_grouped_fp8 contiguous (1x128 / 128x128 scales)"
    layouts, dtypes = ("contiguous",), ("float8_e4m3fn",)

    def run(self, problem, out):
        a, b = _fp8(problem)
        _first("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_fp4_gemm_nt_contiguous")(
            a, b, out, problem.grouped_layout)


@register
class DeepGemmFp8Masked(_DeepGemm):
    name = "deepgemm_fp8_masked"
    summary = "DeepGEMM m_grouped_fp8 masked (1x128 / 128x128 scales)"
    layouts, dtypes = ("masked",), ("float8_e4m3fn",)

    def run(self, problem, out):
        a, b = _fp8(problem)
        _first("m_grouped_fp8_gemm_nt_masked", "m_grouped_fp8_fp4_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked")(
            a, b, out, problem.masked_m, problem.expected_m)


@register
class DeepGemmFp8Dense(_DeepGemm):
    name = "deepgemm_fp8_dense"
    summary = "DeepGEMM fp8_gemm_nt (1x128 / 128x128 scales)"
    layouts, dtypes = ("dense",), ("float8_e4m3fn",)

    def run(self, problem, out):
        a, b = _fp8(problem)
        _first("fp8_gemm_nt", "fp8_fp4_gemm_nt")(a, b, out)
