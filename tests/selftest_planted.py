"""Deliberately weak checks for `ep-harness selftest`'s tests, registered as a plugin
(`--plugin tests.selftest_planted` or a suite's `plugins`), as three collective properties:

* `weak-batch-invariance`: batch-invariance with one flaw: before comparing, it overwrites
  element 0 of every gathered probe copy, so a defect confined to that element (the `ulp`
  injection's default place) cannot show, while one that moves every element (`kth-call`)
  still does. The selftest must report it blind, naming `ulp`.
* `weak-subset-batch-invariance`: batch-invariance that compares only element 0 of every probe
  copy (a check of a subset of each row). Injections at element 0 alone (the selftest's
  placement before issue 32) cannot show it; the default placements (first, middle, last and
  seeded elements of each row) must report it blind, naming `ulp`.
* `weak-reference`: the bounded reference as it was before issue 23 item 1: an element
  counts only where |err| > bound, and every comparison with NaN is false, so NaN and Inf
  outputs pass. The selftest must report it blind, naming `nan` and `inf`.
"""
from dataclasses import replace

from ep_harness import families, properties
from ep_harness.families import collective

WEAK = "weak-batch-invariance"
WEAK_REFERENCE = "weak-reference"
SUBSET = "weak-subset-batch-invariance"
AS = {WEAK: "batch-invariance", WEAK_REFERENCE: "reference", SUBSET: "batch-invariance"}


def _runs(prop, p, world_size):
    return collective.FAMILY.runs(AS.get(prop, prop), p, world_size)


def _observe(subject, ctx, p, prop, runs):
    return collective.FAMILY.observe(subject, ctx, p, AS.get(prop, prop), runs)


def _blinded(gathered):
    for copies, *_ in gathered:
        for per_run in copies:
            for tensor in per_run.values():
                tensor[0] = 0  # the flaw: element 0 of the probe is never compared
    return gathered


def _subset(gathered):
    for copies, *_ in gathered:
        for per_run in copies:
            for tensor in per_run.values():
                tensor.view(-1)[1:] = 0  # the flaw: only element 0 of the probe is compared
    return gathered


def _measure(check, subject, ctx, p, runs, gathered):
    if check.property == WEAK:
        gathered = _blinded(gathered)
    if check.property == SUBSET:
        gathered = _subset(gathered)
    m = collective.FAMILY.measure(replace(check, property=AS.get(check.property, check.property)), subject, ctx, p,
                                  runs, gathered)
    if check.property == WEAK_REFERENCE and m.nonfinite:  # the flaw: non-finite outputs are not counted
        m.mismatched -= sum(n for kind, n in m.nonfinite.items() if kind in ("nan", "+inf", "-inf"))
        m.held = m.mismatched == 0
    return m


# Each is the property it weakens under another name: the same comparison, the same row.
for _name, _as in AS.items():
    properties.register(replace(properties.get(_as), name=_name))
if WEAK not in families.get("collective").properties:
    families.register(replace(collective.FAMILY, properties=(*collective.FAMILY.properties, WEAK, WEAK_REFERENCE, SUBSET),
                              runs=_runs, observe=_observe, measure=_measure))
