"""Issue 32, section 4: tampered or absurd inputs get one line and exit 2, never a traceback
or a wrong verdict; an interrupted --fresh-processes run says interrupted; a case of which
nothing was measured is named; reason texts count what they say they count."""
import json
import os
import signal
import time
from pathlib import Path

import pytest

from ep_harness.run import plan
from ep_harness import subject as registry
from ep_harness.cases import load_suite
from ep_harness.environment import applicable_env, recorded_env
from ep_harness.errors import HarnessError
from ep_harness.regress.gate import gate, read_baseline, update_baseline
from ep_harness.run.plan import MAX_CHECKS, expand
from ep_harness.run.verify import base_record
from ep_harness.subject import Platform
from tests.conftest import REPO, gone, process_tree, start_cli
from tests.forked_cli import cli_fork, forked_pytest  # noqa: F401 (cli_fork: a fixture)
from tests.shared_runs import pass_run  # noqa: F401 (a fixture)
from tests.test_gate import baseline_records, run_with
from tests.test_redteam_plan import CASE

CPU = Platform(backend="gloo", device="cpu", ranks=4)


def one_line_exit_2(proc, named: str, out: Path | None = None):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert named in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    if out is not None:
        assert not out.exists()  # refused before anything ran or was written


# --- the launch-variable allowlist --------------------------------------------------

