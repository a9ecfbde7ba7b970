"""thread-invariance: run-to-run's repeats, each on another intra-op thread count. An order
that follows the thread count (per-thread partial sums, a kernel chosen by the count) never
shows on the count a launch pins (1 per rank), so every other property passes such a subject."""
import pytest
import torch

from ep_harness import threads
from ep_harness.check import single_check
from ep_harness.families import execute
from ep_harness.families.driver import CallLog, Run, judge_threads, subject_call
from ep_harness.measurement import Measurement
from ep_harness.subjects.gemm.common import each_expert
from ep_harness.subjects.gemm.fixed_order_mm import FixedOrderMm, fixed_order_product


class PartialSumPerThread(FixedOrderMm):
    """K cut into one contiguous part per intra-op thread, each part's fixed-order sum rounded
    to float32, the parts added in order: every row alone and one order on a given count (batch-
    and position-invariant), one part on one thread, another order on every other count."""

    name = "test_partial_sum_per_thread"

    def run(self, problem, out):
        def product(a, b, o):
            count = torch.get_num_threads()
            parts = [fixed_order_product(x, y).float()
                     for x, y in zip(a.tensor_split(count, dim=1), b.tensor_split(count, dim=1))]
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            o.copy_(total)

        each_expert(problem, out, product)


def _run(subject, prop, one_rank, **params):
    return execute(single_check(subject, prop, {"dtype": "bfloat16", **params}), subject, one_rank)


@pytest.fixture
def one_thread():
    """The rank's own count as a launch pins it by default."""
    own = torch.get_num_threads()
    torch.set_num_threads(threads.DEFAULT_THREADS)
    yield
    torch.set_num_threads(own)


@pytest.mark.parametrize("layout", ["contiguous", "dense"])
def test_an_order_that_follows_the_thread_count_fails_only_thread_invariance(one_rank, one_thread, layout):
    m = _run(PartialSumPerThread(), "thread-invariance", one_rank, layout=layout)
    assert not m.held and m.mismatched > 0 and m.vacuous_reason is None, (m.mismatched, m.vacuous_reason)
    assert m.detail["threads"] == [1, 2, 4]
    for prop in ("run-to-run", "batch-invariance", "position-invariance"):  # the pinned count: one order
        control = _run(PartialSumPerThread(), prop, one_rank, layout=layout)
        assert control.held and control.mismatched == 0 and control.vacuous_reason is None, prop
    assert torch.get_num_threads() == 1  # every call's count undone


def test_a_fixed_order_holds_on_every_thread_count(one_rank, one_thread):
    m = _run(FixedOrderMm(), "thread-invariance", one_rank, layout="contiguous")
    assert m.held and m.mismatched == 0 and m.total > 0 and m.vacuous_reason is None
    assert m.detail["threads"] == [1, 2, 4]


def test_varied_counts_start_at_the_rank_s_own_then_one_more_then_double():
    assert threads.varied_counts(1, 4) == [1, 2, 4, 8]
    assert threads.varied_counts(3, 3) == [3, 4, 8]
    assert threads.varied_counts(2, 1) == [2]
    assert threads.varied_counts(1, 150)[:6] == [1, 2, 4, 8, 1, 2] and max(threads.varied_counts(1, 150)) == 8
    assert threads.varied_counts(16, 4) == [16, 17, 16, 17]  # up to twice its own
    assert threads.varied_counts(threads.MAX_THREADS, 2) == [threads.MAX_THREADS, threads.MAX_THREADS - 1]


def _runs(n):
    return [Run(f"run {i}", (), None) for i in range(n)]


def _agreeing():
    return Measurement(comparison="bitwise", held=True, mismatched=0, total=8)


def test_calls_that_do_not_match_the_runs_or_never_vary_are_no_verdict():
    extra = _agreeing()
    judge_threads(extra, "thread-invariance", _runs(3), [CallLog(threads=[1, 2, 4, 1])])  # two calls a run
    assert extra.error and "made 4 calls" in extra.error
    same = _agreeing()
    judge_threads(same, "thread-invariance", _runs(3), [CallLog(threads=[2, 2, 2])])  # a subject that pins its own
    assert same.vacuous_reason == "every call ran on 2 thread(s): no thread count varied"
    varied = _agreeing()  # control
    judge_threads(varied, "thread-invariance", _runs(3), [CallLog(threads=[1, 2, 4])])
    assert varied.error is None and varied.vacuous_reason is None
    other = _agreeing()
    judge_threads(other, "run-to-run", _runs(3), [CallLog(threads=[])])
    assert "threads" not in other.detail


def test_a_call_that_raises_leaves_the_rank_on_its_own_count(one_thread):
    from ep_harness.families import driver

    log = CallLog(thread_plan=[4])
    token = driver._LOG.set(log)
    try:
        with pytest.raises(RuntimeError, match="planted"):
            with subject_call({}):
                assert torch.get_num_threads() == 4
                raise RuntimeError("planted")
    finally:
        driver._LOG.reset(token)
    assert torch.get_num_threads() == 1 and log.threads == [4]
