"""Launch one torchrun job per (world size, environment) and watch it.

The launcher wraps torchrun and nothing else. A check that raises on any rank, or does
not finish within its timeout (stacks are dumped first), is recorded as an error and the
job is relaunched from the next check, so one bad subject never costs the whole run and
no process outlives it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.measurement import Measurement
from harness.records import write_json

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180.0
POLL_S = 0.1


@dataclass
class Outcome:
    """What became of one check in a launch: a measurement or an error."""

    seconds: float
    warm_up_seconds: float | None = None  # untimed first pass of a JIT-compiling subject
    measured: Measurement | None = None
    error: str | None = None
    details: dict = field(default_factory=dict)


def torchrun_command(world_size: int, job_dir: Path, start: int, torchrun_args: str | None,
                     module: str = "harness.worker") -> list[str]:
    # Past one host, pass torchrun's own rendezvous (--nnodes, --rdzv-endpoint, ...) through
    # EP_HARNESS_TORCHRUN_ARGS; JOB_DIR must then be on a filesystem every host shares.
    rendezvous = shlex.split(torchrun_args) if torchrun_args else ["--standalone", "--nnodes", "1"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous,
            "--nproc-per-node", str(world_size), "--max-restarts", "0", "--monitor-interval", "0.1",
            "-m", module, str(job_dir), str(start)]


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _ranks_state(job_dir: Path, world_size: int) -> list[dict | None]:
    return [_read_json(job_dir / f"progress-rank{r}") for r in range(world_size)]


def _clear_rank_files(job_dir: Path) -> None:
    for pattern in ("progress-rank*", "pid-rank*", "error-rank*.json", "stack-rank*.txt"):
        for p in job_dir.glob(pattern):
            p.unlink()


def kill_launch(proc: subprocess.Popen, job_dir: Path, grace_s: float = 2.0) -> None:
    """End torchrun, every worker and whatever they spawned: each is killed as a process
    group (torchrun's own session, and each worker's, which its children share), first
    with SIGTERM and, after a grace period, SIGKILL."""
    groups = {proc.pid}
    for pid_file in job_dir.glob("pid-rank*"):
        try:
            groups.add(os.getpgid(int(pid_file.read_text())))
        except (OSError, ValueError):
            pass
    groups.discard(os.getpgrp())  # never our own group
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + (grace_s if sig == signal.SIGTERM else 0)
        while time.time() < deadline and (proc.poll() is None or _alive(groups)):
            time.sleep(0.05)
    proc.wait()


def _alive(groups) -> bool:
    for group in groups:
        try:
            os.killpg(group, 0)
            return True
        except (ProcessLookupError, PermissionError):
            pass
    return False


class Interrupted(BaseException):
    """A signal ended the run; `outcomes` holds what the interrupted launch had finished."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.outcomes: dict[str, Outcome] = {}


