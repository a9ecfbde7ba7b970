"""`ep-harness selftest`: the injections, the table of what each property must catch, the
verdict per cell, and a narrowed selftest end to end (a planted weak check is blind)."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from ep_harness.bits import ulp_distance
from ep_harness import properties
from ep_harness.errors import HarnessError
from ep_harness.families import collective, dispatch, driver, gemm, moe_layer, quant
from ep_harness.selftest import expectations, matrix
from ep_harness.families import BUILT_IN, FAMILIES
from ep_harness.selftest.injections import CLASSES, parse
from ep_harness.selftest.wrap import step_ulp, wrapped
from tests.conftest import REPO, run_cli
from tests.shared_runs import shared_cli

FAMILY_PROPERTIES = {"collective": collective.PROPERTIES, "gemm": gemm.PROPERTIES, "quant": quant.PROPERTIES,
                     "dispatch": dispatch.PROPERTIES, "moe_layer": moe_layer.PROPERTIES}
MUST_CATCH = expectations.must_catch()


def record(prop="batch-invariance", family="collective", status="ok", expect="holds", comparison="bitwise"):
    return {"property": prop, "family": family, "status": status, "expect": expect, "comparison": comparison}


# --- the table -----------------------------------------------------------------------

def test_every_property_of_every_wrapped_family_has_a_row():
    assert {name for name in BUILT_IN if FAMILIES[name].selftest_wrapper} == set(FAMILY_PROPERTIES)
    missing = {(f, p) for f, props in FAMILY_PROPERTIES.items() for p in props
               if p not in MUST_CATCH and (f, p) not in expectations.NOT_TARGETED}  # those say why
    assert not missing


def test_every_injection_class_is_required_by_some_property():
    required = set().union(*MUST_CATCH.values(), *expectations.family_must_catch().values(),
                           expectations.EXACT_REFERENCE)
    assert required == set(CLASSES)


def test_what_a_property_must_catch():
    # A bounded reference need not see 1 ULP (inside its bound), an exact one must.
    assert expectations.required(record("reference", comparison="bounded"), "ulp")[0] is False
    assert expectations.required(record("reference", family="quant", comparison="bitwise"), "ulp")[0] is True
    assert expectations.required(record("reference", comparison="bounded"), "nan")[0] is True
    assert expectations.required(record("rank-invariance"), "one-rank")[0] is True
    assert expectations.required(record("run-to-run"), "one-rank")[0] is False  # same rank every repeat
    assert expectations.required(record("run-to-run"), "kth-call")[0] is True
    assert expectations.required(record("batch-invariance"), "batch-above")[0] is True
    assert expectations.required(record("position-invariance"), "batch-above")[0] is False
    # The collective contract forbids writing the input; the other families are not held to it.
    assert expectations.required(record("run-to-run", family="collective"), "out-of-slice")[0] is True
    assert expectations.required(record("run-to-run", family="gemm"), "out-of-slice")[0] is False



def test_the_layout_size_properties_are_held_to_what_every_invariance_catches():
    for family, prop in (("collective", "tp-size-invariance"), ("moe_layer", "tp-size-invariance"),
                         ("moe_layer", "ep-size-invariance")):
        assert expectations.required(record(prop, family=family), "ulp")[0] is True
        assert expectations.required(record(prop, family=family), "kth-call")[0] is True
    assert expectations.required(record("tp-size-invariance", family="collective"), "out-of-slice")[0] is True
    assert expectations.NOT_TARGETED == {}


@pytest.mark.slow
def test_the_selftest_reaches_the_layout_size_calls(tmp_path):
    """The smoke suite's layout fixes that must hold (the tree reduce-scatter across TP sizes,
    the MoE layer across TP and EP sizes): every injection they must catch, planted through
    reduce_shards / forward_shards, is caught (before, their cells were not applicable)."""
    proc = run_cli("selftest", "--suite", "smoke", "--check", "tp-size-tree", "--check", "moe-layout-fixed",
                   "--injections", "ulp,kth-call,out-of-slice", "--no-report", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "latest" / "selftest.json").read_text())
    assert result["blind"] == [] and result["broken"] == []
    states = {(r["check"].split("/")[0], r["property"]): {name: cell["state"] for name, cell in r["cells"].items()}
              for r in result["checks"]}
    assert {("tp-size-tree", "tp-size-invariance"), ("moe-layout-fixed", "tp-size-invariance"),
            ("moe-layout-fixed", "ep-size-invariance")} <= set(states), sorted(states)
    for key, cells in states.items():
        assert cells["ulp"] == cells["kth-call"] == "caught", (key, cells)
    assert states[("tp-size-tree", "tp-size-invariance")]["out-of-slice"] == "caught"

def test_cells_that_cannot_be_tested_are_not_applicable():
    assert expectations.required(record(expect="violated"), "ulp")[0] is None  # a control
    assert expectations.required(record(status="vacuous"), "ulp")[0] is None
    assert expectations.required(record(status="unexpected"), "ulp")[0] is None
    assert expectations.required(record("no-such-property"), "ulp")[0] is None
    assert expectations.required(record(family="model"), "ulp")[0] is None


def test_a_plugin_property_brings_its_row():
    prop = "test-declared-property"
    try:
        properties.register(properties.Property(prop, "destination", must_catch={"one-rank"}))
        assert expectations.required(record(prop), "one-rank")[0] is True
        assert expectations.required(record(prop), "ulp")[0] is False
        properties.register(properties.Property(prop, "destination"))  # no row: not applicable
        assert expectations.required(record(prop), "one-rank")[0] is None
    finally:
        properties.PROPERTIES.pop(prop, None)


# --- the cells ---------------------------------------------------------------------------

def test_cell_states():
    ok, bad = {"status": "ok", "reason": "holds"}, {"status": "unexpected", "reason": "1 / 8 differ"}
    assert matrix.cell(True, "", bad, fired=True)["state"] == "caught"
    assert matrix.cell(True, "", ok, fired=True)["state"] == "missed"
    assert matrix.cell(True, "", ok, fired=False)["state"] == "not-fired"  # never a miss
    assert matrix.cell(False, "", ok, fired=True)["state"] == "not-required"  # never a miss
    assert matrix.cell(False, "", bad, fired=True)["state"] == "extra"
    assert matrix.cell(None, "a control", None, fired=False)["state"] == "n/a"
    assert matrix.cell(False, "", None, fired=False)["state"] == "not-required"
    raised = {"status": "error", "reason": "ValueError: nan", "detail": {"tracebacks": {"0": "families/moe_layer.py"}}}
    assert matrix.cell(True, "", raised, fired=True)["state"] == "caught"  # the family raised on the value
    wrapper = {"status": "error", "reason": "x", "detail": {"tracebacks": {"1": "harness/selftest/wrap.py"}}}
    assert matrix.cell(True, "", wrapper, fired=True)["state"] == "broken"
    assert matrix.cell(True, "", {"status": "error", "reason": "launch failed", "detail": {"log": ""}},
                       fired=False)["state"] == "broken"
    rows = [{"check": "a", "property": "p", "cells": {"ulp": {"state": "missed"}, "nan": {"state": "caught"}}},
            {"check": "b", "property": "p", "cells": {"ulp": {"state": "caught"}, "nan": {"state": "n/a"}}}]
    assert matrix.blind(rows) == [{"check": "a", "property": "p", "missed": ["ulp"]}]


# --- the injections ------------------------------------------------------------------------

def test_parse_with_parameters_and_bad_input():
    ulp, nan = parse("ulp:call=1:rank=2, nan")
    assert (ulp.name, ulp.call, ulp.rank, ulp.element, ulp.at) == ("ulp", 1, 2, None, None)
    assert [i.label for i in ulp.placements()] == ["ulp.first", "ulp.middle", "ulp.last", "ulp.seeded"]
    assert parse("ulp:element=3")[0].placements() == parse("ulp:element=3")  # an element given: that one
    assert parse("stale:at=last")[0].label == "stale.last" and nan.placements() == [nan]
    assert (nan.name, nan.rank) == ("nan", 0)
    assert parse("one-rank:rank=any")[0].rank is None
    assert [i.name for i in parse(None)] == list(CLASSES)
    for bad, words in (("ulpp", "unknown injection"), ("ulp:calls=1", "is not one of"), ("ulp:call=x", "not a number"),
                       ("ulp:call=-1", ">= 0"), ("ulp,ulp", "twice"), ("ulp:at=centre", "not one of"),
                       ("nan:at=first", "not planted in every row")):
        with pytest.raises(HarnessError, match=words):
            parse(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_step_ulp_moves_every_finite_element_by_one_ulp(dtype):
    g = torch.Generator().manual_seed(7)
    top = 448.0 if dtype == torch.float8_e4m3fn else torch.finfo(dtype).max
    x = torch.cat([torch.randn(64, generator=g) * 3, torch.tensor([0.0, -0.0, top, -top])]).to(dtype)
    if dtype != torch.float8_e4m3fn:
        x = torch.cat([x, torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)])
    y = x.clone()
    step_ulp(y)
    finite = torch.isfinite(x.float())
    assert (ulp_distance(y[finite], x[finite]) == 1).all()
    assert torch.isfinite(y[finite].float()).all()  # the largest value steps down, never to infinity
    assert torch.equal(y[~finite].float().isnan(), x[~finite].float().isnan())
    assert torch.equal(y[~finite & ~x.float().isnan()].float(), x[~finite & ~x.float().isnan()].float())


class FakeGemm:
    """A GEMM subject whose output row i is the input row's sum, and distinct per row."""

    family, summary, layouts, dtypes = "gemm", "test", ("contiguous",), ("float32",)

    def __init__(self, name):
        self.name = name

    def unavailable(self, platform, params):
        return None

    def run(self, problem, out):
        out.copy_(problem.a.sum(1, keepdim=True) + torch.arange(out.shape[1], dtype=out.dtype))