def test_the_allowlist_matches_whole_names_and_prefixes_only_where_they_end_in_an_underscore():
    for name in ("OMP_NUM_THREADSX", "OMP_NUM_THREADS_EVIL", "ONEDNN_MAX_CPU_ISAX", "PYTHONHASHSEEDS"):
        with pytest.raises(HarnessError, match=f"refusing launch variable '{name}'"):
            applicable_env({name: "1"}, "r")
        assert recorded_env({name: "1"}) == {}
    kept = {"OMP_NUM_THREADS": "2", "NCCL_ALGO": "ring", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert applicable_env(kept, "r") == kept and recorded_env(kept) == kept


# --- plan-time limits: timeout_s, seed -----------------------------------------------

def test_a_huge_finite_timeout_is_refused_at_plan_time(tmp_path, cli_fork):
    """1e15 s passed the finite-positive test and overflowed the workers' timedelta: every
    check of the launch became an error."""
    suite = tmp_path / "suite.toml"
    suite.write_text(CASE.format(timeout="1e15"))
    with pytest.raises(HarnessError, match=r"timeout_s = 1000000000000000.0 is more than a day \(86400 s\)"):
        load_suite(suite)
    one_line_exit_2(cli_fork("verify", "--suite", str(suite), "--gpus", "0", "--out", str(tmp_path / "out")),
                    "timeout_s = 1000000000000000.0 is more than a day", tmp_path / "out")
    suite.write_text(CASE.format(timeout="86400"))
    assert load_suite(suite).cases[0].timeout_s == 86400  # the limit itself is allowed


def _results(tmp_path, text: str) -> Path:
    path = tmp_path / "results.jsonl"
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return path


def _record(tmp_path, **changes) -> dict:
    registry.load_all()
    suite = tmp_path / "suite.toml"
    suite.write_text(CASE.format(timeout="60"))
    [check] = expand(load_suite(suite), CPU)
    return {**base_record(check, "r1", "rerun"), "status": "ok", **changes}


def test_a_record_with_a_huge_timeout_is_refused(tmp_path, cli_fork):
    results = _results(tmp_path, json.dumps(_record(tmp_path, timeout_s=1e15)) + "\n")
    one_line_exit_2(cli_fork("verify", "--from-record", str(results), "--gpus", "0", "--out", str(tmp_path / "out"),
                            cwd=tmp_path), "is more than a day (86400 s)", tmp_path / "out")


@pytest.mark.parametrize("how", ["case", "cli"])
def test_a_seed_past_64_bits_is_refused_at_plan_time(tmp_path, how, cli_fork):
    """seed = 2^64 planned, and every check of it became an error record (torch's manual_seed)."""
    suite = tmp_path / "suite.toml"
    text = CASE.format(timeout="60")
    suite.write_text(text.replace("world_size = 2", f"world_size = 2\nseed = {2**64}") if how == "case" else text)
    extra = ["--seed", str(2**64)] if how == "cli" else []
    proc = cli_fork("verify", "--suite", str(suite), "--gpus", "0", "--out", str(tmp_path / "out"), *extra)
    one_line_exit_2(proc, f"seed = {2**64}: values above 2147483647 are not supported", tmp_path / "out")


def test_the_largest_seed_allowed_runs(tmp_path):
    """Positive control for the limit: the largest seed is usable by every input generator."""
    from ep_harness import inputs
    from ep_harness.params import SEED_MAX

    import torch

    inputs.generator(SEED_MAX + 3000, "probe")  # scenarios add up to 3000 to a seed
    with pytest.raises((RuntimeError, ValueError)):
        inputs.generator(2**32, "probe")  # what the limit keeps out
    assert torch.is_tensor(inputs.values((4,), torch.bfloat16, SEED_MAX, "x"))


# --- tampered case files ---------------------------------------------------------------

@pytest.mark.parametrize("plugins, named", [
    ('"tests.planted"', "plugins = 'tests.planted' is not a list of module names; write plugins = ['tests.planted']"),
    ("[1]", "plugins = [1] is not a list of module names"),
    ('[""]', "plugins = [''] is not a list of module names"),
])
def test_plugins_must_be_a_list_of_module_names(tmp_path, plugins, named, cli_fork):
    """plugins = "name" was iterated letter by letter: "cannot import subject plugin 'n'"."""
    suite = tmp_path / "suite.toml"
    suite.write_text(f"[suite]\nplugins = {plugins}\n" + CASE.format(timeout="60"))
    one_line_exit_2(cli_fork("verify", "--suite", str(suite), "--gpus", "0", "--out", str(tmp_path / "out")),
                    named, tmp_path / "out")
    one_line_exit_2(cli_fork("list", "--suite", str(suite)), "is not a list of module names")


def test_a_case_file_that_is_not_utf8_gets_one_line(tmp_path, cli_fork):
    suite = tmp_path / "suite.toml"
    suite.write_bytes(CASE.format(timeout="60").replace('"one"', '"on\xe9"').encode("latin-1"))
    one_line_exit_2(cli_fork("verify", "--suite", str(suite), "--gpus", "0", "--out", str(tmp_path / "out")),
                    "not UTF-8 text (byte 0xe9", tmp_path / "out")


# --- tampered records: --from-record and report -----------------------------------------

@pytest.mark.parametrize("make, named", [
    (lambda r: json.dumps({**r, "expect": "sometimes"}) + "\n", ":1: check 'one/rank-invariance': expect 'sometimes'"),
    (lambda r: json.dumps({k: v for k, v in r.items() if k != "params"}) + "\n", ":1: check 'one/rank-invariance': "
                                                                                  "params is missing"),
    (lambda r: json.dumps({**r, "params": [1]}) + "\n", "params is not an object"),
    (lambda r: json.dumps({**r, "subject": None}) + "\n", "subject is None, not a name"),
    (lambda r: json.dumps(r) + "\n[1, 2]\n", ":2: a line must be a JSON object, not list"),
    (lambda r: json.dumps(r) + "\n" + '{"check": \n', ":2: invalid JSON"),
    (lambda r: json.dumps(r).encode() + b"\n\xff\xfe\n", ":2: not UTF-8 text (byte 0xff)"),
])
def test_from_record_names_the_damaged_line(tmp_path, make, named, cli_fork):
    results = _results(tmp_path, make(_record(tmp_path)))
    one_line_exit_2(cli_fork("verify", "--from-record", str(results), "--gpus", "0", "--out", str(tmp_path / "out"),
                            cwd=tmp_path), named, tmp_path / "out")


@pytest.mark.parametrize("tail, named", [
    (b"[1, 2]\n", "results.jsonl:3: a line must be a JSON object, not list"),
    (b"\xff\n", "results.jsonl:3: not UTF-8 text (byte 0xff)"),
    (b'{"check": \n', "results.jsonl:3: invalid JSON"),
])
def test_report_names_the_damaged_line(tmp_path, tail, named, cli_fork):
    run = run_with(tmp_path, "run", baseline_records())
    results = run / "results.jsonl"
    lines = results.read_bytes().splitlines(keepends=True)
    results.write_bytes(lines[0] + b"\n" + tail + b"".join(lines[1:]))  # a blank line 2: numbers are the file's
    proc = cli_fork("report", str(run))
    one_line_exit_2(proc, named)


# --- baselines ------------------------------------------------------------------------

def _baseline(tmp_path) -> tuple[Path, Path]:
    run = run_with(tmp_path, "run", baseline_records())
    return run, update_baseline(run, tmp_path / "baseline.jsonl")


def test_a_baseline_truncated_to_its_header_does_not_pass(tmp_path, cli_fork):
    """Every check read as "new" and the gate said PASSED."""
    run, base = _baseline(tmp_path)
    assert gate(run, base)["passed"]  # positive control: the whole baseline passes its own run
    lines = base.read_text().splitlines(keepends=True)
    for kept in (lines[:1], lines[:-1]):  # the header alone; one check cut off the end
        base.write_text("".join(kept))
        with pytest.raises(HarnessError, match=r"truncated or empty and would pass every check as new"):
            gate(run, base)
        proc = cli_fork("gate", str(run), "--baseline", str(base))
        one_line_exit_2(proc, "truncated or empty")
        assert "PASSED" not in proc.stdout


@pytest.mark.parametrize("damage, named", [
    (lambda lines: [lines[0], "{not json\n", *lines[2:]], "baseline.jsonl:2: invalid JSON"),
    (lambda lines: [lines[0], "[]\n", *lines[2:]], "baseline.jsonl:2: a line must be a JSON object"),
    (lambda lines: [lines[0], json.dumps({**json.loads(lines[1]), "status": "great"}) + "\n", *lines[2:]],
     "baseline.jsonl:2: check 'held-check': status 'great'"),
    (lambda lines: [lines[0], json.dumps({k: v for k, v in json.loads(lines[1]).items() if k != "check"}) + "\n",
                    *lines[2:]], "baseline.jsonl:2: has no check id"),
    (lambda lines: [lines[0], json.dumps({**json.loads(lines[1]), "mismatched": "x"}) + "\n", *lines[2:]],
     "mismatched = 'x' is not a count"),
    (lambda lines: [lines[0], json.dumps({**json.loads(lines[1]), "params": None}) + "\n", *lines[2:]],
     "params is not an object"),
    (lambda lines: ['{"fingerprint": 3}\n', *lines[1:]], "baseline.jsonl:1: the fingerprint is not an object"),
])
def test_a_tampered_baseline_line_is_named_with_its_own_line_number(tmp_path, damage, named, cli_fork):
    run, base = _baseline(tmp_path)
    base.write_text("".join(damage(base.read_text().splitlines(keepends=True))))
    with pytest.raises(HarnessError, match="restore the baseline from git"):
        read_baseline(base)
    one_line_exit_2(cli_fork("gate", str(run), "--baseline", str(base)), named)


def test_a_baseline_of_an_older_harness_without_a_count_still_gates(tmp_path):
    run, base = _baseline(tmp_path)
    lines = base.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    assert header["checks"] == len(lines) - 1
    base.write_text(json.dumps({"fingerprint": header["fingerprint"]}) + "\n" + "".join(lines[1:]))
    assert gate(run, base)["passed"]


# --- planning: linear, and bounded ---------------------------------------------------------

class CountedId(str):
    """A check id that counts how often it is compared for equality."""

    compared = 0

    def __eq__(self, other):
        CountedId.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def _big_suite(tmp_path, n: int) -> Path:
    suite = tmp_path / "big.toml"
    suite.write_text(CASE.format(timeout="60").replace("timeout_s = 60", "") + f"[case.grid]\nseed = {list(range(n))}\n")
    return suite


def test_duplicate_check_ids_are_found_in_linear_comparisons(tmp_path, monkeypatch):
    """`ids.count(i)` per id: n^2 comparisons (4 x 10^4 checks took 22 s)."""
    registry.load_all()
    original = plan.check_id
    monkeypatch.setattr(plan, "check_id", lambda *a: CountedId(original(*a)))
    n = 3000
    loaded = load_suite(_big_suite(tmp_path, n))
    CountedId.compared = 0
    assert len(expand(loaded, CPU)) == n
    assert CountedId.compared <= 2 * n, CountedId.compared  # n^2 = 9,000,000 before
    # ... and a repeated id is still found (positive control)
    monkeypatch.setattr(plan, "check_id", lambda case, prop, point: CountedId(f"{case}/{prop}"))
    with pytest.raises(HarnessError, match=r"check ids repeat \(one/rank-invariance\)"):
        expand(loaded, CPU)


def test_a_grid_above_the_limit_is_refused_before_any_check_is_built(tmp_path, monkeypatch, cli_fork):
    registry.load_all()
    built = []
    monkeypatch.setattr(plan, "planned", lambda *a, **k: built.append(1))
    suite = tmp_path / "huge.toml"
    suite.write_text(CASE.format(timeout="60") + "[case.grid]\nseed = %s\nrepeats = %s\n"
                     % (list(range(1000)), list(range(1, 1001))))  # 10^6 checks
    with pytest.raises(HarnessError, match=rf"expand to 1,000,000 checks, more than the limit of {MAX_CHECKS:,} "
                                           r"\(the largest: case 'one'\)"):
        expand(load_suite(suite), CPU)
    assert built == []
    one_line_exit_2(cli_fork("verify", "--suite", str(suite), "--gpus", "0", "--out", str(tmp_path / "out")),
                    "more than the limit of 100,000", tmp_path / "out")


# --- a case of which nothing was measured -------------------------------------------------

@pytest.mark.slow
def test_a_case_whose_subject_skips_every_check_is_named_beside_passing_ones(pass_run):
    """tests/cases/unmeasured.toml's cases, in the shared passing run (tests/shared_runs.py)."""
    proc, _, _ = pass_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]  # the measured cases passed
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("# WARNING")]
    assert warnings == ["# WARNING: case 'library-missing' was not measured: all 2 of its check(s) were skipped "
                        "(subject 'planted_never_available': planted: libmissing is not installed)"], proc.stdout


