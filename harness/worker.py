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


def _terminated(job_dir: Path, rank: int) -> None:
    """SIGTERM (torchrun ending the survivors of a failed rank, or the launcher stopping the
    run): leave a note, so that the rank that failed first is the one without one."""
    state = {}
    try:
        state = json.loads((job_dir / f"progress-rank{rank}").read_text())
    except (OSError, ValueError):
        pass
    if not (job_dir / f"error-rank{rank}.json").exists():
        write_atomic(job_dir / f"error-rank{rank}.json", json.dumps({
            "index": state.get("index", -1), "check": None, "rank": rank, "time": time.time(), "terminated": True,
            "error": "SIGTERM: ended while another rank failed or the run was stopped", "traceback": "",
        }))
    os._exit(128 + signal.SIGTERM)


def main(argv: list[str]) -> int:
    job_dir, start = Path(argv[0]), int(argv[1])
    job = json.loads((job_dir / "job.json").read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    (job_dir / f"pid-rank{rank}").write_text(str(os.getpid()))
    stacks = open(job_dir / f"stack-rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: _terminated(job_dir, rank))

    import torch
    import torch.distributed as dist

    from harness import subject as registry
    from harness.context import RankContext
    from harness.environment import rank_fingerprint
    from harness.check import Check
    from harness.families import execute, warm_up
    from harness.subject import compiles_kernels

    torch.use_deterministic_algorithms(True)
    registry.load_all(job["plugins"])
    timeout = timedelta(seconds=job["collective_timeout_s"])
    if job["backend"] == "nccl":
        device = _nccl_device(job, job_dir, rank, world_size, local_rank, start)
        torch.cuda.set_device(device)
        # Eager communicator creation: NCCL logs its rings and trees before the first check.
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(job["backend"], timeout=timeout)
    ctx = RankContext(rank=rank, world_size=world_size, backend=job["backend"], device=device,
                      group=dist.group.WORLD, nccl_algo=os.environ.get("NCCL_ALGO"))
    fingerprints = ctx.gather(rank_fingerprint())
    if rank == 0:
        write_json(job_dir / f"ranks-{start}.json", fingerprints)
    if job["backend"] == "nccl":
        _read_nccl_topology(ctx, job_dir, start)

    checks = job["checks"]
    contexts = _subgroup_contexts(ctx, {c["params"]["world_size"] for c in checks})
    prepared = {}  # subjects whose setup(ctx) ran in this launch
    for index in range(start, len(checks)):
        check = Check.from_json(checks[index])
        _progress(job_dir, rank, index)
        began = time.perf_counter()
        check_ctx = contexts[check.world_size]
        try:
            if check_ctx is None:  # a smaller world size: this rank waits for its subgroup
                dist.barrier()
                continue
            subject = registry.get(check.subject)
            if subject.name not in prepared:  # once per launch per rank, before its first check
                if hasattr(subject, "setup"):
                    subject.setup(check_ctx)
                prepared[subject.name] = subject
            warm_s = 0.0
            if compiles_kernels(subject, check.p):  # compile (or load) its kernels before timing
                warm_began = time.perf_counter()
                warm_up(check, subject, check_ctx)
                warm_s = time.perf_counter() - warm_began
            measured = execute(check, subject, check_ctx).to_json()
            if len(contexts) > 1:
                dist.barrier()  # every rank leaves the check together, the idle ones included
        except BaseException as exc:  # report, then leave: peers may be stuck in a collective
            write_atomic(job_dir / f"error-rank{rank}.json", json.dumps({
                "index": index, "check": check.id, "rank": rank, "time": time.time(),
                "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
            }))
            stacks.flush()
            os._exit(3)
        if rank == 0:
            append_line(job_dir / "records.jsonl", {
                "index": index, "check": check.id, "seconds": round(time.perf_counter() - began - warm_s, 4),
                "warm_up_seconds": round(warm_s, 4) if warm_s else None, "measured": measured,
            })
    for subject in prepared.values():
        if hasattr(subject, "teardown"):
            subject.teardown(ctx)
    _progress(job_dir, rank, len(checks))
    dist.barrier()
    if job["backend"] == "nccl":
        # NCCL teardown after a CUDA-graph capture can hang (seen with emulated hosts); every
        # result is on disk already, so the rank leaves without it.
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()
    return 0


def _subgroup_contexts(ctx, world_sizes: set[int]) -> dict:
    """One RankContext per world size of the launch's checks: the whole launch, or a subgroup
    of ranks 0..w-1 (None on the ranks outside it). Every rank creates every subgroup, in the
    same order, as torch.distributed requires."""
    import dataclasses

    import torch.distributed as dist

    contexts = {ctx.world_size: ctx}
    for size in sorted(w for w in world_sizes if w < ctx.world_size):
        group = dist.new_group(list(range(size)))
        contexts[size] = dataclasses.replace(ctx, world_size=size, group=group) if ctx.rank < size else None
    return contexts


def _nccl_device(job: dict, job_dir: Path, rank: int, world_size: int, local_rank: int, start: int):
    """This rank's GPU; as an emulated host when the launch has more ranks than GPUs."""
    import torch

    from harness.emulation import device_index, emulated_host_env

    os.environ["NCCL_DEBUG_FILE"] = str(job_dir / f"nccl-rank{rank}-{start}.log")
    visible = torch.cuda.device_count()
    if job.get("emulate_hosts") and world_size > visible:
        os.environ.update(emulated_host_env(rank))  # read by NCCL when the communicator is made
        return torch.device("cuda", device_index(rank, visible))
    return torch.device("cuda", local_rank)


def _read_nccl_topology(ctx, job_dir: Path, start: int) -> None:
    """Every rank parses its own NCCL log (no shared filesystem needed); rank 0 merges them
    into the communicator's topology that the order models use, and follows its own log."""
    from harness import nccl_log

    own = Path(os.environ["NCCL_DEBUG_FILE"])
    mine = nccl_log.parse(own.read_text(errors="replace")) if own.exists() else nccl_log.RankLog()
    mine.calls = []
    logs = ctx.gather(mine)
    if ctx.rank == 0:
        ctx.nccl_topology = nccl_log.merge(logs)
        ctx.nccl_log = nccl_log.LogTail(own)
        write_json(job_dir / f"nccl-topology-{start}.json", ctx.nccl_topology.summary())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