def calls(subject, injection, batches, tmp_path, monkeypatch, rank=0):
    """Run the wrapped subject on batches of the given row counts; the outputs and the
    wrapper's log of which calls the defect changed."""
    monkeypatch.setenv("EP_HARNESS_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", str(rank))
    w = wrapped(subject, injection.to_json(), SimpleNamespace(id="the-check", property="batch-invariance"))
    outs, inputs = [], []
    for n, rows in enumerate(batches):
        a = torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) + 100 * n
        out = torch.empty(rows, 8)
        w.run(SimpleNamespace(a=a), out)
        outs.append(out)
        inputs.append(a)
    log = tmp_path / f"injections-rank{rank}.jsonl"
    logged = [json.loads(line)["call"] for line in log.read_text().splitlines()] if log.exists() else []
    return outs, inputs, logged


def clean(subject, batches):
    out = []
    for n, rows in enumerate(batches):
        a = torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) + 100 * n
        o = torch.empty(rows, 8)
        subject.run(SimpleNamespace(a=a), o)
        out.append(o)
    return out


def differing_calls(outs, ref):
    return [i for i, (o, r) in enumerate(zip(outs, ref)) if not torch.equal(o.view(torch.int32), r.view(torch.int32))]


def test_triggers_fire_only_where_they_say(tmp_path, monkeypatch):
    s = FakeGemm("fake-triggers")
    batches = [2, 2, 5, 2]
    ref = clean(s, batches)
    for name, expected in (("kth-call", [2]), ("ulp", [0]), ("batch-above", [2]), ("order-above-size", [2]),
                           ("one-rank", [0, 1, 2, 3]), ("nan", [0, 1, 2, 3])):
        (tmp_path / name).mkdir()
        outs, _, logged = calls(s, CLASSES[name], batches, tmp_path / name, monkeypatch)
        assert differing_calls(outs, ref) == expected == logged, name
    outs, _, logged = calls(s, CLASSES["one-rank"], batches, tmp_path, monkeypatch, rank=1)
    assert differing_calls(outs, ref) == [] == logged  # rank 0 only