def test_pytest_ep_suite_of_only_skipped_checks_exits_1_as_verify_does(tmp_path, cli_fork):
    """pytest exits 0 when every item skips; `verify` of the same checks exits 1 (nothing ran)."""
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly",
            "--ep-suite", "tests/cases/unmeasured.toml", "--ep-gpus", "0", "-k", "library", "tests/test_gate.py"]
    proc = forked_pytest(*args, cwd=REPO, env=dict(os.environ))  # `python -m pytest ARGS`
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "2 skipped" in proc.stdout and "nothing ran: none of the 2 check(s) passed" in proc.stdout, proc.stdout
    allowed = forked_pytest(*args, "--ep-allow-empty", cwd=REPO, env=dict(os.environ))
    assert allowed.returncode == 0, allowed.stdout[-2000:]
    alone = cli_fork("verify", "--suite", "tests/cases/unmeasured.toml", "--check", "library-missing", "--gpus", "0",
                    "--no-report", "--out", str(tmp_path))
    assert alone.returncode == 1 and "nothing ran" in alone.stdout  # the two now agree


# --- a signal during --fresh-processes relaunches --------------------------------------------

@pytest.mark.slow
def test_a_signal_during_fresh_process_relaunches_leaves_no_ok_without_its_relaunch(tmp_path, cli_fork):
    pids = tmp_path / "pids"
    pids.mkdir()
    proc = start_cli("verify", "--suite", "tests/cases/interrupt_fresh.toml", "--gpus", "0", "--fresh-processes", "2",
                     "--out", str(tmp_path / "out"), env={**os.environ, "EP_TEST_CHILD_PIDS": str(pids)})
    deadline = time.time() + 300
    while len(list(pids.iterdir())) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    ranks = [int(p.read_text()) for p in pids.iterdir()]
    assert len(ranks) == 3, proc.communicate()[0][-3000:] if proc.poll() is not None else "the relaunch never hung"
    launch = process_tree(proc.pid)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output[-3000:]
    assert all(gone(pid) for pid in ranks + launch), [p for p in ranks + launch if not gone(p)]
    [run_dir] = [p for p in (tmp_path / "out").iterdir() if p.name != "latest"]
    records = {r["case"]: r for r in map(json.loads, (run_dir / "results.jsonl").read_text().splitlines())}
    steady, hung = records["steady"], records["hangs-in-relaunch"]
    # the one whose relaunch finished before the signal is compared across both launches
    assert steady["status"] == "ok" and steady["fresh_processes"]["launches"] == 2, steady
    assert hung["status"] == "interrupted", hung
    assert hung["reason"].startswith("the run was interrupted by SIGINT before this check's relaunches in fresh "
                                     "processes finished (0 of 1); its first launch was ok")
    assert "INTERRUPTED (partial run)" in output and "\n# OK" not in output, output[-3000:]
    report = cli_fork("report", str(run_dir))
    assert "INTERRUPTED (partial run)" in report.stdout, report.stdout[-2000:]


