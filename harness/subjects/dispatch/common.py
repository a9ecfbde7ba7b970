"""What every dispatcher shares: the FP8 wire's quantizer. What a dispatcher returns
(Received) and the wire-dtype rule are contracts (harness/contracts.py)."""
from __future__ import annotations

import torch

from ep_harness.subjects.quant.torch_fp8 import TorchFp8Quant


def quantize_wire(x: torch.Tensor, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 wire: per-token-group (128) e4m3 with float32 scales, by the torch quantizer;
    power-of-two (UE8M0) scales by default, for which x / scale is exact."""
    return TorchFp8Quant().quantize(x, ue8m0)
