"""docs/extending.md's "Families" and "Properties", followed to the letter: a toy family
and a toy property, each written as a module of one's own under a temporary directory,
registered as documented, and checked on the CPU through `ep-harness verify`.

The toy family sums the rows of a float32 matrix; its probe is one row whose sum must not
depend on the batch around it. `toy_in_order` sums every row left to right (it holds);
`toy_parity_order`, the positive control, sums a row backwards where its index plus the
batch size is odd, so the probe's bits move with the batch and with its row (violated).
The same module declares the family's optional slots: `ep-harness explore` searches its space
and finds the control's violation, `ep-harness selftest` plants its defects through its
wrapper and holds its checks to its must-catch.
"""
import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.doc_blocks import doc_block

# The family and the property exactly as docs/extending.md shows them: its code blocks marked
# `<!-- test: toy_family.py -->` and `<!-- test: toy_property.py -->`.
TOY_FAMILY = doc_block(REPO / "docs" / "extending.md", "toy_family.py")
TOY_PROPERTY = doc_block(REPO / "docs" / "extending.md", "toy_property.py")


def case(name, subject, prop, expect, **params):
    """A case of world size 2; `prop` one property or a list of them."""
    props = [prop] if isinstance(prop, str) else list(prop)
    lines = ["[[case]]", f'name = "{name}"', f'subject = "{subject}"', f"properties = {json.dumps(props)}",
             f'expect = "{expect}"', "[case.params]", "world_size = 2"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in params.items()]
    return "\n".join(lines) + "\n"


def verify(tmp_path, plugins, cases):
    (tmp_path / "toy_family.py").write_text(textwrap.dedent(TOY_FAMILY))
    (tmp_path / "toy_property.py").write_text(textwrap.dedent(TOY_PROPERTY))
    suite = tmp_path / "toy.toml"
    suite.write_text(f'[suite]\nname = "toy"\nplugins = {json.dumps(plugins)}\n\n' + "\n".join(cases))
    proc = run_cli("verify", "--suite", str(suite), "--out", str(tmp_path / "out"), "--quiet", cwd=tmp_path)
    results = tmp_path / "out" / "latest" / "results.jsonl"
    assert results.exists(), proc.stdout + proc.stderr
    return proc, {r["check"]: r for r in map(json.loads, results.read_text().splitlines())}


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory):
    """The family and the property of docs/extending.md, each its own module and both the
    suite's plugins, through `ep-harness verify` once per session (one launch of 2 gloo ranks):
    the family's cases (in-order, control, one-batch: batch-invariance) and the property's
    (in-order, control, one-row: reversal-invariance; batches: the family's own property)."""
    from tests.conftest import completed, once_per_session

    def make(folder):
        folder.mkdir(parents=True, exist_ok=True)
        proc, records = verify(folder, ["toy_family", "toy_property"], [
            case("in-order", "toy_in_order", ["batch-invariance", "reversal-invariance"], "holds"),
            case("control", "toy_parity_order", ["batch-invariance", "reversal-invariance"], "violated"),
            case("one-batch", "toy_in_order", "batch-invariance", "holds", batch_sizes=[4, 4]),
            case("one-row", "toy_in_order", "reversal-invariance", "holds", batch_sizes=[1]),
            case("batches", "toy_in_order", "batch-invariance", "holds"),
        ])
        return {"proc": completed(proc), "records": records}

    shared = once_per_session(tmp_path_factory, "toy-verify", make)
    return subprocess.CompletedProcess(**shared["proc"]), shared["records"]


@pytest.mark.slow
def test_a_family_added_as_the_readme_says_runs_through_verify(toy_run):
    proc, records = toy_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    held, control, same = (records[f"{c}/batch-invariance"] for c in ("in-order", "control", "one-batch"))
    assert held["family"] == "toy" and held["params"]["cols"] == 64  # the family's defaults, recorded
    assert (held["status"], held["mismatched"], held["total"]) == ("ok", 0, 3)
    assert control["status"] == "ok" and control["mismatched"] == 1  # batch 8 sums the probe forwards, 1 and 3 backwards
    # The driver's vacuity rule for a "placement" property, never told this family's name.
    assert same["status"] == "vacuous" and "one and the same placement" in same["reason"]


@pytest.mark.slow
def test_a_property_added_as_the_readme_says_is_planned_run_and_judged(toy_run):
    proc, records = toy_run
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


# -- a family whose checks compile kernels: one module and its registry line ----------------

