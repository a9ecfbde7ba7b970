"""harness/run/precompile.py on the CPU, against the FAKE deep_gemm in tests/fake_deep_gemm (no GPU
here: it records each call's shapes, process and start/end time, and "compiles" by sleeping).

* the calls gathered from a suite's planned checks are exactly those the checks make (the
  real families run on a one-rank gloo group, the fake recording what they call);
* the pool makes them concurrently (overlap read from the recorded start/end events), prints
  progress, and the checks then find every kernel cached;
* failures (a call that raises, a worker that dies, DeepGEMM that does not import) are
  printed with the call and the worker's log, and the other calls still compile;
* a no-op on the CPU, without DeepGEMM checks, and when an earlier run compiled everything;
* a call that hangs, a worker that does not start and a thread that raises end in a failure
  (the check compiles the call itself), never in a hang; no worker, nor what it started,
  outlives compile_all(); the workers load the run's plugins; a bad worker count is one line.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ep_harness.run import precompile

from ep_harness.run import precompile_worker
from ep_harness.cases import load_suite
from ep_harness.check import single_check
from ep_harness.families.gemm_calls import KernelCall
from ep_harness.subject import Platform, get, load_all
from tests.conftest import REPO

FAKE_DIR = REPO / "tests" / "fake_deep_gemm"
H200 = Platform(backend="nccl", device="cuda", ranks=1, gpu_name="NVIDIA H200 (fake)", capability=(9, 0), gpus=1)
FUNCTION = {"deepgemm_bf16_contiguous": "m_grouped_bf16_gemm_nt_contiguous",
            "deepgemm_bf16_masked": "m_grouped_bf16_gemm_nt_masked", "deepgemm_bf16_dense": "bf16_gemm_nt",
            "deepgemm_fp8_contiguous": "m_grouped_fp8_gemm_nt_contiguous",
            "deepgemm_fp8_masked": "m_grouped_fp8_gemm_nt_masked", "deepgemm_fp8_dense": "fp8_gemm_nt"}
# The h200 suite's DeepGEMM cases at sizes a CPU runs in seconds: every layout, dtype, property
# and sweep of the suite, smaller n, k, m and MoE dimensions.
SMALL_GEMM = {"n": 256, "k": 256, "groups": 4}
SMALL_M = {"m_values": [1, 7, 64, 129, 300], "other_loads": [0, 33, 200], "expected_m_values": [1, 64, 256]}
SMALL_MOE = {"hidden": 256, "intermediate": 128, "num_experts": 8, "tokens": 16, "batch_sizes": [1, 7, 16]}


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    """The fake imported as `deep_gemm` in this process (and the adapters' cached import reset).
    A graph-mode run calls the subject eagerly (no CUDA graphs on the CPU): the same calls, as
    capturing one starts with eager warm-up calls of the same function on the same buffers."""
    from ep_harness.families import gemm
    from ep_harness.subjects.gemm import deepgemm

    monkeypatch.setattr(gemm, "replay_in_graph", lambda fn, out, inp: fn(out, inp))

    monkeypatch.syspath_prepend(str(FAKE_DIR))
    monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
    import deep_gemm

    assert deep_gemm.__version__.endswith("+fake")  # never the real one
    monkeypatch.setattr(deepgemm, "_state", {})
    deep_gemm.CALLS.clear()
    yield deep_gemm
    deep_gemm.CALLS.clear()


def small_h200_checks() -> list:
    """The DeepGEMM checks of cases/h200.toml (gemm and MoE families), made small."""
    load_all()
    checks = []
    for case in load_suite(REPO / "cases" / "h200.toml").cases:
        subject = get(case.subject)
        is_moe = case.subject == "composed_moe" and case.params.get("gemm", "").startswith("deepgemm")
        if not (case.subject in FUNCTION or is_moe):
            continue
        small = SMALL_MOE if is_moe else {**SMALL_GEMM, **{k: v for k, v in SMALL_M.items() if k in case.params}}
        for prop in case.properties:
            point = {k: v[0] for k, v in case.grid.items()}
            raw = {**case.params, **point, **small}
            if subject.name == "deepgemm_bf16_dense" or subject.name == "deepgemm_fp8_dense":
                raw.pop("groups")
            checks.append(single_check(subject, prop, raw, backend="nccl", check_id=f"{case.name}/{prop}"))
    return checks


def recorded_key(record: dict) -> tuple:
    return (record["fn"], tuple(record["a"]), tuple(record["b"]), tuple(record["d"]),
            None if record["sfa"] is None else tuple(record["sfa"]),
            None if record["sfb"] is None else tuple(record["sfb"]), record["expected_m"])


def planned_key(call: KernelCall) -> tuple:
    return (FUNCTION[call.subject], call.a, call.b, call.out, call.a_scale, call.b_scale, call.expected_m)


def calls_the_checks_make(checks, ctx, fake) -> set[tuple]:
    """Run every check's real observe (the warm-up a rank runs) against the fake."""
    from ep_harness.families import warm_up

    fake.CALLS.clear()
    for check in checks:
        warm_up(check, get(check.subject), ctx)
    return {recorded_key(r) for r in fake.CALLS}


def worker_env(tmp_path: Path, **extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_DIR), str(REPO)]),
            "FAKE_DEEP_GEMM_LOG": str(tmp_path / "calls.jsonl"), "DG_JIT_CACHE_DIR": str(tmp_path / "dg-cache"),
            **extra}


