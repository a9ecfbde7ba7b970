"""The families and their one driver (driver.py): a family supplies its parameters, its
runs, what each rank observes and how rank 0 measures it; the driver does the rest.

Adding a family touches this registry only (plus its subjects' Protocol in subject.py and
its parameter dataclass in params.py).
"""
from __future__ import annotations

from ep_harness.families import collective, dispatch, driver, gemm, model, moe_layer, quant

FAMILIES = {f.name: f for f in (collective.FAMILY, gemm.FAMILY, quant.FAMILY, dispatch.FAMILY, moe_layer.FAMILY,
                                model.FAMILY)}
PROPERTIES = {name: f.properties for name, f in FAMILIES.items()}


def warm_up(check, subject, ctx) -> None:
    driver.warm_up(FAMILIES[check.family], check, subject, ctx)


def execute(check, subject, ctx):
    """Run one check on this rank; every rank returns the same Measurement."""
    return driver.execute(FAMILIES[check.family], check, subject, ctx)
