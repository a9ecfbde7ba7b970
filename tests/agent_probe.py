"""A rank entry point for tests/test_agent_forks.py: each rank writes what its interpreter looks
like (what a rank of `ep_harness.run.worker` could read), after setting its thread count as the
harness's ranks do."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def _daemon(out_dir: str) -> None:
    """A process that leaves the launch without exec: fork, setsid, fork, the middle one exits."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            Path(out_dir, "daemon.pid").write_text(str(os.getpid()))
            time.sleep(600)
        os._exit(0)


def rank_main(out_dir: str, sleep_s: str = "0", daemon: str = "0") -> None:
    import torch

    from ep_harness.threads import apply_in_rank

    apply_in_rank()
    rank = os.environ["RANK"]
    print(f"probe rank {rank} on stdout", flush=True)
    state = {
        "path": sys.path,
        "hash_randomization": sys.flags.hash_randomization,
        "hash": hash("ep-harness"),
        "threads": torch.get_num_threads(),
        "optimize": sys.flags.optimize,
        "main": getattr(sys.modules["__main__"].__spec__, "name", None),
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS", "PYTHONHASHSEED",
                                               "PYTHONPATH", "PROBE_MARK", "TORCHELASTIC_RUN_ID")},
        "signals": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)},
        "cwd": os.getcwd(),
        "session_leader_is_agent": os.getsid(0) == os.getpgid(0),
        "agent_cmdline": Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:3],
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(state, sort_keys=True))
    if daemon == "1" and rank == "0":
        _daemon(out_dir)
    time.sleep(float(sleep_s))