def test_more_threads_fires_only_above_the_launch_s_count(tmp_path, monkeypatch):
    s = FakeGemm("fake-threads")
    ref = clean(s, [2, 2])
    own = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what the launch pinned
    try:
        for count, expected in ((1, []), (2, [0, 1])):  # the control first: the pinned count
            torch.set_num_threads(count)
            (tmp_path / str(count)).mkdir()
            outs, _, logged = calls(s, CLASSES["more-threads"], [2, 2], tmp_path / str(count), monkeypatch)
            assert differing_calls(outs, ref) == expected == logged, count
    finally:
        torch.set_num_threads(own)


def test_places(tmp_path, monkeypatch):
    s = FakeGemm("fake-places")
    ref = clean(s, [3])[0]
    (tmp_path / "ulp").mkdir()
    (ulp_out,), _, _ = calls(s, parse("ulp:element=5")[0], [3], tmp_path / "ulp", monkeypatch)
    assert torch.nonzero(ulp_out != ref).tolist() == [[0, 5], [1, 5], [2, 5]]  # one element of every row
    spots = {}
    for inj in CLASSES["ulp"].placements():
        (tmp_path / inj.label).mkdir()
        (out,), _, _ = calls(s, inj, [3], tmp_path / inj.label, monkeypatch)
        rows, cols = torch.nonzero(out != ref).unbind(1)
        assert rows.tolist() == [0, 1, 2], inj.label  # one element of every row
        spots[inj.at] = cols.tolist()
    assert spots["first"] == [0, 0, 0] and spots["middle"] == [4, 4, 4] and spots["last"] == [7, 7, 7]
    assert len(set(spots["seeded"])) > 1  # the seeded spot moves from row to row
    (nan_out,), _, _ = calls(s, parse("nan:element=9")[0], [3], tmp_path, monkeypatch)
    assert torch.nonzero(nan_out.isnan()).tolist() == [[1, 1]]  # one element in all
    assert torch.equal(nan_out[~nan_out.isnan()], ref[~nan_out.isnan()])


