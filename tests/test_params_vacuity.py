"""Verdicts that cannot lie: parameters validated before any rank starts, and the driver's
vacuity rules for every family (a check that compared a run with itself is never `ok`)."""
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from ep_harness import subject as registry
from ep_harness.cases import load_suite
from ep_harness.check import single_check
from ep_harness.errors import HarnessError
from ep_harness.families import FAMILIES
from ep_harness.families.driver import vacuity
from ep_harness.run.plan import expand
from ep_harness.subject import Platform, register
from tests.conftest import REPO, run_cli

registry.load_all(["tests.planted"])

# One subject per family, with the smallest valid parameters.
FAMILY_CASES = {
    "collective": ("reduce_scatter_native", {"dtype": "bfloat16", "world_size": 4}, "hidden"),
    "gemm": ("torch_mm", {"dtype": "bfloat16"}, "n"),
    "quant": ("torch_fp8_quant", {}, "rows"),
    "dispatch": ("torch_a2a_dispatch", {"world_size": 4}, "tokens"),
    "moe_layer": ("composed_moe", {"world_size": 4}, "intermediate"),
}
GPU8 = Platform(backend="nccl", device="cuda", ranks=8, gpu_name="H200", gpus=8)


def suite_file(tmp_path, subject, params: dict, grid: dict | None = None, prop="batch-invariance") -> Path:
    lines = ["[[case]]", 'name = "c"', f'subject = "{subject}"', f'properties = ["{prop}"]', 'expect = "holds"']
    for table, values in (("grid", grid or {}), ("params", params)):
        if values:
            lines.append(f"[case.{table}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = tmp_path / "suite.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def plan_error(tmp_path, subject, params, grid=None) -> str:
    with pytest.raises(HarnessError) as err:
        expand(load_suite(suite_file(tmp_path, subject, params, grid)), GPU8)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_every_family_refuses_typos_missing_values_negative_sizes_and_wrong_types(tmp_path, family):
    subject, good, size_key = FAMILY_CASES[family]
    expand(load_suite(suite_file(tmp_path, subject, good)), GPU8)  # the good case plans
    typo = size_key[:-1] + size_key[-1] * 2  # hidden -> hiddenn
    assert f"unknown parameter {typo!r} in [case.params]; did you mean {size_key!r}?" in \
        plan_error(tmp_path, subject, {**good, typo: 64})
    grid = {"world_sise": [2, 3]}
    assert "unknown parameter 'world_sise' in [case.grid]; did you mean 'world_size'?" in \
        plan_error(tmp_path, subject, good, grid)
    assert f"{size_key} = -4: values below" in plan_error(tmp_path, subject, {**good, size_key: -4})
    assert f"{size_key} = 'big' is not of type int" in plan_error(tmp_path, subject, {**good, size_key: "big"})


@pytest.mark.parametrize("family", ["collective", "gemm"])
def test_a_missing_dtype_is_named_before_launch(tmp_path, family):
    subject, good, _ = FAMILY_CASES[family]
    message = plan_error(tmp_path, subject, {k: v for k, v in good.items() if k != "dtype"})
    assert "missing required parameter 'dtype'" in message


def test_bad_parameters_stop_verify_before_anything_is_written(tmp_path):
    path = suite_file(tmp_path, "reduce_scatter_native", {"dtype": "bfloat16", "hiden": 64})
    proc = run_cli("verify", "--suite", str(path), "--gpus", "0", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "did you mean 'hidden'?" in proc.stderr and not (tmp_path / "out").exists()


def test_records_carry_every_effective_parameter(tmp_path):
    [check] = expand(load_suite(suite_file(tmp_path, "reduce_scatter_native", {"dtype": "bfloat16"})), GPU8)
    assert check.params.hidden == 2048 and check.params.seed == 0 and check.params.batch_sizes == [1, 2, 3, 8, 32, 128]
    assert check.params.backend == "nccl"
    assert check.params_record == asdict(check.params)  # what the record stores


# Degenerate sweeps, per family and property, each with its non-degenerate twin.
DEGENERATE = [
    ("collective", "batch-invariance", {"batch_sizes": [8]}, {"batch_sizes": [8, 16]}),
    ("collective", "batch-invariance", {"batch_sizes": [8, 8, 8]}, {"batch_sizes": [8, 8, 16]}),
    ("collective", "run-to-run", {"repeats": 1}, {"repeats": 2}),
    ("collective", "size-invariance", {"message_bytes": [65536]}, {"message_bytes": [65536, 1 << 20]}),
    ("collective", "size-invariance", {"message_bytes": [65536, 65536]}, {"message_bytes": [65536, 1 << 20]}),
    ("collective", "rank-invariance", {"world_size": 1}, {"world_size": 3}),
    ("gemm", "batch-invariance", {"m_values": [8, 8], "other_loads": [0]}, {"m_values": [8, 9], "other_loads": [0]}),
    ("gemm", "run-to-run", {"repeats": 1}, {"repeats": 2}),
    ("quant", "batch-invariance", {"batch_sizes": [8]}, {"batch_sizes": [8, 16]}),
    ("quant", "batch-invariance", {"batch_sizes": [8, 8, 8]}, {"batch_sizes": [8, 16, 8]}),
    ("quant", "run-to-run", {"repeats": 1}, {"repeats": 2}),
    ("dispatch", "batch-invariance", {"batch_sizes": [8]}, {"batch_sizes": [8, 16]}),
    ("dispatch", "batch-invariance", {"batch_sizes": [8, 8, 8]}, {"batch_sizes": [8, 8, 16]}),
    ("dispatch", "run-to-run", {"repeats": 1}, {"repeats": 2}),
    ("dispatch", "position-invariance", {"routing": "single"}, {"routing": "uniform"}),
    ("moe_layer", "batch-invariance", {"batch_sizes": [8, 8, 8]}, {"batch_sizes": [8, 4, 8]}),
    ("moe_layer", "run-to-run", {"repeats": 1}, {"repeats": 2}),
    ("moe_layer", "position-invariance", {"tokens": 1}, {"tokens": 2}),
]


def runs_of(family, prop, params):
    subject, good, _ = FAMILY_CASES[family]
    check = single_check(registry.get(subject), prop, {**good, **params})
    return FAMILIES[family].runs(prop, check.params, check.world_size)


@pytest.mark.parametrize("family, prop, degenerate, varied", DEGENERATE)
def test_degenerate_sweeps_are_vacuous(family, prop, degenerate, varied):
    assert vacuity(prop, runs_of(family, prop, degenerate), sensitivity=100, sensitivity_what=None)
    assert vacuity(prop, runs_of(family, prop, varied), sensitivity=100, sensitivity_what=None) is None


def test_zero_sensitivity_is_vacuous_with_what_was_counted():
    subject, good, _ = FAMILY_CASES["collective"]
    check = single_check(registry.get(subject), "rank-invariance", good)
    runs = FAMILIES["collective"].runs("rank-invariance", check.params, 4)
    assert vacuity("rank-invariance", runs, 0, "of 2,048 probe elements change bits") == \
        "0 of 2,048 probe elements change bits"


def test_every_committed_suite_compares_runs_that_differ():
    """Walk every check of every suite: the compared copies must differ in the dimension the
    property names, unless the check is one the driver reports as vacuous. The known ones:
    the single-token position-invariance checks of the nightly suite (one token has one
    position), the MoE layer's rank-invariance at world size 1, and the degenerate-* cases of
    tests/cases/planted.toml."""
    vacuous = set()
    paths = sorted((REPO / "cases").glob("*.toml")) + sorted((REPO / "tests" / "cases").glob("*.toml"))
    for path in paths:
        suite = load_suite(path)
        registry.load_all(suite.plugins)
        for c in expand(suite, GPU8):
            if vacuity(c.property, FAMILIES[c.family].runs(c.property, c.params, c.world_size), None, None):
                vacuous.add(f"{path.stem}:{c.id}")
    expected = {f"nightly:dispatch-a2a/position-invariance/expert_quant={q}/layout={lay}/routing=single/world_size={ws}"
                for q in ("bf16", "fp8") for lay in ("contiguous", "masked") for ws in (4, 8)}
    expected.add("nightly:moe-deepgemm/rank-invariance/world_size=1")
    planted = load_suite(REPO / "tests" / "cases" / "planted.toml")  # degenerate-*: vacuous by construction
    expected |= {f"planted:{c.id}" for c in expand(planted, GPU8) if c.id.startswith("degenerate-")}
    layout = load_suite(REPO / "tests" / "cases" / "layout.toml")  # one-size: one size, and one size twice
    expected |= {f"layout:{c.id}" for c in expand(layout, GPU8) if c.id.startswith("one-size/")}
    assert vacuous == expected


@pytest.mark.slow
def test_degenerate_checks_come_out_vacuous_end_to_end(planted_run):
    records = [r for check, r in planted_run.items() if check.startswith("degenerate-")]
    assert len(records) == 6
    for r in records:  # every one of these subjects violates the property when it can be seen
        assert r["status"] == "vacuous" and r["reason"].startswith("could not fail: "), (r["check"], r["reason"])


def test_subjects_are_checked_against_their_family_contract():
    class Incomplete:
        name, family, summary = "incomplete", "collective", "no order model, wrong arity"

        def unavailable(self, platform, params):
            return None

        def reduce_scatter(self, out, inp, sizes):
            return None

    with pytest.raises(ValueError) as err:
        register(Incomplete)
    assert "reduce_scatter() takes 3 argument(s), the contract passes 4" in str(err.value)
    assert "order_model" not in str(err.value)  # optional (tests/test_cli_conventions.py)
    assert "incomplete" not in registry.load_all()
