"""One output seam: every line of harness/ and reports/ reaches the terminal through the
console (harness/console.py), which the command makes once from its options: -q and colour
are decided there, not by each module that prints."""
import ast
import io
from pathlib import Path

import pytest

from ep_harness import cli, console
from tests.conftest import REPO
from tests.test_reports import record, write_run

SEAM = "harness/console.py"
STREAMS = {"stdout", "stderr", "__stdout__", "__stderr__"}
# Modules that write their process's own streams, and why none of it is a line for the user.
EXCEPTIONS = {
    "harness/run/precompile_worker.py": "a compile worker: its stdout carries its answers to the pool, so it points "
                                    "sys.stdout at its log (stderr), where its failure lines go too",
    "harness/process_exit.py": "the end of a command, as the interpreter's: a SystemExit's message to stderr, then "
                               "both streams flushed (the console's lines are written by then)",
    "harness/run/worker.py": "a rank: flushes its own stdout (the launch's log, not the terminal) before os._exit "
                         "skips the interpreter's teardown",
}
# Parameters named `quiet` that the console does not decide, and why.
QUIET_PARAMETERS = {
    ("harness/run/precompile.py", "start"): "precompile.py is reworked on another branch; verify passes it the "
                                        "console's decision",
    ("harness/launch/follower.py", "follow"): "follower.py is reworked on another branch; no caller passes it (a "
                                       "follower prints its two lines under -q too, as before)",
    ("reports/render.py", "render_run"): "the caller's choice, not the user's -q: selftest and bench write the "
                                         "page only (they print their own summary)",
}


def terminal_writes(source: str) -> list[str]:
    """Where `source` prints or touches sys.stdout / sys.stderr itself: 'line N: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            found.append(f"line {node.lineno}: print(")
        elif isinstance(node, ast.Attribute) and node.attr in STREAMS and \
                isinstance(node.value, ast.Name) and node.value.id == "sys":
            found.append(f"line {node.lineno}: sys.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and {a.name for a in node.names} & STREAMS:
            found.append(f"line {node.lineno}: from sys import {', '.join(a.name for a in node.names)}")
    return found


def quiet_parameters(source: str) -> list[str]:
    """The functions of `source` taking a `quiet` argument, and the classes with a `quiet` field."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            if any(a.arg == "quiet" for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]):
                found.append(getattr(node, "name", "<lambda>"))
        elif isinstance(node, ast.ClassDef):
            if any(isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == "quiet"
                   for s in node.body):
                found.append(node.name)
    return found


def modules() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8")
            for root in ("harness", "reports") for p in sorted((REPO / root).rglob("*.py"))}


def test_no_module_but_the_console_writes_the_terminal():
    found = {path: writes for path, source in modules().items() if path != SEAM
             for writes in [terminal_writes(source)] if writes}
    assert set(found) - set(EXCEPTIONS) == set(), {p: w for p, w in found.items() if p not in EXCEPTIONS}
    assert set(EXCEPTIONS) <= set(found), f"no longer needed, remove them: {set(EXCEPTIONS) - set(found)}"


def test_the_scan_sees_every_way_of_writing_the_terminal():
    planted = {
        'print("x")': "print(",
        'print("x", file=sys.stderr)': "print(",
        'say = lambda t: print(t, flush=True)': "print(",
        'sys.stdout.write("x")': "sys.stdout",
        'stream = sys.stderr': "sys.stderr",
        'sys.__stdout__.flush()': "sys.__stdout__",
        'from sys import stderr': "from sys import stderr",
    }
    for source, what in planted.items():
        assert [w.split(": ", 1)[1] for w in terminal_writes(source)][:1] == [what], source
    clean = 'console.current().line("x")\nfingerprint(t)\ntraceback.print_exc()\nsys.argv[1:]\nf.write("x")'
    assert terminal_writes(clean) == []
    assert terminal_writes((REPO / SEAM).read_text()) != []  # the console itself does write (the scan sees it)


def test_quiet_is_decided_by_the_console_not_threaded_through():
    found = {(path, name) for path, source in modules().items() if path != SEAM for name in quiet_parameters(source)}
    assert found - set(QUIET_PARAMETERS) == set()
    assert set(QUIET_PARAMETERS) <= found, f"no longer needed, remove them: {set(QUIET_PARAMETERS) - found}"
    # Control: a parameter and a field named quiet are both seen.
    assert quiet_parameters("def f(a, quiet=False): pass\nclass O:\n    quiet: bool = False") == ["f", "O"]


