"""The DeepGEMM compile beside the launches (harness/run/precompile.py `start`/`Background`,
harness/run/verify.py, the ranks' wait in harness/run/worker.py), on the CPU.

A real `verify` on 2 gloo ranks (tests/cases/overlap.toml) with the compile played by a
Background whose work the test controls: the check that "needs the kernels" (planned first)
runs after the launch's other checks and only once the head wrote the marker, while the others
ran during the compile; results.jsonl stays in plan order; without a compile (start() None)
nothing is reordered and nothing waits (the positive control: the same ordering assertions
fail there). Then the parts: the stable partition, which checks wait, the compile's limit and
a compile that raises (the marker is written either way), the ranks' own limit (one line), the
worker count while ranks run, and a signal during the overlap (no worker, rank or record lost).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from ep_harness.run import precompile
from ep_harness.check import single_check
from ep_harness.subject import get, load_all
from tests.conftest import REPO, gone, process_tree, start_cli
from tests.test_precompile import (  # noqa: F401  (fake_deep_gemm, ends_its_workers: fixtures)
    H200, compile_now, ends_its_workers, fake_deep_gemm, leftover_workers, small_h200_checks, worker_env, within)

SUITE = REPO / "tests" / "cases" / "overlap.toml"
NEEDS = "needs-kernels"  # the case whose check "needs the kernels"; first in the plan
PLAN = [NEEDS, "first-other", "second-other"]
WIDTH = {NEEDS: 384, "first-other": 256, "second-other": 128}


def streamed(run_dir: Path) -> list[dict]:
    path = run_dir / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def until(condition, seconds: float = 60.0) -> None:
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.05)


def run_verify(tmp_path, monkeypatch, capsys, fake_start):
    from ep_harness.run.verify import RunOptions, verify

    monkeypatch.setenv("OVERLAP_STAMPS", str(tmp_path / "stamps.jsonl"))
    monkeypatch.setattr(precompile, "start", fake_start)
    code, run_dir = verify(RunOptions(suite=str(SUITE), gpus=0, cpu_ranks=2, out_root=tmp_path / "out",
                                      render=False))
    out = capsys.readouterr().out
    stamps = [json.loads(line) for line in (tmp_path / "stamps.jsonl").read_text().splitlines()]
    first_call = {case: min(s["time"] for s in stamps if s["width"] == w) for case, w in WIDTH.items()}
    return code, run_dir, out, first_call


def compile_after_the_others(run_dir: Path, extra_s: float, raises: bool = False):
    """The compile's work: it ends `extra_s` after the two other checks' records were streamed
    (bounded: without the reordering they never come first)."""
    def work(stop):
        until(lambda: len(streamed(run_dir)) >= 2 or stop.is_set(), 30)
        time.sleep(extra_s)
        if raises:
            raise RuntimeError("planted: the compile broke")
        return precompile.Outcome(done=1)
    return work


def rows(out: str) -> list[str]:
    """The cases in the order their rows were printed as they finished."""
    return [text.split()[3] for text in out.splitlines() if text.startswith("[") and text.split()[0].endswith("/3]")]


def test_the_checks_needing_kernels_run_after_the_compile_and_the_others_during_it(tmp_path, monkeypatch, capsys):
    background = {}

    def fake_start(checks, platform, run_dir, quiet, multi_node=False, plugins=(), ranks=0):
        needing = {c.id for c in checks if c.case == NEEDS}
        background["it"] = precompile.Background(compile_after_the_others(run_dir, 2.5), run_dir / precompile.MARKER,
                                                 needing, 120, lambda text: None).start()
        return background["it"]

    code, run_dir, out, first_call = run_verify(tmp_path, monkeypatch, capsys, fake_start)
    marker = json.loads((run_dir / precompile.MARKER).read_text())
    assert marker["error"] is None and marker["timed_out"] is False
    # The others ran while the compile ran; the check needing it only after the marker.
    assert first_call["first-other"] < first_call["second-other"] < marker["time"] < first_call[NEEDS]
    assert rows(out) == ["first-other", "second-other", NEEDS]  # streamed as they finished
    assert "# launching 3 checks on 2 gloo ranks; the 1 needing the DeepGEMM kernels last, once they are " \
           "compiled\n" in out
    records = streamed(run_dir)
    assert [r["case"] for r in records] == PLAN  # results.jsonl rewritten in plan order
    # Its wait (2.5 s and more) is not its time: its timeout_s is 2 and it did not time out.
    assert records[0]["timeout_s"] == 2 and records[0]["status"] == "vacuous", records[0]
    waited = json.loads((run_dir / "environment.json").read_text())["timing"]["precompile_wait_s"]
    assert 2.0 < waited < 30
    assert f", {waited} s waiting for the DeepGEMM compile" in out


def test_without_a_compile_nothing_is_reordered_and_nothing_waits(tmp_path, monkeypatch, capsys):
    """Positive control for the test above: start() finds nothing to do (None) while the same
    work runs beside the run; the check planned first then runs first, before that work ends,
    so the ordering assertions above fail here."""
    ended = []

    def fake_start(checks, platform, run_dir, quiet, multi_node=False, plugins=(), ranks=0):
        work = compile_after_the_others(run_dir, 0.0)
        threading.Thread(target=lambda: ended.append((work(threading.Event()), time.time())), daemon=True).start()
        return None

    code, run_dir, out, first_call = run_verify(tmp_path, monkeypatch, capsys, fake_start)
    until(lambda: ended, 30)
    assert first_call[NEEDS] < ended[0][1]  # ran before the "compile" ended: the assertion above fails
    assert rows(out) == PLAN
    assert "# launching 3 checks on 2 gloo ranks\n" in out
    assert [r["case"] for r in streamed(run_dir)] == PLAN
    assert not (run_dir / precompile.MARKER).exists()
    assert json.loads((run_dir / "environment.json").read_text())["timing"]["precompile_wait_s"] == 0
    assert "waiting for the DeepGEMM compile" not in out


# -- the parts -----------------------------------------------------------------------------

def test_compiled_last_is_a_stable_partition():
    @dataclasses.dataclass
    class C:
        id: str

    rng = random.Random(25)
    for _ in range(200):
        checks = [C(f"c{i}") for i in range(rng.randint(0, 12))]
        waits = {c.id for c in checks if rng.random() < 0.4}
        ordered = precompile.compiled_last(checks, waits)
        assert sorted(c.id for c in ordered) == sorted(c.id for c in checks)  # a permutation
        cut = sum(c.id not in waits for c in checks)
        assert all(c.id not in waits for c in ordered[:cut]) and all(c.id in waits for c in ordered[cut:])
        assert ordered[:cut] == [c for c in checks if c.id not in waits]  # each part in plan order
        assert ordered[cut:] == [c for c in checks if c.id in waits]
    assert precompile.compiled_last([C("a"), C("b")], {"a"}) != [C("a"), C("b")]  # control: it does move


def test_every_check_making_a_call_still_to_compile_waits(fake_deep_gemm, tmp_path, monkeypatch):
    """Not only the first check of a call (`needed_by`): every check making it waits, and so do
    the DeepGEMM checks compiling their own kernels; a check whose calls an earlier run
    compiled does not. The compile runs on one process fewer per local rank."""
    for k, v in worker_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("EP_HARNESS_PRECOMPILE_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    checks = small_h200_checks()
    first, twin = checks[0], dataclasses.replace(checks[0], id="twin-of-the-first")  # the same calls
    moe = single_check(get("composed_moe"), "reference", {"hidden": 256, "intermediate": 128, "num_experts": 8,
                                                          "tokens": 16, "gemm": "deepgemm_bf16_contiguous",
                                                          "world_size": 4})
    torch_mm = single_check(get("torch_mm"), "reference", {"dtype": "bfloat16", "n": 256, "k": 256})
    assert compile_now([first], H200, tmp_path, quiet=True, device="cpu").done > 0  # compiled before
    later = [c for c in checks[1:4] if not set(precompile.planned_calls([c])[0]) <= set(
        precompile.planned_calls([first])[0])]
    assert later
    lines = []
    monkeypatch.setattr("ep_harness.console.line", lambda text, stream=None: lines.append(text))
    background = precompile.start([first, *later, twin, moe, torch_mm], H200, tmp_path, quiet=False, device="cpu",
                                  ranks=3)
    try:
        assert background.waits_for == {c.id for c in later} | {moe.id}
        assert (calls := precompile.planned_calls([twin, *later])[0]) and calls[0].needed_by == twin.id
    finally:
        outcome = within(120, background.finish)
    assert outcome.failed == [] and (tmp_path / precompile.MARKER).exists()
    assert any(" on 1 processes, into " in text for text in lines), lines  # 4 cores less 3 ranks
    # Control: nothing runs meanwhile, every core compiles.
    assert precompile.worker_count(ranks=0) == 4 and precompile.worker_count(ranks=9) == 1
    monkeypatch.setenv("EP_HARNESS_PRECOMPILE_WORKERS", "7")
    assert precompile.worker_count(ranks=3) == 7  # set: taken as is


def test_a_compile_that_raises_or_outruns_its_limit_still_writes_the_marker(tmp_path):
    said = []

    def raises(stop):
        raise OSError(24, "Too many open files")

    broken = precompile.Background(raises, tmp_path / "a.done", {"x"}, 60, said.append).start()
    assert within(30, broken.finish) is None
    assert json.loads((tmp_path / "a.done").read_text())["error"] == "OSError: [Errno 24] Too many open files"
    assert said == ["compiling DeepGEMM kernels: stopped by OSError: [Errno 24] Too many open files; the checks "
                    "compile their kernels themselves"]

    def until_stopped(stop):
        stop.wait(60)
        return precompile.Outcome(failed=[(None, precompile.STOPPED)] * 3, stopped=True)

    said.clear()
    slow = precompile.Background(until_stopped, tmp_path / "b.done", {"x"}, 0.5, said.append).start()
    assert not (tmp_path / "b.done").exists()  # control: the marker waits for the compile
    outcome = within(30, slow.finish)
    assert outcome.stopped and json.loads((tmp_path / "b.done").read_text())["timed_out"] is True
    assert said == ["compiling DeepGEMM kernels: not finished within 0.5 s (EP_HARNESS_PRECOMPILE_WAIT_S): stopped "
                    "with 3 call(s) left, which their checks compile themselves; raise EP_HARNESS_PRECOMPILE_WAIT_S, "
                    "or set EP_HARNESS_PRECOMPILE=0 to compile in the checks"]


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_bad_wait_limit_is_one_clear_line(monkeypatch, value):
    from ep_harness.errors import HarnessError

    monkeypatch.setenv("EP_HARNESS_PRECOMPILE_WAIT_S", value)
    with pytest.raises(HarnessError) as exc:
        precompile.wait_limit()
    assert "\n" not in str(exc.value) and str(exc.value).startswith(f"EP_HARNESS_PRECOMPILE_WAIT_S={value!r} needs")
    monkeypatch.setenv("EP_HARNESS_PRECOMPILE_WAIT_S", "2.5")
    assert precompile.wait_limit() == 2.5


def test_a_rank_waits_for_the_marker_within_its_own_limit(tmp_path):
    from ep_harness.run.worker import PrecompileNotFinished, wait_for_precompile

    marker, calls = tmp_path / precompile.MARKER, []
    spec = {"marker": str(marker), "checks": ["x"], "limit_s": 5.0, "until": time.time() + 30}
    timer = threading.Timer(0.4, lambda: precompile.write_marker(marker, {}))
    timer.start()
    waited = wait_for_precompile(spec, lambda: calls.append("waiting"))
    assert 0.3 < waited < 10 and calls == ["waiting"]
    assert wait_for_precompile(spec, lambda: calls.append("again")) is None and calls == ["waiting"]  # there already
    marker.unlink()
    spec["until"] = time.time() + 0.3
    with pytest.raises(PrecompileNotFinished) as exc:
        wait_for_precompile(spec, lambda: None)
    message = str(exc.value)
    assert "\n" not in message and message.startswith("the DeepGEMM compile beside the launch did not end within 5 s")
    assert message.endswith("set EP_HARNESS_PRECOMPILE=0 to compile in the checks instead")


INTERRUPTED_RUN = """
import sys
from pathlib import Path
from ep_harness.run import precompile
from ep_harness.check import single_check
from ep_harness.subject import get, load_all
from ep_harness.run.verify import RunOptions, verify

