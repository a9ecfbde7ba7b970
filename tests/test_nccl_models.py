"""The NCCL log parser and the NCCL order models against real NCCL, on the CPU.

The fixtures in tests/fixtures/nccl-2.28.9-emulated-hosts/ were recorded on the lent H200 by
`ci/nccl_record.py` (NCCL 2.28.9, torch 2.11.0+cu130; 3, 4 and 8 ranks sharing the GPU as
emulated hosts, one node per rank, NET/Socket; treefree-w8 and treech1-w4/w8 on a second
machine, driver 580.159.04, whose treefree-w4 re-recording gave the same digests as the
first): per configuration and world size,
every rank's NCCL_DEBUG=INFO log cut to the lines the parser reads, and a SHA-256 of every
rank's output for reduce_scatter_tensor and all_reduce on inputs that `ci/nccl_record.py`
regenerates from the seed. A model passes only if it reproduces every output element of
every rank bit for bit, with the algorithm taken from NCCL's own log line for that call.
"""
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from ep_harness.nccl import log as nccl_log
from ep_harness.nccl import pins
from ep_harness.inputs import dtype_of
from ep_harness.nccl.models import NcclContext, NoPrediction, all_reduce, all_reduce_plan, reduce_scatter
from ep_harness.reference import nccl_pat, nccl_plan, orders

FIXTURES = Path(__file__).parent / "fixtures" / "nccl-2.28.9-emulated-hosts"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ci"))
import nccl_record as recorder  # noqa: E402  (the recorder defines the inputs it used)

from tests.shared_nccl import recorder_inputs  # noqa: E402,F401  (a fixture)


def topology(config: str, world_size: int) -> nccl_log.Topology:
    return nccl_log.read_ranks(sorted((FIXTURES / f"{config}-w{world_size}").glob("rank*.log")))


def rank0_calls(config: str, world_size: int, function: str) -> list[nccl_log.Call]:
    text = (FIXTURES / f"{config}-w{world_size}" / "rank0.log").read_text()
    return [c for c in nccl_log.parse(text).calls if c.function == function]


def recorded(config: str, world_size: int) -> dict:
    return json.loads((FIXTURES / f"{config}-w{world_size}" / "hashes.json").read_text())


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def rs_points(config):
    """(key, dtype, rows) in the order the recorder issued its reduce-scatters."""
    return [(f"rs/{name}/rows{rows}", name, rows) for name in recorder.DTYPES for rows in recorder.RS_ROWS
            if config != "free" or rows == recorder.RS_ROWS[0]]


def test_the_shared_inputs_are_the_recorders_bits(recorder_inputs):
    """The tests read the recorder's inputs from files made once per session (tests/shared_nccl.py):
    a reader that did not make them (another xdist worker) gets the recorder's bits, and the
    tensors are copy-on-write maps, so writing into one changes no other reader's input."""
    from tests.shared_nccl import RecorderInputs

    ar = torch.stack([recorder.ar_input(torch.float16, 3, 3000, r) for r in range(3)])
    rs = torch.stack([recorder.rs_input(torch.bfloat16, 4, 2, r) for r in range(4)])
    assert torch.equal(recorder_inputs.ar(torch.float16, 3, 3000).view(torch.int16), ar.view(torch.int16))
    other = RecorderInputs(recorder_inputs.tmp_path_factory)  # nothing mapped yet: reads the files
    assert other.ar(torch.float16, 3, 3000) is not recorder_inputs.ar(torch.float16, 3, 3000)
    assert torch.equal(other.ar(torch.float16, 3, 3000).view(torch.int16), ar.view(torch.int16))
    assert torch.equal(other.rs(torch.bfloat16, 4, 2).view(torch.int16), rs.view(torch.int16))
    other.ar(torch.float16, 3, 3000)[1, 7] += 1
    assert not torch.equal(other.ar(torch.float16, 3, 3000).view(torch.int16), ar.view(torch.int16))
    assert torch.equal(RecorderInputs(recorder_inputs.tmp_path_factory).ar(torch.float16, 3, 3000).view(torch.int16),
                       ar.view(torch.int16))


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_log_shows_one_node_per_rank_over_sockets(world_size):
    topo = topology("pins", world_size)
    assert (topo.version, topo.nranks, topo.nnodes, topo.local_ranks) == ("2.28.9", world_size, world_size, 1)
    assert topo.transports == ["NET/Socket"]
    assert topo.coll_channels == 8 and topo.ring() == list(range(world_size))
    # Multi-node double binary tree: even and odd channels carry different trees.
    trees = topo.channel_trees()
    assert len(trees) == 8 and trees[0] == trees[2] != trees[1] == trees[3]
    assert all(sorted(t) == list(range(world_size)) for t in trees)