def compile_now(checks, platform, run_dir: Path, quiet: bool, **options):
    """precompile.start(), then wait for the compile to end (None when there was nothing
    to do): the whole compile, as these tests observe it."""
    background = precompile.start(checks, platform, run_dir, quiet, **options)
    if background is None:
        return None
    try:
        return background.finish()
    except BaseException:  # interrupted: end the workers before passing it on
        background.finish(stop_because="")
        raise


def log_records(tmp_path: Path) -> list[dict]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def most_at_once(records: list[dict]) -> int:
    """The largest number of calls in progress at one instant, from their start/end events."""
    events = sorted([(r["start"], 1) for r in records] + [(r["end"], -1) for r in records])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def test_gathered_calls_are_exactly_those_the_checks_make(fake_deep_gemm, one_rank):
    checks = small_h200_checks()
    assert {c.subject for c in checks} == set(FUNCTION) | {"composed_moe"}
    assert {c.params.layout for c in checks if c.family == "moe_layer"} == {"contiguous", "masked"}
    calls, own = precompile.planned_calls(checks)
    assert own == []
    planned = [planned_key(c) for c in calls]
    assert len(planned) == len(set(planned)), "a call gathered twice"
    made = calls_the_checks_make(checks, one_rank, fake_deep_gemm)
    assert set(planned) - made == set(), "gathered, never called (extra)"
    assert made - set(planned) == set(), "called, not gathered (missing)"
    assert len(made) > 30  # every sweep contributes (positive control for the comparison itself)


def test_a_changed_shape_is_noticed(fake_deep_gemm, one_rank):
    """Positive control: checks other than the ones planned make calls the plan lacks (each
    GEMM's reference check with another k: the calls of the checks left as planned are all
    planned, so they could add nothing to the difference)."""
    checks = small_h200_checks()
    planned = {planned_key(c) for c in precompile.planned_calls(checks)[0]}
    moved = [dataclasses.replace(c, params=dataclasses.replace(c.params, k=384)) for c in checks
             if c.family == "gemm" and c.property == "reference"]
    assert {c.subject for c in moved} == set(FUNCTION)
    assert calls_the_checks_make(moved, one_rank, fake_deep_gemm) - planned


def test_skipped_and_non_deepgemm_checks_need_nothing():
    load_all()
    torch_mm = single_check(get("torch_mm"), "reference", {"dtype": "bfloat16", "n": 256, "k": 256})
    assert precompile.planned_calls([torch_mm]) == ([], [])
    dg = single_check(get("deepgemm_bf16_dense"), "reference", {"dtype": "bfloat16", "n": 256, "k": 256})
    assert len(precompile.planned_calls([dg])[0]) == 1
    skipped = dataclasses.replace(dg, skip_reason="deep_gemm cannot be imported")
    assert precompile.planned_calls([skipped]) == ([], [])


def test_multi_rank_moe_is_left_to_its_check():
    load_all()
    moe = single_check(get("composed_moe"), "reference", {**SMALL_MOE, "gemm": "deepgemm_bf16_contiguous",
                                                          "world_size": 4})
    assert precompile.planned_calls([moe]) == ([], [moe.id])


