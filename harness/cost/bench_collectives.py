"""The cost of determinism: native reduce-scatter against its deterministic replacements,
side by side in one launch, medians over repeats. Run under torchrun (one process per GPU,
or gloo ranks on the CPU):

    python -m ep_harness.cost.bench collectives --world-size 4 [--max-mib 256]

Rank 0 writes JSON rows (subject, bytes, median seconds, ratio to native) to the path given.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

SUBJECTS = ("reduce_scatter_native", "all_reduce_slice", "all_to_all_fold", "all_gather_fold")


def main(out_path: str, min_kib: int, max_mib: int, repeats: int) -> int:
    import torch
    import torch.distributed as dist

    from ep_harness import subject as registry

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    subjects = {name: registry.load_all()[name] for name in SUBJECTS}
    rows, size = [], min_kib * 1024
    while size <= max_mib * 2**20:
        hidden = 2048
        n_rows = max(world, (size // 2 // hidden) // world * world)  # bf16 message of about `size` bytes
        inp = torch.randn(n_rows, hidden, device=device).to(torch.bfloat16)
        out = inp.new_empty((n_rows // world, hidden))
        sizes = [n_rows // world] * world
        timings = {}
        for name, subject in subjects.items():
            samples = []
            for i in range(repeats + 2):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                began = time.perf_counter()
                subject.reduce_scatter(out, inp, sizes, dist.group.WORLD)
                if cuda:
                    torch.cuda.synchronize()
                if i >= 2:  # two warm-ups
                    samples.append(time.perf_counter() - began)
            local = torch.tensor([statistics.median(samples)], device=device)
            dist.all_reduce(local, op=dist.ReduceOp.MAX)  # the slowest rank is the collective's time
            timings[name] = float(local)
        for name, seconds in timings.items():
            rows.append({"subject": name, "bytes": inp.numel() * 2, "median_s": seconds,
                         "vs_native": seconds / timings["reduce_scatter_native"]})
        size *= 4
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": world, "backend": dist.get_backend(), "repeats": repeats, "rows": rows}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
