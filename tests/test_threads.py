"""Every rank's thread count is pinned by the harness (harness/threads.py): grouping checks
into one launch never changes a check's bits, and a rerun reproduces a failure's bits, whatever
OMP_NUM_THREADS the user's shell holds. The positive control is a planted GEMM whose bits
depend on torch.get_num_threads() (tests/planted_threads.py), a stand-in for oneDNN's bf16
torch.mm on an Intel Xeon with AMX, which this AMD machine cannot show."""
import json
import os
import shlex
from pathlib import Path

import pytest

from ep_harness.check import Check
from ep_harness.errors import HarnessError
from ep_harness.measurement import Measurement
from ep_harness.threads import DEFAULT_THREADS, pinned, user_setting_note
from ep_harness.verdict import decide
from tests.conftest import run_cli
from tests.shared_runs import pass_run  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parent.parent
SUITE = "tests/cases/threads.toml"
PLANTED = "thread-variant/batch-invariance"
BITS = ("status", "held", "mismatched", "total", "max_ulp", "first_mismatch", "bits_fingerprint")


def harness(*args, omp: str | None):
    """`ep-harness ARGS` as a user runs it, with OMP_NUM_THREADS=`omp` in their shell (None: unset):
    a new interpreter where that differs from this session's environment (torch reads it as it
    loads), else forked from the preloaded one (conftest.run_cli)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": omp} if omp is not None else {})})
    return run_cli(*args, env=env)


def records(run_dir: Path) -> dict[str, dict]:
    lines = (run_dir / "results.jsonl").read_text().splitlines()
    return {r["check"].split("/dtype")[0]: r for r in map(json.loads, lines)}


def environment(run_dir: Path) -> dict:
    return json.loads((run_dir / "environment.json").read_text())


@pytest.mark.slow
def test_a_thread_dependent_failure_in_one_launch_reruns_with_the_same_bits(tmp_path):
    grouped = harness("verify", "--suite", SUITE, "--gpus", "0", "--no-report", "--out", str(tmp_path / "one"),
                      omp="2")
    assert grouped.returncode == 1, grouped.stdout[-3000:] + grouped.stderr[-3000:]
    assert sum(line.startswith("# launching 2 checks on 4 gloo") for line in grouped.stdout.splitlines()) == 1
    assert "OMP_NUM_THREADS=2 in your environment is not what the ranks use" in grouped.stdout
    failed = records(tmp_path / "one" / "latest")[PLANTED]
    assert failed["status"] == "unexpected" and failed["mismatched"] > 0, failed["reason"]
    assert failed["launch_env"] == {"OMP_NUM_THREADS": str(DEFAULT_THREADS)}
    env = environment(tmp_path / "one" / "latest")
    assert env["threads"] == DEFAULT_THREADS
    assert [fp["threads"] for launch in env["ranks"].values() for fp in launch] == [DEFAULT_THREADS] * 4
    # The printed rerun runs the check alone (one rank, which torchrun leaves every core), from
    # a shell with another thread count: the same failure, bit for bit.
    argv = shlex.split(failed["rerun"])
    assert argv[:2] == ["ep-harness", "verify"] and argv[argv.index("--threads") + 1] == str(DEFAULT_THREADS)
    again = harness(*argv[1:], "--no-report", "--out", str(tmp_path / "rerun"), omp="2")
    assert again.returncode == 1, again.stdout[-3000:]
    assert "# launching 1 check on 1 gloo rank" in again.stdout
    alone = records(tmp_path / "rerun" / "latest")[PLANTED]
    assert [alone.get(k) for k in BITS] == [failed.get(k) for k in BITS]
    # --from-record, from a shell with no OMP_NUM_THREADS: the record alone says how many threads
    rerun = harness("verify", "--from-record", str(tmp_path / "one" / "latest" / "results.jsonl"), "--check",
                    failed["check"], "--gpus", "0", "--plugin", "tests.planted_threads", "--no-report", "--out",
                    str(tmp_path / "record"), omp=None)
    assert rerun.returncode == 1, rerun.stdout[-3000:]
    again = records(tmp_path / "record" / "latest")[PLANTED]
    assert [again.get(k) for k in BITS] == [failed.get(k) for k in BITS]
    assert again["launch_env"] == failed["launch_env"]


@pytest.mark.slow
def test_the_pinned_count_reaches_every_rank_whatever_the_shell_says(pass_run):
    """--threads 2 from a shell with OMP_NUM_THREADS=1: the planted GEMM, invariant on two
    threads, holds (so the runs above failed because of the pin, not whatever the count).
    SUITE's cases, in the shared passing run of tests/shared_runs.py (one 4-rank launch)."""
    run, run_dir, _ = pass_run
    assert "OMP_NUM_THREADS=1 in your environment is not what the ranks use" in run.stdout
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    held = records(run_dir)[PLANTED]
    assert (held["status"], held["mismatched"]) == ("ok", 0), held["reason"]
    assert held["launch_env"] == {"OMP_NUM_THREADS": "2"} and "--threads 2" in held["rerun"]
    env = environment(run_dir)
    assert env["threads"] == 2 and env["pinned_env"]["00-ws4"]["OMP_NUM_THREADS"] == "2"
    assert [fp["threads"] for launch in env["ranks"].values() for fp in launch] == [2] * 4


