"""What a launch no longer spends CPU on, each shown to give what it replaced: torch's
rendezvous event names without inspect.stack(), process states and launch namespaces read
from /proc in one go, triton left unimported by a CPU run, and the cyclic garbage
collector's frozen generation (harness/launch/agent/, harness/cli.py)."""
import gc
import os
import subprocess
import sys

import pytest

from ep_harness.launch import processes
from tests.conftest import REPO, REPO_ON_PYTHONPATH, run_cli


def _through_two_frames(name_of):
    def caller():
        return helper()

    def helper():
        return name_of()

    return caller()


def test_rendezvous_event_names_are_torchs(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from ep_harness.launch.agent import _method_name, _rendezvous_names_without_source

    torchs = dynamic_rendezvous.get_method_name
    assert _through_two_frames(torchs) == _through_two_frames(_method_name) == "caller"
    for depth in (1, 2, 3, 10_000):
        assert _through_two_frames(lambda: torchs(depth)) == _through_two_frames(lambda: _method_name(depth))
    assert _method_name(10_000) == "no_method_name"
    assert _through_two_frames(lambda: _method_name(1)) != _through_two_frames(_method_name)  # depth matters
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torchs)  # put back after the test
    _rendezvous_names_without_source()
    assert dynamic_rendezvous.get_method_name is _method_name


@pytest.fixture
def sleeper(tmp_path):
    """A process of a launch namespace whose name holds ") (" (the parse of /proc/PID/stat
    must not split there)."""
    odd = tmp_path / "a) (b"
    odd.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(odd), "30"], start_new_session=True,
                            env={**os.environ, "EP_HARNESS_CHANNEL": "ep-harness/run/launch-0/"})
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not processes.PROC_STAT, reason="needs /proc")
def test_proc_reads_agree_with_psutil(monkeypatch, sleeper):
    import time

    # Popen returns once the exec has begun: the new environment is in place a moment later
    deadline = time.monotonic() + 30
    while b"EP_HARNESS_CHANNEL=" not in open(f"/proc/{sleeper.pid}/environ", "rb").read() \
            or processes.process_state(sleeper.pid).state != "S":  # and it has gone to sleep
        assert time.monotonic() < deadline, "the sleeper's environment never appeared, or it never slept"
        time.sleep(0.01)
    assert b"(a) (b)" in open(f"/proc/{sleeper.pid}/stat", "rb").read()
    pids = [os.getpid(), os.getppid(), sleeper.pid, 1]
    fast = {p: processes.process_state(p) for p in pids}
    carried = {(p, ns): processes._carries(p, ns) for p in pids
               for ns in ("ep-harness/run/launch-0/", "ep-harness/old/", "ep-harness/run/")}
    monkeypatch.setattr(processes, "PROC_STAT", False)
    slow = {p: processes.process_state(p) for p in pids}
    # this process and its parent run between the two reads (R or S, threads coming and going):
    # their parent and group must agree; the sleeper, asleep throughout, agrees in every field
    assert {p: (s.parent, s.group) for p, s in fast.items()} == {p: (s.parent, s.group) for p, s in slow.items()}
    assert fast[sleeper.pid] == slow[sleeper.pid]
    assert fast[sleeper.pid].parent == os.getpid() and fast[sleeper.pid].group == sleeper.pid
    assert carried == {(p, ns): processes._carries(p, ns) for p, ns in carried}
    assert [(p, ns) for (p, ns), yes in carried.items() if yes] == [(sleeper.pid, "ep-harness/run/launch-0/")]
    assert processes.process_state(2 ** 22 + 1) is None and not processes._carries(2 ** 22 + 1, "x")


def test_a_cpu_run_imports_no_triton():
    """The command's and the agent's modules leave triton out; asking for it imports it."""
    code = ("import sys; import ep_harness.run.verify, ep_harness.run.worker, ep_harness.launch.agent; "
            "before = 'triton' in sys.modules; from ep_harness.kernels import bitcompare; "
            "print(before, bitcompare.triton is not None, 'triton' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **REPO_ON_PYTHONPATH})
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, found, after = proc.stdout.split()
    assert before == "False"
    assert after == found  # imported when asked for, where installed
    assert found == str(__import__("importlib").util.find_spec("triton") is not None)


def test_the_comparison_kernel_defined_on_first_use_still_counts_under_the_interpreter():
    """The fused kernel is decorated when first launched (triton imported then): Triton's
    interpreter runs it on CPU tensors and it agrees with the torch path, mismatches planted."""
    pytest.importorskip("triton", reason="triton is not installed here (pip install triton)")
    code = ("import torch; from ep_harness.kernels import bitcompare as bc; from ep_harness.bits import int_view; "
            "a = torch.randn(20000, generator=torch.Generator().manual_seed(0)).bfloat16(); b = a.clone(); "
            "int_view(b)[[5, 1234, 19999]] += 3; int_view(b)[777] -= 1; "
            "print(bc.bitwise_stats(a, b, use_triton=True), bc.bitwise_stats(a, b, use_triton=False))")
    proc = run_cli(code=code, timeout=300, env={**os.environ, **REPO_ON_PYTHONPATH, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    fused, plain = proc.stdout.strip().split(") (")
    assert fused + ")" == "(4, 3, 5)" and "(" + plain == "(4, 3, 5)"


@pytest.fixture
def unfrozen():
    """This test process's frozen objects (conftest's gc.freeze after the collection) back in the
    collector's generations for the test, frozen again after it: a frozen object that dies
    lowers the count, so counts are compared from nothing frozen."""
    gc.unfreeze()
    yield
    gc.freeze()


def test_imports_without_gc_freeze_what_they_made(unfrozen):
    from ep_harness.cli import _imports_without_gc
    from ep_harness.launch.agent import _imports_without_gc as agents

    for imports_without_gc in (_imports_without_gc, agents):
        assert gc.get_freeze_count() == 0
        with imports_without_gc():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= len(made)
        gc.unfreeze()


def test_a_call_from_python_freezes_nothing(tmp_path, unfrozen):
    from ep_harness import cli

    frozen = gc.get_freeze_count()
    assert frozen == 0
    assert cli.main(["report", str(tmp_path / "nothing-here")]) == 2
    assert gc.get_freeze_count() == frozen and gc.isenabled()
