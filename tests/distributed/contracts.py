"""Run under torchrun's agent (gloo; harness/launch/agent/ forks the ranks): every collective
subject against its contract.

For even and uneven (one empty) shards: the output equals the subject's order model bit
for bit; deterministic subjects leave the caller's input unchanged and give the same bits
when `out` aliases this rank's slice of the input. Rank 0 writes the findings as JSON, with
each rank's intra-op thread count (a forked rank must have a torchrun rank's: 1) and the
thread count of the process it was forked from (a fork of a multi-threaded process can
inherit a lock that no thread will release: the fork server must be single-threaded).
"""
import faulthandler
import json
import os

import torch
import torch.distributed as dist

from ep_harness import subject as registry
from ep_harness.inputs import values
from ep_harness.launch.processes import process_state
from ep_harness.reference.collectives import shard_offsets

DETERMINISTIC = ("all_reduce_slice", "all_gather_fold", "all_to_all_fold")


def rank_main(out_path):
    # A hung rank prints every thread's stack and exits (the test then fails with them), well
    # before the test's own timeout would kill the agent and leave only a command line.
    faulthandler.dump_traceback_later(120, exit=True)
    parent_threads = process_state(os.getppid()).threads  # before this rank's own connections exist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    subjects = registry.load_all()
    hidden = 96
    findings = []
    for shards in ([3] * world, [1, 3, 0, 2][:world] if world == 4 else [2, 0, 1]):
        rows = sum(shards)
        start = shard_offsets(shards)[rank]
        inputs = torch.stack([values((rows, hidden), torch.bfloat16, 7, "contract", r) for r in range(world)])
        for name in ("reduce_scatter_native", "reduce_scatterv_native", *DETERMINISTIC):
            subject = subjects[name]
            if name == "reduce_scatter_native" and len(set(shards)) > 1:
                continue
            inp = inputs[rank].clone()
            out = inp.new_empty((shards[rank], hidden))
            subject.reduce_scatter(out, inp, shards, dist.group.WORLD)
            model = subject.order_model("gloo").predict(inputs.reshape(world, -1), [s * hidden for s in shards])
            finding = {
                "subject": name, "shards": shards, "rank": rank,
                "matches_model": torch.equal(out.reshape(-1).view(torch.int16), model[rank].view(torch.int16)),
                "input_unchanged": torch.equal(inp.view(torch.int16), inputs[rank].view(torch.int16)),
            }
            if name in DETERMINISTIC:
                aliased_inp = inputs[rank].clone()
                alias = aliased_inp[start:start + shards[rank]]
                subject.reduce_scatter(alias, aliased_inp, shards, dist.group.WORLD)
                finding["alias_ok"] = torch.equal(alias.view(torch.int16), out.view(torch.int16))
            findings.append(finding)
    gathered = [None] * world
    dist.all_gather_object(gathered, (findings, torch.get_num_threads(), parent_threads))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"findings": [x for per_rank, _, _ in gathered for x in per_rank],
                       "threads": [threads for _, threads, _ in gathered],
                       "parent_threads": [parent for _, _, parent in gathered]}, f)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
