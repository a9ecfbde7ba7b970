"""Per-token-group FP8 quantization in plain torch, two ways.

`torch_fp8_quant` divides by the scale in float32 and casts: two roundings, so a quotient
within half a float32 ULP of an e4m3 tie can land on the tie and round to even the wrong
way (the operands are not e4m3 numbers, so double rounding is not innocuous here).
`torch_fp8_quant_reciprocal` multiplies by a float32 reciprocal of the scale, as
DeepGEMM's and DeepEP's helpers do: three roundings before the cast.
"""
import torch

from ep_harness.subject import register

GROUP = 128
E4M3_MAX = 448.0


def scales(x: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    rows, cols = x.shape
    amax = x.abs().float().view(rows, cols // GROUP, GROUP).amax(dim=2).clamp(min=1e-4)
    s = amax / E4M3_MAX
    if ue8m0:  # round the scale up to a power of two through its exponent bits
        bits = s.view(torch.int32)
        exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
        s = (exp.clamp(1, 254) << 23).view(torch.float32)
    return s


class _TorchQuant:
    family = "quant"
    reciprocal = False

    def unavailable(self, platform, params):
        return None if params.cols % GROUP == 0 else f"cols={params.cols} is not a multiple of {GROUP}"

    def quantize(self, x, ue8m0):
        s = scales(x, ue8m0)
        groups = x.float().view(x.shape[0], -1, GROUP)
        scaled = groups * (1.0 / s.unsqueeze(2)) if self.reciprocal else groups / s.unsqueeze(2)
        return scaled.to(torch.float8_e4m3fn).view(x.shape), s


@register
class TorchFp8Quant(_TorchQuant):
    name = "torch_fp8_quant"
    summary = "x / scale -> e4m3"


@register
class TorchFp8QuantReciprocal(_TorchQuant):
    name = "torch_fp8_quant_reciprocal"
    summary = "x * (1 / scale) -> e4m3"
    reciprocal = True
