"""torchrun's elastic agent, with every rank forked from a process that has imported torch.

`python -m harness.agent <torchrun options> -m MODULE [ARGS]` parses its options with
torchrun's own parser and runs torchrun's LocalElasticAgent (elastic_launch, which is what the
`torchrun` command runs: the same rendezvous, restarts, per-rank environment and teardown).
The one difference: a rank is not a fresh interpreter running MODULE but a forked process
calling MODULE.rank_main(*ARGS) (torchrun's start methods for function entry points). torch,
torch._dynamo and the harness are imported once per launch instead of once per rank: about
2 s of CPU per rank on the 2-core machine (BENCHMARKS.md).

Without GPUs the ranks are forks of this process. A process that has touched CUDA cannot
fork CUDA users, and torchrun's own LaunchConfig asks torch.cuda.is_available(); so where
GPUs are visible the ranks come from a fork server instead: a fresh process that imports
MODULE and never touches CUDA. OMP_NUM_THREADS is set before torch loads OpenMP, by
torchrun's rule, so a rank's thread count is what a torchrun rank's would be.
"""
from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import sys


def _set_omp_threads_as_torchrun(argv: list[str]) -> None:
    """torchrun sets OMP_NUM_THREADS=1 for its ranks when it starts several and the user set
    none; OpenMP reads it when torch loads, so here that must happen before `import torch`."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--nproc-per-node", "--nproc_per_node", default="1")
    nproc, _ = early.parse_known_args(argv)
    if "OMP_NUM_THREADS" not in os.environ and nproc.nproc_per_node.isdigit() and int(nproc.nproc_per_node) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _set_omp_threads_as_torchrun(argv)

    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(argv)
    if not args.module:
        raise SystemExit("harness.agent: the ranks' entry point must be given as -m MODULE")
    config, _, _ = config_from_args(args)
    entry = importlib.import_module(args.training_script)  # the rank's imports, done once here
    if torch.cuda.is_available():
        config.start_method = "forkserver"
        multiprocessing.set_forkserver_preload([args.training_script])
    else:
        config.start_method = "fork"
    try:
        elastic_launch(config, entrypoint=entry.rank_main)(*args.training_script_args)
    except ChildFailedError as exc:  # the ranks' own tracebacks are in this log and the run's store
        failed = ", ".join(f"{f.local_rank} (exit {f.exitcode})" for f in exc.failures.values())
        print(f"harness.agent: local rank(s) {failed} failed", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
