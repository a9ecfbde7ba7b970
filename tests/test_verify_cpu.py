"""`ep-harness verify` end to end on the CPU default (4 gloo ranks, torchrun, real records)."""
import json
import os
import subprocess
import sys

import pytest

from ep_harness.launch import protocol
from ep_harness.launch.launcher import _rank_error
from ep_harness.records import REQUIRED
from ep_harness.run.worker import dealt_single_rank_checks
from tests.conftest import REPO, gone, rank_pids, run_cli, shared_dir
from tests.forked_cli import cli_fork  # noqa: F401 (a fixture)
from tests.shared_runs import fail_run  # noqa: F401 (a fixture)


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def find(recs, case, prop, dtype, ws):
    return next(r for r in recs if r["case"] == case and r["property"] == prop
                and r["params"].get("dtype") == dtype and r["params"]["world_size"] == ws)


@pytest.mark.slow
def test_smoke_run_shows_the_control_and_the_fixes(smoke_run):
    proc, run_dir = smoke_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (run_dir / "report.html").stat().st_size > 10_000
    assert proc.stdout.rstrip().splitlines()[-2].startswith("# OK:")
    recs = records(run_dir)
    for r in recs:
        assert set(REQUIRED) <= set(r), set(REQUIRED) - set(r)
    control = find(recs, "rs-native", "rank-invariance", "bfloat16", 4)
    assert control["expect"] == "violated" and control["held"] is False and control["status"] == "ok"
    assert control["mismatched"] > 0 and control["mismatched"] == control["predicted_mismatched"]
    assert control["total"] == 4 * 2048
    for case in ("ag-fold", "a2a-fold"):
        for prop in ("rank-invariance", "batch-invariance", "position-invariance"):
            for dtype in ("bfloat16", "float16", "float32"):
                for ws in (3, 4):
                    r = find(recs, case, prop, dtype, ws)
                    assert (r["status"], r["held"], r["mismatched"]) == ("ok", True, 0), r["check"]
                    assert r["detail"]["order_sensitive"] > 0  # not vacuous: the inputs could fail


@pytest.mark.slow
def test_every_gloo_count_equals_its_order_model(smoke_run):
    _, run_dir = smoke_run
    measured = [r for r in records(run_dir) if r.get("predicted_mismatched") is not None]
    assert len(measured) > 50
    controls = [r for r in measured if r["expect"] == "violated" and r["status"] != "vacuous"]
    assert controls and all(r["mismatched"] > 0 for r in controls)
    for r in measured:
        assert r["mismatched"] == r["predicted_mismatched"], r["check"]


@pytest.mark.slow
def test_world_size_two_is_vacuous_not_a_pass(smoke_run):
    _, run_dir = smoke_run
    r = find(records(run_dir), "two-ranks", "rank-invariance", "bfloat16", 2)
    assert r["status"] == "vacuous" and "a + b == b + a" in r["reason"]


@pytest.mark.slow
def test_faulty_ranks_become_error_records(fail_run):
    """tests/cases/faults.toml's cases, first in the shared failing run (tests/shared_runs.py)."""
    proc, run_dir, by_case = fail_run
    assert proc.returncode == 1  # errors fail the run ...
    assert by_case["before"]["status"] == "ok" and by_case["after"]["status"] == "ok"  # ... but it goes on
    raised = by_case["raises"]
    assert raised["status"] == "error" and raised["reason"].startswith("rank 1 raised RuntimeError")
    assert "planted failure on rank 1" in raised["detail"]["tracebacks"]["1"]
    hung = by_case["hangs"]
    assert hung["status"] == "error" and "timed out after 3 s" in hung["reason"]
    assert "tests/planted.py" in hung["detail"]["stacks"]["1"]  # rank 1's stack shows where it hangs
    crashed = by_case["crashes"]
    assert crashed["status"] == "error" and "left no traceback" in crashed["reason"]
    assert 1 in crashed["detail"]["silent_ranks"]  # the rank that died is named (others may be killed first)
    quiet = by_case["exits-quietly"]  # every rank gone with code 0: not a hang with stacks to show
    assert quiet["status"] == "error", quiet["reason"]
    assert quiet["reason"].endswith("ranks [0, 1, 2, 3] did not answer for their stacks: they may have exited (a "
                                    "subject that ends its process?), see the launch log"), quiet["reason"]
    segfault = by_case["segfaults"]  # named first, with the crash the log shows, before the others' closed sockets
    assert segfault["status"] == "error" and segfault["reason"].startswith(
        "rank(s) [1] left no traceback (Fatal Python error: Segmentation fault in "), segfault["reason"]
    assert (run_dir / "report.html").exists()
    pids = rank_pids(run_dir)
    assert len(pids) >= 4 * 3  # the first launch and the relaunches after each failure
    assert [pid for pid in pids if not gone(pid)] == []  # no worker outlives the run


