"""torchrun's elastic agent, with every rank forked from a process that has imported torch.

`python -m ep_harness.launch.agent <torchrun options> -m MODULE [ARGS]` parses its options with
torchrun's own parser and runs torchrun's LocalElasticAgent (elastic_launch, which is what the
`torchrun` command runs: the same rendezvous, restarts, per-rank environment and teardown).
The one difference: a rank is not a fresh interpreter running MODULE but a forked process
calling MODULE.rank_main(*ARGS) (torchrun's start methods for function entry points).

The ranks are forks of a fork server (Python's forkserver start method), never of the
agent: when it starts ranks it runs the rendezvous store's server thread and keep-alive timer,
and a fork taken while another thread holds a lock leaves that lock held for good in the
child (a CI run hung 300 s in a 3-rank launch forked from the agent; Python 3.14 made
forkserver its default on Linux for this reason). The agent first imports torch and MODULE,
while it still has one thread, and starts the fork server as a fork of itself, so torch is
imported once per launch, not once per rank (about 2 s of CPU each on the 2-core machine)
nor again by a fork server started anew (1.1 s a launch; BENCHMARKS.md). The fork server
starts no threads and never touches CUDA; a process that has touched CUDA cannot fork CUDA
users, and torchrun's LaunchConfig asks torch.cuda.is_available(), after the fork.
OMP_NUM_THREADS is set before torch loads OpenMP, by torchrun's rule, so a rank's thread
count is a torchrun rank's (and an agent of several ranks has one thread after import torch).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import logging
import multiprocessing
import os
import sys

from ep_harness import console
from ep_harness.launch import fork_server


def _set_omp_threads_as_torchrun(argv: list[str]) -> None:
    """torchrun sets OMP_NUM_THREADS=1 for its ranks when it starts several and the user set
    none; OpenMP reads it when torch loads, so here that must happen before `import torch`."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--nproc-per-node", "--nproc_per_node", default="1")
    nproc, _ = early.parse_known_args(argv)
    if "OMP_NUM_THREADS" not in os.environ and nproc.nproc_per_node.isdigit() and int(nproc.nproc_per_node) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"


# What torch's thread pools read as `import torch` loads them, set while the imports run unless
# the user set them, then removed (the ranks' environment is the user's; the libraries keep
# what they read, and so do the forks of the process).
# * OPENBLAS_NUM_THREADS=1: numpy's OpenBLAS, which `import torch` loads, starts a thread per
#   core as it loads unless told otherwise (15 more threads on the lent H200's 16-core host,
#   where a launch of one rank sets no OMP_NUM_THREADS): the agent would then start its fork
#   server anew, which imports torch again (4.5 s a launch there). Their numpy BLAS stays
#   single-threaded (the harness computes with torch; a torch built on OpenBLAS, as on aarch64,
#   would run its CPU GEMMs on one thread too).
# * OMP_WAIT_POLICY=PASSIVE: an OpenMP thread waiting at a barrier sleeps instead of spinning.
#   Ranks share cores (4 on 2 cores), and a rank on several threads (thread-invariance, --threads)
#   had its spinning threads take the core from the rank beside it: a fixed-order GEMM's check
#   took 9 s in the CPU default instead of 0.4 s (docs/threads.md).
IMPORT_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


@contextlib.contextmanager
def _thread_pools_for_shared_cores():
    """IMPORT_ENV while torch imports (each variable unless the user set it)."""
    added = [name for name in IMPORT_ENV if name not in os.environ]
    os.environ.update({name: IMPORT_ENV[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@contextlib.contextmanager
def _imports_without_gc():
    """The cyclic garbage collector off while torch and MODULE import (they make almost no
    garbage, but every full collection walks all they made so far: 0.1 CPU-s), then what
    they made moved to the collector's permanent generation (gc.freeze): no collection in
    the agent, its fork server or a rank walks it again, the agent's exit included (whose
    final collection walks every object: 0.5 CPU-s after `import torch`), and the forks
    do not copy its pages by touching their GC headers."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _entry_module(argv: list[str]) -> str | None:
    """MODULE in `<options> -m MODULE [ARGS]`, read before torch loads (torchrun's parser needs it)."""
    for flag, value in zip(argv, argv[1:]):
        if flag in ("-m", "--module") and not value.startswith("-"):
            return value
    return None


def _plain_launcher_logs() -> None:
    """torch's log formatter renders a record that carries an exception by importing
    torch._dynamo (1.4 s of CPU), which the agent does each time it logs a failed rank: the
    handlers of its torch.distributed records get a plain formatter instead."""
    for handler in logging.getLogger("torch.distributed").handlers:
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(name)s: %(message)s"))


def _method_name(depth: int = 2) -> str:
    """What torch's rendezvous get_method_name returns (inspect.stack()[depth].function, the
    name of the function `depth` frames above it), from the frames alone."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # fewer frames than that
        return "no_method_name"


def _rendezvous_names_without_source() -> None:
    """torch's c10d rendezvous names every event it records by its caller through
    inspect.stack(), twice, which reads the source lines of every frame on the stack: half
    of what the agent does besides importing (0.1-0.15 CPU-s a launch). The same name from
    the frame itself (a module attribute of torch's: where it is not, nothing is replaced)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _method_name


def _start_fork_server() -> None:
    """The ranks' fork server, a fork of this agent, which has imported torch and the rank
    module (ep_harness.launch.fork_server); started anew where the agent has threads."""
    count = fork_server.threads()
    if not fork_server.start_forked():
        console.current().err(f"ep_harness.launch.agent: {count} threads after importing torch; the fork server is "
                              f"started anew (it imports torch again)")


def _rank_entry(module: str, *args):
    """A rank: MODULE.rank_main(*ARGS), MODULE imported already (before the fork server was forked)."""
    return importlib.import_module(module).rank_main(*args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _set_omp_threads_as_torchrun(argv)
    module = _entry_module(argv)
    if module is None or importlib.util.find_spec(module) is None:
        raise SystemExit(f"ep_harness.launch.agent: no importable entry module ({module!r}); "
                         "end the options with -m MODULE [ARGS], MODULE defining rank_main")
    # What every rank runs, imported while this process has one thread: torch's launcher
    # (a rank starts in its wrapper) and MODULE. The fork server is then a fork of this process.
    with _thread_pools_for_shared_cores(), _imports_without_gc():
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch
        from torch.distributed.run import config_from_args, parse_args

        importlib.import_module(module)
    # For a fork server started anew: the same, so that no rank imports torch itself.
    multiprocessing.set_forkserver_preload(["torch.distributed.elastic.multiprocessing.api", "ep_harness.launch.agent", module])
    _start_fork_server()
    _plain_launcher_logs()
    _rendezvous_names_without_source()
    args = parse_args(argv)
    if not args.module or args.training_script != module:
        raise SystemExit("ep_harness.launch.agent: the ranks' entry point must be given as -m MODULE")
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    try:
        elastic_launch(config, entrypoint=_rank_entry)(args.training_script, *args.training_script_args)
    except ChildFailedError as exc:  # the ranks' own tracebacks are in this log and the run's store
        failed = ", ".join(f"{f.local_rank} (exit {f.exitcode})" for f in exc.failures.values())
        console.current().err(f"ep_harness.launch.agent: local rank(s) {failed} failed")
        return 1
    return 0
