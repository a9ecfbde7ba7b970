"""prefill-decode-invariance: where its copies sit, what each copy records, when it is vacuous,
and the channel pin's verification from NCCL's log (recorded NCCL 2.28.9 logs, no GPU)."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ep_harness.nccl import log as nccl_log
from ep_harness.nccl import models as nccl_models
from ep_harness.nccl import pins
from ep_harness.families.collective import Layout, _record_paths, layouts
from ep_harness.measurement import Measurement
from ep_harness.compare import Mismatch
from ep_harness.families.collective import CollectiveParams
from ep_harness.subject import OrderModel
from ep_harness.reference import nccl_plan

FIXTURES = Path(__file__).parent / "fixtures" / "nccl-2.28.9-emulated-hosts"


def params(**kw):
    return CollectiveParams(dtype="bfloat16", **kw)


def topology(config: str, world_size: int) -> nccl_log.Topology:
    return nccl_log.read_ranks(sorted((FIXTURES / f"{config}-w{world_size}").glob("rank*.log")))


def rank0_calls(config: str, world_size: int) -> list[nccl_log.Call]:
    return nccl_log.parse((FIXTURES / f"{config}-w{world_size}" / "rank0.log").read_text()).calls


def test_decode_is_row_zero_of_the_smallest_message_and_prefill_probes_every_part():
    p = params(hidden=2048, message_bytes=[4096, 65536, 1 << 20], channel_probes=8)
    decode, small, large = layouts("prefill-decode-invariance", p, 4)
    assert decode.probes == (0,) and decode.sizes == (1, 1, 1, 1)  # one row per rank: 16 KiB
    assert decode.label == "decode 16,384 B"
    assert small.rows == 16 and small.probes[0] == 0 and small.probes[-1] == 15
    assert large.rows == 256 and large.label == "prefill 1,048,576 B"
    assert set(large.probes) == {0, 255} | {(2 * i + 1) * 256 // 16 for i in range(8)}


@pytest.mark.parametrize("nbytes", [1 << 18, 1 << 20, 3 << 20, 16 << 20])
@pytest.mark.parametrize("world_size", [4, 8])
def test_every_channel_of_nccls_split_holds_a_prefill_copy(nbytes, world_size):
    """With NCCL's tree split of the message over 8 channels (the harness's channel pin) and
    over fewer, each channel's contiguous range contains a whole probe row."""
    hidden = 2048
    prefill = layouts("prefill-decode-invariance", params(hidden=hidden, message_bytes=[4096, nbytes]), world_size)[1]
    count = prefill.rows * hidden
    for comm_channels in (2, 4, 8):
        allowed = nccl_plan.max_channels(count * 2, comm_channels, 512, 64)
        counts = nccl_plan.channel_counts(count, 2, 2, "Simple", comm_channels, allowed)
        starts = [sum(counts[:c]) for c in range(len(counts))]
        for start, size in zip(starts, counts):
            assert any(start <= row * hidden and (row + 1) * hidden <= start + size for row in prefill.probes), \
                (comm_channels, counts)


def test_each_copy_names_its_channel_and_tree_from_the_log():
    topo = topology("pins", 4)
    call = next(c for c in rank0_calls("pins", 4) if c.function == "AllReduce" and c.nbytes == 1 << 20)
    nccl = nccl_models.NcclContext(topo, [call])
    count, row = (1 << 20) // 2, 2048
    assert nccl_models.element_path(count, 2, nccl, 0, row)[0] == "AllReduce TREE/SIMPLE channel 0 (tree of channel 0)"
    # 8 channels of 65,536 elements: row 40 is in channel 1 (odd: the other tree), row 80 in channel 2.
    what1, sig1 = nccl_models.element_path(count, 2, nccl, 40 * row, 41 * row)
    what2, sig2 = nccl_models.element_path(count, 2, nccl, 80 * row, 81 * row)
    assert what1 == "AllReduce TREE/SIMPLE channel 1 (tree of channel 1)" and sig1 != sig2
    assert what2 == "AllReduce TREE/SIMPLE channel 2 (tree of channel 0)"
    assert sig2 == nccl_models.element_path(count, 2, nccl, 0, row)[1]


def _measurement():
    return Measurement.bitwise(Mismatch(mismatched=0, total=2))