class _Errors:
    """A launch channel holding some ranks' error messages, read as the launcher reads them."""

    def __init__(self, errors):
        self.errors = {protocol.error_key(e.rank): e for e in errors}

    def read(self, key, kind):
        return self.errors.get(key)


@pytest.mark.parametrize("others_terminated", [False, True])
def test_a_segfaulted_rank_is_named_first_however_the_others_ended(tmp_path, others_terminated):
    """Whether the survivors raise on the closed connection or torchrun's SIGTERM reaches them
    first is a race: either way the reason leads with the rank that crashed and what the log says."""
    log = tmp_path / "torchrun-3.log"
    log.write_text("Fatal Python error: Segmentation fault\n\nCurrent thread ...\n")
    errors = [protocol.RankError(index=2, check="c", rank=r, time=1.0 + r, error="RuntimeError: Connection closed",
                                 traceback="...", node="n0", host="h", terminated=others_terminated)
              for r in (0, 2, 3)]
    failed_at, reason, details = _rank_error(_Errors(errors), 4, 1, 0, log, multi=False)
    assert reason.startswith("rank(s) [1] left no traceback (Fatal Python error: Segmentation fault in "
                             "torchrun-3.log: it crashed first); "), reason
    assert reason.endswith("the others were ended by SIGTERM" if others_terminated
                           else "then rank 0 raised RuntimeError: Connection closed"), reason
    assert failed_at == 2 and details["silent_ranks"] == [1] and "Segmentation fault" in details["log"]


