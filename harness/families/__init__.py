"""Per-family executors: how a property's runs are built, executed and compared.

Each executor maps (check, subject, rank context) to the measured part of a record.
"""
from __future__ import annotations

from harness.families import collective, dispatch, gemm, moe_layer, quant

EXECUTORS = {
    "collective": collective.execute,
    "gemm": gemm.execute,
    "quant": quant.execute,
    "dispatch": dispatch.execute,
    "moe_layer": moe_layer.execute,
}

PROPERTIES = {
    "collective": collective.PROPERTIES,
    "gemm": gemm.PROPERTIES,
    "quant": quant.PROPERTIES,
    "dispatch": dispatch.PROPERTIES,
    "moe_layer": moe_layer.PROPERTIES,
}