def test_vacuous_only_when_every_copy_took_the_same_path_in_the_same_size_message():
    ctx = SimpleNamespace(backend="gloo", world_size=4)
    gloo = OrderModel("gloo ring all-reduce + slice", None, exact=True)
    p = params(hidden=256)
    same = [Layout((1, 1, 1, 1), (0,), "decode"), Layout((1, 1, 1, 1), (0,), "prefill")]
    rows = torch.tensor([[1.0, 2.0], [1.0, 3.0]], dtype=torch.bfloat16)
    m = _measurement()
    _record_paths(m, ctx, p, gloo, same, [[], []], rows, None)
    assert "same path (gloo ring chunk 0)" in m.vacuous_reason
    assert m.detail["copies"] == [
        {"copy": "decode: rank 0 row 0", "path": "gloo ring chunk 0", "measured": 0, "predicted": None},
        {"copy": "prefill: rank 0 row 0", "path": "gloo ring chunk 0", "measured": 1, "predicted": None}]
    # Positive controls: another chunk of the same message, or row 0 of a larger message.
    for other in (Layout((1, 1, 1, 1), (3,), "prefill"), Layout((2, 2, 2, 2), (0,), "prefill")):
        m = _measurement()
        _record_paths(m, ctx, p, gloo, [same[0], other], [[], []], rows, rows)
        assert m.vacuous_reason is None
        assert [c["predicted"] for c in m.detail["copies"]] == [0, 1]


def test_channel_pin_holds_only_where_every_size_used_one_range():
    assert pins.channel_pin({"NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"}) == 8
    assert pins.channel_pin({"NCCL_MIN_NCHANNELS": "", "NCCL_MAX_NCHANNELS": ""}) is None
    assert pins.channel_pin({"NCCL_MIN_NCHANNELS": "1", "NCCL_MAX_NCHANNELS": "8"}) is None
    # SGLang's pin (8 channels, recorded): NCCL still gives 4 KiB one channel and 64 KiB two.
    calls = [c for c in rank0_calls("pins", 4) if c.function == "AllReduce" and c.nbytes >= 4096][:5]
    broken = pins.channel_pin_violations(calls, 8)
    assert "most calls used 0..7" in broken
    assert "channels 0..0 at AllReduce 4,096 B" in broken and "channels 0..1 at AllReduce 65,536 B" in broken
    assert pins.channel_pin_violations([c for c in calls if c.channels == (0, 7)], 8) is None
    assert "pins no channel count" in pins.channel_pin_violations(calls, None)
    assert "NCCL built 8 coll channels" in pins.channel_pin_violations(calls[:1], 1, 8)


def test_paths_that_escape_nccl_algo_are_named():
    assert pins.escaped_paths(rank0_calls("pins", 8)) == []
    line = "NCCL INFO AllReduce [Symmetric]: 4096 Bytes -> Kernel AllReduce_AGxLL_R nchannels 4 nthreads 512 nWorks 1"
    sym = nccl_log.parse(line).calls
    nvls = [nccl_log.Call("AllReduce", 1 << 20, "NVLS", "SIMPLE", (0, 15))]
    [s], [n] = pins.escaped_paths(sym), pins.escaped_paths(nvls)
    assert "symmetric kernel" in s and "NCCL_WIN_ENABLE=0" in s
    assert "AllReduce 1,048,576 B: NVLS/SIMPLE" in n and "NCCL_NVLS_ENABLE=0" in n


def test_a_ring_copy_names_its_channel_and_the_order_its_chunk_adds_in():
    """Nothing pinned, 4 nodes, 1 MiB bf16: NCCL ran ring/Simple over channels 0..1; each
    channel's 128 rows are 4 chunks of 32 rows, chunk k added from ring index k + 1 around."""
    call = next(c for c in rank0_calls("free", 4) if c.function == "AllReduce" and c.nbytes == 1 << 20)
    nccl = nccl_models.NcclContext(topology("free", 4), [call])
    count, row = (1 << 20) // 2, 2048

    def path(r):
        return nccl_models.element_path(count, 2, nccl, r * row, (r + 1) * row)[0]

    assert path(0) == "AllReduce RING/SIMPLE channel 0 (adds 1 2 3 0)"
    assert path(63) == "AllReduce RING/SIMPLE channel 0 (adds 2 3 0 1)"
    assert path(64) == "AllReduce RING/SIMPLE channel 0 (adds 3 0 1 2)"
    assert path(200) == "AllReduce RING/SIMPLE channel 1 (adds 3 0 1 2)"
    straddling = nccl_models.element_path(count, 2, nccl, 31 * row + 100, 32 * row + 100)[0]
    assert straddling == "AllReduce RING/SIMPLE channel 0 (adds 1 2 3 0; 2 3 0 1)"