def test_calls_compile_concurrently_with_progress_and_the_checks_find_them_cached(
        fake_deep_gemm, one_rank, tmp_path, monkeypatch):
    checks = small_h200_checks()
    calls = precompile.planned_calls(checks)[0][:12]
    lines: list[str] = []
    monkeypatch.setattr(precompile, "PROGRESS_EVERY_S", 0.0)  # a line per finished call
    env = worker_env(tmp_path, FAKE_DEEP_GEMM_COMPILE_S="1.5")
    outcome = precompile.compile_all(calls, 4, env, "cpu", tmp_path / "precompile.log", lines.append)
    assert (outcome.done, outcome.failed) == (12, [])
    records = log_records(tmp_path)
    assert sorted(map(recorded_key, records)) == sorted(map(planned_key, calls))  # each once, in workers
    assert all(r["outcome"] == "compiled" for r in records)
    assert len({r["pid"] for r in records}) >= 2 and os.getpid() not in {r["pid"] for r in records}
    assert 2 <= most_at_once(records) <= 4  # overlapping calls, never more than the pool
    progress = [re.fullmatch(r"compiling DeepGEMM kernels: (\d+)/12, \d+ s", line) for line in lines]
    assert all(progress), lines
    assert [int(m.group(1)) for m in progress] == list(range(1, 13))
    # The checks (here in this process, with the same cache directory) compile nothing now.
    monkeypatch.setenv("DG_JIT_CACHE_DIR", env["DG_JIT_CACHE_DIR"])
    fake_deep_gemm.CALLS.clear()
    from ep_harness.families import warm_up

    needing = {c.needed_by for c in calls}
    for check in checks:
        if check.id in needing:
            warm_up(check, get(check.subject), one_rank)
    hits = {recorded_key(r): r["outcome"] for r in fake_deep_gemm.CALLS}
    assert all(hits[planned_key(c)] == "cached" for c in calls)


def test_one_call_at_a_time_with_one_worker(tmp_path):
    """Control for the overlap measure: one worker never overlaps itself."""
    load_all()
    dg = single_check(get("deepgemm_bf16_contiguous"), "batch-invariance",
                      {"dtype": "bfloat16", **SMALL_GEMM, "m_values": [1, 129, 300]})
    calls = precompile.planned_calls([dg])[0]
    outcome = precompile.compile_all(calls, 1, worker_env(tmp_path, FAKE_DEEP_GEMM_COMPILE_S="0.2"), "cpu",
                                     tmp_path / "precompile.log", lambda line: None)
    assert outcome.done == len(calls) >= 2
    assert most_at_once(log_records(tmp_path)) == 1
    # the compile yields the CPU to the ranks beside it
    parent = os.getpriority(os.PRIO_PROCESS, 0)
    assert {r["nice"] for r in log_records(tmp_path)} == {min(19, parent + precompile_worker.NICENESS)}


def test_failures_are_printed_and_the_rest_still_compiles(tmp_path):
    load_all()
    dg = single_check(get("deepgemm_bf16_contiguous"), "batch-invariance",
                      {"dtype": "bfloat16", **SMALL_GEMM, "m_values": [1, 129, 300, 700]})
    calls = precompile.planned_calls([dg])[0]
    failing, crashing = calls[1], calls[2]
    env = worker_env(tmp_path, FAKE_DEEP_GEMM_FAIL=f'"a": [{failing.a[0]}, ',
                     FAKE_DEEP_GEMM_CRASH=f'"a": [{crashing.a[0]}, ')
    lines: list[str] = []
    # One compile process: the crash must be survived by the process started in its place
    # (the calls after it are made there), not by another thread's process.
    outcome = precompile.compile_all(calls, 1, env, "cpu", tmp_path / "precompile.log", lines.append)
    assert outcome.done == len(calls) - 2
    assert {c for c, _ in outcome.failed} == {failing, crashing}
    errors = dict(outcome.failed)
    assert errors[failing] == "RuntimeError: fake DeepGEMM: compilation failed for m_grouped_bf16_gemm_nt_contiguous"
    assert errors[crashing] == "the worker process died (exit code 134)"
    failed_lines = [line for line in lines if "FAILED" in line]
    assert len(failed_lines) == 2
    assert any(failing.describe() in line and errors[failing] in line for line in failed_lines)
    assert all(str(tmp_path / "precompile.log") in line for line in failed_lines)
    log = (tmp_path / "precompile.log").read_text()
    assert "NVCC compilation failed: fake error" in log and "Traceback" in log  # DeepGEMM's own print, kept
    compiled = {recorded_key(r) for r in log_records(tmp_path) if r["outcome"] == "compiled"}
    assert compiled == {planned_key(c) for c in calls} - {planned_key(failing), planned_key(crashing)}


