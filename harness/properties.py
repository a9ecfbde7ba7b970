"""The properties a check can hold a subject to, each one value: what it compares, and what
follows from that for the driver, the planner, `explore`, the selftest and the reports.

A family lists the names of the properties it supports (harness/families/<name>.py) and
decides how to run each; everything that is the same for every family is read here, never
from a test on the property's name:

* `compares` says what the probe is compared with, and so when a check could not have
  failed (harness/families/driver.py `vacuity`); not a record's `comparison`, which says how
  the bits were compared (bitwise or within a bound, harness/measurement.py):
  - "reference": every element against a float64 (or exact) reference; one run suffices;
  - "repeat": one placement of the probe run again (a second call, a CUDA-graph replay);
    at least two runs;
  - "placement": the probe moved (another batch, row, size or neighbours) between copies;
    at least two distinct placements;
  - "destination": the probe's copies on several ranks within one call; at least two
    distinct placements and two distinct destinations.
* `gpu`: why only a GPU can run it (None: the CPU can); the planner skips it elsewhere with
  this reason.
* `searchable`: `ep-harness explore` may draw it (its search varies shapes, batches,
  routing and seeds on the CPU, never message sizes or execution modes).
* `must_catch`: the injections `ep-harness selftest` holds it to (None: no row, so none
  of its cells is applicable); harness/selftest/expectations.py explains each row.
* `counts_runs`: its verdict also says how many of the runs differ from the first (k of n:
  how often, not whether); corruption-rate: how many of its calls missed their expectation,
  with a confidence bound on the per-call rate (harness/rates.py).

Adding a property: one `register(Property(...))` (here for a built-in, in a plugin module
for one of one's own), then its name in the `properties` of each family that supports it,
whose `runs` and `measure` say what it runs and compares.
"""
from __future__ import annotations

from dataclasses import dataclass

from ep_harness.errors import HarnessError, registered

COMPARES = ("reference", "repeat", "placement", "destination")


@dataclass(frozen=True)
class Property:
    name: str
    compares: str  # one of COMPARES
    must_catch: frozenset[str] | None = None
    gpu: str | None = None
    searchable: bool = False
    counts_runs: bool = False

    def __post_init__(self):
        if self.compares not in COMPARES:
            raise HarnessError(f"property {self.name!r}: compares {self.compares!r}, which is unknown; "
                               f"use one of {', '.join(COMPARES)}")
        if self.must_catch is not None:
            object.__setattr__(self, "must_catch", frozenset(self.must_catch))

    @property
    def needs_reference(self) -> bool:
        return self.compares == "reference"

    @property
    def min_runs(self) -> int:
        """How many runs a check of it compares at least (copies may share one run, except
        where the property repeats a run)."""
        return 2 if self.compares == "repeat" else 1


PROPERTIES: dict[str, Property] = {}


def register(prop: Property) -> Property:
    """Add a property (or replace one of the same name: a plugin re-imported)."""
    PROPERTIES[prop.name] = prop
    return prop


def get(name: str) -> Property:
    return registered(PROPERTIES, name, "property", "add one with ep_harness.properties.register")


def needs_reference(name: str) -> bool:
    """Whether the property `name` compares with a reference (False for one not registered
    here, e.g. a plugin's that the reader did not load)."""
    prop = PROPERTIES.get(name)
    return prop is not None and prop.needs_reference


_INVARIANCE = frozenset({"ulp", "kth-call"})
for _prop in (
    Property("reference", "reference", {"nan", "inf", "stale"}),
    Property("combine-reference", "reference", {"nan", "inf", "stale"}),
    Property("run-to-run", "repeat", _INVARIANCE, counts_runs=True),
    # run-to-run's repeats, each on another intra-op thread count (harness/threads.py
    # varied_counts): an order that follows the count, which the pinned count never shows
    Property("thread-invariance", "repeat", _INVARIANCE | {"more-threads"}, counts_runs=True),
    Property("batch-invariance", "placement", _INVARIANCE | {"batch-above", "order-above-size"}, searchable=True),
    Property("position-invariance", "placement", _INVARIANCE | {"stale"}, searchable=True),
    Property("size-invariance", "placement", _INVARIANCE | {"order-above-size"}),
    Property("prefill-decode-invariance", "placement", _INVARIANCE | {"order-above-size", "stale"}),
    Property("others-invariance", "placement", _INVARIANCE, searchable=True),
    Property("rank-invariance", "destination", {"one-rank"}, searchable=True),
    Property("graph-invariance", "repeat", {"ulp", "in-graph"}, gpu="CUDA graphs need a GPU"),
    Property("order-invariance", "placement"),  # the model family's; no selftest wrapper
    # Many calls, each against its exact expectation: a rare defect (one row on 1 call in 50)
    # as well as every defect a reference must catch; its record says k of n calls.
    Property("corruption-rate", "reference", {"nan", "inf", "stale", "rare"}, counts_runs=True),
    # Layout size (docs/layout-invariance.md): the same logical inputs through world sizes
    # 1, 2, 4 (8) on subgroups of one launch; a placement is a world size, so one size is
    # "only one run" and a repeated size "one and the same placement" (driver vacuity).
    Property("tp-size-invariance", "placement", _INVARIANCE),
    Property("ep-size-invariance", "placement", _INVARIANCE),
):
    register(_prop)
