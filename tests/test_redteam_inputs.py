"""Red-team review of the commands (2026-12-07): bad input that ended in a traceback, or in a
verdict the run did not earn. Each now gives one line naming the problem and its fix, exit 2,
before anything is written; each has a control that still works."""
import os
import signal
import time

import pytest

from tests.conftest import run_cli
from tests.test_gate import ENV, baseline_records
from tests.test_reports import write_run

PLUGINS = {  # module text -> what the one line says
    "import not_installed_lib_xyz\n": "needs the module 'not_installed_lib_xyz', which is not installed here: install",
    "def f(:\n": "raised SyntaxError at ",
    "raise RuntimeError('boom at import')\n": "raised RuntimeError at ",
    "import sys\nsys.exit(3)\n": "called sys.exit(3) while it was imported",
}


@pytest.mark.parametrize("text", PLUGINS)
@pytest.mark.parametrize("command", [["list"], ["verify", "--check", "ar-slice/*", "--out", "out"]])
def test_a_plugin_that_does_not_import_is_one_line(tmp_path, text, command):
    (tmp_path / "broken_plugin.py").write_text(text)
    proc = run_cli(*command, "--plugin", "broken_plugin", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout[-500:], proc.stderr[-2000:])
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "subject plugin 'broken_plugin' " + PLUGINS[text] in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_plugin_that_imports_is_listed(tmp_path):  # control
    (tmp_path / "fine_plugin.py").write_text("import math\n")
    proc = run_cli("list", "--plugin", "fine_plugin", cwd=tmp_path)
    assert proc.returncode == 0 and "# subjects:" in proc.stdout, proc.stderr


@pytest.mark.parametrize("variable, value, said, good", [
    ("EP_HARNESS_START_TIMEOUT_S", "abc", "needs a positive number of seconds", "30"),
    ("EP_HARNESS_NODE_TIMEOUT_S", "-1", "needs a positive number of seconds", "2.5"),
    ("EP_HARNESS_START_TIMEOUT_S", "nan", "needs a positive number of seconds", "180"),
    ("EP_HARNESS_PIN_RANKS", "banana", "takes 0 (off: no CPU ranks placed on cores) or 1 (on)", "0"),
    ("EP_HARNESS_AGENT_FORKS", "yes", "takes 0 (off: no torchrun agents forked from the command) or 1 (on)", "1"),
])
def test_a_malformed_harness_variable_is_one_line_before_anything_runs(tmp_path, variable, value, said, good):
    proc = run_cli("verify", "--check", "ar-slice/*", "--out", str(tmp_path / "out"),
                   env={**os.environ, variable: value})
    assert proc.returncode == 2 and f"{variable}={value!r} {said}" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    assert run_cli("list", env={**os.environ, variable: good}).returncode == 0  # control: a value it takes


@pytest.mark.parametrize("argv", [
    ["verify", "--out", "{file}"], ["verify", "--junit-xml", "{dir}"], ["verify", "--summary-md", "{dir}"],
    ["selftest", "--out", "{file}"], ["report", "{run}", "--out", "{dir}"], ["gate", "{run}", "--baseline", "{dir}"],
    ["baseline", "update", "{run}", "--baseline", "{dir}"], ["nightly", "--history", "{dir}"],
    ["explore", "all_gather_fold", "--store", "{dir}"],
])
def test_a_path_of_the_wrong_kind_is_refused_before_the_run(tmp_path, argv):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    run = write_run(tmp_path / "run", baseline_records(), ENV)
    argv = [a.format(file=tmp_path / "a-file", dir=tmp_path / "a-dir", run=run) for a in argv]
    proc = run_cli(*argv)
    kind = "a directory; give a file's path" if str(tmp_path / "a-dir") in argv else "a file; give a directory's path"
    assert proc.returncode == 2 and kind in proc.stderr and proc.stderr.count("\n") == 1, (argv, proc.stderr[-1500:])
    assert sorted(p.name for p in (tmp_path / "a-dir").iterdir()) == [] and not (run / "report.html").exists()