# A toy JIT: `kernel(cols)` "compiles" (half a second) on its first call in the cache directory
# every process of the run shares, and notes which process compiled or loaded it, and when.
TOY_KERNELS = '''
import json, os, time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from ep_harness import families
from ep_harness.compare import compare_bitwise
from ep_harness.families.driver import Copy, Family, Precompile, Run, kept
from ep_harness.measurement import Measurement
from ep_harness.params import CommonParams
from ep_harness.subject import Subject, register

def kernel(cols):
    built = Path(os.environ["TOY_KERNEL_CACHE"]) / f"sum-{cols}"
    compiled = not built.exists()
    if compiled:
        time.sleep(0.5)
        built.write_text("a kernel")
    with open(built.with_name("events.jsonl"), "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "cols": cols, "compiled": compiled, "time": time.time()}) + "\\n")

@dataclass(frozen=True, kw_only=True)
class SumParams(CommonParams):
    cols: int = 16
    batch_sizes: list[int] = field(default_factory=lambda: [1, 3])

class SumSubject(Subject, Protocol):
    def row_sums(self, x):
        """x [rows, cols] float32 -> [rows]."""

@dataclass(frozen=True)
class SumKernel:
    family: ClassVar[str] = "toy_jit"
    subject: str
    cols: int
    needed_by: str = field(default="", compare=False)
    timeout_s: float = field(default=60.0, compare=False)

    def key(self):
        return json.dumps([self.subject, self.cols])

    def group(self):
        return (self.subject,)

    def describe(self):
        return f"{self.subject} cols={self.cols} (for {self.needed_by})"

    def to_json(self):
        return asdict(self)

    @classmethod
    def from_json(cls, d):
        return cls(**d)

    def make(self, subject, device):
        subject.row_sums(torch.zeros(1, self.cols, device=device))

def kernel_calls(check):
    return [SumKernel(check.subject, check.params.cols, needed_by=check.id)]

def runs(prop, p, world_size):
    return [Run(f"batch {n}", (Copy(("batch", n)),), n) for n in p.batch_sizes]

def observe(subject, ctx, p, prop, runs):
    g = lambda n: torch.Generator().manual_seed(p.seed + n)  # noqa: E731
    return [kept(subject.row_sums(torch.randn(run.spec, p.cols, generator=g(0)))[0]) for run in runs]

def measure(check, subject, ctx, p, runs, gathered):
    copies = torch.stack(gathered[0]).unsqueeze(1)
    return Measurement.bitwise(compare_bitwise(copies, copies[0], [r.label for r in runs]))

FAMILY = Family("toy_jit", ("batch-invariance",), SumParams, runs, observe, measure, protocol=SumSubject,
                precompile=Precompile(kernel_calls, call=SumKernel))
families.register(FAMILY)

@register
class JitSums:
    name, family, summary = "toy_jit_sums", "toy_jit", "row sums by a kernel compiled on first use"

    def unavailable(self, platform, params):
        return None

    def row_sums(self, x):
        kernel(x.shape[1])
        return x.sum(dim=1)
'''

# A GPU run's compile on the CPU: start() told the platform is a GPU, its workers allocating on the CPU.
COMPILED_RUN = '''
import dataclasses, sys
from pathlib import Path
from ep_harness.run import precompile
from ep_harness.run.verify import RunOptions, verify

gpu_start = precompile.start
precompile.start = lambda checks, platform, run_dir, quiet, **kw: gpu_start(
    checks, dataclasses.replace(platform, device="cuda"), run_dir, quiet, device="cpu", **kw)
code, _ = verify(RunOptions(suite=sys.argv[1], gpus=0, cpu_ranks=2, out_root=Path(sys.argv[2]), render=False))
sys.exit(code)
'''


def compiled_run(tmp_path, **env):
    """The toy family's two checks (one kernel between them) through verify; the kernel
    events and the ranks' pids."""
    import os

    from tests.conftest import rank_pids, run_cli

    (tmp_path / "toy_jit.py").write_text(TOY_KERNELS)
    (tmp_path / "cache").mkdir()
    suite = tmp_path / "jit.toml"
    suite.write_text('[suite]\nname = "jit"\nplugins = ["toy_jit"]\n\n' + "\n".join(
        case(name, "toy_jit_sums", "batch-invariance", "holds", batch_sizes=sizes)
        for name, sizes in (("small", [1, 3]), ("large", [2, 8]))))
    proc = run_cli(str(suite), str(tmp_path / "out"), code=COMPILED_RUN,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
                        "TOY_KERNEL_CACHE": str(tmp_path / "cache"), "DG_JIT_CACHE_DIR": str(tmp_path / "dg"), **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "cache" / "events.jsonl").read_text().splitlines()]
    return events, set(rank_pids((tmp_path / "out" / "latest").resolve()))


