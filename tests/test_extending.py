"""The README's "Adding a family" and "Adding a property", followed to the letter: a toy family
and a toy property, each written as a module of one's own under a temporary directory,
registered as documented, and checked on the CPU through `ep-harness verify`.

The toy family sums the rows of a float32 matrix; its probe is one row whose sum must not
depend on the batch around it. `toy_in_order` sums every row left to right (it holds);
`toy_parity_order`, the positive control, sums a row backwards where its index plus the
batch size is odd, so the probe's bits move with the batch and with its row (violated).
"""
import json
import textwrap

import pytest

from tests.conftest import run_cli

# Step 1 of "Adding a family": the module, with its parameters, its subjects' contract,
# runs, observe, measure and FAMILY; step 2, the registry line, `register(FAMILY)` at its end
# (a plugin module), followed by its subjects.
TOY_FAMILY = '''
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ep_harness import families
from ep_harness.compare import compare_bitwise
from ep_harness.families.driver import Copy, Family, Run, kept
from ep_harness.measurement import Measurement
from ep_harness.params import CommonParams
from ep_harness.subject import Subject, register


@dataclass(frozen=True, kw_only=True)
class ToyParams(CommonParams):
    cols: int = 64
    batch_sizes: list[int] = field(default_factory=lambda: [1, 3, 8])

    def validate(self, subject):
        return None if self.cols >= 2 else f"cols = {self.cols}: a sum needs two columns"


class ToySubject(Subject, Protocol):
    def row_sums(self, x):
        """x [rows, cols] float32 -> [rows]: every row summed."""


def runs(prop, p, world_size):
    # batch-invariance: the probe is row 0 of batches of every size; spec = (rows, probe row)
    return [Run(f"batch {n}", (Copy(("batch", n)),), (n, 0)) for n in p.batch_sizes]


def observe(subject, ctx, p, prop, runs):
    seen = []
    for run in runs:
        n, at = run.spec
        x = torch.randn(n, p.cols, generator=torch.Generator().manual_seed(p.seed + 1 + n))
        x[at] = torch.randn(p.cols, generator=torch.Generator().manual_seed(p.seed))  # the probe
        seen.append(kept(subject.row_sums(x.to(ctx.device))[at]))
    return seen


def measure(check, subject, ctx, p, runs, gathered):
    copies = torch.stack(gathered[0]).unsqueeze(1)  # rank 0's probe sum per run
    return Measurement.bitwise(compare_bitwise(copies, copies[0], [r.label for r in runs]))


FAMILY = Family("toy", ("batch-invariance",), ToyParams, runs, observe, measure, protocol=ToySubject)
families.register(FAMILY)


def in_order(x):
    out = x[:, 0].clone()
    for c in range(1, x.shape[1]):
        out += x[:, c]
    return out


@register
class InOrder:
    name, family, summary = "toy_in_order", "toy", "every row summed left to right"

    def unavailable(self, platform, params):
        return None

    def row_sums(self, x):
        return in_order(x)


@register
class ParityOrder:
    name, family, summary = "toy_parity_order", "toy", "rows summed backwards where row + batch size is odd"

    def unavailable(self, platform, params):
        return None

    def row_sums(self, x):
        odd = (torch.arange(x.shape[0]) + x.shape[0]) % 2 == 1
        return torch.where(odd, in_order(x.flip(1)), in_order(x))
'''

# "Adding a property": register the Property, list its name in the family's properties, and
# teach the family's runs what to run for it (its measure compares runs as they come).
TOY_PROPERTY = '''
from dataclasses import replace

from ep_harness import families, properties
from ep_harness.families.driver import Copy, Run
from ep_harness.properties import Property

import toy_family

properties.register(Property("reversal-invariance", "placement", must_catch={"ulp"}))


def runs(prop, p, world_size):
    if prop == "reversal-invariance":  # the probe first, then last, in the largest batch
        n = max(p.batch_sizes)
        return [Run("first row", (Copy(("row", 0)),), (n, 0)), Run("last row", (Copy(("row", n - 1)),), (n, n - 1))]
    return toy_family.runs(prop, p, world_size)


families.register(replace(toy_family.FAMILY, properties=(*toy_family.FAMILY.properties, "reversal-invariance"),
                          runs=runs))
'''


