"""The record's schema (harness/records.py) sits on the ground floor: it imports the standard
library, torch and ground-floor harness modules only (those that import no harness module),
so whoever reads or writes records does not pull in the environment, the subject registry or
the launcher. Every import counts, those inside functions too."""
import ast
import sys
from pathlib import Path

HARNESS = Path(__file__).resolve().parent.parent / "harness"
ALLOWED_OUTSIDE = {"torch"}  # besides the standard library


def imports_of(source: str) -> set[str]:
    """Every module `source` imports, at any depth: `from ep_harness import x` counts as
    ep_harness.x (x may be a module), relative imports are not used in harness/."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "ep_harness":
                found.update(f"ep_harness.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def harness_imports(source: str) -> set[str]:
    return {m for m in imports_of(source) if m == "ep_harness" or m.startswith("ep_harness.")}


def module_name(path: Path) -> str:
    parts = path.relative_to(HARNESS).with_suffix("").parts
    return ".".join(["ep_harness", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def ground_floor() -> set[str]:
    """The harness modules (in any sub-package) that import no harness module at all."""
    return {module_name(p) for p in HARNESS.rglob("*.py") if not harness_imports(p.read_text())}


def floor_problems(source: str) -> list[str]:
    """What `source` imports that is neither the standard library, torch nor the ground floor."""
    floor = ground_floor()
    problems = []
    for module in sorted(imports_of(source)):
        top = module.partition(".")[0]
        if module in floor or top in ALLOWED_OUTSIDE or top in sys.stdlib_module_names or top == "__future__":
            continue
        problems.append(module)
    return problems


def test_the_ground_floor_holds_errors_and_not_the_environment():
    floor = ground_floor()
    assert {"ep_harness.errors", "ep_harness.bits"} <= floor
    # records imports errors; version asks the environment for the git commit
    assert not {"ep_harness.environment", "ep_harness.subject", "ep_harness.version", "ep_harness.records"} & floor


def test_records_imports_only_the_standard_library_torch_and_the_ground_floor():
    assert floor_problems((HARNESS / "records.py").read_text()) == []


def test_the_floor_check_sees_an_import_inside_a_function():
    # what base_record used to do: the environment, the registry and the version, imported late
    planted = ("import json\nfrom ep_harness.errors import HarnessError\n\n"
               "def base_record(check):\n    from ep_harness.environment import redacted\n"
               "    from ep_harness import subject\n    import pandas\n")
    assert floor_problems(planted) == ["ep_harness.environment", "ep_harness.subject", "pandas"]
