"""NCCL 2.30.7 with its ranks as ONE node on one H200 (single-node emulation), on the CPU.

The fixtures in tests/fixtures/nccl-2.30.7-single-node/ were recorded on the lent H200 on
2026-12-01 (driver 580.159.04, torch 2.11.0+cu130 with its libnccl.so.2 replaced by an NCCL
2.30.7 build for sm_90, ci/use_nccl.sh) by `ci/nccl_record.py --emulate single-node` (4 and 8
processes on cuda:0, NCCL_MULTI_RANK_GPU_ENABLE=1) and cut by ci/nccl_fixtures.py: every
rank's NCCL_DEBUG=INFO log as the parser reads it and a SHA-256 of every rank's output. The
order models of harness/nccl/models.py, unchanged from the emulated-hosts topology, must
reproduce every output element bit for bit, with the algorithm, protocol and channels NCCL
logged for each call; where they stop (a channel split they do not reproduce) they must say
so (NoPrediction) or, at the one point listed in KNOWN_MISSES, miss as recorded.
"""
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from ep_harness.emulation import single_node_problem
from ep_harness.inputs import dtype_of
from ep_harness.nccl import library
from ep_harness.nccl import log as nccl_log
from ep_harness.nccl.models import NcclContext, NoPrediction, all_reduce, reduce_scatter
from ep_harness.run.worker import nccl_library_error

FIXTURES = Path(__file__).parent / "fixtures" / "nccl-2.30.7-single-node"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ci"))
import nccl_record as recorder  # noqa: E402  (the recorder defines the inputs it used)

from tests.shared_nccl import recorder_inputs  # noqa: E402,F401  (a fixture)

MAX_BYTES = 1 << 20  # larger all-reduces take seconds each on a CPU
# Unpinned ring all-reduce (LL) at 200,704 B on 8 ranks: the channel split is predicted
# (0..5, as logged) but the bits are not; the LL ring's chunking of a partial cell there is
# not modelled yet. Recorded so that a change either way is seen.
KNOWN_MISSES = {("free", 8, 200704)}


def fixture(config: str, world_size: int) -> Path:
    return FIXTURES / f"{config}-w{world_size}"


def topology(config: str, world_size: int) -> nccl_log.Topology:
    return nccl_log.read_ranks(sorted(fixture(config, world_size).glob("rank*.log")))


def calls(config: str, world_size: int, function: str) -> list[nccl_log.Call]:
    text = (fixture(config, world_size) / "rank0.log").read_text()
    return [c for c in nccl_log.parse(text).calls if c.function == function]


def recorded(config: str, world_size: int) -> dict:
    return json.loads((fixture(config, world_size) / "hashes.json").read_text())


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("config", ["pins", "free"])
@pytest.mark.parametrize("world_size", [4, 8])
def test_the_log_shows_one_node_of_p2p_rings_and_one_chain_tree(config, world_size):
    topo = topology(config, world_size)
    assert (topo.version, topo.nranks, topo.nnodes, topo.local_ranks) == ("2.30.7", world_size, 1, world_size)
    assert topo.transports == ["P2P/CUMEM"]
    assert topo.ring() == list(range(world_size))  # every channel the same ring
    # NCCL cuts its long `Trees` line at 64 channels: a rank's last channels may be missing
    # there, so only the channels every rank logged are compared.
    complete = [t for t in topo.channel_trees() if len(t) == world_size]
    chain = {r: ([r + 1] if r + 1 < world_size else [], r - 1) for r in range(world_size)}  # 0 -> 1 -> ... -> W-1
    assert len(complete) >= 8 and all(t == chain for t in complete)  # one chain tree on every channel
    assert topo.coll_channels == {("pins", 4): 8, ("pins", 8): 8, ("free", 4): 64, ("free", 8): 56}[config, world_size]


@pytest.mark.parametrize("config", ["pins", "rsring", "free"])
@pytest.mark.parametrize("world_size", [4, 8])
def test_the_ring_reduce_scatter_model_reproduces_every_bit(config, world_size, recorder_inputs):
    topo, hashes = topology(config, world_size), recorded(config, world_size)
    logged = calls(config, world_size, "ReduceScatter")
    points = [(f"rs/{name}/rows{rows}", name, rows) for name in recorder.DTYPES for rows in recorder.RS_ROWS
              if config != "free" or rows == recorder.RS_ROWS[0]]
    assert len(logged) == len(points)
    for (key, name, rows), call in zip(points, logged):
        x = recorder_inputs.rs(dtype_of(name), world_size, rows)
        outs, _ = reduce_scatter(x.reshape(world_size, -1), [rows * recorder.HIDDEN] * world_size,
                                 NcclContext(topo, [call]))
        assert [digest(o) for o in outs] == hashes[key], f"{key}: {call.describe()}"
    # One node: ring for reduce-scatter (no PAT, which NCCL runs at one rank per node only).
    assert {c.algorithm for c in logged} == {"RING"}
    assert {c.protocol for c in logged} == ({"LL"} if config == "free" else {"SIMPLE"})


