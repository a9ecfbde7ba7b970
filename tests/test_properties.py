"""Properties as values (harness/properties.py): the driver's vacuity rules, the planner's
skip reason and explore's choices follow a property's fields, whatever its name."""
import pytest

from ep_harness import properties
from ep_harness.errors import HarnessError
from ep_harness.run.explore import searchable
from ep_harness.families.driver import Copy, Run, vacuity
from ep_harness.run.plan import skip_reason
from ep_harness.properties import Property
from ep_harness.subject import Platform


@pytest.fixture
def toy_property():
    added = []

    def add(**fields):
        prop = properties.register(Property("test-toy-property", **fields))
        added.append(prop.name)
        return prop.name

    yield add
    for name in added:
        properties.PROPERTIES.pop(name, None)


def runs(*copies_per_run):
    return [Run(f"run {i}", tuple(Copy(*c) for c in copies), None) for i, copies in enumerate(copies_per_run)]


MOVED = runs([(("a",), 0)], [(("b",), 0)])  # two runs, the probe in two places, one destination
STILL = runs([(("a",), 0)], [(("a",), 0)])  # two runs, one placement
ONE = runs([(("a",), 0), (("b",), 1)])  # one run holding two copies on two ranks


@pytest.mark.parametrize("comparison, runs_, vacuous", [
    ("reference", runs([(("a",), 0)]), None),
    ("repeat", STILL, None), ("repeat", ONE, "only one run"),
    ("placement", MOVED, None), ("placement", STILL, "one and the same placement"), ("placement", ONE, None),
    ("destination", ONE, None), ("destination", MOVED, "only one destination"),
])
def test_vacuity_follows_the_comparison(toy_property, comparison, runs_, vacuous):
    reason = vacuity(toy_property(compares=comparison), runs_, None, None)
    assert (reason is None) if vacuous is None else (vacuous in reason)


def test_a_gpu_property_is_skipped_on_the_cpu_with_its_reason(toy_property):
    from ep_harness import subject as registry
    from ep_harness.check import typed_params as build

    registry.load_all()
    subject = registry.get("all_gather_fold")
    params = build("collective", {"dtype": "float32"}, subject, "test")
    cpu = Platform("gloo", "cpu", 4)
    assert skip_reason(cpu, subject, toy_property(compares="repeat", gpu="needs a toy GPU"), params) == \
        "needs a toy GPU"
    assert skip_reason(cpu, subject, "run-to-run", params) is None
    assert skip_reason(Platform("nccl", "cuda", 4, gpus=4), subject, "test-toy-property", params) is None


def test_explore_draws_the_searchable_properties_across_ranks_first():
    # tests/selftest_planted.py (a plugin other tests of this worker may have loaded) adds a
    # weak variant to the collective family; the built-in properties keep their order
    def built_in(family):
        return [p for p in searchable(family) if not p.startswith("weak-")]

    assert built_in("dispatch") == ["rank-invariance", "batch-invariance", "position-invariance",
                                    "others-invariance"]
    assert built_in("collective") == ["rank-invariance", "batch-invariance", "position-invariance"]
    assert built_in("gemm") == ["batch-invariance", "position-invariance"]


def test_an_unknown_comparison_or_property_is_one_line():
    with pytest.raises(HarnessError, match="compares 'bitwise', which is unknown; use one of reference, repeat"):
        Property("x", "bitwise")
    with pytest.raises(HarnessError, match="unknown property 'rank-invariants' \\(did you mean 'rank-invariance'"):
        properties.get("rank-invariants")
