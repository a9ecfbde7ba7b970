"""One rank of a launch: init the process group once, run the job's checks in plan order.

Each rank is forked by torchrun's elastic agent (harness/launch/agent/, `-m ep_harness.run.worker`) on any
node, so the imports below are done once per launch (by the agent, before it forks its fork
server). Talks to the launchers only through the run's store (harness/launch/channel.py), named by
EP_HARNESS_STORE (HOST:PORT) and EP_HARNESS_CHANNEL (the launch's namespace), in the messages
of harness/launch/protocol.py: the Job, its Progress (which check, since when, pid, node), a RankError
(the traceback of a check that raised; the rank then exits so torchrun tears the job down), its
Stack (all threads', on request) and rank 0's Record per finished check (a one-rank check dealt
to another rank on gloo: that rank's). EP_HARNESS_JOB_DIR is a directory of this node for NCCL's log.

A job's `precompile` (single node only) names the marker file the head writes once the
DeepGEMM kernels compiled beside the launch are done (harness/run/precompile.py) and the checks
that need them: before the first of those a rank waits for the marker, in a progress state of
its own (`waiting_until`, so that the launcher does not count the wait against the check), and
rank 0 puts how long it waited (`precompile-waited`).
"""
from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ep_harness.launch import protocol
from ep_harness import subject as registry
from ep_harness.launch.channel import SECRET_ENV, Channel, local_node, parse_endpoint, tcp_store
from ep_harness.check import Check
from ep_harness.context import RankContext
from ep_harness.run_environment import rank_environment
from ep_harness.families import FAMILIES, execute, sizes_of, warm_up
from ep_harness.measurement import Measurement
from ep_harness.subject import compiles_kernels, set_up, tear_down
from ep_harness.cores import pin_rank
from ep_harness.threads import THREADS_VAR, apply_in_rank

registry.import_built_in()  # the built-in subjects, imported before the ranks fork

WATCH_S = 0.2
MARKER_POLL_S = 0.05


class PrecompileNotFinished(RuntimeError):
    """The head never said that the DeepGEMM compile ended (its marker file is missing)."""


def wait_for_precompile(spec: dict, waiting) -> float | None:
    """Seconds spent waiting for the marker `spec["marker"]`, None when it was there already
    (no wait began); `waiting()` is called once before a wait begins. Raises PrecompileNotFinished past
    `spec["until"]` (a wall-clock time: a relaunch after it fails at once, not after another
    wait)."""
    marker = Path(spec["marker"])
    if marker.exists():
        return None
    waiting()
    began = time.time()
    while not marker.exists():
        if time.time() > spec["until"]:
            raise PrecompileNotFinished(
                f"the DeepGEMM compile beside the launch did not end within {spec['limit_s']:g} s ({marker} was "
                f"never written; see precompile.log beside it): set EP_HARNESS_PRECOMPILE=0 to compile in the "
                f"checks instead")
        time.sleep(MARKER_POLL_S)
    return time.time() - began


def use_deterministic_algorithms() -> None:
    """What torch.use_deterministic_algorithms(True) does, without its import of
    torch._inductor.config (1.4 s of CPU in every launch, 31 launches in `make test`) only
    to set one flag: ATen's switch is set directly, and inductor, which no built-in subject
    loads, reads TORCHINDUCTOR_DETERMINISTIC=1 when it does."""
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    if "torch._inductor.config" in sys.modules:  # loaded already (by a plugin): set it there
        sys.modules["torch._inductor.config"].deterministic = True
    torch._C._set_deterministic_algorithms(True, warn_only=False)


def _channel() -> Channel:
    host, port = parse_endpoint(os.environ["EP_HARNESS_STORE"])
    return Channel(tcp_store(host, port, is_master=False, timeout_s=60), os.environ["EP_HARNESS_CHANNEL"],
                   secret=os.environ.get(SECRET_ENV))  # the job is taken only if the run's secret signed it


class Watcher(threading.Thread):
    """On its own store connection: dumps every thread's stack when the launcher asks, and
    ends the rank when the launcher sets `abort`, when its torchrun agent is gone (the
    parent changed) or when the store is (the head launcher is gone): no rank outlives its run."""

    def __init__(self, rank: int):
        super().__init__(daemon=True, name="ep-harness-watcher")
        self.rank, self.channel, self.parent, self.dumps = rank, _channel(), os.getppid(), 0

    def run(self) -> None:
        while True:
            time.sleep(WATCH_S)
            if os.getppid() != self.parent:
                os._exit(128 + signal.SIGKILL)
            try:
                if self.channel.has(protocol.ABORT):
                    os._exit(128 + signal.SIGTERM)
                requested = self.channel.count(protocol.STACKS_REQUESTED)
                if requested > self.dumps:
                    self.dumps = requested
                    self.channel.put(protocol.stack_key(self.rank), protocol.Stack(_stacks()).to_wire())
            except Exception:  # the store went away with the head launcher
                os._exit(128 + signal.SIGTERM)


