"""thread-invariance: run-to-run's repeats, each on another intra-op thread count. An order
that follows the thread count (per-thread partial sums, a kernel chosen by the count) never
shows on the count a launch pins (1 per rank), so every other property passes such a subject."""
import json
import os

import pytest
import torch

from ep_harness import threads
from ep_harness.check import single_check
from ep_harness.families import execute
from ep_harness.families.driver import CallLog, Run, judge_threads, subject_call
from ep_harness.measurement import Measurement
from ep_harness.subjects.dispatch.torch_a2a import TorchAllToAllDispatcher
from ep_harness.subjects.gemm.common import each_expert
from ep_harness.subjects.gemm.fixed_order_mm import FixedOrderMm, fixed_order_product
from tests.conftest import REPO_ON_PYTHONPATH, run_cli


class PartialSumPerThread(FixedOrderMm):
    """K cut into one contiguous part per intra-op thread, each part's fixed-order sum written
    in the output's dtype (per-thread partial outputs), the parts added in order in float32:
    every row alone and one order on a given count (batch- and position-invariant), one part
    on one thread, another order on every other count."""

    name = "test_partial_sum_per_thread"

    def run(self, problem, out):
        def product(a, b, o):
            count = torch.get_num_threads()
            parts = [fixed_order_product(x, y).to(o.dtype)
                     for x, y in zip(a.tensor_split(count, dim=1), b.tensor_split(count, dim=1))]
            total = parts[0].float()
            for part in parts[1:]:
                total = total + part.float()
            o.copy_(total)

        each_expert(problem, out, product)


class RowsSplitOverThreads(FixedOrderMm):
    """An expert's rows cut into one part per intra-op thread, the parts after the first summed as
    two K halves, each written in the output's dtype (a split-K through an output-typed
    workspace): the expert's first row (the probe's) keeps one order on every count."""

    name = "test_rows_split_over_threads"

    def run(self, problem, out):
        def halves(a, b, dtype):
            h = a.shape[1] // 2
            return fixed_order_product(a[:, :h], b[:, :h]).to(dtype).float() + \
                fixed_order_product(a[:, h:], b[:, h:]).to(dtype).float()

        def product(a, b, o):
            for c, rows in enumerate(torch.arange(a.shape[0]).tensor_split(torch.get_num_threads())):
                if len(rows):
                    o[rows] = (fixed_order_product(a[rows], b) if c == 0 else halves(a[rows], b, o.dtype)).to(o.dtype)

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


@pytest.mark.parametrize("layout", ["contiguous", "masked", "dense"])
def test_rows_past_the_first_part_that_follow_the_thread_count_fail_thread_invariance(one_rank, one_thread, layout):
    m = _run(RowsSplitOverThreads(), "thread-invariance", one_rank, layout=layout)
    assert not m.held and m.mismatched > 0 and m.vacuous_reason is None, (m.mismatched, m.vacuous_reason)
    for prop in ("run-to-run", "position-invariance", "batch-invariance"):  # one part on the pinned count
        control = _run(RowsSplitOverThreads(), prop, one_rank, layout=layout)
        assert control.held and control.mismatched == 0 and control.vacuous_reason is None, prop


def test_a_fixed_order_holds_on_every_thread_count(one_rank, one_thread):
    m = _run(FixedOrderMm(), "thread-invariance", one_rank, layout="contiguous")
    assert m.held and m.mismatched == 0 and m.total > 0 and m.vacuous_reason is None
    assert m.detail["threads"] == [1, 2, 4]


class CombinePartPerThread(TorchAllToAllDispatcher):
    """A combine that adds a token's top-k terms in one part per intra-op thread (each part from
    +0.0 in float32, the parts in order): the slot order on one thread, another grouping on more."""

    name = "test_combine_part_per_thread"

    def fold(self, slots, weights, group):
        count, parts = min(torch.get_num_threads(), slots.shape[1]), []
        for part in range(count):  # slots part, part + count, ...
            acc = torch.zeros_like(slots[:, 0])
            for j in range(part, slots.shape[1], count):
                acc = acc + weights[:, j:j + 1].float() * slots[:, j]
            parts.append(acc)
        return sum(parts[1:], parts[0])


