"""Typed parameters to the end: families, scenarios and subjects read the family's parameter
dataclass by attribute, so a renamed or mistyped field fails when the suite is planned (or
when this test reads the source), never on one rank in the middle of a run."""
import ast
import os
import sys
import textwrap
from dataclasses import fields, replace
from pathlib import Path

import pytest

from ep_harness import params as params_mod
from ep_harness import subject as registry
from ep_harness.cases import load_suite
from ep_harness.contracts import DispatchConfig
from ep_harness.errors import HarnessError
from ep_harness.families import FAMILIES
from ep_harness.families.collective import CollectiveParams
from ep_harness.families.moe_scenario import TokenParams
from ep_harness.run.plan import expand
from ep_harness.subject import Platform
from tests.conftest import REPO, run_cli

CPU4 = Platform(backend="gloo", device="cpu", ranks=4)
PARAM_NAMES = {"p", "params", "cfg"}  # what families, scenarios and subjects call their parameters
# Where parameters are read: every family, every subject, the families' input builders.
READERS = sorted([*(REPO / "harness" / "families").glob("*.py"), *(REPO / "harness" / "subjects").rglob("*.py")])
PARAM_CLASSES = {cls.__name__: cls for cls in (*(f.params for f in FAMILIES.values()), TokenParams,
                                               params_mod.CommonParams, DispatchConfig)}


def _is_param(node: ast.AST, names: set[str]) -> bool:
    """`p`, `params`, `cfg` (parameters of the enclosing function), or `self.p`."""
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr == "p" and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def _functions(tree: ast.AST):
    """Every function and lambda with the parameter names it takes from PARAM_NAMES (and
    their annotations), minus those it rebinds (`p = torch.softmax(...)` is no parameter)."""
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        args = {a.arg: a.annotation for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
        rebound = {t.id for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.For, ast.comprehension))
                   for t in ast.walk(n.target if not isinstance(n, ast.Assign) else ast.Tuple(n.targets))
                   if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
        names = {a for a in args if a in PARAM_NAMES} - rebound
        yield fn, names, {a: args[a] for a in names}


def string_key_reads(source: str) -> list[str]:
    """`p["hidden"]`, `params.get("x", default)`, `self.p["layers"]`: parameters read by key."""
    found = []
    for fn, names, _ in _functions(ast.parse(source)):
        for node in ast.walk(fn):
            if isinstance(node, ast.Subscript) and _is_param(node.value, names) and \
                    isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and _is_param(node.func.value, names):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(set(found))


def _annotated(hint) -> list:
    """The parameter classes an annotation names (`GemmParams`, `DispatchParams | MoeParams`);
    [] where it names something else or nothing."""
    if hint is None or not all(isinstance(n, (ast.Name, ast.BinOp, ast.BitOr, ast.Load)) for n in ast.walk(hint)):
        return []
    names = [n.id for n in ast.walk(hint) if isinstance(n, ast.Name)]
    return [PARAM_CLASSES[n] for n in names] if all(n in PARAM_CLASSES for n in names) else []


def unknown_attribute_reads(source: str) -> list[str]:
    """`p.hiden`: an attribute that the parameter's annotated class (or, unannotated, every
    parameter class) does not have."""
    every = set().union(*(dir(cls) for cls in PARAM_CLASSES.values()),
                        *({f.name for f in fields(cls)} for cls in PARAM_CLASSES.values()))
    found = []
    for fn, names, annotations in _functions(ast.parse(source)):
        for node in ast.walk(fn):
            read = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
            if not (read and _is_param(node.value, names)):
                continue
            hint = annotations.get(node.value.id) if isinstance(node.value, ast.Name) else None
            classes = _annotated(hint)
            known = set().union(*({f.name for f in fields(c)} | set(dir(c)) for c in classes)) if classes else every
            if node.attr not in known:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(set(found))


def test_the_scans_find_what_they_look_for():
    """Positive controls: each form the scans reject is found, and the typed forms are not."""
    keyed = textwrap.dedent('''
        def f(p, params, cfg):
            return p["hidden"], params.get("shards", "even"), cfg.get("ue8m0", True)
        class S:
            def g(self):
                return self.p["layers"]
        def h(x):
            p = torch.softmax(x, 0)  # a local named p is no parameter
            return p.unsqueeze(0), x["hidden"]
    ''')
    assert [r.split(": ", 1)[1] for r in string_key_reads(keyed)] == [
        "cfg.get('ue8m0', True)", "p['hidden']", "params.get('shards', 'even')", "self.p['layers']"]
    typed = "def f(p: CollectiveParams, params):\n    return p.hidden, params.world_size, p.hiden, params.shardz\n"
    assert string_key_reads(typed) == []
    assert [r.split(": ", 1)[1] for r in unknown_attribute_reads(typed)] == ["p.hiden", "params.shardz"]
    # annotated: held to its own class (GemmParams has no hidden, CollectiveParams has)
    assert unknown_attribute_reads("def f(p: GemmParams):\n    return p.hidden\n") == ["line 2: p.hidden"]
    union = "def f(p: DispatchParams | MoeParams):\n    return p.prefill_tokens, p.probe_experts, p.prefil_tokens\n"
    assert unknown_attribute_reads(union) == ["line 2: p.prefil_tokens"]


