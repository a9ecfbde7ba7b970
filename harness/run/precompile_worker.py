"""A pre-compilation process, and the head's handle on one (harness/run/precompile.py starts a
pool of them, `worker_count` processes):

    python -m ep_harness.run.precompile_worker DEVICE [PLUGIN_MODULE ...]

loads the subjects as a rank does (built-in, entry points, the run's plugin modules), readies
each JIT they compile with (ep_harness.subject.jit_of: DeepGEMM imported), says {"ready": true}
on a line of its own, then reads calls as JSON lines on stdin, {"family": ..., "call": ...}
(rebuilt by that family's Precompile.call class), and answers each with one JSON line,
{"ok": true} or {"ok": false, "error": "..."}, after making the call once on zero-valued
inputs: a JIT compiles (or loads) the kernel on that first call and keeps it in its cache
directory. Anything else written to stdout, by DeepGEMM's C++ (printf: NVCC's errors) or by
Python, goes to stderr, which the pool writes to the run's precompile.log; the answers have a
descriptor of their own.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import traceback

WORKERS_ENV = "EP_HARNESS_PRECOMPILE_WORKERS"
NICENESS = 10  # added to the head's: the compile runs beside the ranks (harness/run/precompile.py)


# -- the head's side ------------------------------------------------------------------------

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


class GaveUp(Exception):
    """A worker that did not answer in time (it has been ended)."""


class Worker:
    """One worker process (its own process group: ended with everything it started, NVCC
    included) and the calls it makes, one at a time. A thread of its own reads its answers,
    so that waiting for one has a limit: a hung NVCC or kernel launch must not hang the run."""

    def __init__(self, env: dict, device: str, log, plugins: list[str], startup_s: float):
        self.proc = subprocess.Popen([sys.executable, "-m", "ep_harness.run.precompile_worker", device, *plugins],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                     text=True, bufsize=1, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.started = False  # whether it said it is ready for calls
        self.startup_s = startup_s  # its limit on saying so
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

    def call(self, call) -> dict | None:
        """The worker's answer, or None when it died (its exit code is then in self.proc).
        Raises GaveUp when it did not start within startup_s or did not answer within
        the call's timeout_s (the worker is ended then)."""
        if not self.started:
            line = self._next_line(self.startup_s, f"the worker process did not start within {self.startup_s:g} s")
            if not line:
                return self._died()
            if json.loads(line) != {"ready": True}:
                raise RuntimeError(f"the worker process began with {line.strip()[:200]!r}, not its ready line")
            self.started = True
        try:
            self.proc.stdin.write(json.dumps({"family": call.family, "call": call.to_json()}) + "\n")
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
        from ep_harness.launch.processes import kill_launch

        kill_launch(self.proc, grace_s=2.0)
        try:
            self.proc.stdin.close()
        except OSError:
            pass


def reason(exc: BaseException) -> str:
    """One line for what ended a call (or the compile)."""
    return str(exc) if isinstance(exc, GaveUp) else (f"{type(exc).__name__}: {exc}".splitlines() or ["?"])[0][:300]



# -- the worker process ---------------------------------------------------------------------

def unready_jits() -> dict[int, str]:
    """Every JIT of the registered subjects readied: why one cannot be, by its id."""
    from ep_harness import subject as registry

    jits = {id(j): j for j in map(registry.jit_of, registry.load_all().values()) if j is not None}
    return {key: why for key, why in ((key, jit.ready()) for key, jit in jits.items()) if why}


def main() -> None:
    # The compile yields the CPU to the ranks measuring checks beside it (and to the head):
    # on the H200's 16 cores, 15 compile processes at equal priority slowed the rank's own
    # CPU work 2-3x. NVCC, started by DeepGEMM from here, inherits the niceness.
    os.nice(NICENESS)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else is printed goes to the log
    sys.stdout = sys.stderr
    device, plugins = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("cuda", [])
    from ep_harness.launch.agent import _imports_without_gc

    # What torch and the subjects make as they load lives until the worker ends: no collection
    # while they load, then out of the collector's reach, so that neither a later collection nor
    # the exit's walks it (0.3 CPU-s).
    with _imports_without_gc():
        from ep_harness import families
        from ep_harness import subject as registry

        broken, unready = None, {}
        try:  # every call fails with the reason (the run's own loading reports it)
            registry.load_all(plugins)
        except Exception as exc:
            broken = f"the subjects cannot be loaded here: {(str(exc).splitlines() or [type(exc).__name__])[0]}"
        if not broken:
            unready = unready_jits()  # each call of theirs fails with the reason (its checks are skipped for it)
    answers.write(json.dumps({"ready": True}) + "\n")  # the pool's limit on a call starts now
    for line in sys.stdin:
        sent, call = json.loads(line), None
        try:
            call = families.get(sent["family"]).precompile.call.from_json(sent["call"])
            if broken:
                raise RuntimeError(broken)
            subject = registry.get(call.subject)
            if id(registry.jit_of(subject)) in unready:
                raise RuntimeError(unready[id(registry.jit_of(subject))])
            call.make(subject, device)
            answer = {"ok": True}
        except Exception as exc:
            what = call.describe() if call is not None else json.dumps(sent)[:300]
            print(f"[precompile pid {os.getpid()}] {what} failed:", file=sys.stderr)
            traceback.print_exc()
            answer = {"ok": False, "error": (f"{type(exc).__name__}: {exc}".splitlines() or ["?"])[0][:300]}
        sys.stderr.flush()
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
