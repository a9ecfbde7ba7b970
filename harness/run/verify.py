"""plan -> launch -> records -> reports -> exit code.

On a GPU, the DeepGEMM kernels the checks need compile beside the launches
(harness/run/precompile.py): each launch runs its other checks first and those that need the
kernels after them (the same order within each part), their ranks waiting until the compile
has ended; results.jsonl keeps the plan's order."""
from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ep_harness import console, subject as registry
from ep_harness.cases import EXPECTATIONS, load_suite, resolve_suite_path, suite_argument
from ep_harness.check import Check
from ep_harness.errors import HarnessError
from ep_harness.environment import applicable_env, pinned_env, platform_for, redacted
from ep_harness.run.fresh import compared_records
from ep_harness.launch import forks
from ep_harness.launch.launcher import Head, Outcome, run_job
from ep_harness.launch.nodes import Nodes
from ep_harness.run.plan import expand, jobs, literal, planned, selected
from ep_harness.launch.processes import Interrupted, interruptible
from ep_harness.records import append_line, new_record, numbered_jsonl, write_atomic, write_json, write_jsonl
from ep_harness.run_environment import EnvironmentRecord, source_suite_name
from ep_harness.threads import of_env, user_setting_note
from ep_harness.verdict import decide
from ep_harness.version import harness_version
from ep_harness.reports.analysis import FAILING, nothing_shown


def new_run_id() -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


