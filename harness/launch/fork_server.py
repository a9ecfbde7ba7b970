"""multiprocessing's fork server started as a fork of this process rather than as a new
interpreter that imports torch again (1.1-1.5 s of CPU each time): torchrun's agent
(harness/launch/agent/) starts its ranks' fork server so, and so does the pytest plugin's
ep_world for its ranks."""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import threading
import traceback

from ep_harness.console import Console

FORKED = ("forkserver", "resource_tracker")  # the -c commands of multiprocessing that run as forks


def threads() -> int:
    """This process's threads, native ones included."""
    return len(os.listdir("/proc/self/task"))


def start_forked() -> bool:
    """Start multiprocessing's fork server (and its resource tracker, which it starts first)
    as a fork of this process, which has imported what the ranks need. Only while this
    process has one thread: a fork taken while another thread holds a lock leaves that lock
    held for good in the child. Otherwise, or where the fork server is not started as a `-c`
    command through multiprocessing.util.spawnv_passfds, it is started anew as usual (or not
    at all: one runs already). Returns whether this process had one thread."""
    if threads() != 1:
        multiprocessing.forkserver.ensure_running()
        return False
    spawn_anew = multiprocessing.util.spawnv_passfds

    def fork_instead(path, args, passfds):
        # The fork server, and the resource tracker that it starts first (a new interpreter
        # that imports multiprocessing: 0.03 CPU-s); anything else is started anew.
        if args[-2:-1] != ["-c"] or not any(f"multiprocessing.{m}" in args[-1] for m in FORKED):
            return spawn_anew(path, args, passfds)
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:  # the new interpreter, less its imports: the same fds, then the same command
            kept = sorted({0, 1, 2, *passfds})
            for low, high in zip(kept, [*kept[1:], os.sysconf("SC_OPEN_MAX")]):
                os.closerange(low + 1, high)
            # ensure_running forked inside its lock; the fork server's own copy must be free
            # (a private attribute: where it is not, there is nothing to free).
            server = getattr(multiprocessing.forkserver, "_forkserver", None)
            if hasattr(server, "_lock"):
                server._lock = threading.Lock()
            exec(args[-1], {"__name__": "__mp_forkserver__"})  # main(...): serves until this process ends
            code = 0
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)

    Console.flush()  # nothing buffered for a fork to write a second time
    multiprocessing.util.spawnv_passfds = fork_instead
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = spawn_anew
    return True