def test_a_bad_thread_count_is_one_line_and_exit_2(tmp_path):
    for bad in ("0", "two", "-1", "1.5"):
        proc = harness("verify", "--suite", "smoke", "--gpus", "0", "--threads", bad, "--out", str(tmp_path),
                       omp=None)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.count("\n") == 1 and "--threads" in proc.stderr and "not a thread count" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # no partial run


def test_the_count_comes_from_the_run_then_the_case_or_record_then_the_default():
    assert pinned({}, None, "c") == {"OMP_NUM_THREADS": str(DEFAULT_THREADS)}
    assert pinned({"OMP_NUM_THREADS": "3", "NCCL_ALGO": "Ring"}, None, "c") == {"OMP_NUM_THREADS": "3",
                                                                                "NCCL_ALGO": "Ring"}
    assert pinned({"OMP_NUM_THREADS": "3"}, 2, "c") == {"OMP_NUM_THREADS": "2"}
    with pytest.raises(HarnessError, match=r"^records.jsonl: x: env OMP_NUM_THREADS = '0' is not a thread count"):
        pinned({"OMP_NUM_THREADS": "0"}, None, "records.jsonl: x")


def test_a_case_pinning_a_bad_thread_count_is_refused_when_planned(tmp_path):
    from ep_harness import subject as registry
    from ep_harness.cases import load_suite
    from ep_harness.run.plan import expand
    from ep_harness.subject import Platform

    suite = tmp_path / "s.toml"
    suite.write_text('[[case]]\nname = "c"\nsubject = "all_gather_fold"\nproperties = ["reference"]\n'
                     'expect = "holds"\nenv = { OMP_NUM_THREADS = "many" }\n[case.params]\ndtype = "bfloat16"\n'
                     'world_size = 4\n')
    registry.load_all()
    with pytest.raises(HarnessError, match="env OMP_NUM_THREADS = 'many' is not a thread count"):
        expand(load_suite(suite), Platform(backend="gloo", device="cpu", ranks=4))


def test_the_user_is_told_when_their_omp_num_threads_is_not_used():
    assert user_setting_note(1, {}) is None and user_setting_note(1, {"OMP_NUM_THREADS": "1"}) is None
    assert "OMP_NUM_THREADS=2 in your environment" in user_setting_note(1, {"OMP_NUM_THREADS": "2"})


def test_the_gate_tells_runs_on_other_thread_counts_apart():
    from ep_harness.regress.gate import describe, fingerprint, fingerprint_hash

    env = {"backend": "gloo", "max_ranks": 4, "torch": "2.13.0+cpu", "cpu": {"model": "AMD EPYC"}, "threads": 1}
    one, two = fingerprint(env), fingerprint({**env, "threads": 2})
    assert one["threads"] == 1 and fingerprint_hash(one) != fingerprint_hash(two)
    assert "1 thread(s) per rank" in describe(one)
    assert "threads" not in fingerprint({**env, "backend": "nccl"})  # GPU bits: the CPU's threads do not enter


