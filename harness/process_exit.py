"""The end of a command: the interpreter's exit steps that anyone can observe, without its
teardown of every object (0.2 CPU-s in a process that imported torch; a forked agent ends the
same way, harness/launch/forks.py)."""
from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import NoReturn


def exit_now(code) -> NoReturn:
    """`sys.exit(code)` as the interpreter does it, up to what a command can observe: the
    status (None 0, an int itself, anything else printed to stderr and 1), non-daemon threads
    joined, atexit's functions (logging's flush, multiprocessing's, weakref finalizers), the
    standard streams flushed; then os._exit. For a process whose own files are closed: one
    left open and unflushed would lose its tail, where the teardown would have flushed it."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()
        _keep_operator_registrations()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    finally:
        os._exit(code & 0xFF)


def _keep_operator_registrations() -> None:
    """torch.library's exit finalizers (_del_library) undo this process's operator
    registrations, which nothing outside it can see. In a forked process (a forked agent, a
    command forked from the tests' server) each undo rewrites dispatcher tables shared
    copy-on-write with the parent (a one-check launch forked by the tests, whose command and
    agent both end here: 0.51 -> 0.46 CPU-s). They are left undone; every other finalizer (a
    temporary directory's removal, ...) still runs."""
    library = sys.modules.get("torch.library")
    if library is None:
        return
    for finalizer, info in list(weakref.finalize._registry.items()):  # CPython's registry of live finalizers
        if info.func is library._del_library:
            finalizer.atexit = False
