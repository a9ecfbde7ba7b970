"""The wire-dtype contract: what crosses the wire follows the expert weights' quantization.

An FP8 checkpoint dispatches FP8 values with per-token-group scales; a BF16 checkpoint
dispatches BF16. A configuration that contradicts the checkpoint is refused, never
silently corrected (SGLang's deepep_v2 dispatcher follows the same rule).
"""
from __future__ import annotations

WIRE_DTYPES = ("bf16", "fp8")


def resolve_wire_dtype(expert_quant: str, requested: str = "auto") -> str:
    """expert_quant: "bf16" or "fp8" (the checkpoint); requested: "auto", "bf16" or "fp8"."""
    if expert_quant not in WIRE_DTYPES:
        raise ValueError(f"expert weights quantization {expert_quant!r} is unknown; use one of {WIRE_DTYPES}")
    if requested == "auto":
        return expert_quant
    if requested not in WIRE_DTYPES:
        raise ValueError(f"wire dtype {requested!r} is unknown; use auto, bf16 or fp8")
    if requested != expert_quant:
        raise ValueError(f"wire dtype {requested} contradicts the {expert_quant} expert weights; "
                         f"use wire=auto or wire={expert_quant}")
    return requested


def wire_refusal(params) -> str | None:
    """Why a case's expert_quant and wire contradict each other (a dispatcher's `unavailable`
    reason), or None."""
    try:
        resolve_wire_dtype(params.get("expert_quant", "bf16"), params.get("wire", "auto"))
    except ValueError as exc:
        return str(exc)
    return None


def check_buffer_option(wire: str, use_fp8_dispatch: bool) -> None:
    """A DeepEP buffer sized for one wire dtype must not carry the other."""
    if use_fp8_dispatch != (wire == "fp8"):
        raise ValueError(f"use_fp8_dispatch={use_fp8_dispatch} contradicts the {wire} wire dtype; "
                         f"set use_fp8_dispatch={wire == 'fp8'}")
