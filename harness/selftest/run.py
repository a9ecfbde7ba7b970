"""`ep-harness selftest --suite S`: does every check catch the defects its property should?

    plan the suite as verify does -> one baseline launch (every check as it is)
      -> one more launch: each check once per injection it must catch, under the id
         `ID@injection`, its subject wrapped on the ranks (harness/selftest/wrap.py, through
         the job's `inject` entry), injection by injection
      -> a matrix of checks x injections -> selftest.json, the terminal, exit code

Only checks that are `ok` in the baseline run with the injections they must catch. Two
launches in all on gloo (a launch of 4 gloo ranks costs about 5 s of start-up on 2 cores),
two per world size on NCCL. Exit 0 when no check is blind, 1 when one is (or a cell is
broken, or nothing was tested), 2 on bad input.
"""
from __future__ import annotations

import dataclasses
import shlex
import time
from pathlib import Path

from ep_harness import console, subject as registry
from ep_harness.cases import load_suite, resolve_suite_path
from ep_harness.check import Check
from ep_harness.environment import pinned_env, platform_for
from ep_harness.run_environment import launcher_environment
from ep_harness.errors import HarnessError
from ep_harness.launch.launcher import Head, run_job
from ep_harness.launch.nodes import Nodes
from ep_harness.run.plan import expand, jobs, literal
from ep_harness.launch.processes import Interrupted, interruptible
from ep_harness.records import read_jsonl, write_json, write_jsonl
from ep_harness.selftest import expectations, matrix
from ep_harness.selftest.injections import Injection, parse
from ep_harness.run.verify import claim_run_dir, finalize, point_latest, rerun_command


@dataclasses.dataclass(frozen=True)
class InjectedCheck(Check):
    """A check as sent to the ranks with the defect to plant (harness/run/worker.py reads `inject`)."""

    inject: dict | None = None

    @classmethod
    def of(cls, check: Check, injection: Injection) -> InjectedCheck:
        """`check` with the defect, under an id of its own (`ID@injection`): one launch
        carries the same check under several injections."""
        fields = {f.name: getattr(check, f.name) for f in dataclasses.fields(Check)}
        return cls(**{**fields, "id": f"{check.id}@{injection.label}"}, inject=injection.to_json())


def fired_checks(job_dir: Path) -> set[str]:
    """Checks (injected ids) in which the injection changed at least one bit on some rank
    (wrap.py's log)."""
    return {line["check"] for log in job_dir.glob("injections-rank*.jsonl") for line in read_jsonl(log)}


class Launcher:
    """Runs (check, injection or None) pairs in as few launches as verify would make for the
    checks alone (one on gloo, one per world size on NCCL), in one run directory."""

    def __init__(self, head: Head, run_dir: Path, platform, plugins: list[str], suite_path: Path,
                 gpus: int | None):
        self.head, self.run_dir, self.platform, self.plugins = head, run_dir, platform, plugins
        self.suite_path, self.gpus = suite_path, gpus

    def run(self, name: str, pairs: list[tuple[Check, Injection | None]]) -> tuple[dict, set]:
        """Records by (injection label or None, check id), and the (injection label, check id)
        pairs whose defect changed a bit."""
        sent = {(inj.label if inj else None, c.id): (InjectedCheck.of(c, inj) if inj else c, c, inj) for c, inj in pairs}
        by_id = {s.id: key for key, (s, _, _) in sent.items()}
        records, fired = {}, set()
        grouping = "one" if self.platform.backend == "gloo" else "per-world-size"
        for n, (world_size, env_overrides, group) in enumerate(jobs([s for s, _, _ in sent.values()], grouping)):
            job_dir = self.run_dir / "jobs" / f"{name}-{n:02d}-ws{world_size}"
            outcomes = run_job(self.head, job_dir, world_size, self.platform.backend, group,
                               pinned_env(self.platform, env_overrides), self.plugins, self.platform.emulation)
            for s in group:
                key = by_id[s.id]
                _, check, inj = sent[key]
                records[key] = finalize(check, outcomes.get(s.id), self.head.run_id, self.rerun(check, inj))
                if inj is not None:
                    records[key]["injection"] = inj.label
            fired |= {by_id[i] for i in fired_checks(job_dir) if i in by_id}
        return records, fired

    def rerun(self, check: Check, injection: Injection | None) -> str:
        if injection is None:
            return rerun_command(str(self.suite_path), check.id, self.gpus, self.plugins, self.platform.emulation)
        spot = f":at={injection.at}" if injection.at and injection.element is None else ""
        cmd = ["ep-harness", "selftest", "--suite", str(self.suite_path), "--check", literal(check.id),
               "--injections", injection.name + spot]
        cmd += ["--gpus", str(self.gpus)] if self.gpus is not None else []
        cmd += ["--emulate", self.platform.emulation] if self.platform.emulation else []
        for p in self.plugins:
            cmd += ["--plugin", p]
        return shlex.join(cmd)


