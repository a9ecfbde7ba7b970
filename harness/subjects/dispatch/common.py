"""What a dispatcher returns, and the pieces every dispatcher shares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ep_harness.subjects.quant.torch_fp8 import TorchFp8Quant


@dataclass
class Received:
    """Rows a rank received, in the layout its grouped GEMM consumes.

    contiguous: x [M_sum, H], each local expert's rows from starts[e], padded to the
    alignment, grouped_layout[row] = local expert or -1. masked: x [E_local, max_m, H],
    masked_m[e] rows valid. src_rank / src_token / src_slot say where each row came from
    (-1 on padding), flattened in the layout's row order.
    """

    layout: str
    x: torch.Tensor
    scale: torch.Tensor | None
    counts: list[int]
    starts: list[int]
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_slot: torch.Tensor
    grouped_layout: torch.Tensor | None = None
    masked_m: torch.Tensor | None = None
    native: Any = None

    def rows(self) -> torch.Tensor:
        """The received rows flattened to [rows, H] (a view)."""
        return self.x.reshape(-1, self.x.shape[-1])


def quantize_wire(x: torch.Tensor, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 wire: per-token-group (128) e4m3 with float32 scales, by the torch quantizer;
    power-of-two (UE8M0) scales by default, for which x / scale is exact."""
    return TorchFp8Quant().quantize(x, ue8m0)
