"""The cost of the layout-size fixes (docs/layout-invariance.md): the TP reduction of one
logical bf16 tensor of V = 8 virtual shards at the launch's world size, each rank reducing
its V / W shards (harness/shards.py reduce_shards), native reduce-scatter against
the tree over the shards; medians over repeats, the slowest rank's. Under torchrun:

    torchrun --nproc-per-node 4 -m ep_harness.cost.bench_layout OUT.json [MIN_KIB MAX_MIB REPEATS]

Rank 0 writes JSON rows (subject, logical bytes, median seconds, ratio to native).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

SUBJECTS = ("reduce_scatter_native", "all_reduce_slice", "all_gather_fold", "tree_reduce_scatter")
SHARDS = 8


def main(out_path: str, min_kib: int = 64, max_mib: int = 16, repeats: int = 9) -> int:
    import torch
    import torch.distributed as dist

    import ep_harness.subjects  # noqa: F401
    from ep_harness import subject as registry
    from ep_harness.shards import reduce_shards

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows, size, hidden = [], min_kib * 1024, 2048
    while size <= max_mib * 2**20:
        n_rows = max(world, size // 2 // hidden // world * world)
        g = torch.Generator().manual_seed(rank)
        mine = torch.randn(SHARDS // world, n_rows, hidden, generator=g).to(torch.bfloat16)
        out = mine.new_empty((n_rows // world, hidden))
        timings = {}
        for name in SUBJECTS:
            subject, samples = registry.get(name), []
            for i in range(repeats + 2):
                dist.barrier()
                began = time.perf_counter()
                reduce_shards(subject, out, mine, [n_rows // world] * world, dist.group.WORLD)
                if i >= 2:  # two warm-ups
                    samples.append(time.perf_counter() - began)
            local = torch.tensor([statistics.median(samples)])
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            timings[name] = float(local)
        rows += [{"subject": n, "bytes": n_rows * hidden * 2, "median_s": s, "vs_native": s / timings[SUBJECTS[0]]}
                 for n, s in timings.items()]
        size *= 16
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": world, "backend": "gloo", "shards": SHARDS, "repeats": repeats, "rows": rows}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *map(int, sys.argv[2:5])))
