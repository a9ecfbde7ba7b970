"""Case files (TOML): what to check, on which grid, with which expectation.

    [suite]
    name = "smoke"
    plugins = []                      # optional: modules that register extra subjects

    [[case]]
    name = "rs-native"                # unique within the suite
    subject = "reduce_scatter_native"
    properties = ["rank-invariance", "batch-invariance"]
    expect = "violated"               # or { gloo = "violated", nccl = "holds" }, or "model":
                                      # whatever an exact order model predicts for the inputs,
                                      # or "measure": a fact about this machine's library
                                      # (e.g. a CPU BLAS's batch-invariance), reported with its
                                      # count and never failing the run
    timeout_s = 60                    # optional, per check
    env = { NCCL_ALGO = "..." }       # optional launch environment overrides
    [case.grid]                       # lists; every combination is one check
    dtype = ["bfloat16", "float32"]
    world_size = [3, 4]
    [case.params]                     # fixed parameters passed to every check
    hidden = 2048
"""
from __future__ import annotations

import importlib.resources
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ep_harness.errors import HarnessError, did_you_mean

SUITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # it names the suite's baseline files: a plain file name

# model: an exact order model predicts it; measure: reported, never asserted (a third-party
# kernel's platform-dependent behaviour: ISA, library build, thread count)
EXPECTATIONS = ("holds", "violated", "model", "measure")
BACKENDS = ("gloo", "nccl")
CASE_KEYS = {"name", "subject", "properties", "expect", "timeout_s", "env", "grid", "params", "description"}
SUITE_KEYS = {"name", "description", "plugins"}
# The harness never turns these on: NVLink SHARP reductions are not deterministic between
# calls, and on shared hosts multicast can take the GPUs out of service.
FORCED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class Case:
    name: str
    subject: str
    properties: list[str]
    expect: dict[str, str]  # backend -> expectation
    grid: dict[str, list]
    params: dict
    env: dict[str, str]
    timeout_s: float
    description: str = ""


@dataclass
class Suite:
    path: Path
    name: str
    description: str
    plugins: list[str] = field(default_factory=list)
    cases: list[Case] = field(default_factory=list)


TIMEOUT_MAX_S = 86_400  # a day: a check that runs longer is hung


def timeout_problem(value) -> str | None:
    """Why `value` is not a usable per-check timeout, or None. inf and nan pass a `<= 0`
    test (every comparison with nan is false) and then break the launcher's arithmetic; a
    huge finite one overflows the workers' collective timeout (a datetime.timedelta)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"timeout_s = {value!r} is not a number"
    if not math.isfinite(value) or value <= 0:
        return f"timeout_s = {value!r} is not a finite positive number of seconds"
    if value > TIMEOUT_MAX_S:
        return f"timeout_s = {value!r} is more than a day ({TIMEOUT_MAX_S} s), the most a check may take"
    return None


def _fail(path: Path, where: str, problem: str, fix: str):
    raise HarnessError(f"{path}: {where}: {problem}; {fix}")


def _expectation(path, where, value) -> dict[str, str]:
    if isinstance(value, str):
        value = {b: value for b in BACKENDS}
    if not isinstance(value, dict) or not value:
        _fail(path, where, f"expect = {value!r} is not a string or a table",
              'write expect = "holds" or expect = { gloo = "violated", nccl = "holds" }')
    for backend, exp in value.items():
        if backend not in BACKENDS:
            _fail(path, where, f"expect has unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
        if exp not in EXPECTATIONS:
            _fail(path, where, f"expect {backend} = {exp!r}", f"use one of {', '.join(EXPECTATIONS)}")
    missing = [b for b in BACKENDS if b not in value]
    if missing:  # never assumed: "holds" on a backend the author did not name could fail or pass unasked
        _fail(path, where, f"expect names no expectation for {', '.join(missing)}",
              f"name every backend ({', '.join(f'{b} = ...' for b in BACKENDS)}) or write one string for all")
    return dict(value)


def _env(path, where, value) -> dict[str, str]:
    """A case's launch environment: a table of variable names to strings, numbers or booleans."""
    if not isinstance(value, dict):
        _fail(path, where, f"env = {value!r} is not a table", 'write env = { NCCL_ALGO = "Ring" }')
    for key, v in value.items():
        if not key or "=" in key or "\0" in key:
            _fail(path, where, f"env has the variable name {key!r}", "name each variable without '=' (KEY = value)")
        if isinstance(v, (dict, list)):
            _fail(path, where, f"env {key} = {v!r} is not a string or a number", f'write {key} = "..."')
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}


