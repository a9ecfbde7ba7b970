"""Per-copy prediction of prefill-decode-invariance for all_reduce_slice with tree pinned, from the
topologies NCCL logged (committed fixtures): `python per_copy.py CONFIG WORLD_SIZE TITLE`, e.g.
`python per_copy.py treefree 4 "W = 4, no channel pin"`. Prints a Markdown table."""
import sys
from dataclasses import asdict
from pathlib import Path
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import torch
from ep_harness import nccl_log, nccl_models
from ep_harness.families.collective import prefill_decode_layouts, all_inputs, _labels
from ep_harness.inputs import dtype_of
from ep_harness.families.collective import CollectiveParams
from ep_harness.reference import nccl_plan

FIX = REPO / "tests" / "fixtures" / "nccl-2.28.9-emulated-hosts"
SIZES = [4096, 65536, 262144, 1048576, 16777216, 33554432]

def run(config, w, title):
    topo = nccl_log.read_ranks(sorted((FIX / f"{config}-w{w}").glob("rank*.log")))
    p = asdict(CollectiveParams(dtype="bfloat16", world_size=w, message_bytes=SIZES))
    dtype = dtype_of("bfloat16")
    layouts = prefill_decode_layouts(p, w)
    rows_out = []
    decode = None
    total = 0
    for layout in layouts:
        x = all_inputs(p, dtype, w, layout).reshape(w, -1)
        count = x.shape[1]
        mt, th = topo.max_threads["Tree"]["Simple"], topo.thread_thresholds["Tree"]["Simple"]
        n = len(nccl_plan.channel_counts(count, 2, 2, "SIMPLE", topo.coll_channels,
                                         nccl_plan.max_channels(count * 2, topo.coll_channels, mt, th)))
        call = nccl_log.Call("AllReduce", count * 2, "TREE", "SIMPLE", (0, n - 1))
        ctx = nccl_models.NcclContext(topo, [call])
        out, _ = nccl_models.all_reduce(x, ctx)
        h = p["hidden"]
        for row, label in zip(layout.probes, _labels(layout)):
            copy = out[row * h:(row + 1) * h]
            if decode is None:
                decode = copy
            diff = int((copy.view(torch.int16) != decode.view(torch.int16)).sum())
            total += diff
            what, _ = nccl_models.element_path(count, 2, ctx, row * h, (row + 1) * h)
            rows_out.append((f"{count * 2:,}", f"{layout.rows:,}", row, what.replace("AllReduce TREE/SIMPLE ", ""), diff))
    print(f"\n### {title}: predicted {total:,} of {len(rows_out) * p['hidden']:,}\n")
    print("| message (B) | rows | probe row | channel (tree) | predicted differing |")
    print("|---:|---:|---:|---|---:|")
    for r in rows_out:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:,} |")
    return total

run(sys.argv[1], int(sys.argv[2]), sys.argv[3])
