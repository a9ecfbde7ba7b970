"""One rank of a launch: init the process group once, run the job's checks in plan order.

Started by torchrun (`python -m harness.worker JOB_DIR START`). Talks to the launcher
through files in JOB_DIR: progress-rank{r} (which check, since when), pid-rank{r},
stack-rank{r}.txt (faulthandler dumps on SIGUSR1), error-rank{r}.json (the traceback
of a check that raised; the rank then exits so torchrun tears the job down), and
records.jsonl (rank 0's measurements, one line per finished check).
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from harness.records import append_line, write_atomic, write_json


def _progress(job_dir: Path, rank: int, index: int) -> None:
    write_atomic(job_dir / f"progress-rank{rank}", json.dumps({"index": index, "since": time.time()}))


def main(argv: list[str]) -> int:
    job_dir, start = Path(argv[0]), int(argv[1])
    job = json.loads((job_dir / "job.json").read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    (job_dir / f"pid-rank{rank}").write_text(str(os.getpid()))
    stacks = open(job_dir / f"stack-rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    import torch
    import torch.distributed as dist

    from harness import subject as registry
    from harness.context import RankContext
    from harness.environment import rank_fingerprint
    from harness.families import EXECUTORS

    torch.use_deterministic_algorithms(True)
    registry.load_all(job["plugins"])
    if job["backend"] == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(job["backend"], timeout=timedelta(seconds=job["collective_timeout_s"]))
    ctx = RankContext(rank=rank, world_size=world_size, backend=job["backend"], device=device,
                      group=dist.group.WORLD)
    fingerprints = ctx.gather(rank_fingerprint())
    if rank == 0:
        write_json(job_dir / f"ranks-{start}.json", fingerprints)

    checks = job["checks"]
    for index in range(start, len(checks)):
        check = checks[index]
        _progress(job_dir, rank, index)
        began = time.perf_counter()
        try:
            subject = registry.get(check["subject"])
            measured = EXECUTORS[check["family"]](check, subject, ctx)
        except BaseException as exc:  # report, then leave: peers may be stuck in a collective
            write_atomic(job_dir / f"error-rank{rank}.json", json.dumps({
                "index": index, "check": check["id"], "rank": rank, "time": time.time(),
                "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
            }))
            stacks.flush()
            os._exit(3)
        if rank == 0:
            append_line(job_dir / "records.jsonl", {
                "index": index, "check": check["id"], "seconds": round(time.perf_counter() - began, 4),
                "measured": measured,
            })
    _progress(job_dir, rank, len(checks))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
