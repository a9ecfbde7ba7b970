"""torchrun's elastic agent, with every rank forked from a process that has imported torch.

`python -m harness.agent <torchrun options> -m MODULE [ARGS]` parses its options with
torchrun's own parser and runs torchrun's LocalElasticAgent (elastic_launch, which is what the
`torchrun` command runs: the same rendezvous, restarts, per-rank environment and teardown).
The one difference: a rank is not a fresh interpreter running MODULE but a forked process
calling MODULE.rank_main(*ARGS) (torchrun's start methods for function entry points).

The ranks are forks of a fork server (Python's forkserver start method): a fresh process,
started first thing, that imports torch, torch._dynamo and MODULE once per launch (about 2 s
of CPU per rank saved on the 2-core machine, BENCHMARKS.md) while the agent imports torch's
launcher, then starts no threads and never touches CUDA. They are never forks of the agent:
when it starts ranks it runs the rendezvous store's server thread and keep-alive timer, and
a fork taken while another thread holds a lock leaves that lock held for good in the child
(a CI run hung 300 s in a 3-rank launch forked from the agent; Python 3.14 made forkserver
its default on Linux for this reason). A process that has touched CUDA cannot fork CUDA users
either, and torchrun's LaunchConfig asks torch.cuda.is_available(). OMP_NUM_THREADS is set
before torch loads OpenMP, by torchrun's rule, so a rank's thread count is a torchrun rank's.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import multiprocessing
import multiprocessing.forkserver
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


def _entry_module(argv: list[str]) -> str | None:
    """MODULE in `<options> -m MODULE [ARGS]`, read before torch loads (torchrun's parser needs it)."""
    for flag, value in zip(argv, argv[1:]):
        if flag in ("-m", "--module") and not value.startswith("-"):
            return value
    return None


def _rank_entry(module: str, *args):
    """A rank: MODULE.rank_main(*ARGS), MODULE imported already by the fork server."""
    return importlib.import_module(module).rank_main(*args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _set_omp_threads_as_torchrun(argv)
    module = _entry_module(argv)
    if module is None or importlib.util.find_spec(module) is None:
        raise SystemExit(f"harness.agent: no importable entry module ({module!r}); "
                         "end the options with -m MODULE [ARGS], MODULE defining rank_main")
    # The fork server imports torch and MODULE while this process imports torch's launcher.
    multiprocessing.set_forkserver_preload(["harness.agent", module])
    multiprocessing.forkserver.ensure_running()

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(argv)
    if not args.module or args.training_script != module:
        raise SystemExit("harness.agent: the ranks' entry point must be given as -m MODULE")
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    try:
        elastic_launch(config, entrypoint=_rank_entry)(args.training_script, *args.training_script_args)
    except ChildFailedError as exc:  # the ranks' own tracebacks are in this log and the run's store
        failed = ", ".join(f"{f.local_rank} (exit {f.exitcode})" for f in exc.failures.values())
        print(f"harness.agent: local rank(s) {failed} failed", file=sys.stderr, flush=True)
        return 1
    return 0