def test_deep_gemm_that_does_not_import_fails_every_call_with_the_reason(tmp_path):
    load_all()
    dg = single_check(get("deepgemm_bf16_dense"), "batch-invariance",
                      {"dtype": "bfloat16", "n": 256, "k": 256, "m_values": [1, 300]})
    calls = precompile.planned_calls([dg])[0]
    env = worker_env(tmp_path, FAKE_DEEP_GEMM_IMPORT_ERROR="libcudart.so.13: cannot open shared object file")
    outcome = precompile.compile_all(calls, 1, env, "cpu", tmp_path / "precompile.log", lambda line: None)
    assert outcome.done == 0 and len(outcome.failed) == len(calls) == 2
    assert all("libcudart.so.13" in error for _, error in outcome.failed)


def test_precompile_is_a_no_op_on_the_cpu_and_without_deepgemm_checks(tmp_path, capsys):
    load_all()
    dg = single_check(get("deepgemm_bf16_dense"), "reference", {"dtype": "bfloat16", "n": 256, "k": 256})
    cpu = Platform(backend="gloo", device="cpu", ranks=4)
    assert compile_now([dg], cpu, tmp_path, quiet=False) is None
    torch_mm = single_check(get("torch_mm"), "reference", {"dtype": "bfloat16", "n": 256, "k": 256})
    assert compile_now([torch_mm], H200, tmp_path, quiet=False, device="cpu") is None
    assert compile_now([dg], H200, tmp_path, quiet=False, multi_node=True, device="cpu") is None
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "precompile.log").exists()  # no worker was started


def test_precompile_prints_progress_remembers_and_is_a_no_op_when_warm(fake_deep_gemm, tmp_path, monkeypatch,
                                                                      capsys):
    for k, v in worker_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("EP_HARNESS_PRECOMPILE_WORKERS", "1")  # what is printed and remembered, not the pool
    checks = small_h200_checks()[:4]
    calls = precompile.planned_calls(checks)[0]
    first = compile_now(checks, H200, tmp_path, quiet=False, device="cpu")
    assert first.done == len(calls) and not first.failed
    out = capsys.readouterr().out
    assert f"# compiling DeepGEMM kernels: {len(calls)} distinct calls (shapes) on " in out
    assert f"# compiling DeepGEMM kernels: {len(calls)}/{len(calls)}, " in out
    manifest = json.loads((tmp_path / "dg-cache" / precompile.MANIFEST).read_text())
    assert set(manifest["calls"]) == {c.key() for c in calls}
    (tmp_path / "calls.jsonl").unlink()
    assert compile_now(checks, H200, tmp_path, quiet=False, device="cpu") is None  # warm
    assert "compiled by an earlier run" in capsys.readouterr().out
    assert log_records(tmp_path) == []  # no worker called anything
    monkeypatch.setenv("DG_JIT_FAKE_SETTING", "1")  # another DeepGEMM setting: compiled again
    assert compile_now(checks, H200, tmp_path, quiet=True, device="cpu").done == len(calls)
    assert capsys.readouterr().out == ""  # -q: no progress


def test_quiet_still_prints_failures(fake_deep_gemm, tmp_path, monkeypatch, capsys):
    for k, v in worker_env(tmp_path, FAKE_DEEP_GEMM_FAIL="bf16_gemm_nt").items():
        monkeypatch.setenv(k, v)
    load_all()
    dg = single_check(get("deepgemm_bf16_dense"), "reference", {"dtype": "bfloat16", "n": 256, "k": 256})
    outcome = compile_now([dg], H200, tmp_path, quiet=True, device="cpu")
    assert len(outcome.failed) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("# compiling DeepGEMM kernels: FAILED deepgemm_bf16_dense")
    manifest = tmp_path / "dg-cache" / precompile.MANIFEST
    assert not manifest.exists() or json.loads(manifest.read_text())["calls"] == []  # not remembered