@pytest.mark.parametrize("config", ["pins", "rsring", "free"])
@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_reduce_scatter_models_reproduce_every_bit_of_nccl(config, world_size, recorder_inputs):
    topo, hashes = topology(config, world_size), recorded(config, world_size)
    calls = rank0_calls(config, world_size, "ReduceScatter")
    points = rs_points(config)
    assert len(calls) == len(points)
    algorithms = set()
    for (key, name, rows), call in zip(points, calls):
        dtype = dtype_of(name)
        x = recorder_inputs.rs(dtype, world_size, rows)
        outs, _ = reduce_scatter(x.reshape(world_size, -1), [rows * recorder.HIDDEN] * world_size,
                                 NcclContext(topo, [call]))
        assert [digest(o) for o in outs] == hashes[key], f"{key}: {call.describe()}"
        algorithms.add(call.algorithm)
    # With the harness's pins NCCL picks PAT for the small messages; pinned ring means ring;
    # unpinned, PAT or ring (LL or Simple) by world size.
    expected = {"pins": {"PAT", "RING"}, "rsring": {"RING"}}.get(config)
    assert algorithms == expected if expected else algorithms <= {"PAT", "RING"}


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_tree_all_reduce_model_reproduces_every_bit_of_nccl(world_size, recorder_inputs):
    topo, hashes = topology("pins", world_size), recorded("pins", world_size)
    calls = rank0_calls("pins", world_size, "AllReduce")  # then the recorder's closing barrier
    points = [(name, nbytes) for name in recorder.DTYPES for nbytes in recorder.AR_BYTES]
    assert [c.nbytes for c in calls[:len(points)]] == [nbytes for _, nbytes in points]
    channels = set()
    for (name, nbytes), call in zip(points, calls):
        dtype = dtype_of(name)
        n = nbytes // dtype.itemsize
        x = recorder_inputs.ar(dtype, world_size, n)
        out, _ = all_reduce(x, NcclContext(topo, [call]))
        assert hashes[f"ar/{name}/{nbytes}"] == [digest(out)] * world_size, call.describe()
        channels.add(call.channels)
    assert channels == {(0, 0), (0, 1), (0, 7)}  # the split changes with the message size


def test_the_logged_algorithm_matters(recorder_inputs):
    """The PAT model matches NCCL's small reduce-scatter; the ring model, which NCCL did
    not run, misses thousands of elements (the recorded outputs themselves, world size 4)."""
    out = torch.load(FIXTURES / "outputs-w4-bfloat16.pt")
    got = out["pins/rs/bfloat16/rows2"].view(torch.bfloat16).reshape(4, -1)
    x = recorder_inputs.rs(torch.bfloat16, 4, 2).reshape(4, -1)
    sizes = [2 * recorder.HIDDEN] * 4
    pat = torch.stack(nccl_pat.pat_reduce_scatter(x, sizes))
    ring = torch.stack(orders.nccl_ring_reduce_scatter(x, sizes))
    assert int((pat.view(torch.int16) != got.view(torch.int16)).sum()) == 0
    assert int((ring.view(torch.int16) != got.view(torch.int16)).sum()) > 1000
    ringed = out["rsring/rs/bfloat16/rows2"].view(torch.bfloat16).reshape(4, -1)
    assert torch.equal(ring.view(torch.int16), ringed.view(torch.int16))


def rotate(tree, by: int, world_size: int):
    if isinstance(tree, int):
        return (tree + by) % world_size
    return rotate(tree[0], by, world_size), rotate(tree[1], by, world_size)


def test_pat_trees_rotate_with_the_destination():
    for world_size in (2, 3, 4, 5, 6, 7, 8, 16):
        trees = nccl_pat.sum_trees(world_size)  # also asserts every rank is summed once
        assert all(trees[d] == rotate(trees[0], d, world_size) for d in range(world_size))
    # World size 4, destination 0: x3 + ((x1 + x2) + x0), unlike the ring's ((x1 + x2) + x3) + x0.
    assert nccl_pat.sum_trees(4)[0] == (3, ((1, 2), 0))