def _stacks() -> str:
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def _terminated(channel: Channel, rank: int, state: dict) -> None:
    """SIGTERM (torchrun ending the survivors of a failed rank, or the launcher stopping the
    run): leave a note, so that the rank that failed first is the one without one."""
    try:
        if not channel.has(protocol.error_key(rank)):
            channel.put(protocol.error_key(rank), protocol.RankError(
                index=state.get("index", -1), check=None, rank=rank, time=time.time(), terminated=True,
                error="SIGTERM: ended while another rank failed or the run was stopped", traceback="",
                node=local_node(), host=socket.gethostname()).to_wire())
    finally:
        os._exit(128 + signal.SIGTERM)


def rank_main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    job_dir = Path(os.environ.get("EP_HARNESS_JOB_DIR", tempfile.gettempdir()))
    channel = _channel()
    job = channel.read(protocol.JOB, protocol.Job)
    start, where = job.start, {"pid": os.getpid(), "node": local_node(), "host": socket.gethostname()}
    state: dict = {}

    def progress(index: int, **extra) -> None:
        state.update(index=index)
        channel.put(protocol.progress_key(rank), protocol.Progress(index=index, since=time.time(), **where,
                                                                   **extra).to_wire())

    progress(start - 1)  # started: the launcher now knows this rank's pid and node
    Watcher(rank).start()
    signal.signal(signal.SIGTERM, lambda signum, frame: _terminated(channel, rank, state))

    threads = apply_in_rank()  # before any check computes (harness/threads.py)
    use_deterministic_algorithms()
    registry.load_all(job.plugins)
    timeout = timedelta(seconds=job.collective_timeout_s)
    if job.backend == "nccl":
        device = _nccl_device(job, job_dir, rank, world_size, local_rank, start)
        torch.cuda.set_device(device)
        # Eager communicator creation: NCCL logs its rings and trees before the first check.
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        # before the process group starts its threads, which then inherit the cores (harness/cores.py)
        pin_rank(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), threads)
        dist.init_process_group(job.backend, timeout=timeout)
    ctx = RankContext(rank=rank, world_size=world_size, backend=job.backend, device=device,
                      group=dist.group.WORLD, nccl_algo=os.environ.get("NCCL_ALGO"))
    environments = ctx.gather(rank_environment())
    if rank == 0:
        channel.put(protocol.RANKS, protocol.RankEnvironments(environments).to_wire())
    pinned = job.pinned_env or {}
    env_error = _pinned_env_error(ctx.gather({**unpinned(pinned), **threads_unlike(pinned, threads)}))
    if job.backend == "nccl":
        from ep_harness.nccl import library as nccl_library

        env_error = env_error or nccl_library_error(job.nccl, ctx.gather(nccl_library.loaded()))
        _read_nccl_topology(ctx, channel)

    checks = job.checks
    contexts = _subgroup_contexts(ctx, {c["params"]["world_size"] for c in checks} | layout_sizes(checks))
    head_node = [r for r, env in enumerate(environments) if env["node"] == environments[0]["node"]]
    dealt = dealt_single_rank_checks(checks, head_node) if job.backend == "gloo" else {}
    solo = _own_rank_context(ctx) if dealt else None
    prepared = {}  # subjects whose setup(ctx) ran in this launch
    precompile = job.precompile  # None once the compile has ended (or when there is none)
    waits_for = set(precompile["checks"]) if precompile else set()
    for index in range(start, len(checks)):
        # `inject`: a defect `ep-harness selftest` plants in the subject (harness/selftest/wrap.py)
        injection = checks[index].get("inject")
        check = Check.from_json({k: v for k, v in checks[index].items() if k != "inject"})
        progress(index)
        began = time.perf_counter()
        check_ctx = contexts[check.world_size]
        if env_error:  # it would measure under other conditions than pinned: run nothing
            if rank == 0:
                refused = Measurement(comparison="bitwise", mismatched=0, total=0, held=False, error=env_error)
                channel.put(protocol.record_key(index), protocol.Record(
                    index=index, check=check.id, seconds=0.0, measured=refused.to_json()).to_wire())
            continue
        try:
            if precompile is not None and check.id in waits_for:  # its kernels compile beside the launch
                spec, precompile = precompile, None
                waited = wait_for_precompile(spec, lambda: progress(index, waiting_until=spec["until"]))
                if waited is not None:  # it said it was waiting (even for less than the clock's step)
                    progress(index)  # the check's own time starts now
                    began = time.perf_counter()
                    if rank == 0:
                        channel.put(protocol.PRECOMPILE_WAITED, protocol.PrecompileWaited(round(waited, 3)).to_wire())
            own_group = _own_group(check, index in dealt)
            if index in dealt:  # a one-rank check dealt to a rank: run where dealt, no one waits
                check_ctx = solo if dealt[index] == rank else None
                if check_ctx is None:
                    _end_of_deal(dealt, index)
                    continue
            elif check_ctx is None:  # a smaller world size: this rank waits for its subgroup
                dist.barrier()
                continue
            subject = registry.get(check.subject)
            if subject.name not in prepared:  # once per launch per rank, before its first check
                set_up(subject, check_ctx)
                prepared[subject.name] = subject
            warm_s = 0.0
            if compiles_kernels(subject, check.params):  # compile (or load) its kernels before timing
                warm_began = time.perf_counter()
                warm_up(check, subject, check_ctx)
                warm_s = time.perf_counter() - warm_began
            if own_group is not None:  # after the warm-up, on the launch's group: the measured calls are its first
                check_ctx = dataclasses.replace(check_ctx, group=own_group)
            if injection is not None:
                from ep_harness.selftest.wrap import wrapped

                subject = wrapped(subject, injection, check, check_ctx)
            measured = execute(check, subject, check_ctx)  # check_ctx's rank 0 alone gets it (None elsewhere)
            if index in dealt:
                _end_of_deal(dealt, index)
            elif check_ctx.world_size < ctx.world_size:
                dist.barrier()  # with the ranks outside its subgroup, which wait in theirs
            if check_ctx.rank == 0:  # sent here: what JSON cannot hold (in a subject's describe()) is this check's error
                channel.put(protocol.record_key(index), protocol.Record(
                    index=index, check=check.id, seconds=round(time.perf_counter() - began - warm_s, 4),
                    warm_up_seconds=round(warm_s, 4) if warm_s else None, measured=measured.to_json()).to_wire())
        except BaseException as exc:  # report, then leave: peers may be stuck in a collective
            channel.put(protocol.error_key(rank), protocol.RankError(
                index=index, check=check.id, rank=rank, time=time.time(), error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(), **where).to_wire())
            os._exit(3)
    for subject in prepared.values():
        tear_down(subject, ctx)
    progress(len(checks))
    dist.barrier()
    # Every result is in the store already. The process group is not torn down: a forked
    # rank ends with os._exit once the agent has its return value, skipping the teardown
    # that costs about a second per launch on gloo and, after a CUDA-graph capture, can hang
    # on NCCL (seen with emulated hosts).
    sys.stdout.flush()


