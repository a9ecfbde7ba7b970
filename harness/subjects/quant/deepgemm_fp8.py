"""DeepGEMM's own quantization helper, deep_gemm.utils.per_token_cast_to_fp8."""
from ep_harness.subject import register
from ep_harness.subjects.gemm.deepgemm import import_refusal


@register
class DeepGemmFp8Quant:
    name = "deepgemm_fp8_quant"
    family = "quant"
    summary = "deep_gemm.utils.per_token_cast_to_fp8"

    def unavailable(self, platform, params):
        if platform.device != "cuda":
            return "deep_gemm loads CUDA libraries at import; this run is on the CPU"
        return import_refusal()

    def compiles_kernels(self, params):
        return True

    def quantize(self, x, ue8m0):
        from deep_gemm.utils import per_token_cast_to_fp8

        return per_token_cast_to_fp8(x, use_ue8m0=ue8m0)