def test_pat_schedule_does_not_depend_on_aggregation():
    for world_size in (3, 4, 8):
        base = nccl_pat.pat_sum_trees(world_size)
        for agg in (2, 4, 8):
            for parallel in (1, 16):
                assert nccl_pat.pat_sum_trees(world_size, agg, parallel) == base


def test_channel_split_by_hand():
    # Tree/Simple: 512 threads, threshold 64 B/thread, 8 channels: < 256 KiB lowers the count.
    assert orders.nccl_channel_split(2048, 2, 2, 8, 512, 64) == [2048]  # 4 KiB: one channel
    assert orders.nccl_channel_split(32768, 2, 2, 8, 512, 64) == [16384, 16384]  # 64 KiB: two
    assert orders.nccl_channel_split(524288, 2, 2, 8, 512, 64) == [65536] * 8  # 1 MiB: eight
    assert orders.nccl_channel_split(1000, 4, 2, 8, 512, 64) == [1000]  # a partial cell


def test_pins_are_read_per_function_and_checked_against_the_log():
    assert pins.pinned_algorithms("allreduce:tree") == {"AllReduce": {"TREE"}}
    assert pins.pinned_algorithms("allreduce:tree;reducescatter:ring") == {
        "AllReduce": {"TREE"}, "ReduceScatter": {"RING"}}
    assert pins.pinned_algorithms("Ring")["ReduceScatter"] == {"RING"}
    assert pins.pinned_algorithms("^NVLS") == {}
    pat = rank0_calls("pins", 4, "ReduceScatter")[0]
    assert pat.algorithm == "PAT"
    [violation] = pins.pin_violations([pat], "allreduce:tree;reducescatter:ring")
    assert "pins ReduceScatter to RING" in violation and "PAT" in violation
    assert pins.pin_violations([pat], "allreduce:tree") == []


def test_the_model_table_picks_the_model_of_the_logged_function_and_algorithm(monkeypatch):
    """A model is one (function, algorithm) line of MODELS: the call NCCL logged is looked up
    there, a pair without a line is NoPrediction naming the call, and a new line is used."""
    from ep_harness.nccl import models

    topo = topology("pins", 4)
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    pat = nccl_log.Call("ReduceScatter", 16, "PAT", "SIMPLE", (0, 0))
    pat_reduce = nccl_log.Call("Reduce", 16, "PAT", "SIMPLE", (0, 0))
    assert models.MODELS[("ReduceScatter", "PAT")] is models._pat_reduce_scatter
    with pytest.raises(NoPrediction, match="no model for Reduce 16 B: PAT"):
        reduce_scatter(x, [2] * 4, NcclContext(topo, [pat_reduce]))
    seen = []
    monkeypatch.setitem(models.MODELS, ("Reduce", "PAT"),
                        lambda inputs, sizes, topo, call: (seen.append(call) or ["toy"], "toy model"))
    assert reduce_scatter(x, [2] * 4, NcclContext(topo, [pat_reduce])) == (["toy"], "toy model")
    assert seen == [pat_reduce]
    assert reduce_scatter(x, [2] * 4, NcclContext(topo, [pat]))[1] == "NCCL PAT reduce-scatter, 4 nodes"
    tree = nccl_log.Call("AllReduce", 16, "TREE", "SIMPLE", (0, 0))
    assert "tree all-reduce" in all_reduce(x, NcclContext(topo, [tree]))[1]
    monkeypatch.delitem(models.MODELS, ("AllReduce", "TREE"))
    with pytest.raises(NoPrediction, match=r"AllReduce 16 B: TREE/SIMPLE, channels 0..0 \(the models cover RING\)"):
        all_reduce(x, NcclContext(topo, [tree]))


def test_no_prediction_names_what_nccl_ran():
    topo = topology("pins", 4)
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    nvls_ar = nccl_log.Call("AllReduce", 16, "NVLS", "SIMPLE", (0, 0))
    with pytest.raises(NoPrediction, match="AllReduce 16 B: NVLS"):
        all_reduce(x, NcclContext(topo, [nvls_ar]))
    ring_elsewhere = nccl_log.Call("AllReduce", 16, "RING", "SIMPLE", (0, 3))  # 16 B fits one channel
    with pytest.raises(NoPrediction, match="predicts channels 0..0, NCCL used 0..3"):
        all_reduce(x, NcclContext(topo, [ring_elsewhere]))
    with pytest.raises(NoPrediction, match="no ReduceScatter/Reduce call"):
        reduce_scatter(x, [2] * 4, NcclContext(topo, []))
    with pytest.raises(NoPrediction, match="no NCCL log"):
        reduce_scatter(x, [2] * 4, None)