def choose(checks: list[Check], limit: int | None) -> list[Check]:
    """The runnable checks, at most `limit` of those that expect to hold (controls cannot be
    tested, so they do not count against the limit and are left out when one is given)."""
    runnable = [c for c in checks if c.skip_reason is None]
    if limit is None:
        return runnable
    return [c for c in runnable if c.expect == "holds"][:limit]


def selftest(suite: str, injections: str | None = None, limit: int | None = None, gpus: int | None = None,
             cpu_ranks: int = 4, selection: list[str] | None = None, plugins: list[str] = (),
             out_root: Path = Path("reports/out"), command: list[str] = (), render: bool = True,
             every_cell: bool = False, emulate: str | None = None) -> tuple[int, Path]:
    """Plant each injection in every check that must catch it (every_cell: in every check
    it applies to, so that catches beyond the table show as `extra`); return the exit code
    (0: no check blind, 1: a check blind) and the run directory."""
    chosen_injections = parse(injections)
    if limit is not None and limit < 1:
        raise HarnessError(f"--limit {limit}: give at least 1 check")
    suite_path = resolve_suite_path(suite)
    loaded = load_suite(suite_path)
    plugins = list(dict.fromkeys([*loaded.plugins, *plugins]))
    registry.load_all(plugins)
    platform = platform_for(Nodes(), gpus, cpu_ranks, emulate)
    checks = choose(expand(loaded, platform, selection), limit)
    if not checks:
        raise HarnessError(f"no runnable check in {suite_path} on this machine; "
                           f"list them with `ep-harness list --suite {suite_path}`")
    run_id, run_dir = claim_run_dir(out_root)
    began = time.time()
    say = console.current().info  # progress, the matrix and the verdict: not under a quiet console
    say(f"# selftest of {suite_path}: {len(checks)} checks, injections {', '.join(i.name for i in chosen_injections)}"
        f" ({platform.topology.describe()})")
    head = Head(Nodes(), run_id)
    launcher = Launcher(head, run_dir, platform, plugins, suite_path, gpus)
    baseline, injected, fired, seconds = {}, {}, {}, {}
    interrupted = None
    with interruptible():
        try:
            t = time.time()
            records, _ = launcher.run("baseline", [(c, None) for c in checks])
            baseline = {check_id: r for (_, check_id), r in records.items()}
            seconds["baseline"] = round(time.time() - t, 2)
            ok = sum(r["status"] == "ok" for r in baseline.values())
            say(f"# baseline: {ok} of {len(checks)} checks ok without injection ({seconds['baseline']} s)")
            pairs = []
            for inj in chosen_injections:
                if inj.gpu_only and platform.device != "cuda":
                    say(f"# {inj.name}: not applicable on the CPU")
                    continue
                due = [c for c in checks if expectations.required(baseline[c.id], inj.name)[0] in
                       ((True, False) if every_cell else (True,))]
                say(f"# {inj.name}: {len(due)} check(s) must catch it" if due else f"# {inj.name}: no check must catch it")
                pairs += [(c, spot) for spot in inj.placements() for c in due]  # by placement, then in plan order
            if pairs:
                say(f"# launching {len(pairs)} injected check{'' if len(pairs) == 1 else 's'}")
                t = time.time()
                records, fired_pairs = launcher.run("injected", pairs)
                seconds["injected"] = round(time.time() - t, 2)
                for (label, check_id), r in records.items():
                    injected.setdefault(label, {})[check_id] = r
                for label, check_id in fired_pairs:
                    fired.setdefault(label, set()).add(check_id)
                for label, got in injected.items():
                    caught = sum(r["status"] in matrix.FAILED for r in got.values())
                    say(f"# {label}: {caught} of {len(got)} checks caught it")
                say(f"# injected launch(es): {seconds['injected']} s")
            else:
                say("# no injection applies to these checks")
        except Interrupted as exc:
            interrupted = exc
            say(f"# interrupted by {exc}: the matrix below has what finished")
        finally:
            head.close()

    rows = []
    for c in checks:
        if c.id not in baseline:
            continue
        cells = {}
        for inj in chosen_injections:
            if inj.gpu_only and platform.device != "cuda":
                cells[inj.name] = {"state": "n/a", "why": "needs a GPU (CUDA-graph capture)"}
                continue
            required, why = expectations.required(baseline[c.id], inj.name)
            spots = {}  # one cell per placement; the check must catch every one
            for spot in inj.placements():
                record = injected.get(spot.label, {}).get(c.id)
                spots[spot.label] = matrix.cell(required, why, record, c.id in fired.get(spot.label, ()))
                if record is not None:
                    spots[spot.label]["rerun"] = record["rerun"]
            cells[inj.name] = matrix.merged(spots)
        rows.append({"check": c.id, "case": c.case, "subject": c.subject, "family": c.family, "property": c.property,
                     "baseline": baseline[c.id]["status"], "cells": cells})
    names = [i.name for i in chosen_injections]
    result = {"suite": str(suite_path), "run_id": run_id, "command": list(command),
              "injections": [i.to_json() | {"describe": i.describe()} for i in chosen_injections],
              "must_catch": {p: sorted(s) for p, s in expectations.must_catch().items()},
              "family_must_catch": {f: sorted(s) for f, s in expectations.family_must_catch().items()},
              "checks": rows, "blind": matrix.blind(rows), "broken": matrix.broken_cells(rows), "seconds": seconds,
              "tested": sum(c["state"] in ("caught", "missed", "extra") for r in rows for c in r["cells"].values()),
              "wall_s": round(time.time() - began, 2), "interrupted": str(interrupted) if interrupted else None}
    environment = launcher_environment(platform, list(command))
    environment.update(suite=str(suite_path), topology=platform.topology.to_dict(), selftest=True)
    if interrupted is not None:  # the report's verdict says so, as a verify run's does
        environment["interrupted"] = str(interrupted)
    write_json(run_dir / "environment.json", environment)
    write_jsonl(run_dir / "results.jsonl", [baseline[c.id] for c in checks if c.id in baseline])
    for inj in chosen_injections:  # one file per class, its placements' records together
        records = [r for spot in inj.placements() for r in injected.get(spot.label, {}).values()]
        if records:
            write_jsonl(run_dir / "injected" / f"{inj.name}.jsonl", records)
    write_json(run_dir / "selftest.json", result)
    point_latest(out_root, run_dir)
    say(matrix.render(rows, names))
    say(f"# selftest.json: {run_dir / 'selftest.json'}; wall {result['wall_s']} s")
    if render:
        from ep_harness.reports.render import render_run

        render_run(run_dir, quiet=True)
        say(f"# report: {run_dir / 'report.html'}")
    if interrupted is not None:
        say(f"# INTERRUPTED (by {interrupted}): the matrix above holds what finished; no verdict on the rest")
        return 128 + interrupted.signum, run_dir
    if result["broken"]:  # the selftest itself failed somewhere: no verdict on those checks
        say(f"# BROKEN: {len(result['broken'])} check x injection cell(s) ended in an error of the injection "
            f"machinery or the launch (listed above)")
        return 1, run_dir
    if not result["blind"] and not result["tested"]:  # nothing planted: no check was shown to have teeth
        say(f"# NOTHING TESTED: no check of {len(rows)} was ok without injection and due to catch one")
        return 1, run_dir
    verdict = "BLIND" if result["blind"] else "OK"
    say(f"# {verdict}: {len(result['blind'])} blind check(s) of {len(rows)}; "
        f"{result['tested']} check x injection cells tested")
    return (1 if result["blind"] else 0), run_dir