def rerun_command(suite: str, check_id: str, gpus: int | None, plugins: list[str], emulate: str | None = None,
                  from_record: bool = False, nodes: Nodes = Nodes(), threads: int | None = None) -> str:
    """The command that runs this one check again, under the same conditions: `threads`, the
    ranks' thread count it ran with, is spelled out (a check alone must not get another)."""
    cmd = ["ep-harness", "verify", "--from-record" if from_record else "--suite", suite, "--check", literal(check_id)]
    if nodes.multi:  # the head's command; the other nodes start theirs as before
        cmd += ["--nnodes", str(nodes.nnodes), "--nproc-per-node", str(nodes.nproc_per_node)]
        cmd += ["--rdzv-endpoint", nodes.endpoint] if nodes.endpoint else []
        cmd += ["--launcher", nodes.launcher] if nodes.launcher != "torchrun" else []
    if gpus is not None:
        cmd += ["--gpus", str(gpus)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    if emulate:
        cmd += ["--emulate", emulate]
    for p in plugins:
        cmd += ["--plugin", p]
    return shlex.join(cmd)


def base_record(check: Check, run_id: str, rerun: str) -> dict:
    """The check's record before anything is measured, with what this process adds to it: the
    launch environment redacted (a credential's value never reaches a results file), the
    harness's version, and the package of a third-party subject."""
    return new_record(check, run_id, rerun, launch_env=redacted(check.env), harness_version=harness_version(),
                      subject_distribution=registry.plugin_distribution(check.subject))


def finalize(check: Check, outcome: Outcome | None, run_id: str, rerun: str,
             interrupted: BaseException | None = None) -> dict:
    rec = base_record(check, run_id, rerun)
    if check.skip_reason:
        rec.update(status="skipped", reason=check.skip_reason)
        return rec
    if outcome is None and interrupted is not None:
        rec.update(status="interrupted", reason=f"the run was interrupted by {interrupted} before this check finished")
        return rec
    rec["seconds"] = outcome.seconds
    if outcome.warm_up_seconds is not None:
        rec["warm_up_seconds"] = outcome.warm_up_seconds
    if outcome.error:
        rec.update(status="error", reason=outcome.error, detail=outcome.details)
        return rec
    m = outcome.measured
    rec.update(m.to_record())
    if m.error:  # measured, but not under the conditions pinned (e.g. another NCCL algorithm)
        rec.update(status="error", reason=m.error)
        return rec
    rec["status"], rec["reason"] = decide(check, m)
    if m.note:
        rec["reason"] += f"; {m.note}"
    return rec


class Stream:
    """Each check's row as it finishes, with a running count and the time since the start;
    each record appended to results.jsonl as it arrives, so an interrupted or killed run
    keeps what it measured (the final file is then rewritten whole, in plan order)."""

    def __init__(self, run_dir: Path, run_id: str, checks: list[Check], rerun):
        from ep_harness.reports import terminal

        self.terminal, self.path, self.run_id, self.rerun = terminal, run_dir / "results.jsonl", run_id, rerun
        self.out = console.current()
        self.runnable = sum(c.skip_reason is None for c in checks)
        self.keys = terminal.varying([{"case": c.case, "params": c.params_record} for c in checks])
        self.records: dict[str, dict] = {}  # check id -> its record, as streamed
        self.began = time.time()
        self.out.info(f"{'# [n/N]':<10}{'elapsed':>8} {terminal.header()[2:]}")

    def finished(self, check: Check, outcome: Outcome) -> None:
        record = self.records[check.id] = finalize(check, outcome, self.run_id, self.rerun(check))
        # The row before the line on disk: a signal that lands between the two (Interrupted
        # is raised in this thread) then never hides a streamed record's row; the record is
        # kept either way (the final results.jsonl is written from every outcome).
        if not self.out.quiet:
            count = f"[{len(self.records)}/{self.runnable}]"
            row = self.terminal.row(record, self.keys[check.case], self.out.colour)
            self.out.info(f"{count:<10}{time.time() - self.began:7.1f}s {row[2:]}")
        append_line(self.path, record)


def timing(records, wall_s: float, precompile_wait_s: float = 0.0) -> dict:
    """Where a run's time went: the launches' wall clock, the checks' own time, the untimed
    warm-up of JIT-compiling subjects (what a warm kernel cache saves) and how long rank 0
    waited, in all launches, for the DeepGEMM compile beside them (harness/run/precompile.py)."""
    records = list(records)
    warmed = [r["warm_up_seconds"] for r in records if r.get("warm_up_seconds") is not None]
    return {"wall_s": round(wall_s, 2), "check_s": round(sum(float(r.get("seconds") or 0) for r in records), 2),
            "warm_up_s": round(sum(warmed), 2), "warmed_checks": len(warmed),
            "precompile_wait_s": round(precompile_wait_s, 2)}


def timing_line(t: dict) -> str:
    return (f"# wall {t['wall_s']} s: {t['check_s']} s in checks" +
            (f", {t['warm_up_s']} s warming up {t['warmed_checks']} JIT-compiling check(s) (kernel compile or "
             f"cache load, untimed)" if t["warmed_checks"] else "") +
            (f", {t['precompile_wait_s']} s waiting for the DeepGEMM compile" if t.get("precompile_wait_s") else ""))


RECORD_FIX = "pass a results.jsonl that `ep-harness verify` wrote"


def record_problem(record: dict) -> str | None:
    """What keeps a record from being rerun (a hand-edited or damaged results file), or None."""
    for key in ("check", "case", "subject", "property"):
        if not isinstance(record.get(key), str) or not record[key]:
            return f"{key} is {record.get(key)!r}, not a name"
    if not isinstance(record.get("params"), dict):
        return f"check {record['check'][:80]!r}: params is {'missing' if 'params' not in record else 'not an object'}"
    if record.get("expect") not in EXPECTATIONS:
        return f"check {record['check'][:80]!r}: expect {record.get('expect')!r} is not one of {', '.join(EXPECTATIONS)}"
    return None


def checks_from_records(path: Path, platform, selection: list[str] | None, threads: int | None = None) -> list[Check]:
    """The checks of a results.jsonl, rebuilt from their records (params validated again), each
    on the thread count its record's launch_env names (`threads`, where given, instead)."""
    try:
        records = numbered_jsonl(path, RECORD_FIX)
    except OSError as exc:
        raise HarnessError(f"{path}: cannot read records ({exc}); {RECORD_FIX}") from None
    for lineno, r in records:
        problem = record_problem(r)
        if problem:
            raise HarnessError(f"{path}:{lineno}: {problem}; {RECORD_FIX}")
    chosen = [r for _, r in records if selected(r["check"], selection)]
    if not chosen:
        if not records:
            raise HarnessError(f"{path} holds no record; pass a results.jsonl that a run wrote")
        raise HarnessError(f"--check {' '.join(selection or [])} matches no record in {path}")
    return [planned(platform, registry.get(r["subject"]), r["property"],
                    {k: v for k, v in r["params"].items() if k != "backend"}, f"{path}: {r['check']}",
                    id=r["check"], suite=str(path), case=r["case"], expect=r["expect"],
                    timeout_s=r.get("timeout_s", 120.0),
                    env=applicable_env(r.get("launch_env") or {}, f"{path}: {r['check']}: launch_env"),
                    threads=threads)
            for r in chosen]


def unmeasured_cases(records: list[dict]) -> list[str]:
    """One line per case of which no check ran, beside cases that did: a run that passes
    measured nothing of it (a subject's library missing here, a GPU-only case on the CPU),
    which its OK must not hide. A run where nothing ran at all says so itself."""
    by_case: dict[str, list[dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], []).append(r)
    if all(r["status"] == "skipped" for r in records):
        return []
    lines = []
    for case, rs in by_case.items():
        if all(r["status"] == "skipped" for r in rs):
            reasons = list(dict.fromkeys(r["reason"] for r in rs))
            more = f" (and {len(reasons) - 1} other reason(s))" if len(reasons) > 1 else ""
            lines.append(f"case {case!r} was not measured: all {len(rs)} of its check(s) were skipped "
                         f"(subject {rs[0]['subject']!r}: {reasons[0]}{more})")
    return lines


def write_ci_outputs(run_dir: Path, records: list[dict], environment: dict, junit_xml: Path | None,
                     summary_md: Path | None, regressions: list[dict] = (),
                     annotate: bool = True) -> None:
    """JUnit XML and the Markdown summary where asked for; annotations under GitHub Actions
    (with -q too: they are how a failure reaches the pull request; `annotate=False` where the
    run's own verify printed them)."""
    from ep_harness.reports import ci_outputs

    if junit_xml is not None:
        write_atomic(Path(junit_xml), ci_outputs.junit_xml(records, run_dir.name))
    if summary_md is not None:
        with open(summary_md, "a", encoding="utf-8") as f:  # $GITHUB_STEP_SUMMARY is appended to
            f.write(ci_outputs.summary_markdown(records, environment, list(regressions)))
    if os.environ.get("GITHUB_ACTIONS") == "true" and annotate:
        for line in ci_outputs.github_annotations(records, environment):
            console.current().line(line)


def claim_run_dir(out_root: Path) -> tuple[str, Path]:
    """A new run directory, created exclusively: two runs that draw the same id never merge."""
    out_root.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        run_id = new_run_id()
        try:
            (out_root / run_id).mkdir()
        except FileExistsError:
            continue
        return run_id, out_root / run_id
    raise HarnessError(f"could not create a new run directory under {out_root}; check that it is writable")


@contextlib.contextmanager
def nothing_left_on_signal():
    """From claiming the run directory to the first launch (whose own handler keeps what
    finished): SIGINT, SIGTERM or SIGHUP removes the directories claimed (the list yielded),
    which hold no record yet, and raises Interrupted, which the command reports in one line."""
    claimed: list[Path] = []
    try:
        with interruptible():
            yield claimed
    except Interrupted as exc:
        for path in claimed:
            shutil.rmtree(path, ignore_errors=True)
        exc.note = "before any check ran; nothing was written"
        raise


def point_latest(out_root: Path, run_dir: Path) -> None:
    link = out_root / "latest"
    tmp = out_root / f".latest-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, link)


@dataclass(frozen=True)
class RunOptions:
    """What one verify run is asked to do, built once by the CLI from its arguments; other
    callers (nightly, the pytest plugin, bench) name only what differs from the defaults."""

    suite: str  # a suite's name or path (ignored with from_record)
    gpus: int | None = None  # None: every visible GPU; 0: CPU ranks on gloo
    cpu_ranks: int = 4
    selection: list[str] | None = None  # --check: case names, id prefixes or globs
    plugins: list[str] = ()  # added to the suite's own
    out_root: Path = Path("reports/out")
    command: list[str] = ()  # the command line, for environment.json
    render: bool = True
    launches: str = "auto"  # how checks are grouped into torchrun launches
    emulate: str | None = None  # "hosts" or "single-node" (harness/emulation.py)
    from_record: Path | None = None  # rerun these records' checks instead of a suite's
    allow_empty: bool = False  # a run whose checks were all skipped passes
    seed: int | None = None
    junit_xml: Path | None = None
    summary_md: Path | None = None
    show_skipped: bool = False
    nodes: Nodes = Nodes()
    fresh_processes: int = 1  # launches of every check, each in new processes
    threads: int | None = None  # every rank's thread count (None: the case's or record's, else 1: harness/threads.py)


def launch_grouping(options: RunOptions, platform, nodes: Nodes) -> str:
    """How checks share launches: one on gloo (or over several nodes, where every rank takes
    part in every launch), one per world size on NCCL, unless --launches says."""
    if nodes.multi:
        return "one"
    if options.launches != "auto":
        return options.launches
    return "one" if platform.backend == "gloo" else "per-world-size"


@dataclass(frozen=True)
class Launches:
    """A run's launches: its checks grouped into jobs (launch_grouping), each launched on
    its world size, with the compile beside them (harness/run/precompile.py) once it started."""

    checks: list[Check]
    platform: Any
    nodes: Nodes
    environment: EnvironmentRecord
    run_dir: Path
    plugins: list[str]
    options: RunOptions

    def start_compile(self):
        """The compile beside the launches (a Background), or None; each local rank takes a
        compile process's place."""
        from ep_harness.run import precompile

        grouping = launch_grouping(self.options, self.platform, self.nodes)
        local_ranks = max((self.nodes.ranks or ws for ws, _, _ in jobs(self.checks, grouping)), default=1)
        return precompile.start(self.checks, self.platform, self.run_dir, console.current().quiet,
                                multi_node=self.nodes.multi, plugins=self.plugins, ranks=local_ranks)

    def run(self, head: Head, background, tag: str, on_outcome) -> dict[str, Outcome]:
        """Every job once, in new processes (`tag` names a relaunch's job directories)."""
        from ep_harness.run.precompile import arranged

        done: dict[str, Outcome] = {}
        platform = self.platform
        for n, (world_size, env_overrides, job_checks) in enumerate(
                jobs(self.checks, launch_grouping(self.options, platform, self.nodes))):
            world_size = self.nodes.ranks or world_size
            env = pinned_env(platform, env_overrides)
            job_dir = self.run_dir / "jobs" / f"{n:02d}-ws{world_size}{tag}"
            self.environment.launched(job_dir.name, env)
            job_checks, wait, later = arranged(background, job_checks)
            from ep_harness.reports.terminal import launch_line

            console.current().info(launch_line(len(job_checks), world_size, platform.backend,
                                               f"{tag.replace('-', ' ')}{later}"))
            done.update(run_job(head, job_dir, world_size, platform.backend, job_checks, env, self.plugins,
                                platform.emulation, on_outcome=on_outcome, precompile_wait=wait))
        return done


def launch_all(head: Head, launches: Launches, on_outcome
               ) -> tuple[dict[str, Outcome], list[dict[str, Outcome]], Interrupted | None]:
    """Every launch once the nodes are there, with the compile beside them, and with
    --fresh-processes K every launch again K-1 times (harness/run/fresh.py): the first launches'
    outcomes, each relaunch's, and the interrupt that ended them early (what finished is
    kept). The head is closed on the way out."""
    outcomes: dict[str, Outcome] = {}
    relaunched: list[dict[str, Outcome]] = []  # --fresh-processes: the outcomes of each later launch
    interrupted = None
    background = None  # the DeepGEMM compile beside the launches (harness/run/precompile.py)
    with interruptible():
        try:
            head.wait_for_nodes()
            background = launches.start_compile()
            outcomes.update(launches.run(head, background, "", on_outcome))
            for k in range(1, launches.options.fresh_processes):  # the same checks again, each launch in new processes
                relaunched.append({})  # filled when done; an interrupt leaves it holding what finished
                relaunched[-1] = launches.run(head, background, f"-fresh{k}", None)
            if background is not None:  # nothing waits for it any more (a launch that died before its checks)
                background.finish(stop_because="every launch has ended")
        except Interrupted as exc:  # every process is gone; keep what finished, mark the rest
            if relaunched:  # the interrupted launch was a relaunch: its outcomes are not the first launch's
                relaunched[-1] = exc.outcomes
            else:
                outcomes.update(exc.outcomes)
            interrupted = exc
            console.current().line(f"# interrupted by {exc}: keeping {len(outcomes)} finished check(s)")
        finally:
            if background is not None:  # interrupted or failed: its workers and their NVCC end too
                background.finish(stop_because="")
            head.close()
    return outcomes, relaunched, interrupted


def verify(options: RunOptions) -> tuple[int, Path]:
    """Run a suite, or (from_record) the checks of an earlier results.jsonl from their
    records alone: every effective parameter is in the record. With fresh_processes = K every
    launch is made K times, each in new processes, and a check whose bits differ between them
    fails (harness/run/fresh.py). On several nodes this is the head's side (node rank 0); the
    others run ep_harness.launch.follower.follow."""
    nodes, plugins = options.nodes.validate(), list(options.plugins)
    # Before a plugin loads or the run's store starts a thread: the fork that forks the agents.
    with forks.serving() if _forks_agents(nodes, options) else contextlib.nullcontext():
        return _verify(options, nodes, plugins)


def _forks_agents(nodes: Nodes, options: RunOptions) -> bool:
    """Whether the agents may be forks of the command (harness/launch/forks.py): run by
    torchrun, no emulated topology, and not --fresh-processes, whose every launch must be a new
    interpreter (its own hash seed and address layout)."""
    return nodes.launcher == "torchrun" and options.emulate is None and options.fresh_processes == 1


def _verify(options: RunOptions, nodes, plugins: list[str]) -> tuple[int, Path]:
    if options.from_record is not None:
        suite_path = options.from_record
        registry.load_all(plugins)
        platform = platform_for(nodes, options.gpus, options.cpu_ranks, options.emulate)
        checks = checks_from_records(options.from_record, platform, options.selection, options.threads)
    else:
        suite_path = resolve_suite_path(options.suite)
        loaded = load_suite(suite_path)
        plugins = list(dict.fromkeys([*loaded.plugins, *plugins]))
        registry.load_all(plugins)
        platform = platform_for(nodes, options.gpus, options.cpu_ranks, options.emulate)
        checks = expand(loaded, platform, options.selection, options.seed, options.threads)
    with nothing_left_on_signal() as claimed:  # until the first launch, a signal leaves no run behind
        run_id, run_dir = claim_run_dir(options.out_root)
        claimed.append(run_dir)
        environment = EnvironmentRecord(platform, options.command, suite_path, options.selection,
                                        source_suite_name(options.from_record) if options.from_record else loaded.name)
        threads = environment.pinned_threads([c.env for c in checks if c.skip_reason is None])
        out = console.current()
        if not out.quiet:  # what the run is, before its rows (pytest's and nccl-tests' order)
            from ep_harness.reports.terminal import run_header

            plan = [(nodes.ranks or ws, len(cs))
                    for ws, _, cs in jobs(checks, launch_grouping(options, platform, nodes))]
            skipped = sum(c.skip_reason is not None for c in checks)
            for line in run_header(environment.data, plan, skipped, run_id=run_id):
                out.info(line)
            note = user_setting_note(threads) if isinstance(threads, int) else None
            if note:
                out.info(f"# note: {note}")

        suite_arg = str(suite_path) if options.from_record is not None else suite_argument(options.suite, suite_path)

        def rerun(c: Check) -> str:
            return rerun_command(suite_arg, c.id, options.gpus, plugins, platform.emulation,
                                 options.from_record is not None, nodes, of_env(c.env))

        stream = Stream(run_dir, run_id, checks, rerun)
        try:
            head = Head(nodes, run_id)
        except HarnessError:
            run_dir.rmdir()  # nothing was written: no partial run
            raise
        if nodes.multi:
            out.info(f"# head of {nodes.nnodes} nodes x {nodes.nproc_per_node} ranks: the run's store is at "
                     f"{head.endpoint}; waiting for the other nodes")
            if nodes.launcher == "torchrun":
                out.info(f"# on each other node K: {nodes.follower_command(head.endpoint, head.generated_secret)}")
    outcomes, relaunched, interrupted = launch_all(head, Launches(checks, platform, nodes, environment, run_dir,
                                                                  plugins, options), stream.finished)
    differ = environment.finish(head.reported, run_dir, interrupted, timing(stream.records.values(),
                                                                           time.time() - stream.began,
                                                                           head.precompile_wait_s))
    for line in differ:
        out.warning(f"the nodes differ, {line}")
    described = environment.data  # environment.json; the gate's run fingerprint is drawn from it

    records = [stream.records.get(c.id) or finalize(c, outcomes.get(c.id), run_id, rerun(c), interrupted)
               for c in checks]
    records = compared_records(records, checks, relaunched, options.fresh_processes, interrupted)
    write_json(run_dir / "environment.json", described)
    write_jsonl(run_dir / "results.jsonl", records)  # the whole run, in plan order, atomically
    point_latest(options.out_root, run_dir)
    out.info(timing_line(described["timing"]))
    for line in unmeasured_cases(records):  # before the verdict, which stays the last lines
        out.warning(line)
    if options.render:
        from ep_harness.reports.render import render_run

        render_run(run_dir, show_skipped=options.show_skipped, rows=out.quiet)
    write_ci_outputs(run_dir, records, described, options.junit_xml, options.summary_md)
    if interrupted is not None:
        return 128 + interrupted.signum, run_dir
    failing = sum(r["status"] in FAILING for r in records)
    if all(r["status"] == "skipped" for r in records) and not options.allow_empty:
        out.info(f"# nothing ran: all {len(records)} checks were skipped (see their reasons above); "  # not a pass
                 f"pass --allow-empty to accept that")
        return 1, run_dir
    vacuous_only = nothing_shown(records)
    if vacuous_only:  # checks ran, but none of them could have failed: not a pass either
        out.info(f"# FAILED: {vacuous_only}")
        return 1, run_dir
    return (1 if failing else 0), run_dir
