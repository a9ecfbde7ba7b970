"""Expand case grids into checks, and drop what this machine cannot run (with the reason)."""
from __future__ import annotations

import fnmatch
import itertools
import math
import re
from collections import Counter

from dataclasses import replace

from ep_harness import families, params, properties
from ep_harness import subject as registry
from ep_harness.cases import Suite, suite_argument, timeout_problem
from ep_harness.check import Check, typed_params
from ep_harness.errors import HarnessError, did_you_mean
from ep_harness.params import CommonParams
from ep_harness.subject import Platform
from ep_harness.threads import pinned as pinned_threads


def check_id(case: str, prop: str, point: dict) -> str:
    parts = [case, prop]
    for key in sorted(point):
        parts.append(f"{key}={point[key]}")
    return "/".join(parts)


def skip_reason(platform: Platform, subject, prop: str, params: CommonParams) -> str | None:
    world_size = params.world_size
    if world_size > platform.ranks:
        where = (f"--gpus {platform.ranks}" if platform.device == "cuda"
                 else f"the CPU default of {platform.ranks} gloo ranks")
        return f"needs {world_size} ranks; this run has {platform.ranks} ({where})"
    needs_gpu = "CUDA graphs need a GPU" if params.mode == "graph" else properties.get(prop).gpu
    if needs_gpu and platform.device != "cuda":
        return needs_gpu
    if params.gpu_only and platform.device != "cuda":
        return "sized for GPUs (gpu_only = true in the case file)"
    return subject.unavailable(platform, params)


def planned(platform: Platform, subject, prop: str, raw: dict, where: str, grid_keys=frozenset(),
            threads: int | None = None, **fields) -> Check:
    """One check for this platform: its parameters validated and typed (the backend set), its
    topology, its thread count pinned in its launch environment (`threads`, else the case's or
    record's, else the default: harness/threads.py), and why this machine skips it, if it
    does. `fields`: id, suite, case, expect, timeout_s, env."""
    problem = timeout_problem(fields.get("timeout_s"))
    if problem:  # a case file is checked when loaded; a record (--from-record) only here
        raise HarnessError(f"{where}: {problem}; use a finite positive number of seconds up to 86400")
    fields["env"] = pinned_threads(dict(fields.get("env") or {}), threads, where)
    typed = replace(typed_params(subject.family, raw, subject, where, grid_keys), backend=platform.backend)
    try:
        skip = skip_reason(platform, subject, prop, typed)
    except AttributeError as exc:  # a subject reading a field its family's parameters lack
        problem = params.unknown_field(exc, f"subject {subject.name!r}")
        if problem is None:
            raise
        raise HarnessError(f"{where}: {problem}") from None
    return Check(subject=subject.name, family=subject.family, property=prop, params=typed,
                 topology=platform.topology.describe(), nccl=platform.nccl, skip_reason=skip, **fields)


def literal(check_id: str) -> str:
    """A --check pattern that matches exactly this id (glob brackets, * and ? escaped)."""
    return re.sub(r"([\[\]*?])", r"[\1]", check_id)


def selected(check_id: str, selection: list[str] | None) -> bool:
    """Whether --check patterns pick this check; no patterns pick every check. A pattern is a
    glob over the whole id or over its leading parts, cut at a `/`: `rs-native` (a case name)
    and `rs-native/rank-invariance` pick all of that case's (and property's) checks, but not
    those of a case `rs-native-stable`."""
    return not selection or any(
        fnmatch.fnmatchcase(check_id, pat) or fnmatch.fnmatchcase(check_id, pat.rstrip("/") + "/*")
        for pat in selection)


MAX_CHECKS = 100_000  # a plan is held in memory, a record each: a grid this large is a typo in a list


def repeated(ids: list[str]) -> list[str]:
    """The ids that occur more than once, in one pass (a count per id, not a scan per id)."""
    return sorted(i for i, n in Counter(ids).items() if n > 1)


