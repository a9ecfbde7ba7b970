"""Kernels compiled beside the launches, many at once.

DeepGEMM's JIT compiles a kernel (NVCC, 3-4 s each on the lent H200) the first time a GEMM of
a new shape is called, into a cache directory every process of the run shares
(DG_JIT_CACHE_DIR, pinned by every launch); a rank calls one shape after another, so a cold
`--suite h200` spent most of its time compiling kernels one at a time. When a GPU run starts,
`start`
1. asks each check's family for the calls it will make (Family.precompile, a
   ep_harness.families.driver.Precompile) and keeps the distinct ones (`planned_calls`);
2. makes each once in a pool of worker processes (harness/run/precompile_worker.py), one per CPU
   core less one per local rank (EP_HARNESS_PRECOMPILE_WORKERS, when set, is taken as is),
   printing progress; the kernels land in the cache, where the checks' warm-up finds them.
This runs in a thread of the head (`Background`) while the ranks run the checks that need none
of them: each launch runs last, in their order, the checks that wait (`waits_for`: every check
making a call still to compile, and those whose calls are decided at run time, which would
build the same cache entries at the same time; `arranged`), and a rank waits before the first
of them until the head has written the run directory's `MARKER`, however the compile ends. The
wait is a progress state of its own (`waiting_until`), outside every check's timeout_s, with a
limit of its own (EP_HARNESS_PRECOMPILE_WAIT_S, default WAIT_LIMIT_S): past it the compile is
stopped and the checks compile what is left; a rank still waiting RANK_GRACE_S later (a head
that is stuck) fails its check with one line.

Nothing here decides a verdict: a call that fails or is not planned is compiled by its check,
and a failure is printed with the worker's log. A no-op on the CPU, without such calls, on
several nodes, with EP_HARNESS_PRECOMPILE=0, and when an earlier run compiled every call into
the same cache (the manifest): the run then launches as without it (no reordering, no wait).
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ep_harness import families
from ep_harness import subject as registry
from ep_harness.launch import settings
from ep_harness.run.precompile_worker import Worker as _Worker, reason as _reason, worker_count

MANIFEST = "ep-harness-precompiled.json"  # in the DeepGEMM cache directory: calls compiled there
PROGRESS_EVERY_S = 2.0
STARTUP_LIMIT_S = 300.0  # a worker's start: torch, CUDA and DeepGEMM imported, 16 at once on one GPU
LABEL = "compiling DeepGEMM kernels"  # the lines' wording: DeepGEMM's are the built-in families' kernels
WAIT_ENV = "EP_HARNESS_PRECOMPILE_WAIT_S"
WAIT_LIMIT_S = settings.SECONDS[WAIT_ENV][0]  # the compile's limit while ranks wait for it (calls have their own)
RANK_GRACE_S = 60.0  # past the compile's limit, a rank stops waiting for a head that never wrote the marker
MARKER = "precompile.done"  # in the run directory: written by the head once the compile has ended


# -- 1. what the planned checks will call ---------------------------------------------------

def planned_calls(checks) -> tuple[list, list[str]]:
    """The distinct calls of the checks that will run, in first-use order, and the ids of
    checks whose calls cannot be known before the launch (they compile their own kernels,
    as before)."""
    calls, own, _ = _gathered(checks)
    return calls, own


def _gathered(checks) -> tuple[list, list[str], dict]:
    """planned_calls, and for each call the ids of every check that makes it (`needed_by`
    names only the first)."""
    calls, users, own = {}, {}, []
    for check in checks:
        slot = None if check.skip_reason else families.get(check.family).precompile
        found = slot.calls(check) if slot is not None else []
        if found is None:
            own.append(check.id)
            continue
        for call in found:
            first = calls.setdefault(call, dataclasses.replace(call, timeout_s=check.timeout_s))
            if check.timeout_s > first.timeout_s:  # the call's limit: the most any check needing it allows
                calls[call] = dataclasses.replace(first, timeout_s=check.timeout_s)
            needers = users.setdefault(call, [])
            if check.id not in needers:
                needers.append(check.id)
    return list(calls.values()), own, users


def compiled_last(checks: list, waits_for) -> list:
    """A launch's checks with those in `waits_for` moved after the others, each part in its
    own order (a stable partition): the others run while the kernels compile."""
    return [c for c in checks if c.id not in waits_for] + [c for c in checks if c.id in waits_for]


def arranged(background: Background | None, checks: list) -> tuple[list, dict | None, str]:
    """A launch's checks as it runs them beside the compile, what its ranks are told to wait
    for (Background.rank_wait, None when none of them waits) and what its launch line adds."""
    if background is None or not any(c.id in background.waits_for for c in checks):
        return checks, None, ""
    waiting = sum(c.id in background.waits_for for c in checks)
    return (compiled_last(checks, background.waits_for), background.rank_wait(),
            f"; the {waiting} needing the DeepGEMM kernels last, once they are compiled")


# -- 2. compile them, many at once --------------------------------------------------------

def interleaved(calls: list) -> list:
    """The calls round-robin over their groups (`group()`; for a GEMM its subject and weight
    shape): calls of one group often build the same kernel, and two processes building it at
    once both pay for it, while a call made after the first finished loads it from the cache."""
    groups: dict[tuple, list] = {}
    for call in calls:
        groups.setdefault(call.group(), []).append(call)
    order = []
    for i in range(max(map(len, groups.values()), default=0)):
        order += [g[i] for g in groups.values() if i < len(g)]
    return order


@dataclass
class Outcome:
    done: int = 0
    failed: list[tuple[object, str]] = field(default_factory=list)
    seconds: float = 0.0
    compiled: list = field(default_factory=list)  # the calls made (what the manifest remembers)
    stopped: bool = False  # ended by `stop` before every call was answered


def compile_all(calls: list, workers: int, env: dict, device: str, log_path: Path,
                say: Callable[[str], None], failed_say: Callable[[str], None] | None = None,
                plugins: list[str] = (), stop: threading.Event | None = None) -> Outcome:
    """Make every call once in `workers` processes (each loading the run's `plugins`, as the
    ranks do); `say` gets the progress lines (at most one every PROGRESS_EVERY_S, and the
    last), `failed_say` (default `say`) one line per failure. A worker that dies fails its
    call and is replaced for the calls left. A worker that cannot be started, hangs (past the
    call's timeout_s) or answers nonsense fails its call and its thread stops: whatever
    broke it would likely break the next one too, and every stopped thread bounds the time
    lost to one limit; the other threads make the calls left, and calls no thread is left to
    make fail as not tried. Every failed call is compiled by its check, as without this step.
    `stop` set (the launches ended, the run was interrupted, or the compile outran its limit)
    ends every worker at once; the calls not answered by then fail as stopped, without a line
    each (outcome.stopped says so)."""
    failed_say = failed_say or say
    todo: queue.Queue = queue.Queue()
    for call in calls:
        todo.put(call)
    answers: queue.Queue = queue.Queue()
    started: list[_Worker] = []
    lock, stopping = threading.Lock(), threading.Event()
    began = time.perf_counter()

    def serve() -> None:
        worker = None
        try:
            while True:
                try:
                    call = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    if worker is None:
                        with lock:
                            if stopping.is_set():  # ended meanwhile: start nothing new
                                return
                            worker = _Worker(env, device, log, plugins, STARTUP_LIMIT_S)
                            started.append(worker)
                    answer = worker.call(call)
                except Exception as exc:  # EMFILE/ENOMEM starting it, GaveUp, a garbled answer
                    answers.put((call, {"ok": False, "error": _reason(exc)}))
                    return
                if answer is None:
                    answer = {"ok": False, "error": f"the worker process died (exit code {worker.proc.returncode})"}
                    worker.end()  # what it started (NVCC) may outlive it
                    worker = None  # the next call gets a new one
                answers.put((call, answer))
        finally:
            if worker is not None:
                worker.end()

    outcome = Outcome()
    with open(log_path, "a") as log:
        threads = [threading.Thread(target=serve, daemon=True, name=f"precompile-{i}")
                   for i in range(max(1, min(workers, len(calls))))]
        try:
            for t in threads:
                t.start()
            last = time.perf_counter()
            finished = 0
            answered: set = set()
            while finished < len(calls):
                if stop is not None and stop.is_set():
                    outcome.stopped = True
                    _drain(todo)
                    outcome.failed += [(c, STOPPED) for c in calls if c not in answered]
                    break
                try:  # in slices, so that a signal (ep_harness.launch.processes.interruptible) is taken at once
                    call, answer = answers.get(timeout=0.5)
                except queue.Empty:
                    if not any(t.is_alive() for t in threads) and answers.empty():
                        break  # every thread has stopped: nobody is left to make the calls still queued
                    continue
                elapsed = time.perf_counter() - began
                answered.add(call)
                if answer["ok"]:
                    outcome.done += 1
                    outcome.compiled.append(call)
                else:
                    outcome.failed.append((call, answer["error"]))
                    failed_say(f"{LABEL}: FAILED {call.describe()}: {answer['error']} (the check compiles it "
                               f"itself; worker log: {log_path})")
                finished += 1
                if finished == len(calls) or time.perf_counter() - last >= PROGRESS_EVERY_S:
                    say(f"{LABEL}: {finished}/{len(calls)}, {elapsed:.0f} s")
                    last = time.perf_counter()
            untried = _drain(todo)
            if untried:
                outcome.failed += [(call, "not tried: every compile process stopped") for call in untried]
                failed_say(f"{LABEL}: {len(untried)} call(s) not tried: every compile process stopped after a "
                           f"failure above (their checks compile them; worker log: {log_path})")
        finally:  # an interrupt (or anything else) ends every worker and what it started
            _drain(todo)
            with lock:
                stopping.set()
                for worker in started:
                    worker.end()
            for t in threads:
                t.join(timeout=10)
    outcome.seconds = time.perf_counter() - began
    return outcome


def _drain(todo: queue.Queue) -> list:
    left = []
    while True:
        try:
            left.append(todo.get_nowait())
        except queue.Empty:
            return left


# -- the manifest: calls an earlier run compiled into this cache ----------------------------

def manifest_identity(platform, calls: list) -> dict:
    """What decides which kernel a call builds, besides its shapes: the identity of each JIT
    the calls' subjects compile with (ep_harness.subject.jit_of)."""
    identity: dict = {}
    for jit in {id(j): j for j in (registry.jit_of(registry.get(c.subject)) for c in calls) if j}.values():
        identity.update(jit.identity(platform))
    return identity


def compiled_before(cache_dir: Path, identity: dict) -> set[str]:
    try:
        recorded = json.loads((cache_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return set()
    return set(recorded.get("calls", [])) if recorded.get("identity") == identity else set()


def remember(cache_dir: Path, identity: dict, keys: set[str]) -> None:
    keys = keys | compiled_before(cache_dir, identity)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"identity": identity, "calls": sorted(keys)}, indent=1))
    os.replace(tmp, cache_dir / MANIFEST)