def unpinned(pinned: dict[str, str]) -> dict[str, str | None]:
    """The pinned variables this rank's own environment does not hold as pinned: name -> what
    it holds (None: missing). A launcher that lost or changed one would measure other paths."""
    return {k: os.environ.get(k) for k, v in pinned.items() if os.environ.get(k) != v}


def nccl_library_error(named: str | None, per_rank: list) -> str | None:
    """Why the ranks do not all run the NCCL the run names (each an
    ep_harness.nccl.library.LoadedNccl), or None: a record must name the NCCL that computed it."""
    wrong = [f"rank {r} runs {lib.text or 'no NCCL library'}" + (f" ({lib.problem()})" if lib.problem() else "")
             for r, lib in enumerate(per_rank) if lib.text != named or lib.problem()]
    if not wrong:
        return None
    return (f"the run names NCCL {named or 'none'} (read from the launcher's library), but " + "; ".join(wrong[:4]) +
            (f"; {len(wrong) - 4} more" if len(wrong) > 4 else "") +
            ": every rank must load one NCCL (replace torch's libnccl.so.2 on every node: docs/gpu.md)")
def threads_unlike(pinned: dict[str, str], threads: int) -> dict[str, str]:
    """{"torch.get_num_threads()": what torch runs on} where that is not the pinned count."""
    wanted = pinned.get(THREADS_VAR)
    return {} if wanted is None or wanted == str(threads) else {"torch.get_num_threads()": str(threads)}


def _pinned_env_error(per_rank: list[dict]) -> str | None:
    wrong = [f"rank {r}: {k} {'missing' if v is None else f'is {v!r}'}"
             for r, found in enumerate(per_rank) for k, v in sorted(found.items())]
    if not wrong:
        return None
    return "pinned variables not as pinned in the ranks' own environment (" + "; ".join(wrong[:6]) + \
        (f"; {len(wrong) - 6} more" if len(wrong) > 6 else "") + "): fix the launcher or the environment it passes"


