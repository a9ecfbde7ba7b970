"""Nothing leaked, nothing shadowed: what a run records of the environment, what it lets the
working directory do, and what the installed pytest plugin costs a session that ignores it."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ep_harness.environment import recorded_env
from tests.conftest import REPO, gone, process_tree, run_cli, start_cli
from tests.forked_cli import cli_fork  # noqa: F401 (a fixture)
from tests.shared_runs import pass_run  # noqa: F401 (a fixture)

SMOKE = str(REPO / "cases" / "smoke.toml")
ONE_CHECK = "rs-native/rank-invariance/dtype=bfloat16/world_size=3"


def test_only_allowlisted_variables_are_recorded_and_credentials_are_redacted():
    env = recorded_env({"NCCL_ALGO": "allreduce:tree", "EP_API_TOKEN": "secret", "HOME": "/root",
                        "NCCL_IB_KEY": "hunter2", "AWS_SECRET_ACCESS_KEY": "x", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert env == {"NCCL_ALGO": "allreduce:tree", "NCCL_IB_KEY": "<redacted>", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.slow
def test_a_run_neither_leaks_a_token_nor_runs_the_working_directorys_modules(pass_run):
    """The shared passing run (tests/shared_runs.py) starts in a directory with a module that
    shadows the standard library and a `reports` package of the user's own, with credentials
    (SECRETS) in its environment."""
    proc, run_dir, records = pass_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = (run_dir / "environment.json").read_text()
    assert "secret-value" not in text and "another-secret" not in text
    assert '"NCCL_SOCKET_KEY": "<redacted>"' in text  # positive control: the run had the credentials
    [record] = [r for r in records.values() if r["case"] == "measured"]
    assert record["status"] == "ok"


def test_the_installed_plugin_costs_an_unrelated_session_nothing(tmp_path):
    (tmp_path / "test_plain.py").write_text(
        "import os, sys\n"
        "def test_plain():\n"
        "    assert 'torch' not in sys.modules\n"
        "    assert 'CUDA_VISIBLE_DEVICES' not in os.environ or os.environ.get('KEEP') == '1'\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"})
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "1 passed" in proc.stdout
    # ... while the plugin is loaded in that session (its marker is declared).
    listing = subprocess.run([sys.executable, "-m", "pytest", "--markers", "-p", "no:cacheprovider"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert "gpus(n)" in listing.stdout


def test_bad_input_never_writes_a_partial_run(tmp_path):
    proc = run_cli("verify", "--suite", SMOKE, "--check", ONE_CHECK, "--cpu-ranks", "0", "--out", str(tmp_path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "--cpu-ranks 0" in proc.stderr and not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_keeps_finished_results_and_leaves_no_process(tmp_path, sig, code):
    children = tmp_path / "children"
    children.mkdir()
    proc = start_cli("verify", "--suite", str(REPO / "tests" / "cases" / "interrupt.toml"), "--gpus", "0",
                     "--out", str(tmp_path / "out"), env={**os.environ, "EP_TEST_CHILD_PIDS": str(children)})
    deadline = time.time() + 180
    while len(list(children.iterdir())) < 3 and time.time() < deadline:  # every rank is inside the hang
        time.sleep(0.2)
    spawned = [int(p.read_text()) for p in children.iterdir()]
    assert len(spawned) == 3, proc.communicate()[0] if proc.poll() is not None else "ranks never reached the hang"
    [run_dir] = [p for p in (tmp_path / "out").iterdir() if p.name != "latest"]
    workers = process_tree(proc.pid)  # the launch: its agent, the ranks' fork server, the 3 ranks, their children
    assert len(workers) >= 5
    # Streamed: the finished check reaches results.jsonl (within the launcher's next polls) before the run ends.
    streamed = run_dir / "results.jsonl"
    deadline = time.time() + 10
    while not streamed.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert [json.loads(line)["case"] for line in streamed.read_text().splitlines()] == ["before"]
    sent = time.time()
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, output[-2000:]
    # the signal ended it (the hang alone runs to its 600 s timeout): a liveness bound, not a
    # speed claim, so it stays far above what a loaded 2-core machine takes (15 s flaked at load 16)
    assert time.time() - sent < 60
    assert all(gone(pid) for pid in workers + spawned), [p for p in workers + spawned if not gone(p)]
    statuses = {json.loads(line)["case"]: json.loads(line)["status"]
                for line in (run_dir / "results.jsonl").read_text().splitlines()}
    assert statuses == {"before": "ok", "hangs": "interrupted", "after": "interrupted"}
    assert (run_dir / "report.html").exists() and "INTERRUPTED (partial run)" in output
    assert "\n[1/3] " in output, output[-3000:]  # its row was printed as it finished, with a running count
    assert "interrupted by SIG" in (run_dir / "results.jsonl").read_text()


def test_rerun_commands_select_exactly_their_check_whatever_its_id():
    import fnmatch
    import shlex

    from ep_harness.run.verify import rerun_command

    cid = "odd[1]/rank-invariance/a*b?c"
    argv = shlex.split(rerun_command("suite.toml", cid, None, []))
    pattern = argv[argv.index("--check") + 1]
    assert fnmatch.fnmatchcase(cid, pattern)
    assert not fnmatch.fnmatchcase("odd1/rank-invariance/aXbYc", pattern)


def test_a_corrupt_history_line_is_skipped_and_appends_stay_whole(tmp_path, capsys):
    from ep_harness.records import append_line
    from ep_harness.reports.trends import load_history

    history = tmp_path / "history.jsonl"
    row = {"date": "2026-11-29T00:00:00+00:00", "run_id": "r", "check": "c", "status": "ok", "mismatched": 0,
           "seconds": 1.0}
    append_line(history, row)
    with open(history, "a", encoding="utf-8") as f:
        f.write('{"date": "2026-11-30T00:00:00+00:00", "run_id": "cut sh')  # a night cut short
    append_line(history, {**row, "run_id": "r2"})
    frame = load_history(history)
    assert list(frame["run_id"]) == ["r"]  # the broken line and the one glued to it are skipped
    assert "skipped a line that is not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("bad, said", [
    ({"date": 5, "run_id": "x", "check": "c"}, "date = 5 is not an ISO timestamp"),
    ({"date": "yesterday", "run_id": "x", "check": "c"}, "date = 'yesterday' is not an ISO timestamp"),
    ({"date": "2026-11-30T00:00:00+00:00", "check": "c"}, "run_id = None is not a string"),
    (["a", "list"], "not a JSON object"),
])
def test_a_history_row_the_trends_cannot_read_is_skipped_by_its_line(tmp_path, capsys, bad, said):
    """A hand-edited row ({"date": 5}) ended `make nightly` in a pandas traceback."""
    import json

    from ep_harness.records import append_line
    from ep_harness.reports.trends import load_history

    history = tmp_path / "history.jsonl"
    row = {"date": "2026-11-29T00:00:00+00:00", "run_id": "r", "check": "c", "status": "ok", "mismatched": 0}
    append_line(history, row)
    with open(history, "a", encoding="utf-8") as f:
        f.write(json.dumps(bad) + "\n")
    assert list(load_history(history)["run_id"]) == ["r"]
    assert f"history.jsonl:2: skipped a row: {said}" in capsys.readouterr().err


def test_two_runs_that_draw_the_same_id_never_merge(tmp_path, monkeypatch):
    from ep_harness.run import verify

    ids = iter(["same", "same", "other"])
    monkeypatch.setattr(verify, "new_run_id", lambda: next(ids))
    first, second = verify.claim_run_dir(tmp_path), verify.claim_run_dir(tmp_path)
    assert first == ("same", tmp_path / "same") and second == ("other", tmp_path / "other")


def test_a_run_in_which_nothing_ran_is_not_ok(tmp_path, cli_fork):
    proc = cli_fork("verify", "--suite", SMOKE, "--check", "graph/*", "--gpus", "0", "--out", str(tmp_path))
    assert proc.returncode == 1 and "nothing ran" in proc.stdout and "# NOTHING RAN" in proc.stdout
    proc = cli_fork("verify", "--suite", SMOKE, "--check", "graph/*", "--gpus", "0", "--out", str(tmp_path),
                   "--allow-empty")
    assert proc.returncode == 0


@pytest.mark.slow
def test_an_interrupted_exploration_leaves_no_process(tmp_path):
    proc = start_cli("explore", "all_gather_fold", "--world-size", "3", "--budget", "120",
                     "--store", str(tmp_path / "store.jsonl"), cwd=tmp_path, env=dict(os.environ))
    deadline = time.time() + 120
    while len(list(tmp_path.glob("explore/*/pid-rank*"))) < 3 and time.time() < deadline:
        time.sleep(0.2)
    ranks = [int(p.read_text()) for p in tmp_path.glob("explore/*/pid-rank*")]
    assert len(ranks) == 3, proc.communicate(timeout=60)[0][-2000:]
    launch = process_tree(proc.pid)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "exploration interrupted by SIGTERM" in output
    assert all(gone(pid) for pid in ranks + launch), [p for p in ranks + launch if not gone(p)]


def test_a_latin1_terminal_renders_any_record(tmp_path):
    from tests.test_reports import record, write_run

    run = write_run(tmp_path / "run", [record("a", reason="held → ≤ 2⁻⁸ · ü", status="unexpected", held=False,
                                              mismatched=1)])
    proc = subprocess.run([sys.executable, "-m", "ep_harness", "report", str(run)], capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONIOENCODING": "latin-1", "LC_ALL": "C"})
    assert proc.returncode == 1 and proc.stderr == b"", proc.stderr.decode("latin-1")[-2000:]  # a FAILED run
    assert "\u2264" in (run / "report.html").read_text(encoding="utf-8")  # the page keeps the text, in UTF-8
