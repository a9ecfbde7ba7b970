"""The one property driver: what every family shares, written once.

    runs -> every rank executes them -> gather to rank 0 -> the family measures
         -> vacuity (the same rules for every family) -> one verdict, shared with all ranks

A family (harness/families/<name>.py) supplies only what is its own, as a `Family`:

* `properties`: the names of the properties it supports (each an ep_harness.properties.Property);
* `params`: its parameter dataclass (an ep_harness.params.CommonParams; it owns the defaults);
* `protocol`: the Protocol its subjects implement (harness/subject.py);
* `runs(prop, p, world_size)`: the runs a property compares, each with the `Copy`s of the
  probe it yields, in comparison order (where each copy sits: what the vacuity rules read);
  `p` here and below is the check's parameter dataclass, read by attribute (`p.hidden`);
* `observe(subject, ctx, p, prop, runs)`: on every rank, execute the runs and return what
  this rank saw (picklable: it is gathered to rank 0; a small named type, not a bare tuple);
* `measure(check, subject, ctx, p, runs, gathered)`: on rank 0, a `Measurement`, with
  `sensitivity` set to how many probe elements some reordering would change.

Vacuity, decided here for every family and property from the property's comparison
(harness/properties.py; a check that could not fail is `vacuous`, never `ok`):

* none for a property compared with a reference (its every element is compared);
* fewer than two compared copies, or one run of a property that repeats runs
  (`repeats = 1`, a one-element sweep);
* every compared copy from the same placement (`batch_sizes = [8, 8, 8]`, a single token
  whose "first", "middle" and "last" positions coincide), except for a property that
  repeats one placement by design (run-to-run, graph-invariance);
* a property compared across destinations (rank-invariance) with the probe on a single
  destination;
* no probe element that any reordering the property could expose would change;
* no element compared at all (a reference check whose every token was left out).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ep_harness import kernel_trace, properties
from ep_harness.context import RankContext
from ep_harness.measurement import Measurement

@dataclass(frozen=True)
class Copy:
    """One compared copy of the probe: everything that fixes its inputs and position, and
    the rank that holds it."""

    placement: tuple
    destination: int = 0


@dataclass(frozen=True)
class Run:
    """One execution a property compares; `spec` is the family's own description of it."""

    label: str
    copies: tuple[Copy, ...]
    spec: Any


@dataclass(frozen=True)
class Family:
    """One family, registered by ep_harness.families.register: its name, the names of the
    properties it supports (harness/properties.py), its parameter dataclass (a subclass of
    ep_harness.params.CommonParams), how it runs and measures a check, and the Protocol its
    subjects implement (harness/subject.py checks each subject against it when registered;
    `optional` names the Protocol's members a subject may leave out)."""

    name: str
    properties: tuple[str, ...]
    params: type
    runs: Callable[[str, Any, int], list[Run]]  # (property, the params dataclass, world size)
    observe: Callable
    measure: Callable
    protocol: type | None = None  # None: only the members every subject has (ep_harness.subject.Subject)
    optional: tuple[str, ...] = ()


def kept(t: torch.Tensor) -> torch.Tensor:
    """What a rank observed, as a CPU copy of its own. `.cpu()` of a CPU tensor is the tensor
    itself: a subject that writes its next result into the same buffer would change what was
    observed before the comparison (a combine alternating its order in one reused buffer
    would compare equal to itself)."""
    return t.detach().to("cpu", copy=True)


def vacuity(prop: str, runs: list[Run], sensitivity: int | None, sensitivity_what: str | None) -> str | None:
    """Why a check of `prop` over `runs` could not have failed, or None: the rules follow
    the property's comparison (harness/properties.py), whatever its name."""
    kind = properties.get(prop)
    if kind.needs_reference:
        return None
    copies = [c for r in runs for c in r.copies]
    if len(copies) < 2 or len(runs) < kind.min_runs:
        return f"only one run ({runs[0].label if runs else 'none'}): nothing to compare " \
               f"(a one-element sweep or repeats = 1)"
    if kind.comparison != "repeat" and len({c.placement for c in copies}) < 2:
        return (f"the {len(copies)} compared runs are one and the same placement ({runs[0].label}): "
                f"nothing moved in the dimension {prop} names")
    if kind.comparison == "destination" and len({c.destination for c in copies}) < 2:
        return "the probe lands on only one destination"
    if sensitivity == 0:
        return f"0 {sensitivity_what or 'probe elements change bits under any reordering this check could expose'}"
    return None


def compared_nothing(m: Measurement) -> str | None:
    """A comparison over no element (every token left out, an empty output) holds whatever
    the subject returned."""
    if m.total == 0 and m.held and not m.extra_failure and not m.error:
        return "0 elements were compared (every one left out or none produced)"
    return None


def warm_up(family: Family, check, subject, ctx: RankContext) -> None:
    """Every run of the check executed once, untimed and unmeasured: a JIT-compiling subject
    compiles (or loads from its cache) each kernel the check will time."""
    p = check.params
    family.observe(subject, ctx, p, check.property, family.runs(check.property, p, ctx.world_size))


def execute(family: Family, check, subject, ctx: RankContext) -> Measurement:
    """Run an ep_harness.check.Check of `family` on this rank; every rank returns the same Measurement."""
    p, prop = check.params, check.property
    runs = family.runs(prop, p, ctx.world_size)
    trace = kernel_trace.traced(subject, p, ctx.device)
    with kernel_trace.kernel_names(ctx.device, trace) as ran:
        local = family.observe(subject, ctx, p, prop, runs)
    gathered = ctx.gather(local)
    kernels = ctx.gather(ran) if trace else None
    result = None
    if ctx.rank == 0:
        result = family.measure(check, subject, ctx, p, runs, gathered)
        result.vacuous_reason = result.vacuous_reason or vacuity(prop, runs, result.sensitivity,
                                                                 result.sensitivity_what) or compared_nothing(result)
        if trace:
            _prove_kernels(result, subject, p, kernels)
        if hasattr(subject, "describe"):  # what exactly ran: library version, its configuration
            result.detail["subject_info"] = subject.describe(p)
    return ctx.share_from_rank0(result)  # every rank reaches the same verdict


def _prove_kernels(result: Measurement, subject, p, kernels: list[set[str]]) -> None:
    """List what ran; a declared kernel that ran on no rank makes the check an error."""
    wanted = kernel_trace.declared(subject, p)
    result.kernels = kernel_trace.summarize(kernels, wanted)
    absent = kernel_trace.missing(wanted, kernels)
    if absent:
        ran = ", ".join(result.kernels[:6]) or "none"
        result.error = (f"{subject.name} declares kernels {absent} but none ran during the measured calls "
                        f"(a silent fallback?); ran: {ran}")
