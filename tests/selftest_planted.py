"""A deliberately weak check for `ep-harness selftest`'s tests, registered as a plugin
(`--plugin tests.selftest_planted` or a suite's `plugins`).

`weak-batch-invariance` is the collective family's batch-invariance with one flaw: before
comparing, it overwrites element 0 of every gathered probe copy, so a defect confined to
that element (the `ulp` injection's default place) cannot show, while one that moves every
element (`kth-call`) still does. The selftest must report it blind, naming `ulp`.
"""
from dataclasses import replace

from harness import families
from harness.families import collective
from harness.selftest import expectations

WEAK = "weak-batch-invariance"


def _runs(prop, p, world_size):
    return collective.FAMILY.runs("batch-invariance" if prop == WEAK else prop, p, world_size)


def _blinded(gathered):
    for copies, *_ in gathered:
        for per_run in copies:
            for tensor in per_run.values():
                tensor[0] = 0  # the flaw: element 0 of the probe is never compared
    return gathered


def _measure(check, subject, ctx, p, runs, gathered):
    if check.property == WEAK:
        gathered = _blinded(gathered)
    return collective.FAMILY.measure(check, subject, ctx, p, runs, gathered)


if WEAK not in families.PROPERTIES["collective"]:
    families.FAMILIES["collective"] = replace(collective.FAMILY, properties=(*collective.FAMILY.properties, WEAK),
                                              runs=_runs, measure=_measure)
    families.PROPERTIES["collective"] = families.FAMILIES["collective"].properties
expectations.declare(WEAK, expectations.MUST_CATCH["batch-invariance"])
