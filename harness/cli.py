"""`ep-harness`: verify, report, list, gate, baseline, nightly, explore, selftest, doctor."""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import traceback
from pathlib import Path

from ep_harness import console
from ep_harness.console import Console
from ep_harness.errors import HarnessError, Interrupted
from ep_harness.process_exit import exit_now
# the agent's: the same GC handling around imports, and the thread pools set for cores that ranks share
from ep_harness.launch.agent import _thread_pools_for_shared_cores, _imports_without_gc
from ep_harness.regress.gate import NotComparable


def _gpus(value: str) -> int | None:
    if value in ("", "auto"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number; use --gpus 0 for the CPU or a GPU count")


def _whole(minimum: int, what: str):
    """An argparse type: a whole number of at least `minimum`, else "'X' is not <what>"."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = minimum - 1
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}")
        return number
    return parse


_seed = _whole(0, "a seed (a whole number >= 0)")
_positive_int = _whole(1, "a positive whole number")


def _seconds(value: str) -> float:
    """A finite positive number of seconds (0, NaN or infinity would make a search that
    tries nothing, or never stops, and say it found nothing)."""
    from ep_harness.launch.settings import positive_seconds

    number = positive_seconds(value)
    if number is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a finite positive number of seconds")
    return number


def _file(value: str) -> Path:
    """A file the command writes or reads: an existing directory there is refused up front
    (not after a run, with its records already written)."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a directory; give a file's path")
    return path