def _subgroup_contexts(ctx, world_sizes: set[int]) -> dict:
    """One RankContext per world size of the launch's checks: the whole launch, or a subgroup
    of ranks 0..w-1 (None on the ranks outside it). Every rank creates every subgroup, in the
    same order, as torch.distributed requires."""
    contexts = {ctx.world_size: ctx}
    for size in sorted(w for w in world_sizes if w < ctx.world_size):
        group = dist.new_group(list(range(size)))
        contexts[size] = dataclasses.replace(ctx, world_size=size, group=group) if ctx.rank < size else None
    for c in contexts.values():  # a layout-size check runs on the subgroups up to its own size
        if c is not None:
            c.subgroups = {w: contexts[w] for w in contexts if w < c.world_size}
    return contexts


def _own_group(check: Check, dealt: bool):
    """The process group made for a check of several ranks whose family runs its property on one
    of its own (Family.own_group), else None. Every rank of the launch makes it, those outside it
    too, in check order, as torch.distributed requires; it is kept to the end of the launch (a
    subject may key what it made by the group)."""
    if dealt or check.world_size < 2 or check.property not in FAMILIES[check.family].own_group:
        return None
    return dist.new_group(list(range(check.world_size)))


def dealt_single_rank_checks(checks: list[dict], ranks: list[int]) -> dict[int, int]:
    """index -> rank for the launch's one-rank checks, dealt in turn to `ranks` (gloo: the ranks
    on rank 0's node, where rank 0 alone ran them before and whose machine the run's records
    name), where there are two or more: on rank 0 alone they left the other ranks, and a core,
    idle (1.8 of the CPU default's 15 s). Each runs on a one-rank group of its own rank, where
    a check sees rank 0 of world size 1 as on rank 0; which process computes it is not in its
    bits (--fresh-processes compares them across processes)."""
    if len(ranks) < 2:
        return {}
    single = [i for i, c in enumerate(checks) if c["params"]["world_size"] == 1 and not sizes_of(c)]
    return {index: ranks[turn % len(ranks)] for turn, index in enumerate(single)}


def _end_of_deal(dealt: dict[int, int], index: int) -> None:
    """After the last of a run of dealt checks, every rank waits for the others: the next
    check starts together, its time its own."""
    if index + 1 not in dealt:
        dist.barrier()


def _own_rank_context(ctx):
    """This rank alone, as rank 0 of a one-rank group: a dealt check's context. Every rank
    makes every rank's group, in rank order, as torch.distributed requires."""
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]
    return dataclasses.replace(ctx, rank=0, world_size=1, group=groups[ctx.rank], subgroups={})


def layout_sizes(checks: list[dict]) -> set[int]:
    """The world sizes the launch's layout-size checks run through (params `layout_sizes`,
    harness/families/layout.py), beside the checks' own world sizes."""
    return {w for c in checks for w in sizes_of(c)}


def _nccl_device(job: protocol.Job, job_dir: Path, rank: int, world_size: int, local_rank: int, start: int):
    """This rank's GPU; ranks beyond the visible GPUs share them, emulated as the job says."""
    from ep_harness.emulation import device_index, emulation_env

    os.environ["NCCL_DEBUG_FILE"] = str(job_dir / f"nccl-rank{rank}-{start}.log")
    visible = torch.cuda.device_count()
    if job.emulate and world_size > visible:
        os.environ.update(emulation_env(job.emulate, rank))  # read by NCCL when the communicator is made
        return torch.device("cuda", device_index(rank, visible))
    return torch.device("cuda", local_rank)


def _read_nccl_topology(ctx, channel: Channel) -> None:
    """Every rank parses its own NCCL log (no shared filesystem needed); rank 0 merges them
    into the communicator's topology that the order models use, and follows its own log."""
    from ep_harness.nccl import log as nccl_log

    own = Path(os.environ["NCCL_DEBUG_FILE"])
    mine = nccl_log.parse(own.read_text(errors="replace")) if own.exists() else nccl_log.RankLog()
    mine.calls = []
    logs = ctx.gather(mine)
    if ctx.rank == 0:
        ctx.nccl_topology = nccl_log.merge(logs)
        ctx.nccl_log = nccl_log.LogTail(own)
        channel.put(protocol.NCCL_TOPOLOGY, protocol.NcclTopology(ctx.nccl_topology.summary()).to_wire())