def test_stale_keeps_the_previous_calls_value(tmp_path, monkeypatch):
    s = FakeGemm("fake-stale")
    ref = clean(s, [3, 3, 2])
    outs, _, logged = calls(s, CLASSES["stale"], [3, 3, 2], tmp_path, monkeypatch)
    assert torch.equal(outs[0], ref[0]) and logged == [1, 2]  # nothing before the first call
    # the previous call's value one row further on (another token's), rows wrapping round
    assert torch.equal(outs[1][:, 0], ref[0][[1, 2, 0], 0]) and torch.equal(outs[1][:, 1:], ref[1][:, 1:])
    assert torch.equal(outs[2][:, 0], ref[1][[1, 2], 0])  # the previous call's true value, not its stale one
    assert (outs[1][:, 0] != ref[1][:, 0]).all()  # never the value it replaces


class PaddedGemm(FakeGemm):
    """FakeGemm whose last output row is padding: left as the harness filled it (its sentinel)."""

    def run(self, problem, out):
        super().run(problem, out)
        out[-1:].view(torch.int32).fill_(driver.SENTINEL_BITS[torch.float32])


def test_stale_never_keeps_a_padding_element_the_previous_call_did_not_write(tmp_path, monkeypatch):
    s = PaddedGemm("fake-stale-padding")
    ref = clean(s, [3, 3])
    outs, _, logged = calls(s, CLASSES["stale"], [3, 3], tmp_path, monkeypatch)
    # row 1 would take the previous call's row 2, padding: it keeps its own value instead
    assert torch.equal(outs[1][:, 0], torch.stack([ref[0][1, 0], ref[1][1, 0], ref[0][0, 0]]))
    assert not driver.still_sentinel(outs[1][:2]).any() and logged == [1]


def test_out_of_slice_writes_the_input_not_the_output(tmp_path, monkeypatch):
    s = FakeGemm("fake-slice")
    ref = clean(s, [3])
    outs, inputs, logged = calls(s, CLASSES["out-of-slice"], [3], tmp_path, monkeypatch)
    pristine = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert torch.equal(outs[0], ref[0]) and logged == [0]
    assert (ulp_distance(inputs[0], pristine) == 1).all()


# --- end to end ------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def planted_selftest(tmp_path_factory):
    """tests/cases/selftest.toml with every CPU injection class (every placement of `ulp`),
    once per test session: the process and its output directory (two launches of 3 gloo ranks)."""
    return shared_cli(tmp_path_factory, "planted-selftest", "selftest", "--suite", str(REPO / "tests/cases/selftest.toml"),
                      "--injections", "ulp,kth-call,one-rank,nan,inf,in-graph", "--out", "{out}")