class CombineChunkPerThread(TorchAllToAllDispatcher):
    """A combine that splits the tokens into one chunk per intra-op thread, chunk c adding its
    top-k terms from slot c on (as threads given a static share of the rows might): the first
    token keeps one order on every count; tokens in the later chunks do not."""

    name = "test_combine_chunk_per_thread"

    def fold(self, slots, weights, group):
        count, k = torch.get_num_threads(), slots.shape[1]
        out = []
        for c, (part, w) in enumerate(zip(slots.tensor_split(count), weights.tensor_split(count))):
            acc = torch.zeros_like(part[:, 0])
            for j in [(c + i) % k for i in range(k)]:
                acc = acc + w[:, j:j + 1].float() * part[:, j]
            out.append(acc)
        return torch.cat(out)


class CountsItsCalls(TorchAllToAllDispatcher):
    """Remembers the thread count of each dispatch and combine."""

    name = "test_counts_its_calls"

    def __init__(self):
        self.counts = []

    def dispatch(self, *args):
        self.counts.append(("dispatch", torch.get_num_threads()))
        return super().dispatch(*args)

    def combine(self, *args):
        self.counts.append(("combine", torch.get_num_threads()))
        return super().combine(*args)


def _dispatch(subject, prop, one_rank):
    return execute(single_check(subject, prop, {"num_experts": 8}), subject, one_rank)


def test_a_dispatch_runs_its_dispatch_and_combine_on_one_count_a_run(one_rank, one_thread):
    subject = CountsItsCalls()
    m = _dispatch(subject, "thread-invariance", one_rank)
    assert m.held and m.mismatched == 0 and m.total > 0 and m.vacuous_reason is None and m.error is None
    assert m.detail["threads"] == [1, 2, 4]
    assert subject.counts == [(call, n) for n in (1, 2, 4) for call in ("dispatch", "combine")]
    assert torch.get_num_threads() == 1


class CombineOnOneThread(CombinePartPerThread):
    """Pins its combine to one thread (and leaves it there): only its dispatch follows the plan."""

    name = "test_combine_on_one_thread"

    def combine(self, *args):
        torch.set_num_threads(1)
        return super().combine(*args)


def test_a_later_call_that_sets_its_own_count_is_named(one_rank, one_thread):
    m = _dispatch(CombineOnOneThread(), "thread-invariance", one_rank)
    assert m.held and m.detail["threads"] == [1, 2, 4] and m.detail["threads_of_later_calls"] == [(1, 1), (2, 1)]
    assert m.note.startswith("2 call(s) after a run's first ended on another thread count than the run's "
                             "(run 1: 1, run 2: 1)"), m.note
    assert torch.get_num_threads() == 1
    control = _dispatch(CombinePartPerThread(), "thread-invariance", one_rank)  # unpinned: caught, no note
    assert not control.held and control.note is None and "threads_of_later_calls" not in control.detail


def test_a_combine_whose_order_follows_the_thread_count_fails_only_thread_invariance(one_rank, one_thread):
    m = _dispatch(CombinePartPerThread(), "thread-invariance", one_rank)
    assert not m.held and m.mismatched > 0 and m.vacuous_reason is None, (m.mismatched, m.vacuous_reason)
    for prop in ("run-to-run", "batch-invariance", "position-invariance", "combine-reference"):  # the pinned count
        control = _dispatch(CombinePartPerThread(), prop, one_rank)
        assert control.held and control.mismatched == 0 and control.vacuous_reason is None, prop