def test_calls_are_interleaved_across_gemms():
    load_all()
    calls = precompile.planned_calls(small_h200_checks())[0]
    order = precompile.interleaved(calls)
    assert sorted(map(planned_key, order)) == sorted(map(planned_key, calls))  # the same calls, reordered
    gemms = {(c.subject, c.b) for c in calls}
    assert len(gemms) >= 8
    assert len({(c.subject, c.b) for c in order[:len(gemms)]}) == len(gemms)  # every GEMM once, first


# -- what a broken worker must not do: hang the run, leave processes, fail plugin subjects -----

def leftover_workers(tmp_path: Path) -> list[int]:
    """Live processes started with this test's worker_env (its FAKE_DEEP_GEMM_LOG path)."""
    from tests.conftest import gone, processes_with_env

    marker = f"FAKE_DEEP_GEMM_LOG={tmp_path / 'calls.jsonl'}\0"
    return [pid for pid in processes_with_env(marker) if pid != os.getpid() and not gone(pid)]


@pytest.fixture
def ends_its_workers(tmp_path):
    """After the test, kills (by pid) any worker process it left, so that a failing test
    leaves nothing running; the test asserts on leftover_workers() itself."""
    yield
    for pid in leftover_workers(tmp_path):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def within(seconds: float, fn):
    """fn()'s result, or a test failure (not a hang) when it has not returned after `seconds`:
    a generous bound that only a hang exceeds, not a timing measurement."""
    import threading

    result, done = [], threading.Event()

    def run():
        try:
            result.append(fn())
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(seconds), f"still waiting after {seconds} s"
    assert result, "raised (see the thread's exception above)"
    return result[0]


def test_a_call_is_given_the_largest_timeout_of_the_checks_that_need_it():
    load_all()
    dg = single_check(get("deepgemm_bf16_dense"), "reference", {"dtype": "bfloat16", "n": 256, "k": 256})
    short, long = dataclasses.replace(dg, timeout_s=3.0), dataclasses.replace(dg, id="long", timeout_s=7.0)
    for checks in ([short, long], [long, short]):
        (call,) = precompile.planned_calls(checks)[0]
        assert call.timeout_s == 7.0
    (call,) = precompile.planned_calls([short])[0]
    assert call.timeout_s == 3.0 and call.needed_by == dg.id
    assert KernelCall.from_json(call.to_json()).timeout_s == 3.0  # what the worker receives


def test_a_hung_precompile_call_does_not_hang_the_run(fake_deep_gemm, tmp_path, monkeypatch, ends_its_workers):
    """A call that never returns (NVCC or a kernel launch hung: here the fake "compiles" for an
    hour) is given up after the needing check's timeout_s, its worker and what it started are
    ended, and the check compiles it itself (and times out there, with a record)."""
    for k, v in worker_env(tmp_path, FAKE_DEEP_GEMM_COMPILE_S="3600").items():
        monkeypatch.setenv(k, v)
    load_all()
    dg = dataclasses.replace(single_check(get("deepgemm_bf16_dense"), "reference",
                                          {"dtype": "bfloat16", "n": 256, "k": 256}), timeout_s=3.0)
    outcome = within(120, lambda: compile_now([dg], H200, tmp_path, quiet=True, device="cpu"))
    assert [(c.needed_by, error) for c, error in outcome.failed] == [(dg.id, "timed out after 3 s")]
    assert outcome.done == 0
    assert leftover_workers(tmp_path) == []
    manifest = json.loads((tmp_path / "dg-cache" / precompile.MANIFEST).read_text())
    assert manifest["calls"] == []  # not remembered: its check compiles it