def grid_size(suite: Suite) -> int:
    """How many checks the suite's grids expand to, counted before any is built."""
    return sum(len(case.properties) * math.prod(len(v) for v in case.grid.values()) for case in suite.cases)


def expand(suite: Suite, platform: Platform, selection: list[str] | None = None, seed: int | None = None,
           threads: int | None = None) -> list[Check]:
    """Every check of the suite, in file order; skipped ones carry `skip_reason`. `seed`
    re-seeds every check (the records keep it); `threads` pins every check's thread count
    (None: the case's, else the harness's default)."""
    size = grid_size(suite)
    if size > MAX_CHECKS:
        largest = max(suite.cases, key=lambda c: len(c.properties) * math.prod(len(v) for v in c.grid.values()))
        raise HarnessError(f"{suite.path}: the grids expand to {size:,} checks, more than the limit of {MAX_CHECKS:,} "
                           f"(the largest: case {largest.name!r}); split the suite or shorten its grid lists")
    checks = []
    for case in suite.cases:
        subject = registry.get(case.subject)
        if "model" in case.expect.values() and subject.family == "collective" and \
                registry.hook(subject, "order_model") is None:  # optional, but then nothing can predict
            raise HarnessError(f"{suite.path}: case {case.name!r}: expect = \"model\" needs an order model and "
                               f"subject {subject.name!r} has none; write expect = \"holds\" or \"violated\", or "
                               f"give the subject order_model(backend)")
        known = families.get(subject.family).properties
        for prop in case.properties:
            if prop not in known:
                raise HarnessError(
                    f"{suite.path}: case {case.name!r}: property {prop!r} is not defined for "
                    f"{subject.family} subjects{did_you_mean(prop, known)}; known: {', '.join(known)}"
                )
        keys = list(case.grid)
        where = f"{suite.path}: case {case.name!r}"
        for prop in case.properties:
            for values in itertools.product(*(case.grid[k] for k in keys)):
                point = dict(zip(keys, values))
                raw = {**case.params, **point, **({"seed": seed} if seed is not None else {})}
                checks.append(planned(
                    platform, subject, prop, raw, where, frozenset(keys), id=check_id(case.name, prop, point),
                    suite=str(suite.path), case=case.name, expect=case.expect.get(platform.backend, "holds"),
                    timeout_s=case.timeout_s, env=case.env, threads=threads))
    ids = [c.id for c in checks]
    dupes = repeated(ids)
    if dupes:
        raise HarnessError(f"{suite.path}: check ids repeat ({dupes[0]}); give the cases distinct names")
    if selection:
        checks = [c for c in checks if selected(c.id, selection)]
        if not checks:
            names = [*(c.name for c in suite.cases), *ids]
            named = suite_argument(suite.name, suite.path)  # a built-in suite by its name, else its path
            raise HarnessError(f"--check {' '.join(selection)} matches no check of suite {named}"
                               f"{did_you_mean(selection[0], names)}; list them with "
                               f"`ep-harness list --suite {named}`")
    return checks


LAUNCHES = ("one", "per-world-size", "per-check")


def jobs(checks: list[Check], launches: str = "per-world-size") -> list[tuple[int, dict, list[Check]]]:
    """Group runnable checks into launches, plan order kept; each launch has the largest world
    size of its checks. "one": one launch per environment, smaller world sizes on subgroups of
    ranks 0..w-1 (gloo: the ring and fold orders depend only on the world size, so the bits are
    those of a launch of their own); "per-world-size": one per (world size, environment);
    "per-check": one per check (only to measure what grouping saves)."""
    if launches not in LAUNCHES:
        raise ValueError(f"launches {launches!r}; known: {', '.join(LAUNCHES)}")
    groups: dict[tuple, list[Check]] = {}
    for c in checks:
        if c.skip_reason is None:
            size = None if launches == "one" else c.world_size
            key = (size, tuple(sorted(c.env.items())), c.id if launches == "per-check" else None)
            groups.setdefault(key, []).append(c)
    return [(max(c.world_size for c in cs), dict(env), cs) for (_, env, _), cs in groups.items()]