@pytest.mark.parametrize("path", READERS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_family_scenario_or_subject_reads_a_parameter_by_string_key(path):
    assert string_key_reads(path.read_text()) == []


@pytest.mark.parametrize("path", READERS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_parameter_attribute_read_is_a_field(path):
    """A field renamed in harness/params.py but not where it is read fails here, on the CPU,
    not on rank 2 of a GPU run."""
    assert unknown_attribute_reads(path.read_text()) == []


def test_the_scans_cover_the_families_and_subjects():
    names = {str(p.relative_to(REPO)) for p in READERS}
    assert {"harness/families/collective.py", "harness/families/dispatch.py", "harness/families/moe_scenario.py",
            "harness/subjects/dispatch/deepep.py", "harness/subjects/moe/composed.py"} <= names


TYPO_PLUGIN = '''
from ep_harness.subject import register


@register
class ReadsAField:
    name, family, summary = "{name}", "collective", "reads params.{field} when planned"

    def unavailable(self, platform, params):
        return None if params.{field} > 0 else "never"

    def reduce_scatter(self, out, inp, sizes, group):
        raise AssertionError("planning alone must decide")
'''


def _suite(tmp_path: Path, field: str) -> Path:
    name = f"reads_{field}"
    (tmp_path / f"{name}_plugin.py").write_text(TYPO_PLUGIN.format(name=name, field=field))
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[suite]\nplugins = ["{name}_plugin"]\n[[case]]\nname = "c"\nsubject = "{name}"\n'
                    f'properties = ["rank-invariance"]\nexpect = "holds"\n'
                    f'[case.params]\ndtype = "bfloat16"\nworld_size = 2\n')
    return path


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("reads_hiden", "reads_hidden"):
        registry._REGISTRY.pop(name, None)
        sys.modules.pop(f"{name}_plugin", None)


def test_a_subject_reading_a_missing_field_fails_when_planned_naming_it(plugin_path):
    suite = load_suite(_suite(plugin_path, "hiden"))
    registry.load_all(suite.plugins)
    with pytest.raises(HarnessError) as err:
        expand(suite, CPU4)
    message = str(err.value)
    assert "\n" not in message
    assert "subject 'reads_hiden' reads CollectiveParams.hiden, which is not a field; did you mean 'hidden'?" in message
    # control: the same subject reading the real field plans, and runs nothing to decide it
    control = load_suite(_suite(plugin_path, "hidden"))
    registry.load_all(control.plugins)
    [check] = expand(control, CPU4)
    assert check.skip_reason is None and check.params.hidden == 2048


def test_the_cli_stops_with_one_line_naming_the_field_before_anything_is_written(tmp_path):
    suite = _suite(tmp_path, "hiden")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = run_cli("verify", "--suite", str(suite), "--out", str(tmp_path / "out"), cwd=REPO, env=env, timeout=300,
                   module=True)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "reads CollectiveParams.hiden, which is not a field; did you mean 'hidden'?" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_an_attribute_error_about_something_else_is_not_blamed_on_the_parameters():
    class Other:
        pass

    try:
        Other().hidden
    except AttributeError as exc:
        assert params_mod.unknown_field(exc, "subject 'x'") is None
    try:
        CollectiveParams(dtype="bfloat16").hiden
    except AttributeError as exc:
        assert "did you mean 'hidden'?" in params_mod.unknown_field(exc, "subject 'x'")


def _readme_subject_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Adding a subject", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_subject_example_reads_its_parameters_by_attribute(tmp_path, scratch_registry):
    """The documented plugin, as written, plans: equal shards run, uneven ones are skipped
    with its reason; the same example with a mistyped field stops the plan naming it."""
    source = _readme_subject_example()
    assert "params.shards" in source and string_key_reads(source) == [] and unknown_attribute_reads(source) == []
    exec(compile(source, "README.md", "exec"), {})
    subject = registry.get("my_reduce_scatter")
    even = CollectiveParams(dtype="bfloat16", world_size=2)
    assert subject.unavailable(CPU4, even) is None
    assert subject.unavailable(CPU4, replace(even, shards="uneven")) == "my_reduce_scatter takes equal shards only"
    scratch_registry.pop("my_reduce_scatter")
    exec(compile(source.replace("params.shards", "params.shard"), "README.md", "exec"), {})
    path = tmp_path / "suite.toml"
    path.write_text('[[case]]\nname = "c"\nsubject = "my_reduce_scatter"\nproperties = ["rank-invariance"]\n'
                    'expect = "holds"\n[case.params]\ndtype = "bfloat16"\nworld_size = 2\n')
    with pytest.raises(HarnessError, match=r"reads CollectiveParams\.shard, which is not a field; "
                                           r"did you mean 'shards'\?"):
        expand(load_suite(path), CPU4)