@pytest.mark.slow
def test_a_family_that_declares_its_kernels_has_them_compiled_once_before_its_checks(tmp_path):
    events, ranks = compiled_run(tmp_path)
    compiled = [e for e in events if e["compiled"]]
    assert len(compiled) == 1 and compiled[0]["pid"] not in ranks  # once, by a compile worker, for both checks
    in_ranks = [e for e in events if e["pid"] in ranks]
    assert in_ranks and all(e["time"] > compiled[0]["time"] for e in in_ranks)  # the checks found it built


@pytest.mark.slow
def test_without_the_compile_the_ranks_compile_the_kernel_themselves(tmp_path):
    """Positive control for the test above: the same run with EP_HARNESS_PRECOMPILE=0."""
    events, ranks = compiled_run(tmp_path, EP_HARNESS_PRECOMPILE="0")
    compiled = [e for e in events if e["compiled"]]
    assert compiled and all(e["pid"] in ranks for e in compiled)


# -- the launch and run layers reach families and subjects through their registries only ----

LAUNCH_AND_RUN = ("launch", "run")  # the two wings, every module in them
FAMILY_OR_SUBJECT = ("ep_harness.families.", "ep_harness.subjects")


def is_harness_module(name: str) -> bool:
    where = REPO / "harness" / Path(*name.split(".")[1:])
    return name.startswith("ep_harness.") and (where.with_suffix(".py").exists() or (where / "__init__.py").exists())


