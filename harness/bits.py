"""Bit-level views of floating-point tensors: integer views and ULP distances."""
from __future__ import annotations

import torch

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret the bytes of `t` as signed integers of the same width."""
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def ordered_key(t: torch.Tensor) -> torch.Tensor:
    """Map float bit patterns to int64 keys whose difference is the ULP distance.

    Positive floats keep their pattern; negative ones are mirrored below zero, so +0 and
    -0 share key 0 and adjacent representable values differ by exactly 1.
    """
    bits = int_view(t).to(torch.int64)
    sign_bit = 1 << (8 * t.element_size() - 1)
    return torch.where(bits < 0, -(bits + sign_bit), bits)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered_key(a) - ordered_key(b)).abs()


def hex_bits(value: torch.Tensor) -> str:
    """Bit pattern of a single element, e.g. '0x3f80'."""
    width = 2 * value.element_size()
    mask = (1 << (8 * value.element_size())) - 1
    return f"0x{int(int_view(value.reshape(1))[0]) & mask:0{width}x}"


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 = 2^-p for a format with p significand bits (round to nearest)."""
    return torch.finfo(dtype).eps / 2