def _control_characters(path: Path, where: str, value, field: str) -> None:
    """Refuse control characters (a newline in a case name could forge an `# OK` line or a
    CI workflow command in a log) in every string of a case, however deeply nested."""
    if isinstance(value, str):
        bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
        if bad is not None:
            _fail(path, where, f"{field} contains the control character {bad!r}", "write it on one line, in plain text")
    elif isinstance(value, dict):
        for k, v in value.items():
            _control_characters(path, where, k, f"{field} key")
            _control_characters(path, where, v, f"{field}.{k}")
    elif isinstance(value, list):
        for v in value:
            _control_characters(path, where, v, field)


def _case(path: Path, index: int, raw) -> Case:
    where = f"case #{index + 1}"
    if not isinstance(raw, dict):
        _fail(path, where, "is not a table", "write each case as a [[case]] table")
    _control_characters(path, where, {k: v for k, v in raw.items() if k != "description"}, "the case")
    name = raw.get("name")
    if isinstance(name, str) and name:
        where = f"case {name!r}"
    else:
        _fail(path, where, "has no name", 'add name = "..."')
    unknown = sorted(set(raw) - CASE_KEYS)
    if unknown:
        _fail(path, where, f"unknown key(s) {', '.join(unknown)}", f"allowed keys: {', '.join(sorted(CASE_KEYS))}")
    for key in ("subject", "properties", "expect"):
        if key not in raw:
            _fail(path, where, f"missing {key!r}", f"add {key} = ...")
    if not isinstance(raw["subject"], str):
        _fail(path, where, "subject is not a string", 'write subject = "name"')
    props = raw["properties"]
    if isinstance(props, str):
        props = [props]
    if not isinstance(props, list) or not props or not all(isinstance(p, str) for p in props):
        _fail(path, where, "properties must be a non-empty list of names", 'write properties = ["rank-invariance"]')
    grid = raw.get("grid", {})
    if not isinstance(grid, dict):
        _fail(path, where, "grid is not a table", "write [case.grid] with list values")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            _fail(path, where, f"grid.{key} = {values!r} is not a non-empty list", f"write {key} = [{values!r}]")
    params = raw.get("params", {})
    if not isinstance(params, dict):
        _fail(path, where, "params is not a table", "write [case.params]")
    overlap = sorted(set(params) & set(grid))
    if overlap:
        _fail(path, where, f"{', '.join(overlap)} is both in grid and params", "keep it in one of them")
    env = _env(path, where, raw.get("env", {}))
    for key, forced in FORCED_ENV.items():
        if key in env and env[key] != forced:
            _fail(path, where, f"env {key}={env[key]} is refused", f"the harness keeps {key}={forced}")
    timeout = raw.get("timeout_s", 120)
    problem = timeout_problem(timeout)
    if problem:
        _fail(path, where, problem, "use a finite positive number of seconds up to 86400, e.g. timeout_s = 120")
    return Case(
        name=name, subject=raw["subject"], properties=props,
        expect=_expectation(path, where, raw["expect"]), grid=grid, params=params, env=env,
        timeout_s=float(timeout), description=str(raw.get("description", "")),
    )