def all_reduce_points(config: str, world_size: int):
    logged = calls(config, world_size, "AllReduce")
    points = [(name, nbytes) for name in recorder.DTYPES for nbytes in recorder.AR_SIZES[config]]
    assert [c.nbytes for c in logged[:len(points)]] == [nbytes for _, nbytes in points]
    return [(name, nbytes, call) for (name, nbytes), call in zip(points, logged) if nbytes <= MAX_BYTES]


@pytest.mark.parametrize("config", ["pins", "treefree", "free"])
@pytest.mark.parametrize("world_size", [4, 8])
def test_the_all_reduce_models_reproduce_every_bit_or_say_where_they_stop(config, world_size, recorder_inputs):
    """Tree (the fix's path: Simple, 8 channels or NCCL's own count) and ring (nothing pinned:
    LL up to 1 MiB here, on up to 64 channels)."""
    topo, hashes = topology(config, world_size), recorded(config, world_size)
    exact, stopped, missed = 0, [], []
    for name, nbytes, call in all_reduce_points(config, world_size):
        dtype = dtype_of(name)
        x = recorder_inputs.ar(dtype, world_size, nbytes // dtype.itemsize)
        try:
            out, _ = all_reduce(x, NcclContext(topo, [call]))
        except NoPrediction as exc:
            assert "channel split predicts" in str(exc), exc  # the only place these models stop here
            stopped.append(nbytes)
            continue
        if hashes[f"ar/{name}/{nbytes}"] == [digest(out)] * world_size:
            exact += 1
        else:
            missed.append(nbytes)
    assert {(config, world_size, n) for n in missed} <= KNOWN_MISSES and len(missed) in (0, len(recorder.DTYPES))
    assert set(stopped) <= {200704, 1000000}  # sizes that leave a partial channel share at many channels
    assert exact >= {"pins": 12, "treefree": 36, "free": 33}[config]
    assert {c.algorithm for _, _, c in all_reduce_points(config, world_size)} == (
        {"RING"} if config == "free" else {"TREE"})


def test_nccl_version_codes_and_mapped_libraries():
    assert library.decode(23007) == (2, 30, 7) and library.decode(22809) == (2, 28, 9)
    assert library.decode(2708) == (2, 7, 8)  # before 2.9: major * 1000
    maps = ("7f00-7f10 r-xp 00000000 00:00 0 /site/nvidia/nccl/lib/libnccl.so.2\n"
            "7f10-7f20 r--p 00000000 00:00 0 /site/nvidia/nccl/lib/libnccl.so.2\n"
            "7f20-7f30 r-xp 00000000 00:00 0 /usr/lib/libc.so.6\n"
            "7f30-7f40 rw-p 00000000 00:00 0 \n")
    assert library.mapped_paths(maps) == ("/site/nvidia/nccl/lib/libnccl.so.2",)
    two = maps + "7f50-7f60 r-xp 00000000 00:00 0 /opt/nccl/build/lib/libnccl.so.2.30.7\n"
    assert len(library.mapped_paths(two)) == 2


def test_a_rank_that_runs_another_nccl_than_the_run_names_is_an_error():
    good = library.LoadedNccl((2, 30, 7), ("/a/libnccl.so.2",), (2, 28, 9))
    old = library.LoadedNccl((2, 28, 9), ("/a/libnccl.so.2",), (2, 28, 9))
    preloaded = library.LoadedNccl((2, 30, 7), ("/a/libnccl.so.2", "/b/libnccl.so.2.30.7"), (2, 28, 9))
    assert nccl_library_error("2.30.7", [good, good]) is None
    message = nccl_library_error("2.30.7", [good, old])
    assert "rank 1 runs 2.28.9" in message and "rank 0" not in message
    message = nccl_library_error("2.30.7", [preloaded, good])
    assert "rank 0 runs 2.30.7 (2 NCCL libraries are mapped" in message and "replace torch's" in message
    assert good.to_dict() == {"version": "2.30.7", "paths": ["/a/libnccl.so.2"], "torch_compiled": "2.28.9"}


def test_single_node_emulation_is_refused_below_nccl_2_30():
    assert single_node_problem((2, 30, 7)) is None and single_node_problem((2, 31, 0)) is None
    problem = single_node_problem((2, 28, 9))
    assert "needs NCCL >= 2.30.0" in problem and "runs 2.28.9" in problem and "ci/build_nccl.sh" in problem
    assert "no NCCL library" in single_node_problem(None)