def test_a_worker_that_does_not_start_stops_its_thread_and_the_rest_is_not_tried(tmp_path, monkeypatch,
                                                                                   ends_its_workers):
    """A worker whose start hangs (here importing deep_gemm takes an hour) fails its call after
    STARTUP_LIMIT_S; its thread stops rather than hang again on the next call, and the calls
    no thread is left to make fail as not tried (their checks compile them)."""
    monkeypatch.setattr(precompile, "STARTUP_LIMIT_S", 2.0)
    load_all()
    dg = single_check(get("deepgemm_bf16_dense"), "batch-invariance",
                      {"dtype": "bfloat16", "n": 256, "k": 256, "m_values": [1, 300, 700]})
    calls = precompile.planned_calls([dg])[0]
    lines: list[str] = []
    outcome = within(120, lambda: precompile.compile_all(calls, 1, worker_env(tmp_path, FAKE_DEEP_GEMM_IMPORT_S="3600"),
                                                         "cpu", tmp_path / "precompile.log", lines.append))
    assert outcome.done == 0 and [c for c, _ in outcome.failed] == calls
    assert [e for _, e in outcome.failed] == ["the worker process did not start within 2 s",
                                              "not tried: every compile process stopped",
                                              "not tried: every compile process stopped"]
    assert [line for line in lines if "not tried" in line] == [
        f"compiling DeepGEMM kernels: 2 call(s) not tried: every compile process stopped after a failure above "
        f"(their checks compile them; worker log: {tmp_path / 'precompile.log'})"]
    assert leftover_workers(tmp_path) == []


@pytest.mark.parametrize("fails, calls, threads, expected", [
    ("always", 1, 1, "returned 0 done ['OSError: [Errno 24] Too many open files']"),
    ("always", 3, 2, "returned 0 done ['OSError: [Errno 24] Too many open files', 'OSError: [Errno 24] Too many "
                     "open files', 'not tried: every compile process stopped']"),
    ("once", 4, 2, "returned 3 done ['OSError: [Errno 24] Too many open files']"),
])
def test_a_serve_thread_that_raises_does_not_hang_compile_all(tmp_path, monkeypatch, ends_its_workers, fails, calls,
                                                               threads, expected):
    """Starting a worker can raise (EMFILE, ENOMEM: one worker per CPU core, each a CUDA
    context): the call it was for fails with the reason, that thread stops, the others make
    the calls left, and compile_all() returns once no thread is left (a hang, which is what
    this shows, fails the test after 60 s: `within`)."""
    made = []

    class CannotStart(precompile._Worker):
        def __init__(self, *args):
            made.append(1)  # under compile_all's lock
            if fails == "always" or len(made) == 1:
                raise OSError(24, "Too many open files")  # as Popen in a serve thread can
            super().__init__(*args)

    monkeypatch.setattr(precompile, "_Worker", CannotStart)
    load_all()
    dg = single_check(get("deepgemm_bf16_dense"), "batch-invariance",
                      {"dtype": "bfloat16", "n": 256, "k": 256, "m_values": [1, 300, 700, 900][:calls]})
    planned = precompile.planned_calls([dg])[0]
    outcome = within(60, lambda: precompile.compile_all(planned, threads, worker_env(tmp_path), "cpu",
                                                        tmp_path / "precompile.log", lambda line: None))
    out = f"returned {outcome.done} done {sorted(e for _, e in outcome.failed)}"
    assert expected in out, out
    assert leftover_workers(tmp_path) == []


def test_precompile_knows_plugin_subjects(fake_deep_gemm, tmp_path, monkeypatch, capsys, ends_its_workers):
    """planned_calls() gathers calls of any _DeepGemm subclass, a plugin's too
    (tests/fallback_plugin's subject, which tests/test_gpu.py runs on the GPU): the workers
    load the run's plugins as the ranks do, so its calls are made, not failed."""
    for k, v in worker_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    load_all(["tests.fallback_plugin"])
    check = single_check(get("planted_deepgemm_fallback"), "reference",
                         {"dtype": "bfloat16", **SMALL_GEMM, "m_values": [7, 129]})
    calls = precompile.planned_calls([check])[0]
    assert calls and {c.subject for c in calls} == {"planted_deepgemm_fallback"}
    # Control: workers not told of the plugin cannot make its calls (and say why).
    unaware = compile_now([check], H200, tmp_path, quiet=True, device="cpu")
    assert len(unaware.failed) == len(calls)
    assert all("unknown subject 'planted_deepgemm_fallback'" in e for _, e in unaware.failed)
    capsys.readouterr()
    outcome = compile_now([check], H200, tmp_path, quiet=True, device="cpu",
                                    plugins=["tests.fallback_plugin"])
    assert (outcome.done, outcome.failed) == (len(calls), [])
    assert capsys.readouterr().out == ""  # -q and nothing failed: no line


