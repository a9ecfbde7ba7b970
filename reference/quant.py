"""Exact per-token-group FP8 (e4m3fn) quantization: the one correct bit pattern.

    scale[r, j] = max(amax(x[r, 128j:128(j+1)]), 1e-4) / 448   (float32, or rounded up to a
                                                                power of two for UE8M0)
    q[r, k]     = RNE_e4m3(x[r, k] / scale[r, k // 128])        (one rounding, saturating at 448)

The 1e-4 floor and the 448 divisor are DeepGEMM's and DeepEP's conventions. The division
is done in float64 and rounded once to e4m3 here, by hand, so no intermediate float32
rounding can creep in. Every step is exact or one IEEE-rounded operation (exponents read
with frexp, powers of two built from their bits, no log2 or exp2 whose last bit a device's
math library may round otherwise), so the bits are the same on the CPU and on a GPU.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXP = -6
AMAX_FLOOR = 1e-4


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 as one float32 division, as the kernels compute it. The divisor is a
    tensor: CUDA divides by a Python scalar as a multiplication by its reciprocal, which
    rounds differently, and the scales must be the same on every device."""
    amax = amax.to(torch.float32)
    return amax / torch.full_like(amax, E4M3_MAX)


def group_scales(x: torch.Tensor, group: int = 128, ue8m0: bool = False) -> torch.Tensor:
    """x: [rows, cols] (cols a multiple of `group`) -> float32 scales [rows, cols // group]."""
    rows, cols = x.shape
    if cols % group:
        raise ValueError(f"cols={cols} is not a multiple of the group size {group}")
    amax = x.to(torch.float64).abs().view(rows, cols // group, group).amax(dim=2).clamp_min(AMAX_FLOOR)
    scale = scale_of(amax)
    return round_up_to_power_of_two(scale) if ue8m0 else scale


def round_up_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales: each (positive, finite) float32 scale rounded up to a power of two, so
    that x / scale is exact in binary: 2^ceil(log2(s)), computed from s's exponent."""
    s = scale.to(torch.float64)
    finite = torch.isfinite(s)
    mantissa, exp = torch.frexp(torch.where(finite, s, torch.ones_like(s)))  # s = m * 2^e, m in [0.5, 1)
    rounded = power_of_two(torch.where(mantissa == 0.5, exp - 1, exp))
    return torch.where(finite, rounded, s).to(torch.float32)  # NaN and Inf (non-finite inputs) stay


def power_of_two(exp: torch.Tensor) -> torch.Tensor:
    """2.0 ** exp as float64, exactly, for integer exponents of normal float64 values
    ([-1022, 1023]), built from the IEEE bits."""
    return ((exp.to(torch.int64) + 1023) << 52).view(torch.float64)


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the nearest e4m3fn value (ties to even), saturating at 448."""
    mag = v.abs()
    finite = torch.isfinite(mag)
    _, exp = torch.frexp(torch.where(finite & (mag > 0), mag, torch.ones_like(mag)))  # mag = m * 2^exp
    exp = (exp - 1).clamp(E4M3_MIN_NORMAL_EXP, 1023)  # floor(log2(mag)); subnormals share the smallest normal's quantum
    quantum = power_of_two(exp - E4M3_MANTISSA_BITS)
    rounded = torch.round(mag / quantum) * quantum  # torch.round: half to even; exact in float64
    rounded = torch.where(finite, rounded.clamp_max(E4M3_MAX), torch.nan)  # e4m3fn has no infinity: NaN
    return torch.copysign(rounded, v).to(torch.float8_e4m3fn)  # keeps -0 and tiny negatives


def quantize_per_token_group(x: torch.Tensor, group: int = 128, ue8m0: bool = False):
    """x: [rows, cols] -> (q float8_e4m3fn [rows, cols], scales float32 [rows, cols // group])."""
    scale = group_scales(x, group, ue8m0)
    expanded = scale.to(torch.float64).repeat_interleave(group, dim=1)
    return round_to_e4m3(x.to(torch.float64) / expanded), scale


def quantize_per_block(w: torch.Tensor, block: int = 128, ue8m0: bool = False):
    """w: [n, k] (multiples of `block`) -> (q [n, k], scales float32 [n // block, k // block])."""
    n, k = w.shape
    if n % block or k % block:
        raise ValueError(f"weight {n}x{k} is not a multiple of the {block}x{block} block")
    blocks = w.to(torch.float64).view(n // block, block, k // block, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)
    scale = scale_of(amax)
    if ue8m0:
        scale = round_up_to_power_of_two(scale)
    expanded = scale.to(torch.float64).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return round_to_e4m3(w.to(torch.float64) / expanded), scale


def dequantize_per_token_group(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    return q.to(torch.float64) * scale.to(torch.float64).repeat_interleave(group, dim=-1)


def dequantize_per_block(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    s = scale.to(torch.float64).repeat_interleave(block, -2).repeat_interleave(block, -1)
    return q.to(torch.float64) * s