def imported_by_name(path) -> set[str]:
    """Every module a file imports, `from ep_harness import x` read as ep_harness.x where x is
    a module (a name a package defines, as ep_harness.families.FAMILIES, is not)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(m for m in (f"{node.module}.{a.name}" for a in node.names) if is_harness_module(m))
    return found


def family_or_subject_imports(paths) -> dict[str, list[str]]:
    offending = {p.name: sorted(m for m in imported_by_name(p) if m.startswith(FAMILY_OR_SUBJECT)) for p in paths}
    return {name: found for name, found in offending.items() if found}


def test_no_launch_or_run_module_imports_a_family_or_a_subject():
    paths = [p for wing in LAUNCH_AND_RUN for p in sorted((REPO / "harness" / wing).rglob("*.py"))]
    assert {p.stem for p in paths} >= {"launcher", "worker", "verify", "precompile", "protocol"}
    assert family_or_subject_imports(paths) == {}


@pytest.mark.parametrize("line", ["from ep_harness.families.gemm import runs_for", "import ep_harness.subjects",
                                  "from ep_harness import subjects", "from ep_harness.families.moe_scenario import placements"])
def test_the_layer_check_sees_a_family_or_subject_import(tmp_path, line):
    planted = tmp_path / "worker.py"
    planted.write_text("from ep_harness import families, subject\nfrom ep_harness.families import FAMILIES\n")
    assert family_or_subject_imports([planted]) == {}  # the registries are the way in
    planted.write_text(planted.read_text() + line + "\n")
    assert list(family_or_subject_imports([planted])) == ["worker.py"]


# --- the optional slots: a search space, a selftest wrapper, what the selftest holds it to ---

@pytest.fixture
def toy(tmp_path, monkeypatch, scratch_registry):
    """The toy family module imported as a plugin is, into scratch family and subject registries."""
    import importlib
    import sys

    from ep_harness import families

    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))
    (tmp_path / "toy_family.py").write_text(textwrap.dedent(TOY_FAMILY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "toy_family", raising=False)
    module = importlib.import_module("toy_family")
    yield module
    sys.modules.pop("toy_family", None)


def scratch_subject(name):
    from ep_harness import subject as registry

    return registry.get(name)


def test_explore_draws_from_the_search_space_the_family_module_declares(toy):
    from dataclasses import replace

    from hypothesis import find

    from ep_harness import families

    from ep_harness.run import explore
    from ep_harness.errors import HarnessError

    example = find(explore.strategy("toy"), lambda e: len(e["params"]["batch_sizes"]) == 3)
    assert example["property"] == "batch-invariance"  # the family's only searchable property
    assert set(example["params"]) == {"cols", "seed", "batch_sizes"}
    check = explore.as_check(scratch_subject("toy_in_order"), example, 2, "gloo")
    assert type(check.params) is toy.ToyParams and check.params.batch_sizes == example["params"]["batch_sizes"]
    # Control: the same family without the slot cannot be explored, and explore says which can.
    families.register(replace(toy.FAMILY, search_space=None))
    with pytest.raises(HarnessError, match=r"explore has no search space for toy subjects; families: "
                                           r"collective, gemm, dispatch$"):
        explore.strategy("toy")


def test_selftest_plants_its_defects_through_the_wrapper_the_family_module_declares(toy, tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch

    from ep_harness.bits import ulp_distance
    from ep_harness.selftest.injections import CLASSES
    from ep_harness.selftest.wrap import wrapped

    monkeypatch.setenv("EP_HARNESS_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    subject = scratch_subject("toy_in_order")
    ulp = CLASSES["ulp"].placements()[0]  # each row of sums has one element: every spot is that one
    w = wrapped(subject, ulp.to_json(), SimpleNamespace(id="toy-check", property="batch-invariance"))
    assert isinstance(w, toy.Injected)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))
    first, second, true = w.row_sums(x), w.row_sums(x), subject.row_sums(x)
    assert ulp_distance(first, true).tolist() == [1] * 5  # call 0: every row's sum 1 ULP off
    assert torch.equal(second, true)  # `ulp` plants on call 0 only
    write = CLASSES["out-of-slice"]
    w = wrapped(subject, write.to_json(), SimpleNamespace(id="toy-check", property="batch-invariance"))
    before = x.clone()
    assert torch.equal(w.row_sums(x), true) and (ulp_distance(x, before) == 1).all()  # the write lands in x


def test_the_selftest_holds_the_family_to_the_must_catch_its_module_declares(toy):
    from dataclasses import replace

    from ep_harness import families
    from ep_harness.selftest import expectations

    record = {"property": "batch-invariance", "family": "toy", "status": "ok", "expect": "holds",
              "comparison": "bitwise"}
    assert expectations.family_must_catch()["toy"] == frozenset({"out-of-slice"})
    assert expectations.required(record, "out-of-slice")[0] is True  # the family's, not batch-invariance's
    assert expectations.required(record, "ulp")[0] is True  # the property's own row
    # Controls: without the must-catch only the property's row counts; without the wrapper nothing applies.
    families.register(replace(toy.FAMILY, must_catch=frozenset()))
    assert expectations.required(record, "out-of-slice")[0] is False
    families.register(replace(toy.FAMILY, selftest_wrapper=None))
    assert expectations.required(record, "ulp") == (None, "no injection wrapper for the toy family "
                                                         "(harness/selftest/wrap.py)")


def suite(tmp_path, cases):
    (tmp_path / "toy_family.py").write_text(textwrap.dedent(TOY_FAMILY))
    path = tmp_path / "toy.toml"
    path.write_text('[suite]\nname = "toy"\nplugins = ["toy_family"]\n\n' + "\n".join(cases))
    return path


@pytest.mark.slow
def test_a_family_with_a_wrapper_and_a_must_catch_is_selftested_end_to_end(tmp_path):
    path = suite(tmp_path, [case("in-order", "toy_in_order", "batch-invariance", "holds"),
                            case("control", "toy_parity_order", "batch-invariance", "violated")])
    proc = run_cli("selftest", "--suite", str(path), "--injections", "ulp,out-of-slice", "--no-report",
                   "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "latest" / "selftest.json").read_text())
    assert result["family_must_catch"]["toy"] == ["out-of-slice"] and result["blind"] == []
    rows = {r["check"]: r["cells"] for r in result["checks"]}
    held = rows["in-order/batch-invariance"]
    assert (held["ulp"]["state"], held["out-of-slice"]["state"]) == ("caught", "caught")
    assert "subject modified its input x" in held["out-of-slice"]["reason"]  # the family's input check caught it
    assert {c["state"] for c in rows["control/batch-invariance"].values()} == {"n/a"}  # a control: not applicable


@pytest.mark.slow
def test_a_family_with_a_search_space_is_explored_end_to_end(tmp_path):
    suite(tmp_path, [])
    store = tmp_path / "counterexamples.jsonl"
    explore = ("explore", "--plugin", "toy_family", "--world-size", "2", "--budget", "60", "--store", str(store))
    proc = run_cli(*explore, "toy_parity_order", "--max-examples", "50", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a violation found, and shrunk
    assert 'subject = "toy_parity_order"' in proc.stdout and 'properties = ["batch-invariance"]' in proc.stdout
    assert [json.loads(line)["subject"] for line in store.read_text().splitlines()] == ["toy_parity_order"]
    proc = run_cli(*explore, "toy_in_order", "--max-examples", "10", cwd=tmp_path)  # control: nothing to find
    assert proc.returncode == 0 and "# no violation found" in proc.stdout, proc.stdout + proc.stderr
