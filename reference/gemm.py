"""Float64 grouped GEMM references, D = A @ B^T per expert ("nt", as DeepGEMM names it).

Contiguous layout: A [M_sum, K], rows grouped per expert; grouped_layout [M_sum] int32 holds
each row's expert, -1 for padding rows (whose output is 0). Masked layout: A [G, max_m, K]
and masked_m [G]; rows at or past masked_m[g] are not computed (0 here). B is [G, N, K].
FP8 references take dequantized operands, so their error measures the kernel, not the
quantization.
"""
from __future__ import annotations

import torch

from ep_harness.bits import int_view
from ep_harness.reference.orders import chain_fold


def grouped_contiguous(a: torch.Tensor, b: torch.Tensor, grouped_layout: torch.Tensor) -> torch.Tensor:
    """a [M_sum, K], b [G, N, K], grouped_layout [M_sum] -> float64 [M_sum, N]."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    for g in range(b.shape[0]):
        rows = (grouped_layout == g).nonzero().flatten()
        if rows.numel():
            out[rows] = a64[rows] @ b64[g].T
    return out


def grouped_masked(a: torch.Tensor, b: torch.Tensor, masked_m: torch.Tensor) -> torch.Tensor:
    """a [G, max_m, K], b [G, N, K], masked_m [G] -> float64 [G, max_m, N]."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    out = torch.zeros(a.shape[0], a.shape[1], b.shape[1], dtype=torch.float64, device=a.device)
    for g in range(b.shape[0]):
        m = int(masked_m[g])
        out[g, :m] = a64[g, :m] @ b64[g].T
    return out


def abs_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_k |a[m, k] * b[n, k]| in float64: the scale of the rounding-error bound."""
    return a.to(torch.float64).abs() @ b.to(torch.float64).abs().T


def k_order_sensitive(row: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> int:
    """Outputs of one row (row [K] against weight [N, K]) whose bits in out_dtype change when its
    K float32 products, added one after the other, are added as two halves' sums instead. Both
    are fixed sequences of elementwise float32 additions (`chain_fold`), so the count is the same
    on every CPU and GPU; a GEMV's own blocking (AVX-512 or AVX2 lanes, a GPU's split) would
    make it the machine's: one CPU's GEMV may already add the halves apart, and count 0."""
    products = (weight.float().cpu() * row.float().cpu()).T.contiguous()  # [K, N]; exact for bf16 and fp8
    k, half = products.shape[0], products.shape[0] // 2
    if half == 0:
        return 0  # one product: no other order
    whole = chain_fold(products, list(range(k)))
    split = chain_fold(products[:half], list(range(half))) + chain_fold(products[half:], list(range(k - half)))
    return int((int_view(whole.to(out_dtype)) != int_view(split.to(out_dtype))).sum())
