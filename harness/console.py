"""The one way a line reaches the terminal, in the spirit of pytest's terminal reporter.

A `Console` is made once per command (cli.main, from its options) and installed for the
command's length; every module writes through `current()`. It decides two things once:
whether the command is quiet (-q: progress and banners are left out, failures, verdicts and
errors never are) and whether the status cells are coloured (only on a terminal, never with
NO_COLOR set or TERM=dumb). A library caller outside a command (the pytest plugin, a bench,
a test) gets a console made on the spot, or installs its own with `using`.

Each line is written whole: print() writes a line and its end separately, so another thread
of the head (the DeepGEMM compile's progress beside the launches' records) could land its
line between them."""
from __future__ import annotations

import contextlib
import os
import sys
import threading

_LOCK = threading.Lock()


def line(text: str, stream=None) -> None:
    """`text` and its newline in one write, flushed, never inside another thread's line."""
    if stream is None:
        stream = _current.stdout if _current is not None else sys.stdout  # looked up now: tests replace it
    with _LOCK:
        stream.write(text + "\n")
        stream.flush()


def colour_wanted(stream) -> bool:
    """Colour only on a terminal, never with NO_COLOR set (no-color.org) or TERM=dumb: a CI log
    or a file gets plain text."""
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR") and \
        os.environ.get("TERM") != "dumb"


class Console:
    """Where a command's lines go. `stdout`/`stderr` left None are looked up at each write
    (tests replace sys.stdout); `colour` left None is decided here, once, from stdout."""

    def __init__(self, quiet: bool = False, colour: bool | None = None, stdout=None, stderr=None):
        self.quiet = quiet
        self._stdout, self._stderr = stdout, stderr
        self.colour = colour_wanted(self.stdout) if colour is None else colour

    @property
    def stdout(self):
        return self._stdout if self._stdout is not None else sys.stdout

    @property
    def stderr(self):
        return self._stderr if self._stderr is not None else sys.stderr

    def line(self, text: str) -> None:
        """What the command is for, printed under -q too: results, failures, verdicts."""
        line(text, self.stdout)

    def info(self, text: str) -> None:
        """Progress, banners and notes: left out under -q."""
        if not self.quiet:
            line(text, self.stdout)

    def warning(self, text: str) -> None:
        """'# WARNING: text' beside the progress (left out under -q)."""
        self.info(f"# WARNING: {text}")

    def err(self, text: str) -> None:
        """A line on stderr, under -q too: an error, or a warning that must not mix with the output."""
        line(text, self.stderr)

    @staticmethod
    def tolerant_streams() -> None:
        """A latin-1 or C locale must not crash a report: what it cannot encode is escaped."""
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="backslashreplace")

    @staticmethod
    def flush() -> None:
        """Nothing left buffered (before a fork, which would write it a second time)."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()


_current: Console | None = None


def current() -> Console:
    """The command's console; outside a command, one made now (not quiet, colour as stdout allows)."""
    return _current if _current is not None else Console()


@contextlib.contextmanager
def using(console: Console):
    """`console` is the current one until the block ends (then the one before it is again)."""
    global _current
    before, _current = _current, console
    try:
        yield console
    finally:
        _current = before