def case(name, subject, prop, expect, **params):
    lines = ["[[case]]", f'name = "{name}"', f'subject = "{subject}"', f'properties = ["{prop}"]',
             f'expect = "{expect}"', "[case.params]", "world_size = 2"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in params.items()]
    return "\n".join(lines) + "\n"


def verify(tmp_path, plugin, cases):
    (tmp_path / "toy_family.py").write_text(textwrap.dedent(TOY_FAMILY))
    (tmp_path / "toy_property.py").write_text(textwrap.dedent(TOY_PROPERTY))
    suite = tmp_path / "toy.toml"
    suite.write_text(f'[suite]\nname = "toy"\nplugins = ["{plugin}"]\n\n' + "\n".join(cases))
    proc = run_cli("verify", "--suite", str(suite), "--out", str(tmp_path / "out"), "--quiet", cwd=tmp_path)
    results = tmp_path / "out" / "latest" / "results.jsonl"
    assert results.exists(), proc.stdout + proc.stderr
    return proc, {r["check"]: r for r in map(json.loads, results.read_text().splitlines())}


@pytest.mark.slow
def test_a_family_added_as_the_readme_says_runs_through_verify(tmp_path):
    proc, records = verify(tmp_path, "toy_family", [
        case("in-order", "toy_in_order", "batch-invariance", "holds"),
        case("control", "toy_parity_order", "batch-invariance", "violated"),
        case("one-batch", "toy_in_order", "batch-invariance", "holds", batch_sizes=[4, 4]),
    ])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    held, control, same = (records[f"{c}/batch-invariance"] for c in ("in-order", "control", "one-batch"))
    assert held["family"] == "toy" and held["params"]["cols"] == 64  # the family's defaults, recorded
    assert (held["status"], held["mismatched"], held["total"]) == ("ok", 0, 3)
    assert control["status"] == "ok" and control["mismatched"] == 1  # batch 8 sums the probe forwards, 1 and 3 backwards
    # The driver's vacuity rule for a "placement" property, never told this family's name.
    assert same["status"] == "vacuous" and "one and the same placement" in same["reason"]


@pytest.mark.slow
def test_a_property_added_as_the_readme_says_is_planned_run_and_judged(tmp_path):
    proc, records = verify(tmp_path, "toy_property", [
        case("in-order", "toy_in_order", "reversal-invariance", "holds"),
        case("control", "toy_parity_order", "reversal-invariance", "violated"),
        case("one-row", "toy_in_order", "reversal-invariance", "holds", batch_sizes=[1]),
        case("batches", "toy_in_order", "batch-invariance", "holds"),
    ])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert records["in-order/reversal-invariance"]["status"] == "ok"
    assert records["in-order/reversal-invariance"]["mismatched"] == 0
    assert records["control/reversal-invariance"]["status"] == "ok"
    assert records["control/reversal-invariance"]["mismatched"] == 1  # the last row, summed backwards
    # First and last row of a one-row batch coincide: vacuous by the property's comparison.
    assert records["one-row/reversal-invariance"]["status"] == "vacuous"
    assert records["batches/batch-invariance"]["status"] == "ok"  # the family's own property still runs


def test_an_unregistered_property_or_a_bad_family_is_refused_in_one_line():
    from dataclasses import replace

    from ep_harness import families
    from ep_harness.errors import HarnessError
    from ep_harness.families import gemm

    with pytest.raises(HarnessError, match="property 'reversal-invariancee' is not registered"):
        families.register(replace(gemm.FAMILY, name="toy-bad", properties=("reversal-invariancee",)))
    with pytest.raises(HarnessError, match="not a dataclass derived from ep_harness.params.CommonParams"):
        families.register(replace(gemm.FAMILY, name="toy-bad", params=dict))
    assert "toy-bad" not in families.FAMILIES