def test_a_plugin_that_cannot_be_loaded_fails_every_call_with_the_reason(tmp_path, ends_its_workers):
    load_all()
    dg = single_check(get("deepgemm_bf16_dense"), "batch-invariance",
                      {"dtype": "bfloat16", "n": 256, "k": 256, "m_values": [1, 300]})
    calls = precompile.planned_calls([dg])[0]
    outcome = precompile.compile_all(calls, 1, worker_env(tmp_path), "cpu", tmp_path / "precompile.log",
                                     lambda line: None, plugins=["tests.no_such_plugin_module"])
    assert outcome.done == 0 and len(outcome.failed) == 2
    assert all(e.startswith("RuntimeError: the subjects cannot be loaded here: cannot import subject plugin "
                            "'tests.no_such_plugin_module'") for _, e in outcome.failed), outcome.failed


DIES_WITH_A_CHILD = '''
import os, subprocess
def use_deterministic_algorithms(flag):
    pass
def bf16_gemm_nt(a, b, d):
    # as DeepGEMM's JIT does, compile in a child process (NVCC); the worker then dies
    subprocess.Popen(["sleep", "300"])
    os._exit(134)
'''


def test_a_dead_workers_children_are_ended(tmp_path, ends_its_workers):
    """A worker that dies mid-call (segfault, OOM kill) leaves its NVCC child running unless
    its process group is ended: compile_all() ends it before starting the next worker."""
    from tests.conftest import gone, processes_with_env

    fake = tmp_path / "fake" / "deep_gemm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(DIES_WITH_A_CHILD)
    env = {**worker_env(tmp_path), "PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO)])}
    # Control: the measure sees a process started with this environment.
    control = subprocess.Popen(["sleep", "300"], env=env)
    try:  # until it has exec'd, /proc shows the forking parent's environment
        deadline = time.monotonic() + 10
        while control.pid not in leftover_workers(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert control.pid in leftover_workers(tmp_path)
    finally:
        control.kill()
        control.wait()
    load_all()
    dg = single_check(get("deepgemm_bf16_dense"), "reference", {"dtype": "bfloat16", "n": 256, "k": 256})
    calls = precompile.planned_calls([dg])[0]
    outcome = precompile.compile_all(calls, 1, env, "cpu", tmp_path / "precompile.log", lambda line: None)
    assert [e for _, e in outcome.failed] == ["the worker process died (exit code 134)"]
    started = [pid for pid in processes_with_env(f"FAKE_DEEP_GEMM_LOG={tmp_path / 'calls.jsonl'}")
               if pid != os.getpid()]
    assert all(gone(pid) for pid in started) and leftover_workers(tmp_path) == []


@pytest.mark.parametrize("value", ["auto", "0", "-3", "2.5"])
def test_a_bad_worker_count_is_one_clear_line(fake_deep_gemm, tmp_path, monkeypatch, value):
    """EP_HARNESS_PRECOMPILE_WORKERS that is not a positive integer is refused with one line
    naming it, before any worker starts."""
    from ep_harness.errors import HarnessError

    for k, v in worker_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("EP_HARNESS_PRECOMPILE_WORKERS", value)
    load_all()
    dg = single_check(get("deepgemm_bf16_dense"), "reference", {"dtype": "bfloat16", "n": 256, "k": 256})
    with pytest.raises(HarnessError) as exc:
        compile_now([dg], H200, tmp_path, quiet=True, device="cpu")
    message = str(exc.value)
    assert "\n" not in message and f"EP_HARNESS_PRECOMPILE_WORKERS={value!r} needs a positive integer" in message
    assert not (tmp_path / "precompile.log").exists()


def test_a_good_worker_count_is_taken(monkeypatch):
    """Control for the refusal above: a positive integer (spaces around it allowed) is used
    as given, and without the variable the count is the CPUs this process may use."""
    monkeypatch.setenv("EP_HARNESS_PRECOMPILE_WORKERS", " 3 ")
    assert precompile.worker_count() == 3
    monkeypatch.delenv("EP_HARNESS_PRECOMPILE_WORKERS")
    assert precompile.worker_count() == len(os.sched_getaffinity(0))