def _check(expect: str) -> Check:
    from ep_harness.families.gemm import GemmParams

    return Check(id="c", suite="-", case="c", subject="torch_mm", family="gemm", property="batch-invariance",
                 params=GemmParams(dtype="bfloat16"), expect=expect, timeout_s=1.0)


def test_measure_reports_the_count_and_never_fails():
    differs = Measurement(comparison="bitwise", mismatched=4, total=1792, held=False)
    same = Measurement(comparison="bitwise", mismatched=0, total=1792, held=True)
    assert decide(_check("measure"), differs) == ("ok", "measured, not asserted: does not hold on this machine "
                                                        "(4 / 1,792 differ: 4 in value)")
    assert decide(_check("measure"), same) == ("ok", "measured, not asserted: holds on this machine "
                                                     "(0 / 1,792 differ)")
    assert decide(_check("holds"), differs)[0] == "unexpected"  # the same measurement, asserted
    broken = Measurement(comparison="bitwise", mismatched=4, total=1792, held=False, extra_failure="NaN output")
    assert decide(_check("measure"), broken)[0] == "unexpected"  # measured is not excused from being right


def test_measure_is_an_expectation_a_case_may_key_by_backend(tmp_path):
    from ep_harness.cases import load_suite

    suite = tmp_path / "s.toml"
    suite.write_text('[[case]]\nname = "c"\nsubject = "torch_mm"\nproperties = ["batch-invariance"]\n'
                     'expect = { gloo = "measure", nccl = "holds" }\n')
    assert load_suite(suite).cases[0].expect == {"gloo": "measure", "nccl": "holds"}


def test_a_measured_check_is_shown_as_measured_with_its_count():
    from ep_harness.reports.terminal import render

    rec = {"run_id": "r", "check": "m/batch-invariance", "case": "m", "subject": "torch_mm", "family": "gemm",
           "property": "batch-invariance", "params": {"dtype": "bfloat16", "world_size": 1}, "expect": "measure",
           "held": False, "mismatched": 4, "total": 1792, "status": "ok", "reason": "measured", "rerun": "x",
           "seconds": 0.1}
    text = render([rec], {})
    assert "  measured  " in text and "# measured, not asserted" in text
    assert "#   m/batch-invariance: 4 / 1,792" in text
    assert text.splitlines()[-1].startswith("# OK: 1 ok") and "(1 of the ok measured, not asserted)" in text


def test_the_fixed_order_gemm_gives_a_row_the_same_bits_in_any_batch_on_any_thread_count():
    """fixed_order_mm, what the CPU default asserts to hold: a row's bits alone, in a batch of 300
    and on 1 or 2 threads are one; the sum is the float64 product's to within K float64 roundings.
    Positive control: summing the K halves apart (the planted thread-variant GEMM's one-thread
    path) moves bits of the same rows."""
    import torch

    from ep_harness.subjects.gemm.fixed_order_mm import fixed_order_product
    from tests.planted import split_k

    gen = torch.Generator().manual_seed(7)
    a = torch.randn(300, 512, generator=gen).bfloat16()
    b = torch.randn(96, 512, generator=gen).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = fixed_order_product(a, b)
        torch.set_num_threads(1)
        assert torch.equal(fixed_order_product(a, b), batch)
        for m in (1, 3, 128, 299):
            assert torch.equal(fixed_order_product(a[:m], b), batch[:m]), m
        assert torch.equal(fixed_order_product(a[137:138], b), batch[137:138])
    finally:
        torch.set_num_threads(before)
    exact = a.double() @ b.double().T
    assert (batch - exact).abs().max() <= 512 * 2.0 ** -52 * (a.double().abs() @ b.double().abs().T).max()
    assert (split_k(a, b) != batch.float()).any()