def test_a_run_its_environment_calls_interrupted_is_reported_interrupted(tmp_path):
    """Every record finished (the signal came after the last check), or the interrupted ones
    were deleted: environment.json still names the signal, and the report says so."""
    run = write_run(tmp_path / "run", baseline_records(), {**ENV, "interrupted": "SIGINT"})
    proc = run_cli("report", str(run))
    assert proc.returncode == 1 and "# INTERRUPTED (by SIGINT): " in proc.stdout, proc.stdout[-1500:]
    assert "INTERRUPTED (by SIGINT)" in (run / "report.html").read_text()
    whole = write_run(tmp_path / "whole", baseline_records(), ENV)  # control
    proc = run_cli("report", str(whole))
    assert proc.returncode == 0 and "# OK: " in proc.stdout


CASE = '''[suite]
name = "t"
[[case]]
name = "c"
subject = "all_gather_fold"
properties = ["rank-invariance"]
{line}
[case.grid]
dtype = ["bfloat16"]
'''


@pytest.mark.parametrize("line, said", [
    ('expect = "holds"\nenv = "X=1"', "env = 'X=1' is not a table"),
    ('expect = "holds"\nenv = ["X"]', "env = ['X'] is not a table"),
    ('expect = "holds"\nenv = { "A=B" = "1" }', "env has the variable name 'A=B'"),
    ('expect = "holds"\nenv = { "" = "1" }', "env has the variable name ''"),
    ('expect = "holds"\nenv = { X = { y = 1 } }', "env X = {'y': 1} is not a string or a number"),
    ('expect = { nccl = "holds" }', "expect names no expectation for gloo"),
])
def test_a_case_table_the_harness_cannot_run_as_written_is_one_line(tmp_path, line, said):
    suite = tmp_path / "suite.toml"
    suite.write_text(CASE.format(line=line))
    for command in (["list", "--suite", str(suite)], ["verify", "--suite", str(suite), "--out", str(tmp_path / "o")]):
        proc = run_cli(*command)
        assert proc.returncode == 2 and f"case 'c': {said}" in proc.stderr, (command, proc.stderr[-1500:])
        assert proc.stderr.count("\n") == 1 and not (tmp_path / "o").exists()
    suite.write_text(CASE.format(line='expect = { gloo = "holds", nccl = "holds" }\nenv = { X = 1 }'))  # control
    proc = run_cli("list", "--suite", str(suite))
    assert proc.returncode == 0 and "c/rank-invariance/dtype=bfloat16" in proc.stdout, proc.stderr


@pytest.mark.parametrize("option, value", [("--budget", "0"), ("--budget", "nan"), ("--budget", "inf"),
                                           ("--max-examples", "0"), ("--world-size", "-2")])
def test_an_explore_that_could_try_nothing_is_refused(tmp_path, option, value):
    proc = run_cli("explore", "all_gather_fold", option, value, "--store", str(tmp_path / "s.jsonl"))
    assert proc.returncode == 2 and f"argument {option}: {value!r} is not a" in proc.stderr, proc.stderr[-1500:]
    assert not (tmp_path / "s.jsonl").exists()


def test_torch_that_does_not_import_is_one_line(tmp_path):
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: cannot open shared object file')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "shadow")}
    for command in (["list"], ["verify", "--check", "ar-slice/*", "--out", str(tmp_path / "o")]):
        proc = run_cli(*command, env=env, code="import sys; from ep_harness.cli import main; sys.exit(main())")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc.stderr[-1500:])
        assert "torch does not import here (libtorch_cpu.so: cannot open shared object file)" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_report_of_a_run_where_nothing_ran_fails_as_its_verify_did(tmp_path):
    skipped = [dict(r, status="skipped", held=None, mismatched=None, total=None, reason="needs 8 ranks")
               for r in baseline_records()]
    proc = run_cli("report", str(write_run(tmp_path / "run", skipped, ENV)))
    assert proc.returncode == 1 and "# NOTHING RAN" in proc.stdout, proc.stdout[-1500:]