@pytest.mark.slow
def test_selftest_finds_the_planted_weak_check(planted_selftest):
    """tests/cases/selftest.toml on 3 gloo ranks: the sound checks catch what their property
    must; the weak batch-invariance (element 0 never compared) is blind to `ulp` and only
    to it; the weak reference (non-finite outputs not counted, as before issue 23 item 1)
    is blind to `nan` and `inf`; the control's cells are not applicable."""
    proc, tmp_path = planted_selftest
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "BLIND: weak/weak-batch-invariance (weak-batch-invariance) missed ulp" in proc.stdout
    assert "BLIND: weak-ref/weak-reference (weak-reference) missed nan, inf" in proc.stdout
    assert "BLIND: subset/weak-subset-batch-invariance (weak-subset-batch-invariance) missed ulp" in proc.stdout
    assert "# selftest matrix" in proc.stdout
    result = json.loads((tmp_path / "latest" / "selftest.json").read_text())
    assert result["blind"] == [
        {"check": "weak/weak-batch-invariance", "property": "weak-batch-invariance", "missed": ["ulp"]},
        {"check": "subset/weak-subset-batch-invariance", "property": "weak-subset-batch-invariance", "missed": ["ulp"]},
        {"check": "weak-ref/weak-reference", "property": "weak-reference", "missed": ["nan", "inf"]}]
    by_check = {r["check"]: r["cells"] for r in result["checks"]}
    # The subset check sees the defect at the first element only; every other placement is missed.
    assert by_check["subset/weak-subset-batch-invariance"]["ulp"]["spots"] == {
        "ulp.first": "caught", "ulp.middle": "missed", "ulp.last": "missed", "ulp.seeded": "missed"}
    assert by_check["weak/weak-batch-invariance"]["ulp"]["missed_at"] == ["ulp.first"]
    cells = {r["check"]: {k: c["state"] for k, c in r["cells"].items()} for r in result["checks"]}
    assert all(r["baseline"] == "ok" for r in result["checks"])
    assert cells["weak/weak-batch-invariance"]["kth-call"] == "caught"  # not blind to a change of every element
    assert cells["fold/batch-invariance"] == {"ulp": "caught", "kth-call": "caught", "one-rank": "not-required",
                                              "nan": "not-required", "inf": "not-required", "in-graph": "n/a"}
    assert cells["fold/rank-invariance"]["one-rank"] == "caught"
    assert cells["fold/run-to-run"]["ulp"] == cells["fold/run-to-run"]["kth-call"] == "caught"
    assert cells["fold/reference"]["nan"] == cells["fold/reference"]["inf"] == "caught"
    assert set(cells["native-control/rank-invariance"].values()) == {"n/a"}
    assert (tmp_path / "latest" / "injected" / "ulp.jsonl").exists()
    page = (tmp_path / "latest" / "report.html").read_text()
    assert "Selftest: 3 blind check(s)" in page and '<td class="st-missed"' in page


@pytest.fixture(scope="session")
def subset_at_element_0(tmp_path_factory):
    """The subset check (it compares element 0 of the probe only) with `ulp` planted at element
    0 of every row, the placement before issue 32, once per test session: one cell, caught."""
    return shared_cli(tmp_path_factory, "subset-at-element-0", "selftest", "--suite",
                      str(REPO / "tests/cases/selftest.toml"), "--check", "subset/*", "--injections", "ulp:element=0",
                      "--no-report", "--out", "{out}")


@pytest.mark.slow
def test_selftest_passes_when_no_check_is_blind(subset_at_element_0):
    """Exit 0 when every tested cell is caught (the sound checks' own catches, one-rank by
    rank-invariance among them, are in the planted run above)."""
    proc, tmp_path = subset_at_element_0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "latest" / "selftest.json").read_text())
    assert result["blind"] == [] and result["tested"] == 1


@pytest.mark.slow
def test_a_subset_check_passes_only_where_the_defect_is_at_element_0(subset_at_element_0, planted_selftest):
    """The placement before issue 32 (element 0 of every row) let a check that compares only
    element 0 pass the selftest: so it still does with that placement asked for, and with the
    middle of each row it is blind (read from the module's run of every placement, whose
    subset cell misses the middle first: its rerun asks for that placement alone)."""
    proc, at0 = subset_at_element_0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [only] = json.loads((at0 / "latest" / "selftest.json").read_text())["checks"]
    assert (only["check"], only["cells"]["ulp"]["state"]) == ("subset/weak-subset-batch-invariance", "caught")
    proc, out = planted_selftest
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "BLIND: subset/weak-subset-batch-invariance (weak-subset-batch-invariance) missed ulp" in proc.stdout
    [subset] = [r for r in json.loads((out / "latest" / "selftest.json").read_text())["checks"]
                if r["check"] == "subset/weak-subset-batch-invariance"]
    assert "--injections ulp:at=middle" in subset["cells"]["ulp"]["rerun"]


def test_bad_injection_is_one_line_and_exit_2(tmp_path):
    proc = run_cli("selftest", "--suite", "smoke", "--injections", "ulpp", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown injection 'ulpp'" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_limit_keeps_the_first_checks_that_expect_to_hold():
    from dataclasses import replace

    from ep_harness import subject as registry
    from ep_harness.check import single_check
    from ep_harness.selftest.run import choose

    registry.load_all()
    base = single_check(registry.get("all_gather_fold"), "rank-invariance", {"dtype": "bfloat16", "world_size": 3})
    checks = [replace(base, id="control", expect="violated"), replace(base, id="skipped", skip_reason="needs a GPU"),
              replace(base, id="a"), replace(base, id="b"), replace(base, id="c")]
    assert [c.id for c in choose(checks, None)] == ["control", "a", "b", "c"]
    assert [c.id for c in choose(checks, 2)] == ["a", "b"]