# -- the step a GPU run takes beside its launches ---------------------------------------------

def wait_limit() -> float:
    """EP_HARNESS_PRECOMPILE_WAIT_S, or WAIT_LIMIT_S."""
    return settings.seconds(WAIT_ENV)


def write_marker(path: Path, content: dict) -> None:
    """Atomically: a rank that sees the file sees all of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(content))
    os.replace(tmp, path)


class Background:
    """The compile in a thread of the head while the launches run. `waits_for`: the ids of
    the checks that must run after it (`rank_wait` is what their ranks are told); the marker
    is written however the compile ends, so that no rank waits for it forever. After
    `limit_s` the compile is stopped (the checks compile what is left)."""

    def __init__(self, compile: Callable[[threading.Event], Outcome], marker: Path, waits_for, limit_s: float,
                 say: Callable[[str], None]):
        self.marker, self.waits_for, self.limit_s = marker, frozenset(waits_for), limit_s
        self.stop = threading.Event()
        self.outcome: Outcome | None = None
        self.error: str | None = None  # what the compile raised
        self.timed_out = False
        self.began = time.time()
        self._compile, self._say = compile, say
        self._thread = threading.Thread(target=self._run, daemon=True, name="precompile")
        self._timer = threading.Timer(limit_s, self._too_long)
        self._timer.daemon = True

    def start(self) -> Background:
        self._thread.start()
        self._timer.start()
        return self

    def _too_long(self) -> None:
        self.timed_out = True
        self.stop.set()

    def _run(self) -> None:
        try:
            self.outcome = self._compile(self.stop)
        except BaseException as exc:  # a bug, EMFILE, ...: the checks compile their kernels as without this step
            self.error = _reason(exc)
            self._say(f"{LABEL}: stopped by {self.error}; the checks compile their kernels themselves")
        finally:
            self._timer.cancel()
            try:
                if self.timed_out and self.outcome is not None:
                    left = sum(error == STOPPED for _, error in self.outcome.failed)
                    self._say(f"{LABEL}: not finished within {self.limit_s:g} s ({WAIT_ENV}): stopped with {left} "
                              f"call(s) left, which their checks compile themselves; raise {WAIT_ENV}, or set "
                              f"EP_HARNESS_PRECOMPILE=0 to compile in the checks")
            finally:
                write_marker(self.marker, {
                    "done": self.outcome.done if self.outcome else 0,
                    "failed": len(self.outcome.failed) if self.outcome else None, "error": self.error,
                    "timed_out": self.timed_out, "seconds": round(time.time() - self.began, 3),
                    "time": time.time()})

    def rank_wait(self) -> dict:
        """What a launch's ranks are told (the job's `precompile`): the marker to wait for,
        before which checks, and until when (RANK_GRACE_S after the compile's own limit:
        only a head that is stuck leaves them waiting that long)."""
        return {"marker": str(self.marker), "checks": sorted(self.waits_for),
                "limit_s": self.limit_s + RANK_GRACE_S, "until": self.began + self.limit_s + RANK_GRACE_S}

    def finish(self, stop_because: str | None = None, limit_s: float = 60.0) -> Outcome | None:
        """The compile's outcome once it has ended (None when it raised). With
        `stop_because`, it is stopped first if still running (saying why, unless empty);
        after a stop it has `limit_s` to end its workers."""
        if stop_because is not None and self._thread.is_alive():
            if stop_because:
                self._say(f"{LABEL}: stopped: {stop_because}")
            self.stop.set()
        deadline = time.time() + limit_s
        while self._thread.is_alive():  # in slices: a signal is taken at once
            self._thread.join(0.2)
            if self.stop.is_set() and time.time() > deadline:
                self._say(f"{LABEL}: the compile thread did not end within {limit_s:g} s of being stopped "
                          f"(see {self.marker.parent / 'precompile.log'})")
                break
        return self.outcome


STOPPED = "stopped before it was compiled"


def start(checks, platform, run_dir: Path, quiet: bool, multi_node: bool = False, device: str = "cuda",
          plugins: list[str] = (), ranks: int = 0) -> Background | None:
    """Start compiling the kernels the checks will need (the calls their families plan), in
    the background; None when there is nothing to do (then nothing waits and nothing is
    reordered). `ranks`: the local ranks that run meanwhile (each takes a compile process's
    place). `plugins`: the run's plugin modules, which the workers load as the ranks do (a
    plugin may add a family or a DeepGEMM subject). (`device`: where the workers allocate,
    "cpu" only in tests.)"""
    if platform.device != "cuda" or multi_node or os.environ.get("EP_HARNESS_PRECOMPILE", "1") == "0":
        return None
    processes = worker_count(ranks)  # a bad setting is refused on every GPU run, not only a cold one
    limit_s = wait_limit()
    from ep_harness.console import line
    from ep_harness.environment import deep_gemm_cache_dir, pinned_env
    from ep_harness.launch.processes import import_paths

    say = (lambda text: None) if quiet else (lambda text: line(f"# {text}"))
    failed_say = lambda text: line(f"# {text}")  # noqa: E731  (printed under -q too)
    calls, own, users = _gathered(checks)
    if own:
        say(f"DeepGEMM kernels of {len(own)} check(s) are decided at run time (multi-rank routing): "
            f"they compile their own, e.g. {own[0]}")
    if not calls:
        return None
    env = {**os.environ, **pinned_env(platform, {}), **import_paths()}  # as the ranks run
    cache_dir = Path(env.get("DG_JIT_CACHE_DIR") or deep_gemm_cache_dir())
    identity = manifest_identity(platform, calls)
    known = compiled_before(cache_dir, identity)
    todo = interleaved([c for c in calls if c.key() not in known])
    if not todo:
        say(f"DeepGEMM kernels: all {len(calls)} planned calls were compiled by an earlier run into {cache_dir}")
        return None
    # The checks making a call still to compile, and those compiling their own kernels: these
    # would build the same cache entries as the workers, at the same time.
    waits_for = {check_id for call in todo for check_id in users[call]} | set(own)
    workers = min(processes, len(todo))
    say(f"{LABEL}: {len(todo)} distinct calls (shapes) on {workers} processes, into {cache_dir}" +
        (f"; meanwhile the ranks run the checks that need none ({len(waits_for)} wait for them)" if ranks else ""))

    def compile(stop: threading.Event) -> Outcome:
        outcome = compile_all(todo, workers, env, device, run_dir / "precompile.log", say, failed_say=failed_say,
                              plugins=list(plugins), stop=stop)
        remember(cache_dir, identity, {c.key() for c in outcome.compiled})
        if outcome.failed and not outcome.stopped:
            say(f"{LABEL}: {len(outcome.failed)} of {len(todo)} failed; their checks compile them again and report it")
        return outcome

    return Background(compile, Path(run_dir).resolve() / MARKER, waits_for, limit_s, failed_say).start()