@contextlib.contextmanager
def interruptible():
    """While launches run, SIGINT, SIGTERM and SIGHUP (and `timeout`) raise Interrupted in
    this thread, once: the launcher then ends every process group, and the run keeps what it
    finished. Signals that arrive during that clean-up are ignored."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def handler(signum, frame):
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _collect(job_dir: Path, checks: list, start: int, outcomes: dict) -> None:
    """The checks of this launch that rank 0 finished and recorded (read while the ranks run:
    a line still being written is left for the next poll)."""
    path = job_dir / "records.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for text in lines:
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            break
        if line["index"] >= start and checks[line["index"]].id not in outcomes:
            outcomes[checks[line["index"]].id] = Outcome(line["seconds"], line.get("warm_up_seconds"),
                                                         measured=Measurement.from_json(line["measured"]))


def _dump_stacks(job_dir: Path, world_size: int) -> dict[str, str]:
    for r in range(world_size):
        try:
            os.kill(int((job_dir / f"pid-rank{r}").read_text()), signal.SIGUSR1)
        except (OSError, ValueError):
            pass
    time.sleep(1.0)
    dumps = {}
    for r in range(world_size):
        path = job_dir / f"stack-rank{r}.txt"
        if path.exists() and path.read_text().strip():
            dumps[str(r)] = path.read_text()
    return dumps


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _watch(proc, job_dir: Path, world_size: int, checks: list, start: int, launched: float, log_path: Path,
           on_poll=None):
    """Wait for the launch; return (failed_at, error, details) for a start-up failure or a
    check that outran its timeout (stacks dumped first), or (None, None, {})."""
    while proc.poll() is None:
        time.sleep(POLL_S)
        if on_poll is not None:
            on_poll()
        states = _ranks_state(job_dir, world_size)
        running = [s for s in states if s and s["index"] < len(checks)]
        if not running and not any(states) and time.time() - launched > START_TIMEOUT_S:
            return start, f"ranks did not start within {START_TIMEOUT_S:.0f} s", {
                "stacks": _dump_stacks(job_dir, world_size), "log": _log_tail(log_path)}
        for s in running:
            if time.time() - s["since"] > checks[s["index"]].timeout_s:
                failed_at = min(x["index"] for x in running)
                stuck = [r for r, x in enumerate(states) if x and x["index"] == failed_at]
                return failed_at, (f"timed out after {checks[failed_at].timeout_s:.0f} s "
                                   f"(ranks {stuck} still inside the check); stack dumps attached"), {
                    "stacks": _dump_stacks(job_dir, world_size)}
    return None, None, {}


def run_job(job_dir: Path, world_size: int, backend: str, checks: list, env: dict[str, str],
            plugins: list[str], torchrun_args: str | None = None, emulate_hosts: bool = False,
            on_outcome=None) -> dict[str, Outcome]:
    """Run `checks` on `world_size` ranks; return an Outcome per check id. emulate_hosts:
    NCCL ranks beyond the visible GPUs share them as emulated hosts (harness/emulation.py).
    on_outcome(check, outcome) is called for every check as soon as it is finished."""
    job_dir.mkdir(parents=True, exist_ok=True)
    longest = max(c.timeout_s for c in checks)
    write_json(job_dir / "job.json", {
        "backend": backend, "plugins": plugins, "checks": [c.to_json() for c in checks], "emulate_hosts": emulate_hosts,
        # Collective timeouts sit above the launcher's: the launcher must see a hang first.
        "collective_timeout_s": longest + 60,
    })
    child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1",
                 # The working directory never goes before the standard library: a json.py
                 # there must not run inside the ranks (plugins are found at the path's end).
                 "PYTHONSAFEPATH": "1",
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    outcomes: dict[str, Outcome] = {}
    reported: set[str] = set()

    def report() -> None:  # hand every newly finished check to the caller, in plan order
        _collect(job_dir, checks, start, outcomes)
        for c in checks:
            if c.id in outcomes and c.id not in reported:
                reported.add(c.id)
                if on_outcome is not None:
                    on_outcome(c, outcomes[c.id])

    start, attempt = 0, 0
    while start < len(checks):
        _clear_rank_files(job_dir)
        log_path = job_dir / f"torchrun-{attempt}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(torchrun_command(world_size, job_dir, start, torchrun_args), env=child_env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        launched = time.time()
        try:
            failed_at, error, details = _watch(proc, job_dir, world_size, checks, start, launched, log_path, report)
        except Interrupted as exc:  # end the processes, then keep what was finished
            kill_launch(proc, job_dir)
            _collect(job_dir, checks, start, outcomes)
            exc.outcomes = outcomes
            raise
        finally:  # whatever happened, no process of this launch outlives it
            kill_launch(proc, job_dir)
        report()
        if error is None and proc.returncode != 0:
            # A rank's own traceback first; notes of ranks ended by SIGTERM after it last.
            errors = sorted(filter(None, (_read_json(p) for p in job_dir.glob("error-rank*.json"))),
                            key=lambda e: (e.get("terminated", False), e["time"]))
            if errors:
                first = errors[0]
                failed_at = first["index"]
                silent = [r for r in range(world_size) if r not in {e["rank"] for e in errors}]
                if first.get("terminated") and silent:
                    error = (f"rank(s) {silent} exited without a Python traceback; the others were ended by "
                             f"SIGTERM: it left no traceback (exited or was killed first)")
                else:
                    error = f"rank {first['rank']} raised {first['error']}"
                    if silent:
                        error += f"; rank(s) {silent} left no traceback (exited or were killed first)"
                details = {"tracebacks": {str(e["rank"]): e["traceback"] for e in errors}, "silent_ranks": silent}
            else:
                states = [s for s in _ranks_state(job_dir, world_size) if s]
                failed_at = min((s["index"] for s in states), default=start)
                error = f"a rank exited with code {proc.returncode} without a Python traceback"
                details = {"log": _log_tail(log_path)}
        if error is None:
            break
        seconds = round(time.time() - launched, 3)
        if not any(_ranks_state(job_dir, world_size)):  # failed before any check: all would
            reason = f"the {world_size}-rank launch failed before its first check ({error})"
            for c in checks[start:]:
                outcomes.setdefault(c.id, Outcome(seconds, error=reason, details={"log": _log_tail(log_path)}))
            break
        if failed_at is None or failed_at >= len(checks):
            failed_at = start
        outcomes[checks[failed_at].id] = Outcome(seconds, error=error, details=details)
        report()
        start = failed_at + 1
        while start < len(checks) and checks[start].id in outcomes:
            start += 1
        attempt += 1
    for c in checks:  # a job that ended early leaves no check unaccounted for
        outcomes.setdefault(c.id, Outcome(0.0, error="the launch ended before this check ran",
                                             details={"log": _log_tail(job_dir / f"torchrun-{attempt}.log")}))
    report()
    return outcomes
