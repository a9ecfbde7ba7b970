"""The ranks of an `ep-harness explore` launch (harness/run/explore.py starts it): rank 0 runs
the Hypothesis search and broadcasts each example; every rank runs the check it names.

Imports are at the top so that ep_harness.launch.agent does them once per launch, before it forks its
fork server, not once per rank (the CLI side, harness/run/explore.py, stays free of torch until
it launches).
"""
from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample

from ep_harness import subject as registry
from ep_harness.context import RankContext
from ep_harness.run.explore import as_check, strategy
from ep_harness.families import execute
from ep_harness.records import write_json


def rank_main(job_dir: str) -> int:
    """Every rank: rank 0 searches; all ranks evaluate what it broadcasts."""
    job_dir = Path(job_dir)
    job = json.loads((job_dir / "job.json").read_text())
    registry.load_all(job["plugins"])
    subject = registry.get(job["subject"])
    rank = int(os.environ["RANK"])
    (job_dir / f"pid-rank{rank}").write_text(str(os.getpid()))  # so that an interrupted launch ends every rank
    device = torch.device("cpu")
    if job["backend"] == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(job["backend"], timeout=datetime.timedelta(seconds=job["budget_s"] + 300))
    ctx = RankContext(rank, dist.get_world_size(), job["backend"], device, dist.group.WORLD)

    def evaluate(example) -> tuple[bool, object]:
        """(whether rank 0 sent an example, its Measurement: on rank 0 only); None ends the search."""
        box = [example]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return False, None
        return True, execute(as_check(subject, box[0], ctx.world_size, job["backend"]), subject, ctx)

    if rank != 0:
        while evaluate(None)[0]:
            pass
        dist.destroy_process_group()
        return 0

    began, count, found, replayed = time.time(), 0, None, False

    def violates(example) -> bool:
        nonlocal count
        if time.time() - began > job["budget_s"]:
            return False
        count += 1
        _, m = evaluate(example)
        return m.held is False and not m.vacuous_reason

    for example in job["known"]:  # replay known counterexamples first
        if violates(example):
            found, replayed = example, True
            break
    if found is None:
        try:
            found = find(strategy(subject.family), violates, settings=settings(
                max_examples=job["max_examples"], deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck),
                # Phase.explain reruns the shrunk example with each part varied, to annotate a
                # failing test's report; find() shows no report, and it was 95% of the search.
                phases=[phase for phase in Phase if phase is not Phase.explain]))
        except NoSuchExample:
            found = None
    summary = None
    if found is not None:
        _, m = evaluate(found)
        summary = (f"{found['property']}: {m.mismatched:,} / {m.total:,} differ "
                   f"(first at {m.first_mismatch['row']})" if m.first_mismatch else found["property"])
    evaluate(None)
    write_json(job_dir / "result.json", {"found": found is not None, "example": found, "examples": count,
                                          "seconds": time.time() - began, "summary": summary,
                                          "replayed": replayed})
    dist.destroy_process_group()
    return 0
