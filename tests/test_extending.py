"""docs/extending.md's "Families" and "Properties", followed to the letter: a toy family
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

from tests.conftest import REPO, run_cli
from tests.doc_blocks import doc_block

# The family and the property exactly as docs/extending.md shows them: its code blocks marked
# `<!-- test: toy_family.py -->` and `<!-- test: toy_property.py -->`.
TOY_FAMILY = doc_block(REPO / "docs" / "extending.md", "toy_family.py")
TOY_PROPERTY = doc_block(REPO / "docs" / "extending.md", "toy_property.py")


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