# Recorded with nothing pinned (`free`: NCCL picks algorithm, protocol and channels), with
# tree pinned but NCCL's own channel count (`treefree`) and with tree on one channel
# (`treech1`): every all-reduce of the sweep, 4 KiB to 32 MiB (ci/nccl_record.py SWEEP_BYTES).
# Sizes above 1 MiB take seconds each on a CPU: the default run checks one of them per
# recording, EP_HARNESS_NCCL_FULL_SWEEP=1 all 420 (180 free, 120 treefree, 120 treech1; done
# once when the fixtures were recorded: every one equal).
FULL_SWEEP = os.environ.get("EP_HARNESS_NCCL_FULL_SWEEP") == "1"
LARGE = {3: ("bfloat16", 12345676), 4: ("float16", 3149824), 8: ("float32", 16777216)}
TREE_LARGE = {("treefree", 4): ("bfloat16", 16 << 20), ("treefree", 8): ("float16", 12345676),
              ("treech1", 4): ("float32", 4 << 20), ("treech1", 8): ("bfloat16", (3 << 20) + 4096)}


def sweep(config: str, world_size: int, max_bytes: int | None = None, dtypes=recorder.DTYPES):
    """(dtype name, bytes, NCCL's call) for the recorder's all-reduces (then its closing barrier)."""
    calls = rank0_calls(config, world_size, "AllReduce")
    points = [(name, nbytes) for name in recorder.DTYPES for nbytes in recorder.AR_SIZES[config]]
    assert [c.nbytes for c in calls[:len(points)]] == [nbytes for _, nbytes in points]
    return [(name, nbytes, call) for (name, nbytes), call in zip(points, calls)
            if (max_bytes is None or nbytes <= max_bytes) and name in dtypes]


def reproduce(config: str, world_size: int, points, inputs) -> set[str]:
    """Every point's model output against NCCL's recorded digests; the algorithms seen."""
    topo, hashes = topology(config, world_size), recorded(config, world_size)
    seen = set()
    for name, nbytes, call in points:
        dtype = dtype_of(name)
        n = nbytes // dtype.itemsize
        x = inputs.ar(dtype, world_size, n)
        out, _ = all_reduce(x, NcclContext(topo, [call]))
        assert hashes[f"ar/{name}/{nbytes}"] == [digest(out)] * world_size, f"{name}: {call.describe()}"
        seen.add(f"{call.algorithm}/{call.protocol}")
    return seen


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_unpinned_all_reduce_models_reproduce_every_bit_of_nccl(world_size, recorder_inputs):
    """Nothing pinned, one node per rank: NCCL builds 2 channels and picks ring (LL below
    ~64-128 KiB, Simple above) nearly everywhere, tree/LL for 4 KiB at 8 ranks."""
    topo = topology("free", world_size)
    assert topo.coll_channels == 2 and topo.env.get("NCCL_ALGO") is None and "NCCL_PROTO" not in topo.env
    points = sweep("free", world_size, None if FULL_SWEEP else 1 << 20)
    name, nbytes = LARGE[world_size]
    points += [] if FULL_SWEEP else [p for p in sweep("free", world_size, None, (name,)) if p[1] == nbytes]
    seen = reproduce("free", world_size, points, recorder_inputs)
    assert {"RING/LL", "RING/SIMPLE"} <= seen and seen <= {"RING/LL", "RING/SIMPLE", "TREE/LL"}
    assert ("TREE/LL" in seen) == (world_size == 8)


def tree_points(config: str, world_size: int):
    """The sweep up to 1 MiB and one larger size (all of it with EP_HARNESS_NCCL_FULL_SWEEP=1)."""
    if FULL_SWEEP:
        return sweep(config, world_size)
    name, nbytes = TREE_LARGE[config, world_size]
    return sweep(config, world_size, 1 << 20) + [p for p in sweep(config, world_size, None, (name,)) if p[1] == nbytes]


def logged_channels_by_size(config: str, world_size: int) -> dict[int, set[tuple[int, int]]]:
    """Every size of the sweep -> the channel ranges NCCL logged for it (over the dtypes)."""
    out: dict[int, set[tuple[int, int]]] = {}
    for _, nbytes, call in sweep(config, world_size):
        out.setdefault(nbytes, set()).add(call.channels)
    return out