def load_suite(path) -> Suite:
    """Load and check a suite file: a path, or a built-in suite's importlib.resources Traversable."""
    path = Path(path) if isinstance(path, str) else path
    if path.is_dir():
        raise HarnessError(f"{path} is a directory; give a case file (a .toml) or a suite's name")
    if not path.is_file():
        known = sorted(known_suites())
        raise HarnessError(f"case file {path} not found; known suites: {', '.join(known) or 'none'}")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # TOML is UTF-8 (a leading BOM is allowed)
    except UnicodeDecodeError as exc:
        raise HarnessError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                           f"save the case file as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise HarnessError(f"{path}: malformed TOML ({exc}); fix the syntax at that line") from None
    unknown = sorted(set(raw) - {"suite", "case"})
    if unknown:
        _fail(path, "top level", f"unknown key(s) {', '.join(unknown)}", "only [suite] and [[case]] are allowed")
    meta = raw.get("suite", {})
    if not isinstance(meta, dict):
        _fail(path, "top level", "suite is not a table", "write a [suite] table")
    bad = sorted(set(meta) - SUITE_KEYS)
    if bad:
        _fail(path, "[suite]", f"unknown key(s) {', '.join(bad)}", f"allowed: {', '.join(sorted(SUITE_KEYS))}")
    cases_raw = raw.get("case", [])
    if not isinstance(cases_raw, list) or not cases_raw:
        _fail(path, "top level", "no [[case]] tables", "add at least one [[case]]")
    cases = [_case(path, i, c) for i, c in enumerate(cases_raw)]
    seen = set()
    for c in cases:
        if c.name in seen:
            _fail(path, f"case {c.name!r}", "the name is used twice", "give every case its own name")
        seen.add(c.name)
    name = str(meta.get("name", path.stem))
    if not SUITE_NAME.fullmatch(name):
        _fail(path, "[suite]", f"name {name!r} is not a plain file name",
              "use letters, digits, '.', '_' and '-' (e.g. name = \"team-nightly\")")
    plugins = meta.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) and p for p in plugins):
        _fail(path, "[suite]", f"plugins = {plugins!r} is not a list of module names",
              f"write plugins = [{plugins!r}]" if isinstance(plugins, str) else 'write plugins = ["my_engine.ep_subjects"]')
    return Suite(path=path, name=name, description=str(meta.get("description", "")),
                 plugins=list(plugins), cases=cases)


BUILT_IN = "ep_harness.suites"  # the repository's cases/ folder, installed as this package's data


def built_in_dir():
    """The built-in suites' folder: package data found through importlib.resources (a wheel in
    any install layout: venv, --user, --target), else the checkout's cases/ (a clone, or an
    editable install of one)."""
    try:
        found = importlib.resources.files(BUILT_IN)
    except ModuleNotFoundError:
        found = None
    if found is not None and found.is_dir():
        return found
    checkout = Path(__file__).resolve().parent.parent / "cases"
    return checkout if checkout.is_dir() else None


def known_suites() -> dict[str, Path]:
    """The built-in suites by name. The working directory's cases/ is not searched: a suite of
    one's own is named by its path (`--suite ./cases/mine.toml`)."""
    folder = built_in_dir()
    if folder is None:
        return {}
    return {p.name[:-len(".toml")]: p for p in sorted(folder.iterdir(), key=lambda p: p.name)
            if p.name.endswith(".toml") and p.is_file()}


def suite_argument(name: str, path) -> str:
    """What a rerun command passes as --suite: the built-in suite's name (it resolves in any
    install), else the path."""
    return name if "/" not in name and known_suites().get(name) == path else str(path)


def resolve_suite_path(name: str) -> Path:
    """A built-in suite by name (`smoke`); anything with a `.toml` suffix or a path separator,
    or naming an existing file, is a path and used as given."""
    p = Path(name)
    if p.suffix == ".toml" or "/" in name or os.sep in name:
        return p
    known = known_suites()
    if name in known:
        return known[name]
    if p.is_file():
        return p
    raise HarnessError(f"unknown suite {name!r}{did_you_mean(name, known)}; built-in suites: "
                       f"{', '.join(known) or 'none'} (or give the path of a TOML file)")