@pytest.mark.parametrize("args, message", [
    (["--suite", "tests/cases/does-not-exist.toml"], "not found"),
    (["--gpus", "4"], "--gpus 4 but this machine has 0 visible GPUs"),
    (["--suite", "smoke", "--check", "no/such/check"], "matches no check"),
    (["--gpus", "4", "--emulate-hosts"], "--emulate hosts runs NCCL ranks on a GPU, but no GPU"),
    (["--gpus", "4", "--emulate", "single-node"], "--emulate single-node runs NCCL ranks on a GPU, but no GPU"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, message, cli_fork):
    proc = cli_fork("verify", *args, "--out", str(tmp_path))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_malformed_and_unknown_subject_files(tmp_path, cli_fork):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[case]]\nname = 'x'\nsubject = 'no_such_subject'\nproperties = ['rank-invariance']\n"
                   "expect = 'holds'\n")
    proc = cli_fork("verify", "--suite", str(bad), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "unknown subject 'no_such_subject'" in proc.stderr
    bad.write_text("[[case]\n")
    proc = cli_fork("verify", "--suite", str(bad), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "malformed TOML" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_records_name_their_topology_and_the_tp_reduction(smoke_run):
    _, run_dir = smoke_run
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["topology"]["kind"] == "cpu-gloo" and env["topology"]["ranks"] == 4
    assert env["tp_reduction"]["via"] == "torch.distributed on gloo"
    assert env["tp_reduction"]["engine_custom_all_reduce"].startswith("off")
    assert all(r["topology"] == "cpu-gloo: 4 gloo ranks on the CPU" for r in records(run_dir))
    assert [f["deterministic_algorithms"] for launch in env["ranks"].values() for f in launch] == [True] * 4


# What torch.use_deterministic_algorithms(True) leaves set, read in a fresh interpreter: first
# with inductor not loaded (it must stay so: it costs each launch 1.4 s), then loaded.
_DETERMINISM_PROBE = """
import sys, torch
from ep_harness.run.worker import use_deterministic_algorithms
use_deterministic_algorithms()
print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
      "torch._inductor.config" in sys.modules)
import torch._inductor.config as inductor
print(inductor.deterministic)
inductor.deterministic = False
use_deterministic_algorithms()
print(inductor.deterministic)
"""


def test_ranks_set_what_use_deterministic_algorithms_sets():
    probe = subprocess.run([sys.executable, "-c", _DETERMINISM_PROBE], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "TORCHINDUCTOR_DETERMINISTIC": "0"})
    assert probe.returncode == 0, probe.stderr
    # ATen deterministic and not warn-only; inductor deterministic whether it loads after or before.
    assert probe.stdout.split() == ["True", "False", "False", "True", "True"]


@pytest.mark.slow
def test_custom_all_reduce_violates_size_invariance_as_predicted(smoke_run):
    _, run_dir = smoke_run
    for dtype in ("bfloat16", "float32"):
        r = find(records(run_dir), "custom-ar-sizes", "size-invariance", dtype, 4)
        assert (r["status"], r["held"]) == ("ok", False), r["reason"]
        assert r["mismatched"] > 0 and r["mismatched"] == r["predicted_mismatched"]


@pytest.mark.slow
def test_a_record_alone_reruns_its_check_bit_for_bit(smoke_run, tmp_path):
    _, run_dir = smoke_run
    control = find(records(run_dir), "rs-native", "batch-invariance", "float16", 3)
    proc = run_cli("verify", "--from-record", str(run_dir / "results.jsonl"), "--check", control["check"],
                   "--gpus", "0", "--no-report", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [again] = records(tmp_path / "latest")
    for key in ("status", "held", "mismatched", "total", "predicted_mismatched", "max_ulp", "first_mismatch", "params"):
        assert again[key] == control[key], key
    assert again["rerun"].startswith("ep-harness verify --from-record ")


def test_make_verify_with_more_gpus_than_present():
    proc = subprocess.run(["make", "-s", "verify", "GPUS=4"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--gpus 4 but this machine has 0 visible GPUs" in proc.stderr


def test_gpus_are_counted_by_torch_only_where_a_gpu_driver_is(monkeypatch):
    import torch

    from ep_harness import environment

    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch now fails
    monkeypatch.setattr(environment, "GPU_DRIVER_PATHS", ("/no/such/driver",))
    assert environment.visible_gpus() == 0
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(environment, "GPU_DRIVER_PATHS", ("/",))
    assert environment.visible_gpus() == torch.cuda.device_count()


@pytest.mark.slow
def test_a_subject_sets_up_once_per_launch(planted_run):
    assert [r["status"] for check, r in planted_run.items() if check.startswith("engine/")] == ["ok"] * 3


def test_one_rank_checks_are_dealt_to_the_ranks_in_turn():
    checks = [{"property": "reference", "params": {"world_size": w}} for w in (4, 1, 1, 3, 1, 1, 1)]
    checks.append({"property": "tp-size-invariance", "params": {"world_size": 1}})  # a layout check: not dealt
    assert dealt_single_rank_checks(checks, [0, 1, 2, 3]) == {1: 0, 2: 1, 4: 2, 5: 3, 6: 0}
    assert dealt_single_rank_checks(checks, [0, 1, 2]) == {1: 0, 2: 1, 4: 2, 5: 0, 6: 1}
    # two nodes of two ranks, rank 0's node holding ranks 0 and 2: the others never get one
    assert dealt_single_rank_checks(checks, [0, 2]) == {1: 0, 2: 2, 4: 0, 5: 2, 6: 0}
    assert dealt_single_rank_checks(checks[1:3], [0]) == {}  # rank 0 alone runs them all


def test_one_rank_checks_run_where_dealt_and_hold(planted_run, tmp_path_factory):
    """The planted run's launch of 4 gloo ranks: its four one-rank checks in a row ran on ranks
    0, 1, 2 and 3 (tests.planted.SaysWhichRank notes where), each as rank 0 of its own group."""
    dealt = {check: r for check, r in planted_run.items() if check.startswith("dealt/")}
    assert len(dealt) == 4 and {r["status"] for r in dealt.values()} == {"ok"}, dealt
    run_dir = shared_dir(tmp_path_factory) / "planted-run" / "latest"
    [noted] = list((run_dir / "jobs").glob("*/one-rank-checks.txt"))
    assert set(noted.read_text().split()) == {"0", "1", "2", "3"}


@pytest.mark.slow
def test_one_launch_gives_the_bits_of_a_launch_per_world_size(smoke_run, tmp_path):
    """World sizes 1, 2 and 3 in one 4-rank launch (subgroups of ranks 0..w-1, one-rank checks
    dealt to every rank; the smoke run) against a launch of their own: the same status,
    counts, prediction, first differing bits and bits. (World size 4 is the whole launch
    either way.)"""
    proc, run_dir = smoke_run
    assert sum(line.startswith("# launching") for line in proc.stdout.splitlines()) == 1
    patterns = ("rs-native/*/world_size=3", "ag-fold/*/dtype=bfloat16/world_size=3", "two-ranks/*",
                "fold-reference/*/world_size=3", "gemm-fixed-order/*/layout=masked", "quant-ue8m0/*")
    proc = run_cli("verify", "--suite", "smoke", "--gpus", "0", "--launches", "per-world-size", "--no-report",
                   *(arg for p in patterns for arg in ("--check", p)), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:]
    launches = [line for line in proc.stdout.splitlines() if line.startswith("# launching")]
    assert len(launches) == 3, launches
    runs = {"per-world-size": {r["check"]: r for r in records(tmp_path / "latest")}}
    runs["one"] = {check: r for check, r in ((r["check"], r) for r in records(run_dir)) if check in runs["per-world-size"]}
    keys = ("status", "mismatched", "total", "predicted_mismatched", "max_ulp", "first_mismatch", "max_abs",
            "bits_fingerprint")
    assert runs["one"].keys() == runs["per-world-size"].keys()
    for check, r in runs["one"].items():
        assert [r.get(k) for k in keys] == [runs["per-world-size"][check].get(k) for k in keys], check
    assert {r["params"]["world_size"] for r in runs["one"].values()} == {1, 2, 3}