def test_a_signal_before_the_first_launch_leaves_no_run_directory(tmp_path):
    """Between claiming the run directory and the first launch (whose own handler keeps what
    finished), SIGTERM left an empty run directory, and SIGINT a KeyboardInterrupt traceback."""
    from ep_harness.launch.processes import Interrupted
    from ep_harness.run.verify import claim_run_dir, nothing_left_on_signal

    with pytest.raises(Interrupted, match="SIGTERM"):
        with nothing_left_on_signal() as claimed:
            claimed.append(claim_run_dir(tmp_path)[1])
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert list(tmp_path.iterdir()) == []
    with nothing_left_on_signal() as claimed:  # control: no signal, the directory stays for the run
        claimed.append(claim_run_dir(tmp_path)[1])
    assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("raised, code, said", [
    ("ctrl-c", 130, "interrupted by SIGINT"),
    ("before-start", 143, "interrupted by SIGTERM; before any check ran; nothing was written"),
])
def test_the_command_reports_an_early_signal_in_one_line(monkeypatch, capsys, raised, code, said):
    from ep_harness import cli
    from ep_harness.run import verify

    def interrupted(*args, **kwargs):
        if raised == "ctrl-c":
            raise KeyboardInterrupt
        with verify.nothing_left_on_signal():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)

    monkeypatch.setattr(verify, "_verify", interrupted)
    assert cli.main(["verify", "--check", "ar-slice/*"]) == code
    err = capsys.readouterr().err
    assert err == f"ep-harness: {said}\n"


@pytest.mark.parametrize("argv, said", [
    (["--seed", "-5"], "argument --seed: '-5' is not a seed (a whole number >= 0)"),
    (["--suite", "{dir}"], "is a directory; give a case file (a .toml) or a suite's name"),
    (["--nnodes", "0"], "--nnodes 0: give 1 or more nodes"),
    (["--from-record", "{empty}"], "empty.jsonl holds no record; pass a results.jsonl that a run wrote"),
    (["--suite", "smoke", "--from-record", "{empty}"], "--suite and --from-record both name the checks to run"),
])
def test_a_misleading_message_now_names_the_argument_at_fault(tmp_path, argv, said):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "a-dir").mkdir()
    argv = [a.format(dir=tmp_path / "a-dir", empty=tmp_path / "empty.jsonl") for a in argv]
    proc = run_cli("verify", *argv, "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and said in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-1500:]
    assert not (tmp_path / "out").exists()


def test_a_case_file_saved_with_a_byte_order_mark_loads(tmp_path):
    suite = tmp_path / "suite.toml"
    suite.write_bytes("\ufeff".encode() + CASE.format(line='expect = "holds"').encode())
    proc = run_cli("list", "--suite", str(suite))
    assert proc.returncode == 0 and "c/rank-invariance/dtype=bfloat16" in proc.stdout, proc.stderr


@pytest.mark.parametrize("example, said", [
    ({"property": "rank-invariance", "params": {"dtype": "bfloat16", "hiden": 64}}, "unknown parameter 'hiden'"),
    ({"property": "no-such-property", "params": {}}, "not a counterexample of all_gather_fold"),
    ([1], "not a counterexample of all_gather_fold"),
])
def test_an_edited_counterexample_store_is_named_by_its_line_before_the_search(tmp_path, example, said):
    """A tampered store line ended the search in a rank's traceback."""
    import json

    store = tmp_path / "store.jsonl"
    good = {"subject": "all_gather_fold", "found": "x",  # as a search stores it: every searched parameter
            "example": {"property": "rank-invariance", "params": {"dtype": "bfloat16", "hidden": 64, "seed": 3}}}
    store.write_text(json.dumps(good) + "\n" + json.dumps({**good, "example": example}) + "\n")
    proc = run_cli("explore", "all_gather_fold", "--store", str(store), "--budget", "5")
    assert proc.returncode == 2 and "store.jsonl:2: " in proc.stderr and said in proc.stderr, proc.stderr[-1500:]
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "explore").exists()