def _folder(value: str) -> Path:
    """A directory the command writes into: an existing file there is refused up front."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a file; give a directory's path")
    return path


class Parser(argparse.ArgumentParser):
    """No silent abbreviations (`--suit` is an error, not `--suite`); subcommands are made
    of the same class (add_subparsers uses the parser's own)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """One line, not the usage: what was wrong, the closest name where one was mistyped,
        and where the usage is (exit 2, as argparse's own errors)."""
        import re

        from ep_harness.errors import did_you_mean

        choice = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            known = re.findall(r"'([^']*)'", choice.group(3))
            what = "command" if choice.group(1) == "command" else choice.group(1)
            message = f"unknown {what} {choice.group(2)!r}{did_you_mean(choice.group(2), known)}; choose from " \
                      f"{', '.join(known)}"
        console.current().err(f"{self.prog}: error: {message} (see {self.prog} --help)")
        self.exit(2)

    def options(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings if s.startswith("--")]

    def subcommand(self, name: str | None) -> "Parser":
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                return action.choices[name]
        return self


class _Version(argparse.Action):
    """--version, computed only when asked (it runs git)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the harness version and commit, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from ep_harness.version import version_line

        console.current().line(version_line())
        parser.exit()


def _emulation_arguments(parser: argparse.ArgumentParser) -> None:
    """--emulate MODE, and --emulate-hosts (its older spelling of `--emulate hosts`)."""
    from ep_harness.emulation import MODES

    parser.add_argument("--emulate", choices=MODES, default=None,
                        help="run --gpus N NCCL ranks on fewer GPUs: 'hosts' (one emulated host per rank, NET/Socket) "
                             "or 'single-node' (one NCCL node, P2P on the device; NCCL >= 2.30). Neither is NVLink")
    parser.add_argument("--emulate-hosts", dest="emulate", action="store_const", const="hosts",
                        help="the same as --emulate hosts")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ep-harness", description=__doc__)
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="run a suite of checks and write a run directory")
    v.add_argument("--suite", default="smoke", help="suite name under cases/ or a path to a TOML file")
    v.add_argument("--gpus", type=_gpus, default=None,
                   help="GPUs to use (default: every visible GPU; 0 or none visible: CPU with gloo)")
    v.add_argument("--cpu-ranks", type=int, default=4, help="largest gloo world size on the CPU (default 4)")
    _emulation_arguments(v)
    v.add_argument("--check", action="append", default=[], metavar="ID",
                   help="run only these checks: a case name, an id prefix (CASE/PROPERTY) or a glob over ids "
                        "(repeatable)")
    v.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE to register extra subjects (repeatable)")
    v.add_argument("--out", type=_folder, default=Path("reports/out"), help="where run directories go")
    v.add_argument("--no-report", action="store_true", help="write records only")
    v.add_argument("--allow-empty", action="store_true", help="exit 0 even when every check was skipped")
    v.add_argument("--seed", type=_seed, help="re-seed every check of the run (recorded in each record's params)")
    v.add_argument("--fresh-processes", type=int, default=1, metavar="K",
                   help="launch every check K times, each in new processes, and fail a check whose bits differ")
    v.add_argument("--junit-xml", type=_file, metavar="PATH", help="also write JUnit XML, one testcase per check")
    v.add_argument("--summary-md", type=_file, metavar="PATH",
                   help="append a Markdown verdict (e.g. to $GITHUB_STEP_SUMMARY)")
    v.add_argument("--show-skipped", action="store_true", help="list skipped checks one by one")
    v.add_argument("-q", "--quiet", action="store_true",
                   help="print only failures (with their rerun commands) and the verdict line")
    v.add_argument("--launches", choices=["auto", "one", "per-world-size", "per-check"], default="auto",
                   help="how checks share torchrun launches (auto: one on gloo, one per world size on NCCL)")
    v.add_argument("--from-record", type=Path, metavar="RESULTS_JSONL",
                   help="rerun checks of an earlier run from their records alone (with --check to pick)")
    v.add_argument("--threads", default=None, metavar="N",
                   help="CPU threads of every rank (default: a case's or record's own, else 1; OMP_NUM_THREADS in "
                        "your environment does not change it: docs/threads.md)")
    m = v.add_argument_group("several nodes (torchrun's c10d rendezvous; world size = NNODES x NPROC_PER_NODE)")
    m.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    m.add_argument("--nproc-per-node", type=int, default=None, metavar="P", help="ranks per node")
    m.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="the head node's address (node rank 0 hosts the run's store there); the same on every node")
    m.add_argument("--node-rank", type=int, default=0,
                   help="0 on the head (which writes the run directory), 1..NNODES-1 on the others")
    m.add_argument("--launcher", choices=["torchrun", "slurm"], default="torchrun",
                   help="torchrun: one `ep-harness verify` per node; slurm: the head (inside an allocation) "
                        "starts every node's torchrun with srun")
    m.add_argument("--run-secret", default=os.environ.get("EP_HARNESS_RUN_SECRET"), metavar="S",
                   help="signs the run's store: the head draws one and prints it unless given; the other nodes "
                        "need it (default: $EP_HARNESS_RUN_SECRET)")

    r = sub.add_parser("report", help="render a run directory (terminal table + report.html)")
    r.add_argument("run_dir", type=Path)
    r.add_argument("--against", type=Path, help="an earlier run to compare with")
    r.add_argument("--out", type=_file, help="where to write the HTML (default RUN_DIR/report.html)")
    r.add_argument("--show-skipped", action="store_true", help="list skipped checks one by one")

    g = sub.add_parser("gate", help="compare a run with its platform's baseline; non-zero on a regression")
    g.add_argument("run_dir", type=Path)
    g.add_argument("--baseline", type=_file, help="default: ci/baselines/<platform>.jsonl")

    b = sub.add_parser("baseline", help="manage baselines")
    b.add_argument("action", choices=["update"])
    b.add_argument("run_dir", type=Path)
    b.add_argument("--baseline", type=_file, help="default: ci/baselines/<platform>.jsonl")

    n = sub.add_parser("nightly", help="verify + gate + history + report with trends (make nightly)")
    n.add_argument("--suite", default="nightly")
    n.add_argument("--gpus", type=_gpus, default=None)
    _emulation_arguments(n)
    n.add_argument("--summary-md", type=_file, metavar="PATH", help="append a Markdown verdict with the gate's result")
    n.add_argument("--junit-xml", type=_file, metavar="PATH")
    n.add_argument("--baseline", type=_file)
    n.add_argument("--history", type=_file, default=Path("reports/out/history.jsonl"))

    e = sub.add_parser("explore", help="search for an invariance violation of a subject and shrink it")
    e.add_argument("subject")
    e.add_argument("--world-size", type=_positive_int, default=4)
    e.add_argument("--budget", type=_seconds, default=120.0, help="seconds of search (default 120)")
    e.add_argument("--max-examples", type=_positive_int, default=200)
    e.add_argument("--plugin", action="append", default=[])
    e.add_argument("--gpus", type=_gpus, default=None)
    e.add_argument("--store", type=_file, default=Path("reports/out/counterexamples.jsonl"))
    e.add_argument("--out", type=_folder, default=None,
                   help="where the search's launch directory goes (default: explore/ beside --store)")

    st = sub.add_parser("selftest", help="plant defects in each subject of a suite and show which checks catch them")
    st.add_argument("--suite", default="smoke", help="suite name under cases/ or a path to a TOML file")
    st.add_argument("--injections", default=None, metavar="A,B",
                    help="injection classes, optionally with parameters (ulp:call=1:rank=2); default: all")
    st.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N checks that expect to hold")
    st.add_argument("--check", action="append", default=[], metavar="ID",
                    help="only these checks: a case name, an id prefix or a glob (repeatable)")
    st.add_argument("--gpus", type=_gpus, default=None)
    st.add_argument("--cpu-ranks", type=int, default=4)
    _emulation_arguments(st)
    st.add_argument("--plugin", action="append", default=[], metavar="MODULE")
    st.add_argument("--out", type=_folder, default=Path("reports/out"), help="where run directories go")
    st.add_argument("--no-report", action="store_true", help="write selftest.json and records only")
    st.add_argument("--every-cell", action="store_true",
                    help="also plant injections a check need not catch (slower; shows extra catches)")

    sub.add_parser("doctor", help="what this machine will run and skip, and the command that fixes each gap")

    ls = sub.add_parser("list", help="list the suites and subjects, or a suite's checks and what this machine skips")
    ls.add_argument("--suite", default=None, help="list this suite's checks (default: list suites and subjects)")
    ls.add_argument("--gpus", type=_gpus, default=None)
    ls.add_argument("--cpu-ranks", type=int, default=4)
    _emulation_arguments(ls)
    ls.add_argument("--plugin", action="append", default=[])
    return parser


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # the ep-harness command itself, not a call from Python
    argv = sys.argv[1:] if argv is None else argv
    Console.tolerant_streams()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, and the option it was probably meant to be
        _unknown_arguments(parser.subcommand(getattr(args, "command", None)), unknown)
    try:
        # The command's one console: -q (verify's) and colour are decided here, for every line after.
        with console.using(Console(quiet=getattr(args, "quiet", False))) as out:
            code = _command(args, argv, out)
    finally:
        if program:  # about to exit: its last collection need not walk what torch made (below)
            gc.freeze()
    if program:  # the command's files are closed: the exit without the teardown of every object
        exit_now(code)
    return code


@contextlib.contextmanager
def _launching_imports():
    """Around the imports of a command that launches ranks (torch loads there): no garbage
    collection, numpy's BLAS without its thread pool, so that the command keeps one thread
    and can fork its torchrun agents (harness/launch/forks.py), and OpenMP threads that sleep
    while they wait (the agents and ranks forked from it keep what torch read)."""
    with _imports_without_gc(), _thread_pools_for_shared_cores():
        yield


def _command(args, argv: list[str], out: Console) -> int:
    try:
        from ep_harness.launch import settings

        settings.check_all()  # a malformed EP_HARNESS_* variable: one line before anything runs
        if args.command == "verify":
            from ep_harness.cases import load_suite, resolve_suite_path
            from ep_harness.environment import platform_for
            from ep_harness.launch.nodes import Nodes
            from ep_harness.threads import parse_threads

            # Bad node options, a missing or malformed suite and more GPUs than the machine
            # has fail here, before torch loads (on a machine without a GPU driver).
            nodes = Nodes(args.nnodes, args.nproc_per_node, args.rdzv_endpoint, args.node_rank,
                          args.launcher, args.run_secret).validate()
            if nodes.node_rank > 0:  # not the head: run this node's ranks for the head's launches
                from ep_harness.launch import forks

                with _launching_imports():
                    from ep_harness.launch.follower import follow
                with forks.serving():  # before the store's threads: agents forked where the head's are
                    return follow(nodes, args.out, plugins=args.plugin)
            if args.fresh_processes < 1:
                raise HarnessError(f"--fresh-processes {args.fresh_processes}: give 1 or more launches")
            threads = None if args.threads is None else parse_threads(args.threads, "--threads")
            if args.from_record is None:
                load_suite(resolve_suite_path(args.suite))
            elif any(a == "--suite" or a.startswith("--suite=") for a in argv):  # one source of checks, not two
                raise HarnessError("--suite and --from-record both name the checks to run; give one of them")
            platform_for(nodes, args.gpus, args.cpu_ranks, args.emulate)
            with _launching_imports():
                from ep_harness.run.verify import RunOptions, verify

            code, run_dir = verify(RunOptions(
                args.suite, gpus=args.gpus, cpu_ranks=args.cpu_ranks, selection=args.check, plugins=args.plugin,
                out_root=args.out, command=["ep-harness", *argv], render=not args.no_report,
                launches=args.launches, emulate=args.emulate, from_record=args.from_record,
                allow_empty=args.allow_empty, seed=args.seed, junit_xml=args.junit_xml, summary_md=args.summary_md,
                show_skipped=args.show_skipped, nodes=nodes, fresh_processes=args.fresh_processes, threads=threads))
            if out.quiet:
                _quiet_summary(run_dir, out)
            return code
        if args.command == "report":
            from ep_harness.reports.render import render_run

            # 1 for a run that failed, as for the verify that made it, and for a regression --against
            return render_run(args.run_dir, against=args.against, out=args.out, show_skipped=args.show_skipped,
                              failed_run_fails=True)
        # list and doctor load torch and the subjects, and do little else
        if args.command == "list":
            with _imports_without_gc():
                return _list(args, out)
        if args.command == "doctor":
            with _imports_without_gc():
                from ep_harness.doctor import doctor

                return doctor()
        if args.command == "selftest":
            with _launching_imports():
                from ep_harness.selftest.run import selftest
            from ep_harness.launch import forks

            with forks.serving() if args.emulate is None else contextlib.nullcontext():  # before any plugin loads
                return selftest(args.suite, args.injections, args.limit, gpus=args.gpus, cpu_ranks=args.cpu_ranks,
                                selection=args.check, plugins=args.plugin, out_root=args.out,
                                command=["ep-harness", *argv], render=not args.no_report,
                                every_cell=args.every_cell, emulate=args.emulate)[0]
        if args.command == "gate":
            from ep_harness.regress.gate import gate, render_gate

            result = gate(args.run_dir, args.baseline)
            out.line(render_gate(result))
            return 0 if result["passed"] else 1
        if args.command == "baseline":
            from ep_harness.regress.gate import update_baseline

            out.line(f"baseline written: {update_baseline(args.run_dir, args.baseline)}")
            return 0
        if args.command == "explore":
            import importlib.util

            if importlib.util.find_spec("hypothesis") is None:
                raise HarnessError("explore searches with hypothesis, which is not installed; "
                                   "pip install 'ep-harness[explore]'")
            with _launching_imports():
                from ep_harness.run.explore import explore
            from ep_harness.launch import forks

            with forks.serving():  # before any plugin loads
                return explore(args.subject, args.world_size, args.budget, args.max_examples, args.plugin,
                               store=args.store, gpus=args.gpus, out=args.out)
        if args.command == "nightly":
            with _launching_imports():
                from ep_harness.regress.nightly import nightly

            return nightly(args.suite, gpus=args.gpus, baseline=args.baseline, history=args.history,
                           emulate=args.emulate, summary_md=args.summary_md, junit_xml=args.junit_xml,
                           command=["ep-harness", *argv])
    except NotComparable as exc:  # no baseline of this run's fingerprint: neither pass nor regression
        out.err(f"ep-harness: {exc}")
        return 3
    except HarnessError as exc:
        out.err(f"ep-harness: error: {exc}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C where no handler of the run's was there (imports, planning)
        out.err("ep-harness: interrupted by SIGINT")
        return 130
    except Interrupted as exc:  # e.g. between claiming the run directory and the first launch
        out.err(f"ep-harness: interrupted by {exc}{'; ' + exc.note if exc.note else ''}")
        return 128 + exc.signum
    except ImportError as exc:
        if not _torch_failed(exc):
            raise
        out.err(f"ep-harness: error: torch does not import here ({(str(exc).splitlines() or ['?'])[0]}); install it "
                f"(pip install torch==2.13.0 for the CPU build, see the README) or repair it; ep-harness doctor "
                f"says what else is missing")
        return 2
    return 2


def _torch_failed(exc: ImportError) -> bool:
    """Whether the import that failed was torch's own: torch missing, or its package raising."""
    if exc.name == "torch" or (exc.name or "").startswith("torch."):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return any(f"{os.sep}torch{os.sep}" in frame.filename for frame in frames)


def _quiet_summary(run_dir: Path, out: Console) -> None:
    """verify -q: each failure with its rerun command, then the verdict and the counts."""
    from ep_harness.reports.analysis import FAILING, counts, verdict
    from ep_harness.reports.load import load_run
    from ep_harness.reports.terminal import _one_line, divergence, mark

    run = load_run(run_dir)
    records = run.records
    for r in records:
        if r["status"] in FAILING:
            out.line(_one_line(f"{mark(r)}: {r['check']}: {r['reason']}{divergence(r)}"))
            out.line(_one_line(f"  rerun: {r['rerun']}"))
    summary = ", ".join(f"{n} {status}" for status, n in counts(records).items() if n)
    out.line(f"# {verdict(records, interrupted=run.environment.get('interrupted'))}: {summary} ({run_dir})")


def _unknown_arguments(parser: Parser, unknown: list[str]) -> None:
    from ep_harness.errors import did_you_mean

    hint = next((did_you_mean(a.partition("=")[0], parser.options()) for a in unknown if a.startswith("--")), "")
    parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _list(args, out: Console) -> int:
    from ep_harness import subject as registry
    from ep_harness.cases import known_suites, load_suite, resolve_suite_path
    from ep_harness.environment import detect

    if args.suite is None:
        subjects = registry.load_all(args.plugin)  # a plugin that does not load: its one line, nothing before it
        out.line("# suites (--suite NAME, or a path to a TOML file):")
        for name, path in known_suites().items():
            out.line(f"  {name:16}  {load_suite(path).description}")
        out.line("# subjects:")
        for name, subject in sorted(subjects.items()):
            out.line(f"  {name:30}  {subject.family:10}  {subject.summary}")
        return 0
    suite = load_suite(resolve_suite_path(args.suite))  # a missing or malformed suite fails before torch loads
    from ep_harness.run.plan import expand

    registry.load_all([*suite.plugins, *args.plugin])
    for c in expand(suite, detect(args.gpus, args.cpu_ranks, args.emulate)):
        out.line(c.id + (f"  [skip: {c.skip_reason}]" if c.skip_reason else ""))
    return 0
