"""Rewrite imports of the top-level `harness`, `reference` and `reports` packages to the one
installed namespace, `ep_harness` (issue 25): `harness.x` -> `ep_harness.x`, `reference.x` ->
`ep_harness.reference.x`, `reports.x` -> `ep_harness.reports.x`, in import statements, dotted
strings (mock targets, `-m harness.worker`, "harness.suites") and commands (`-m harness`). The
folders keep their names; only import names change (docs/namespace.md). It also regenerates
pyproject.toml's package list from the folders (and its entry points).

Idempotent: a second run changes nothing. Run it after merging a branch that still uses the
old names; `--check` changes nothing and exits 1 listing the files that still need it (a test
runs that, so a stale import fails the suite):

    python3 ci/rename_namespace.py          # rewrite in place
    python3 ci/rename_namespace.py --check  # exit 1 if anything is left to rewrite

Only dotted names that are real modules of the folders are rewritten (`reference.moe`, never
a variable's `reference.shape`); bare words (`"reference"`, a property name) are left alone.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "ep_harness"
# old top-level name -> its name inside the namespace
PACKAGES = {"harness": NAMESPACE, "reference": f"{NAMESPACE}.reference", "reports": f"{NAMESPACE}.reports"}
SCOPE = ("harness/", "reference/", "reports/", "tests/", "ci/", "docs/", "cases/", "README.md", "BENCHMARKS.md",
         "Makefile")
SUFFIXES = {".py", ".sh", ".md", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".ini", ".j2", ""}
# Committed measurements keep the commands they were made with; their scripts are code and follow.
CODE_ONLY = ("results/",)
SELF = Path(__file__).resolve()
# A file that holds old names on purpose (this script's own test) says so in a comment.
LEAVE_MARKER = "rename_namespace: " + "leave this file"
# Names `harness.` may be followed by that are attributes of the package, not modules.
PACKAGE_ATTRIBUTES = ("__version__", "__file__", "__path__", "__main__")
# Installed as ep_harness.suites (package-dir maps it to cases/): not a folder of harness/.
MAPPED = {"harness": ("suites",)}


def submodules(folder: Path) -> set[str]:
    """The names importable directly under a package folder: its modules and subpackages."""
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return names


def rules(repo: Path) -> list[tuple[re.Pattern, str]]:
    found = []
    for old, new in PACKAGES.items():
        names = submodules(repo / old) | set(MAPPED.get(old, ()))
        if old == "harness":
            names |= set(PACKAGE_ATTRIBUTES)
        alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
        # `old.<module>` not preceded by a name, a dot (already namespaced), a hyphen (ep-harness) or a
        # path, but maybe by an escape in a string (b"\0-m\0harness.agent\0", a /proc cmdline)
        found.append((re.compile(rf"(?:(?<![\w.\-/])|(?<=\\[0nt])){old}\.({alternatives})(?![\w\-])"),
                      rf"{new}.\1"))
        # statements: at a line's start, or in a string of code (`"import harness; ..."`)
        found.append((re.compile(rf"""(?m)(^\s*|["';]\s*)from {old} import\b"""), rf"\1from {new} import"))
        found.append((re.compile(rf"""(?m)(^\s*|["';]\s*)import {old}(?![\w.\-/])"""), rf"\1import {new}"))
    # `python -m harness ...` in commands, and ["-m", "harness"] in argument lists
    found.append((re.compile(r"(?<![\w\-])-m harness(?![\w.\-/])"), f"-m {NAMESPACE}"))
    found.append((re.compile(r"""(["'])-m\1(\s*,\s*)(["'])harness\3"""), rf"\1-m\1\2\3{NAMESPACE}\3"))
    found.append((re.compile(rf"\b([Aa]) (?={NAMESPACE}\.)"), r"\1n "))  # "a harness.x" -> "an ep_harness.x"
    return found


def files(repo: Path) -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=repo,
                             capture_output=True, text=True, check=True).stdout.split()
    chosen = []
    for name in tracked:
        path = repo / name
        if path.resolve() == SELF or not path.is_file():
            continue
        in_scope = name.startswith(SCOPE) or name in SCOPE
        code = name.startswith(CODE_ONLY) and path.suffix == ".py"
        if (in_scope and path.suffix in SUFFIXES) or code:
            chosen.append(path)
    return chosen


def package_list(repo: Path) -> str:
    """pyproject's `packages`: every folder with an __init__.py under the three packages, by
    its installed name, and the suites (cases/ as package data)."""
    names = []
    for old, new in PACKAGES.items():
        for init in sorted((repo / old).rglob("__init__.py")):
            rel = init.parent.relative_to(repo / old).parts
            if "__pycache__" not in rel:
                names.append(".".join((new, *rel)))
    names.append(f"{NAMESPACE}.suites")
    body, line = [], "    "
    for quoted in (f'"{n}",' for n in sorted(names)):
        if len(line) + len(quoted) + 1 > 110:
            body.append(line.rstrip())
            line = "    "
        line += quoted + " "
    body.append(line.rstrip())
    return "packages = [\n" + "\n".join(body) + "\n]"


def rewrite_pyproject(text: str, repo: Path) -> str:
    return re.sub(r"(?ms)^packages = \[\n.*?^\]", lambda _: package_list(repo), text, count=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file needs rewriting")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to rewrite (default: this one)")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    compiled = rules(repo)
    stale = []
    for path in [*files(repo), repo / "pyproject.toml"]:
        text = path.read_text()
        if LEAVE_MARKER in text:
            continue
        new = text
        for pattern, replacement in compiled:  # in pyproject.toml: the entry points
            new = pattern.sub(replacement, new)
        if path == repo / "pyproject.toml":
            new = rewrite_pyproject(new, repo)
        if new != text:
            stale.append(path.relative_to(repo))
            if not args.check:
                path.write_text(new)
    verb = "needs rewriting" if args.check else "rewritten"
    for name in stale:
        print(f"{verb}: {name}")
    if args.check and stale:
        print(f"{len(stale)} file(s) still use the old import names; run: python3 ci/rename_namespace.py",
              file=sys.stderr)
        return 1
    print(f"{len(stale)} file(s) {verb}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