def test_a_combine_whose_later_rows_follow_the_thread_count_fails_thread_invariance(one_rank, one_thread):
    """thread-invariance probes a row in every part of the tokens split over its most threads,
    on every rank; each row is held to its own copy in the first run."""
    m = _dispatch(CombineChunkPerThread(), "thread-invariance", one_rank)
    assert not m.held and m.mismatched > 0 and m.vacuous_reason is None, (m.mismatched, m.vacuous_reason)
    assert not m.first_mismatch["row"].endswith(" token 0"), m.first_mismatch  # token 0: one chunk on every count
    for prop in ("run-to-run", "position-invariance", "combine-reference"):  # one chunk on the pinned count
        control = _dispatch(CombineChunkPerThread(), prop, one_rank)
        assert control.held and control.mismatched == 0 and control.vacuous_reason is None, prop


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
    assert extra.error and "began 4 runs (its family should mark a run's later calls continues_run" in extra.error
    fewer = _agreeing()  # every call marked as continuing: one run began
    judge_threads(fewer, "thread-invariance", _runs(3), [CallLog(threads=[1])])
    assert "began 1 runs (its family should mark only a run's later calls, never its first, continues_run" \
        in fewer.error
    same = _agreeing()
    judge_threads(same, "thread-invariance", _runs(3), [CallLog(threads=[2, 2, 2])])  # a subject that pins its own
    assert same.vacuous_reason == "every run ran on 2 thread(s): no thread count varied"
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


@pytest.fixture
def partial_sum_gemm(monkeypatch):
    """PartialSumPerThread under its name, for a composed model to use as its experts' GEMM."""
    from ep_harness import subject

    monkeypatch.setitem(subject._REGISTRY, PartialSumPerThread.name, PartialSumPerThread())
    return PartialSumPerThread.name


def test_a_model_whose_expert_gemm_follows_the_thread_count_fails_thread_invariance(one_rank, one_thread,
                                                                                     partial_sum_gemm):
    """The model family runs each generate on one count; its GEMMs inside follow it. (On one
    rank there is no TP partial whose order could move: the family calls the agreeing checks
    vacuous there; cases/model.toml holds the 4-rank ones.)"""
    from ep_harness.subject import get

    model = get("composed_model")
    fixed = {"dense_gemm": "fixed_order_mm"}
    planted = execute(single_check(model, "thread-invariance", {**fixed, "gemm": partial_sum_gemm}), model, one_rank)
    assert not planted.held and planted.mismatched > 0 and planted.detail["threads"] == [1, 2], planted.mismatched
    control = execute(single_check(model, "run-to-run", {**fixed, "gemm": partial_sum_gemm}), model, one_rank)
    assert control.held and control.mismatched == 0 and control.total == planted.total
    sound = execute(single_check(model, "thread-invariance", {**fixed, "gemm": "fixed_order_mm"}), model, one_rank)
    assert sound.held and sound.mismatched == 0 and sound.total == planted.total and sound.detail["threads"] == [1, 2]


ROWS_SUITE = """
[suite]
name = "rows-over-threads"
plugins = ["tests.planted_threads"]

[[case]]
name = "fold-rows"
subject = "planted_rows_split_over_threads_fold"
properties = ["thread-invariance", "run-to-run", "rank-invariance", "reference"]
expect = "holds"
[case.grid]
world_size = [4]
[case.params]
dtype = "bfloat16"
"""


def test_a_fold_whose_later_rows_follow_the_thread_count_fails_thread_invariance(tmp_path):
    """4 gloo ranks: thread-invariance compares every row of every rank's output (a shard's first
    row, the other properties' probe, is in the first thread's part on every count)."""
    suite = tmp_path / "rows.toml"
    suite.write_text(ROWS_SUITE)
    proc = run_cli("verify", "--suite", str(suite), "--gpus", "0", "--no-report", "--out", str(tmp_path / "out"),
                   env={**os.environ, **REPO_ON_PYTHONPATH, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = {r["property"]: r for r in map(json.loads, (tmp_path / "out" / "latest" / "results.jsonl").open())}
    caught = runs["thread-invariance"]
    assert caught["status"] == "unexpected" and caught["mismatched"] > 0, caught["reason"]
    assert caught["detail"]["threads"] == [1, 2, 4]
    for control in ("run-to-run", "rank-invariance", "reference"):  # one part on the pinned count
        assert (runs[control]["status"], runs[control]["mismatched"]) == ("ok", 0), (control, runs[control]["reason"])
