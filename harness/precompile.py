"""DeepGEMM's kernels compiled beside the launches, many at once.

DeepGEMM JIT-compiles a kernel (NVCC, 3-4 s each on the lent H200) the first time a GEMM of
a new shape is called, and keeps the cubin in its cache directory (DG_JIT_CACHE_DIR, which
every launch pins: ep_harness.environment.deep_gemm_cache_dir). A rank calls one shape after
another, so a cold `--suite h200` spent most of its time compiling kernels one at a time.

When a GPU run starts, this module (`start`)
1. gathers every distinct DeepGEMM call the planned checks will make (`planned_calls`): the
   subject, layout, dtype and the exact shapes of its operands, scales and output (and
   `expected_m` for masked layouts): DeepGEMM picks its kernel configuration from these, so
   a smaller stand-in shape could build another kernel than the check needs;
2. makes each call once on zero-valued inputs of those shapes, in a pool of worker
   processes (harness/precompile_worker.py) sized to the CPU count less one per local rank
   (the ranks share the CPU with them; EP_HARNESS_PRECOMPILE_WORKERS, when set, is taken as
   is), printing progress; the compiled kernels land in the cache, where the checks' own
   warm-up finds them.
This runs in a thread of the head (`Background`) while the ranks start and run the checks that
need none of these kernels: verify.py moves the checks that do (`waits_for`: every check making
a call still to compile, and the DeepGEMM checks that compile their own kernels, which would
otherwise build the same cache entries as the workers at the same time) to the end of each
launch, keeping their order (`compiled_last`), and a rank waits before the first of them until
the head has written the run directory's marker (`MARKER`), which it does however the compile
ends (done, failed, raised, stopped). The wait is a progress state of its own (the ranks'
`waiting_until`), outside every check's timeout_s, and has a limit of its own (EP_HARNESS_PRECOMPILE_WAIT_S, default
WAIT_LIMIT_S): past it the head stops the compile and the checks compile what is left; a rank
still waiting RANK_GRACE_S later (a head that is stuck) fails its check with one line.

Nothing here decides a verdict: a call that fails or is not gathered is compiled by the check
itself as before (and fails there if it must), and a failure is printed with the worker's log.
A no-op on the CPU, without DeepGEMM, on several nodes, with EP_HARNESS_PRECOMPILE=0, and when
every call was compiled by an earlier run into the same cache (the manifest below): the run
then launches as it would without this module (no reordering, no wait).
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

FP8 = "float8_e4m3fn"
MANIFEST = "ep-harness-precompiled.json"  # in the DeepGEMM cache directory: calls compiled there
PROGRESS_EVERY_S = 2.0
LABEL = "compiling DeepGEMM kernels"
CALL_LIMIT_S = 600.0  # a call's limit when no check gave one (KernelCall.timeout_s)
STARTUP_LIMIT_S = 300.0  # a worker's start: torch, CUDA and DeepGEMM imported, 16 at once on one GPU
WORKERS_ENV = "EP_HARNESS_PRECOMPILE_WORKERS"
WAIT_ENV = "EP_HARNESS_PRECOMPILE_WAIT_S"
WAIT_LIMIT_S = 900.0  # the compile's limit while ranks may wait for it (calls have their own)
RANK_GRACE_S = 60.0  # past the compile's limit, a rank stops waiting for a head that never wrote the marker
MARKER = "precompile.done"  # in the run directory: written by the head once the compile has ended


@dataclass(frozen=True)
class KernelCall:
    """One DeepGEMM call as a check makes it. Equal calls build the same kernels; `counts`
    (rows per expert: runtime values, not part of the kernel), `needed_by` (the first
    check that makes it, for messages) and `timeout_s` (the largest timeout_s of the checks
    that make it: past it they would time out anyway, so the call is given up) are carried
    along but not compared."""

    subject: str
    layout: str
    dtype: str
    a: tuple[int, ...]
    b: tuple[int, ...]
    out: tuple[int, ...]
    a_scale: tuple[int, ...] | None = None
    b_scale: tuple[int, ...] | None = None
    expected_m: int | None = None  # masked layouts only
    counts: tuple[int, ...] = field(default=(), compare=False)
    alignment: int = field(default=128, compare=False)
    needed_by: str = field(default="", compare=False)
    timeout_s: float = field(default=CALL_LIMIT_S, compare=False)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> KernelCall:
        shapes = {k: (tuple(d[k]) if d.get(k) is not None else None) for k in ("a", "b", "out", "a_scale", "b_scale")}
        return cls(**{**d, **shapes, "counts": tuple(d.get("counts") or ())})

    def key(self) -> str:
        """What identifies the call in the manifest (a stable string)."""
        return json.dumps([self.subject, self.layout, self.dtype, self.a, self.b, self.out, self.a_scale,
                           self.b_scale, self.expected_m])

    def describe(self) -> str:
        shape = lambda s: "x".join(map(str, s))  # noqa: E731
        em = f" expected_m={self.expected_m}" if self.expected_m is not None else ""
        return f"{self.subject} a={shape(self.a)} b={shape(self.b)}{em} (for {self.needed_by})"


# -- 1. what the planned checks will call ---------------------------------------------------

def is_deepgemm(subject) -> bool:
    from ep_harness.subjects.gemm.deepgemm import _DeepGemm

    return isinstance(subject, _DeepGemm)


def gemm_call(subject_name: str, layout: str, dtype: str, counts, n: int, k: int, groups: int,
              alignment: int, expected_m: int | None, needed_by: str) -> KernelCall:
    """The call a GEMM subject receives for experts holding `counts` rows each, with the
    shapes its operands have in the layout (ep_harness.contracts.layout_rows, which
    gemm_problem.build and the dispatchers' layouts follow; FP8 adds block scales)."""
    from ep_harness.contracts import expected_m_hint, layout_rows

    counts = tuple(int(c) for c in counts)
    rows = layout_rows(layout, list(counts), alignment)
    a, out = (*rows, k), (*rows, n)
    b = (n, k) if layout == "dense" else (groups, n, k)
    if layout == "masked":
        expected_m = expected_m or expected_m_hint(counts)
    scales = {}
    if dtype == FP8:
        scales = {"a_scale": (*a[:-1], k // 128), "b_scale": (*b[:-2], n // 128, k // 128)}
    return KernelCall(subject_name, layout, dtype, a, b, out, expected_m=expected_m if layout == "masked" else None,
                      counts=counts, alignment=alignment, needed_by=needed_by, **scales)


def _gemm_check_calls(check, subject) -> list[KernelCall]:
    from ep_harness.families.gemm import runs_for

    p = check.params
    return [gemm_call(subject.name, p.layout, p.dtype, run.counts, p.n, p.k, p.groups, p.alignment, run.expected_m,
                      check.id)
            for run in runs_for(check.property, p)]


def _moe_check_calls(check, gemm) -> list[KernelCall]:
    """The layer's two expert GEMMs per run, at world size 1 with torch's dispatcher: the
    experts' row counts follow from routing the run's tokens (cheap: the router alone)."""
    from ep_harness.families.moe_layer import partials, router_weights
    from ep_harness.families.moe_scenario import placement_runs
    from ep_harness.subjects.moe.composed import route

    p = check.params
    experts, hidden, inter = p.num_experts, p.hidden, p.intermediate
    router, calls = router_weights(p), []
    for run in placement_runs(check.property, p, 1):
        idx, _ = route(partials(p, run.spec, 0, 1), router, p.topk, p.scoring)
        counts = [int((idx == e).sum()) for e in range(experts)]
        for n, k in ((2 * inter, hidden), (hidden, inter)):  # gate-up, then down
            calls.append(gemm_call(gemm.name, p.layout, "bfloat16", counts, n, k, experts, p.alignment,
                                   None, check.id))
    return calls


def planned_calls(checks) -> tuple[list[KernelCall], list[str]]:
    """The distinct DeepGEMM calls of the checks that will run, in first-use order, and the
    ids of DeepGEMM checks whose calls cannot be known before the launch (they compile
    their own kernels, as before)."""
    calls, own, _ = _gathered(checks)
    return calls, own


def _gathered(checks) -> tuple[list[KernelCall], list[str], dict[KernelCall, list[str]]]:
    """planned_calls, and for each call the ids of every check that makes it (`needed_by`
    names only the first)."""
    from ep_harness import subject as registry
    from ep_harness.subject import compiles_kernels

    calls: dict[KernelCall, KernelCall] = {}
    users: dict[KernelCall, list[str]] = {}
    own: list[str] = []
    for check in checks:
        if check.skip_reason:
            continue
        subject = registry.get(check.subject)
        if check.family == "gemm" and is_deepgemm(subject):
            found = _gemm_check_calls(check, subject)
        elif check.family == "moe_layer" and is_deepgemm(registry.get(check.params.gemm)):
            if check.world_size != 1 or check.params.dispatch != "torch_a2a_dispatch":
                own.append(check.id)  # the rows each rank receives are decided by the other ranks
                continue
            found = _moe_check_calls(check, registry.get(check.params.gemm))
        else:
            if compiles_kernels(subject, check.params) and _uses_deepgemm_gemm(check):
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


def _uses_deepgemm_gemm(check) -> bool:
    """A composed subject (the model) with a DeepGEMM GEMM stage."""
    from ep_harness import subject as registry
    from ep_harness.families.model import ModelParams
    from ep_harness.families.moe_scenario import MoeParams

    p = check.params
    names = [p.gemm, p.dense_gemm] if isinstance(p, ModelParams) else [p.gemm] if isinstance(p, MoeParams) else []
    return any(name in registry.load_all() and is_deepgemm(registry.get(name)) for name in names)


# -- 2. compile them, many at once --------------------------------------------------------

def interleaved(calls: list[KernelCall]) -> list[KernelCall]:
    """The calls round-robin over their GEMMs (subject and weight shape): calls of one GEMM
    that differ only in M often build the same kernel, and two processes building it at once
    both pay for it, while a call made after the first finished loads it from the cache."""
    groups: dict[tuple, list[KernelCall]] = {}
    for call in calls:
        groups.setdefault((call.subject, call.b), []).append(call)
    order = []
    for i in range(max(map(len, groups.values()), default=0)):
        order += [g[i] for g in groups.values() if i < len(g)]
    return order


@dataclass
class Outcome:
    done: int = 0
    failed: list[tuple[KernelCall, str]] = field(default_factory=list)
    seconds: float = 0.0
    compiled: list[KernelCall] = field(default_factory=list)  # the calls made (what the manifest remembers)
    stopped: bool = False  # ended by `stop` before every call was answered


class GaveUp(Exception):
    """A worker that did not answer in time (it has been ended)."""


class _Worker:
    """One worker process (its own process group: ended with everything it started, NVCC
    included) and the calls it makes, one at a time. A thread of its own reads its answers,
    so that waiting for one has a limit: a hung NVCC or kernel launch must not hang the run."""

    def __init__(self, env: dict, device: str, log, plugins: list[str] = ()):
        self.proc = subprocess.Popen([sys.executable, "-m", "ep_harness.precompile_worker", device, *plugins],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                     text=True, bufsize=1, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.started = False  # whether it said it is ready for calls
        threading.Thread(target=self._read, daemon=True, name=f"precompile-answers-{self.proc.pid}").start()

    def _read(self) -> None:
        with self.proc.stdout as stream:
            for line in stream:
                self.lines.put(line)
        self.lines.put("")  # end of file: the worker has ended

    def _next_line(self, limit_s: float, failure: str) -> str:
        try:
            return self.lines.get(timeout=limit_s)
        except queue.Empty:
            self.end()
            raise GaveUp(failure) from None

    def call(self, call: KernelCall) -> dict | None:
        """The worker's answer, or None when it died (its exit code is then in self.proc).
        Raises GaveUp when it did not start within STARTUP_LIMIT_S or did not answer within
        the call's timeout_s (the worker is ended then)."""
        if not self.started:
            line = self._next_line(STARTUP_LIMIT_S, f"the worker process did not start within "
                                                    f"{STARTUP_LIMIT_S:g} s")
            if not line:
                return self._died()
            if json.loads(line) != {"ready": True}:
                raise RuntimeError(f"the worker process began with {line.strip()[:200]!r}, not its ready line")
            self.started = True
        try:
            self.proc.stdin.write(json.dumps(call.to_json()) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # it died (or was ended): its end of file follows
            pass
        line = self._next_line(call.timeout_s, f"timed out after {call.timeout_s:g} s")
        return json.loads(line) if line else self._died()

    def _died(self) -> None:
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # closed its answers but lives on: end it
            self.end()
        return None

    def end(self) -> None:
        """End the worker's process group (and anything it started elsewhere): also when the
        worker itself has died, as its NVCC may still run. SIGTERM, then SIGKILL to whatever
        is left after 2 s; returns once the worker has been reaped."""
        from ep_harness.processes import kill_launch

        kill_launch(self.proc, grace_s=2.0)
        try:
            self.proc.stdin.close()
        except OSError:
            pass


def _reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, GaveUp) else (f"{type(exc).__name__}: {exc}".splitlines() or ["?"])[0][:300]


def compile_all(calls: list[KernelCall], workers: int, env: dict, device: str, log_path: Path,
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
                            worker = _Worker(env, device, log, plugins)
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
            answered: set[KernelCall] = set()
            while finished < len(calls):
                if stop is not None and stop.is_set():
                    outcome.stopped = True
                    _drain(todo)
                    outcome.failed += [(c, STOPPED) for c in calls if c not in answered]
                    break
                try:  # in slices, so that a signal (ep_harness.processes.interruptible) is taken at once
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


def _drain(todo: queue.Queue) -> list[KernelCall]:
    left = []
    while True:
        try:
            left.append(todo.get_nowait())
        except queue.Empty:
            return left


# -- the manifest: calls an earlier run compiled into this cache ----------------------------

def manifest_identity(platform) -> dict:
    """What decides which kernel a call builds, besides its shapes."""
    import torch

    from ep_harness.subjects.gemm.deepgemm import settings

    return {"deep_gemm": settings().get("version"), "gpu": platform.gpu_name,
            "capability": list(platform.capability or ()), "torch": torch.__version__, "cuda": torch.version.cuda,
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DG_") and k != "DG_JIT_CACHE_DIR"}}


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

def worker_count(ranks: int = 0) -> int:
    """EP_HARNESS_PRECOMPILE_WORKERS processes, or one per CPU core this process may use less
    one per local rank running meanwhile (at least one)."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value:
        try:
            count = int(value)
        except ValueError:
            count = 0
        if count < 1:
            from ep_harness.errors import HarnessError

            raise HarnessError(f"{WORKERS_ENV}={value!r} needs a positive integer (the number of DeepGEMM compile "
                               f"processes); unset it for one per CPU core, or set EP_HARNESS_PRECOMPILE=0 to "
                               f"compile in the checks")
        return count
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores - ranks)


def wait_limit() -> float:
    """EP_HARNESS_PRECOMPILE_WAIT_S, or WAIT_LIMIT_S."""
    value = os.environ.get(WAIT_ENV, "").strip()
    if not value:
        return WAIT_LIMIT_S
    try:
        limit = float(value)
    except ValueError:
        limit = 0.0
    if not limit > 0 or limit == float("inf"):
        from ep_harness.errors import HarnessError

        raise HarnessError(f"{WAIT_ENV}={value!r} needs a positive number of seconds (how long the checks wait for "
                           f"the DeepGEMM compile); unset it for {WAIT_LIMIT_S:g} s, or set EP_HARNESS_PRECOMPILE=0 "
                           f"to compile in the checks")
    return limit


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
    """Start compiling the DeepGEMM kernels the checks will need, in the background; None
    when there is nothing to do (then nothing waits and nothing is reordered). `ranks`: the
    local ranks that run meanwhile (each takes a compile process's place). `plugins`: the
    run's plugin modules, which the workers load as the ranks do (a plugin subject may be a
    DeepGEMM one). (`device`: where the workers allocate, "cpu" only in tests.)"""
    if platform.device != "cuda" or multi_node or os.environ.get("EP_HARNESS_PRECOMPILE", "1") == "0":
        return None
    processes = worker_count(ranks)  # a bad setting is refused on every GPU run, not only a cold one
    limit_s = wait_limit()
    from ep_harness.console import line
    from ep_harness.environment import deep_gemm_cache_dir, pinned_env
    from ep_harness.processes import import_paths

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
    identity = manifest_identity(platform)
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