# --- reason texts ------------------------------------------------------------------------------

def test_run_to_run_counts_repeats_as_repeats_and_copies_as_copies():
    """"2 of 11 repeats differ" at 3 repeats: the rows are repeats x copies."""
    from types import SimpleNamespace

    from ep_harness.measurement import Measurement
    from ep_harness.verdict import decide

    def reason(rows, differing, repeats):
        check = SimpleNamespace(expect="holds", property="run-to-run", params=SimpleNamespace(repeats=repeats))
        m = Measurement(comparison="bitwise", held=False, mismatched=5, total=100, rows=rows, rows_differing=differing)
        return decide(check, m)[1]

    assert "2 of 11 compared copies (3 repeats x 4 copies) differ from the first" in reason(12, 2, 3)
    assert "repeats differ" not in reason(12, 2, 3)
    assert "1 of 2 repeats differ from the first" in reason(3, 1, 3)


def test_an_invariance_checks_first_copy_is_not_called_the_reference():
    import math

    import torch

    from ep_harness.compare import compare_bitwise
    from ep_harness.measurement import Measurement
    from ep_harness.reports.text import mismatch_text
    from ep_harness.verdict import decide
    from types import SimpleNamespace

    copies = torch.tensor([[1.0, 2.0], [math.nan, 2.0]])
    b = compare_bitwise(copies, copies[0])
    assert b.nonfinite == {"nan": 1}
    m = Measurement(comparison="bitwise", held=False, mismatched=b.mismatched, total=b.total, rows=2, rows_differing=1, nonfinite=b.nonfinite)
    for prop, against in (("rank-invariance", "the first copy"), ("reference", "the reference")):
        status, why = decide(SimpleNamespace(expect="holds", property=prop, params=None), m)
        assert status == "unexpected" and f"1 NaN where {against} is finite" in why, why
        text = mismatch_text({"property": prop, "mismatched": 1, "total": 4, "nonfinite": b.nonfinite, "rerun": "x"})
        assert f"NaN where {against} is finite: 1" in text, text