def start(checks, platform, run_dir, quiet, multi_node=False, plugins=(), ranks=0):
    load_all()
    dg = single_check(get("deepgemm_bf16_dense"), "batch-invariance",
                      {"dtype": "bfloat16", "n": 256, "k": 256, "m_values": [1, 300]})
    calls = precompile.planned_calls([dg])[0]
    work = lambda stop: precompile.compile_all(calls, 2, dict(__import__("os").environ), "cpu",
                                               run_dir / "precompile.log", print, stop=stop)
    return precompile.Background(work, run_dir / precompile.MARKER, {c.id for c in checks if c.case == "needs-kernels"},
                                 600, print).start()

precompile.start = start
code, _ = verify(RunOptions(suite=sys.argv[1], gpus=0, cpu_ranks=2, out_root=Path(sys.argv[2]), render=False))
sys.exit(code)
"""


def command_line(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:  # ended meanwhile
        return ""


def test_a_signal_during_the_overlap_ends_workers_and_ranks_and_keeps_finished_checks(tmp_path, ends_its_workers):
    """SIGTERM while the ranks wait for a compile that would take an hour: the run ends at once
    with 143, no compile worker (nor what it started) and no rank is left, the checks that
    finished are kept and the waiting one is marked interrupted."""
    env = worker_env(tmp_path, FAKE_DEEP_GEMM_COMPILE_S="3600")
    proc = start_cli(str(SUITE), str(tmp_path / "out"), env=env, code=INTERRUPTED_RUN)
    try:
        until(lambda: (tmp_path / "out").exists() and any(p.name != "latest" for p in (tmp_path / "out").iterdir()))
        [run_dir] = [p for p in (tmp_path / "out").iterdir() if p.name != "latest"]
        until(lambda: len(streamed(run_dir)) >= 2)  # the others are done: the ranks now wait
        # The command's descendants: its 2 compile workers, and the launch (the agent, the
        # ranks' fork server and the 2 ranks, which wait for the compile now).
        tree = process_tree(proc.pid)
        workers = [pid for pid in tree if "ep_harness.run.precompile_worker" in command_line(pid)]
        ranks = [pid for pid in tree if pid not in workers]
        assert len(workers) == 2 and len(ranks) >= 4, (workers, ranks)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()  # the process this test started, by its handle
            proc.communicate()
    assert proc.returncode == 143, output[-2000:]
    assert all(gone(pid) for pid in workers + ranks) and leftover_workers(tmp_path) == []
    statuses = {r["case"]: r["status"] for r in streamed(run_dir)}
    assert statuses == {NEEDS: "interrupted", "first-other": "vacuous", "second-other": "vacuous"}, output[-2000:]
    assert json.loads((run_dir / precompile.MARKER).read_text())["error"] is None  # written on the way out too


class SlowStream:
    """A terminal whose every write lets other threads run (as a pipe that blocks may)."""

    def __init__(self):
        self.text = ""

    def write(self, chunk):
        for ch in chunk:
            self.text += ch
            time.sleep(0)
        time.sleep(0.001)

    def flush(self):
        pass


def lines_from_two_threads(emit) -> list[str]:
    stream = SlowStream()
    threads = [threading.Thread(target=lambda tag=tag: [emit(f"{tag} line {i}", stream) for i in range(40)])
               for tag in ("compile", "record")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stream.text.splitlines()


def test_lines_printed_from_two_threads_stay_whole():
    from ep_harness.console import line

    expected = sorted(f"{tag} line {i}" for tag in ("compile", "record") for i in range(40))
    assert sorted(lines_from_two_threads(line)) == expected
    # Control: print() writes the line and its end apart, and another thread's line lands between.
    assert sorted(lines_from_two_threads(lambda text, stream: print(text, file=stream))) != expected
