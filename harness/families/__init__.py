"""The family registry, and the one driver (driver.py) that runs every family's checks.

A family is one module that defines `FAMILY`, an ep_harness.families.driver.Family (its
properties, its parameter dataclass, its runs, what each rank observes, how rank 0
measures, and its subjects' Protocol), plus one registry line: its module's name in
`BUILT_IN` below, or, for a family of one's own, `ep_harness.families.register(FAMILY)` at
the end of a plugin module (loaded like a subject plugin: `--plugin`, a suite's
`plugins`, or an entry point). Everything else reads it from here: the planner (which
properties a family has), the parameters' validation and the checks rebuilt on the ranks
(its parameter dataclass), and the subjects' contract check (its Protocol).
"""
from __future__ import annotations

import importlib
from dataclasses import is_dataclass

from ep_harness import properties
from ep_harness.errors import HarnessError, did_you_mean, registered
from ep_harness.families import driver
from ep_harness.families.driver import Family
from ep_harness.families.layout import sizes_of  # noqa: F401  (a launch's subgroups: harness/run/worker.py)
from ep_harness.params import CommonParams

# One line per built-in family: harness/families/<module>.py defines FAMILY.
BUILT_IN = ("collective", "gemm", "quant", "dispatch", "moe_layer", "model")

FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family (or replace one of the same name: a plugin re-imported, a test's variant)."""
    if not (isinstance(family.params, type) and is_dataclass(family.params) and issubclass(family.params, CommonParams)):
        raise HarnessError(f"family {family.name!r}: params {family.params!r} is not a dataclass derived from "
                           f"ep_harness.params.CommonParams; declare its parameters as one")
    unknown = [p for p in family.properties if p not in properties.PROPERTIES]
    if unknown:
        raise HarnessError(f"family {family.name!r}: property {unknown[0]!r} is not registered"
                           f"{did_you_mean(unknown[0], properties.PROPERTIES)}; register it first with "
                           f"ep_harness.properties.register(Property(...))")
    FAMILIES[family.name] = family
    return family


def get(name: str) -> Family:
    return registered(FAMILIES, name, "family", "a plugin module adds one with ep_harness.families.register")


for _module in BUILT_IN:
    register(importlib.import_module(f"{__name__}.{_module}").FAMILY)


def warm_up(check, subject, ctx) -> None:
    driver.warm_up(get(check.family), check, subject, ctx)


def execute(check, subject, ctx):
    """Run one check on this rank: its Measurement on rank 0, None on the others."""
    return driver.execute(get(check.family), check, subject, ctx)