def assert_split_predicts_every_logged_range(config: str, world_size: int):
    """The channel split of the model (cheap: no reduction) for all 60 calls of the sweep;
    all_reduce_plan raises NoPrediction where it differs from the range NCCL logged."""
    topo = topology(config, world_size)
    for name, nbytes, call in sweep(config, world_size):
        size = dtype_of(name).itemsize
        all_reduce_plan(nbytes // size, size, NcclContext(topo, [call]))


@pytest.mark.parametrize("world_size", [4, 8])
def test_tree_without_channel_pin_reproduces_every_bit_of_nccl(world_size, recorder_inputs):
    """Tree pinned, no channel pin, one node per rank: 2 channels carrying the two trees of
    the double binary tree; below 64 KiB (2 channels x 512 threads x 64 B) only channel 0."""
    topo = topology("treefree", world_size)
    assert topo.coll_channels == 2 and sorted(topo.trees) == [0, 1] and topo.trees[0] != topo.trees[1]
    assert logged_channels_by_size("treefree", world_size) == {
        nbytes: {(0, 0) if nbytes < 1 << 16 else (0, 1)} for nbytes in recorder.SWEEP_BYTES}
    assert_split_predicts_every_logged_range("treefree", world_size)
    points = tree_points("treefree", world_size)
    assert reproduce("treefree", world_size, points, recorder_inputs) == {"TREE/SIMPLE"}
    assert {c.channels for _, _, c in points} == {(0, 0), (0, 1)}


@pytest.mark.parametrize("world_size", [4, 8])
def test_tree_on_one_channel_reproduces_every_bit_of_nccl(world_size, recorder_inputs):
    """NCCL_MIN/MAX_NCHANNELS=1 and NCCL_MIN/MAX_CTAS=1: one coll channel, carrying the tree
    of channel 0 of the unpinned communicator, and every size of the sweep (and the
    recorder's closing barrier) on channel 0 only."""
    topo = topology("treech1", world_size)
    assert all(topo.env[f"NCCL_{v}"] == "1" for v in ("MIN_NCHANNELS", "MAX_NCHANNELS", "MIN_CTAS", "MAX_CTAS"))
    assert topo.coll_channels == 1 and sorted(topo.trees) == [0] and sorted(topo.rings) == [0]
    assert topo.trees[0] == topology("treefree", world_size).trees[0]
    calls = rank0_calls("treech1", world_size, "AllReduce")
    assert len(calls) == len(recorder.DTYPES) * len(recorder.SWEEP_BYTES) + 1
    assert {c.channels for c in calls} == {(0, 0)}
    assert logged_channels_by_size("treech1", world_size) == {nbytes: {(0, 0)} for nbytes in recorder.SWEEP_BYTES}
    assert_split_predicts_every_logged_range("treech1", world_size)
    assert reproduce("treech1", world_size, tree_points("treech1", world_size), recorder_inputs) == {"TREE/SIMPLE"}


@pytest.mark.parametrize("world_size", [4, 8])
def test_one_channel_and_two_channel_trees_agree_exactly_where_nccl_used_channel_0_only(world_size):
    """Positive control from the recordings alone: the one-channel and the unpinned tree
    all-reduce give the same bits for a size exactly when the unpinned one ran on channel 0
    only (18 of 60 calls: 6 sizes below 64 KiB x 3 dtypes); from 64 KiB on, the part of the
    message on channel 1 went through the other tree, and every one of the 42 differs."""
    one, two = recorded("treech1", world_size), recorded("treefree", world_size)
    same = 0
    for name, nbytes, call in sweep("treefree", world_size):
        key = f"ar/{name}/{nbytes}"
        assert (one[key] == two[key]) == (call.channels == (0, 0)), f"{key}: {call.describe()}"
        same += one[key] == two[key]
    assert same == len(recorder.DTYPES) * sum(nbytes < 1 << 16 for nbytes in recorder.SWEEP_BYTES) == 18


@pytest.mark.parametrize("world_size", [4, 8])
def test_a_wrong_tree_or_channel_assignment_misses_nccl(world_size, recorder_inputs):
    """Positive control for the tree model: 64 KiB of bf16, the smallest size NCCL splits over
    two channels. The model with the logged trees and split equals both recordings; the same
    order with the trees swapped, with the whole message on one tree, or with the one-channel
    recording fed the other tree, misses NCCL's output in thousands of elements (counted
    against the model, which equals NCCL's recorded bits)."""
    nbytes, n = 1 << 16, (1 << 16) // 2
    x = recorder_inputs.ar(torch.bfloat16, world_size, n)
    [(_, _, two_call)] = [p for p in sweep("treefree", world_size, None, ("bfloat16",)) if p[1] == nbytes]
    [(_, _, one_call)] = [p for p in sweep("treech1", world_size, None, ("bfloat16",)) if p[1] == nbytes]
    two_topo, one_topo = topology("treefree", world_size), topology("treech1", world_size)
    two, _ = all_reduce(x, NcclContext(two_topo, [two_call]))
    one, _ = all_reduce(x, NcclContext(one_topo, [one_call]))
    key = f"ar/bfloat16/{nbytes}"
    assert recorded("treefree", world_size)[key] == [digest(two)] * world_size
    assert recorded("treech1", world_size)[key] == [digest(one)] * world_size
    plan, _ = all_reduce_plan(n, 2, NcclContext(two_topo, [two_call]))
    assert two_call.channels == (0, 1) and plan.counts == [n // 2] * 2
    tree0, tree1 = two_topo.channel_trees()

    def misses(out: torch.Tensor, nccl: torch.Tensor) -> int:
        return int((out.view(torch.int16) != nccl.view(torch.int16)).sum())

    swapped = orders.nccl_tree_all_reduce(x, [tree1, tree0], plan.counts)
    assert misses(swapped, two) > n // 10
    assert misses(orders.nccl_tree_all_reduce(x, [tree0], [n]), two) > n // 20  # misses in channel 1's half
    assert misses(orders.nccl_tree_all_reduce(x, [tree1], [n]), one) > n // 10


def test_the_ring_model_needs_nccls_channel_split(recorder_inputs):
    """Recorded whole (4 ranks, bf16): ring/LL at 64 KiB and ring/Simple at 128 KiB, each over
    channels 0..1. The model reproduces every element; the same ring folded as one channel
    (the chunking of a single-channel ring all-reduce) misses thousands."""
    saved = torch.load(FIXTURES / "outputs-free-w4-bfloat16.pt")
    topo = topology("free", 4)
    calls = {nbytes: call for name, nbytes, call in sweep("free", 4, 1 << 17, ("bfloat16",))}
    for nbytes, proto in ((65536, "LL"), (131072, "SIMPLE")):
        got = saved[f"free/ar/bfloat16/{nbytes}"].view(torch.int16)
        x = recorder_inputs.ar(torch.bfloat16, 4, nbytes // 2)
        call = calls[nbytes]
        assert (call.protocol, call.channels) == (proto, (0, 1))
        out, _ = all_reduce(x, NcclContext(topo, [call]))
        assert int((out.view(torch.int16) != got).sum()) == 0
        one_channel = orders.nccl_ring_all_reduce(x, nccl_plan.chunk_elements("RING", proto, 2))
        assert int((one_channel.view(torch.int16) != got).sum()) > 1000


def test_ll_traffic_counts_four_times_in_the_split():
    # Ring/LL, 2 channels, 8 ranks (threshold 8 * 8 = 64): 32 KiB stays on one channel and
    # 64 KiB takes two, as logged. Counting LL's traffic 4x in the cell but not in the
    # per-channel budget would deal 4 KiB of a 4 KiB message to each of two channels.
    assert nccl_plan.channel_counts(16384, 2, 2, "LL", 2, nccl_plan.max_channels(32768, 2, 512, 64)) == [16384]
    assert nccl_plan.channel_counts(32768, 2, 2, "LL", 2, nccl_plan.max_channels(65536, 2, 512, 64)) == [16384] * 2
    assert nccl_plan.channel_counts(2048, 2, 2, "LL", 2, 1) == [2048]  # 4 KiB: channel 0 only (logged 0..0)
    assert nccl_plan.channel_counts(2048, 2, 2, "Simple", 2, 2) == [2048]
    assert nccl_plan.chunk_elements("RING", "Simple", 2) == 1 << 20  # 2 MiB: 4 steps of NCCL_BUFFSIZE / 8
    assert nccl_plan.chunk_elements("RING", "LL", 4) == 8192  # 32 KiB of data per 64 KiB LL step
    assert nccl_plan.chunk_elements("RING", "LL128", 2) == 288000  # 15 of 16 words of a 600 KiB step