class Terminal(io.StringIO):
    """A stdout that says it is a terminal (as a pty does), for colour."""

    def isatty(self):
        return True


@pytest.fixture
def decisions(monkeypatch):
    """How often a command decided on colour (each Console made without `colour` decides once)."""
    made = []
    wanted = console.colour_wanted
    monkeypatch.setattr(console, "colour_wanted", lambda stream: made.append(stream) or wanted(stream))
    return made


def report_on_a_terminal(tmp_path, monkeypatch, env: dict) -> str:
    for name in ("NO_COLOR", "TERM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = write_run(tmp_path / "run", [record("a"), record("b", status="unexpected", held=False, mismatched=3,
                                                          reason="expected to hold, but 3 differ")])
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    assert cli.main(["report", str(run), "--out", str(tmp_path / "copy.html")]) == 1  # a failed run
    return terminal.getvalue()


def test_colour_is_decided_once_per_command_and_never_with_no_color(tmp_path, monkeypatch, decisions):
    coloured = report_on_a_terminal(tmp_path, monkeypatch, {"TERM": "xterm"})
    assert len(decisions) == 1
    assert "\x1b[31munexpected\x1b[0m" in coloured and "\x1b[32mok" in coloured and "\x1b[31mFAILED" in coloured
    decisions.clear()
    plain = report_on_a_terminal(tmp_path, monkeypatch, {"TERM": "xterm", "NO_COLOR": "1"})
    assert len(decisions) == 1 and "\x1b[" not in plain and "unexpected" in plain and "# FAILED" in plain
    assert "\x1b[" not in report_on_a_terminal(tmp_path, monkeypatch, {"TERM": "dumb"})


SKIPPED_SUITE = '''
[[case]]
name = "fold"
subject = "all_gather_fold"
properties = ["rank-invariance"]
expect = "holds"
[case.grid]
dtype = ["bfloat16"]
world_size = [3]
'''


def verify_nothing_runs(tmp_path, capsys, *options) -> tuple[int, list[str], str]:
    """`verify OPTIONS` in this process, of a suite whose one check needs more ranks than given
    (skipped: no launch), and what it printed."""
    (tmp_path / "skipped.toml").write_text(SKIPPED_SUITE)
    code = cli.main(["verify", *options, "--suite", str(tmp_path / "skipped.toml"), "--gpus", "0",
                     "--cpu-ranks", "2", "--out", str(tmp_path / "runs")])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_quiet_prints_only_the_verdict_and_the_rest_prints_the_run(tmp_path, capsys, decisions):
    code, quiet, err = verify_nothing_runs(tmp_path, capsys, "-q")
    run_dir = (tmp_path / "runs" / "latest").resolve()
    assert (code, err) == (1, "") and len(decisions) == 1
    assert quiet == [f"# NOTHING RAN: 1 skipped ({run_dir})"]  # no header, no progress, no table
    assert (run_dir / "report.html").exists()  # -q prints less; it writes the same
    decisions.clear()
    code, full, err = verify_nothing_runs(tmp_path, capsys)
    assert (code, err) == (1, "") and len(decisions) == 1
    assert full[0].startswith("# ep-harness ") and "# launch plan: 0 launches: none; 1 skipped" in full
    assert full[-1].startswith("# nothing ran: all 1 checks were skipped") and len(full) > 8


def test_errors_go_to_stderr_in_one_line_with_their_exit_code(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nothing-here")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("ep-harness: error: ")
    with pytest.raises(SystemExit) as exc:
        cli.main(["verify", "--suit", "smoke"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and err == ("ep-harness verify: error: unrecognized arguments: --suit "
                                                         "smoke (did you mean '--suite'?) (see ep-harness verify --help)\n")


def test_a_quiet_console_keeps_what_a_command_is_for():
    out, err = io.StringIO(), io.StringIO()
    quiet = console.Console(quiet=True, stdout=out, stderr=err)
    quiet.info("# progress")
    quiet.warning("beside the progress")
    quiet.line("# FAILED: 1 unexpected")
    quiet.err("ep-harness: error: bad input")
    assert (out.getvalue(), err.getvalue()) == ("# FAILED: 1 unexpected\n", "ep-harness: error: bad input\n")
    loud = console.Console(stdout=out, stderr=err)
    loud.info("# progress")
    loud.warning("the nodes differ")
    assert out.getvalue().endswith("# progress\n# WARNING: the nodes differ\n")
    assert console.Console(stdout=Terminal(), colour=False).colour is False  # given: not decided again
    with console.using(quiet):
        assert console.current() is quiet
    assert console.current() is not quiet  # the one before it is current again
