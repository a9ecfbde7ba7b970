"""User-facing errors: one line that names the problem and the fix."""
import traceback


class HarnessError(Exception):
    """Bad input or an unusable environment; printed as one line, exit code 2."""


class Interrupted(BaseException):
    """A signal ended the run (harness/launch/processes.py's `interruptible` raises it);
    `outcomes` holds what the interrupted launch had finished. Exit code 128 + the signal's."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.outcomes: dict = {}  # check id -> ep_harness.launch.launcher.Outcome
        self.note = ""  # what became of the run, for the command's one line


def first_line(exc: BaseException, limit: int | None = 200) -> str:
    """"Type: message" cut to its first line (and `limit` characters): an exception as a
    record's one-line reason. Never empty, whatever the message (str(exc) may be "")."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:limit]


def did_you_mean(word: str, choices) -> str:
    """" (did you mean 'X'?)" for the closest of `choices` (difflib), or '' when none is close."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def registered(table: dict, name: str, what: str, how_to_add: str):
    """table[name] from a registry, or one line naming the closest known name and how to add one."""
    try:
        return table[name]
    except KeyError:
        raise HarnessError(f"unknown {what} {name!r}{did_you_mean(name, table)}; known: {', '.join(table) or 'none'} "
                           f"({how_to_add})") from None


def plugin_import_problem(module: str, exc: BaseException) -> str:
    """One line for a plugin module that did not import: not found (the path), a library it
    needs missing (the install), an error in its own code (where), or an exit while importing."""
    if isinstance(exc, ModuleNotFoundError) and exc.name and not (module + ".").startswith(exc.name + "."):
        return (f"subject plugin {module!r} needs the module {exc.name!r}, which is not installed here: "
                f"install the library that provides it (pip install ...)")
    if isinstance(exc, ImportError):
        return f"cannot import subject plugin {module!r} ({exc}); check the module path or PYTHONPATH"
    if isinstance(exc, SystemExit):
        return (f"subject plugin {module!r} called sys.exit({exc.code!r}) while it was imported; a plugin "
                f"module must only define and register subjects")
    where = ""
    if isinstance(exc, SyntaxError):
        where = f" at {exc.filename}:{exc.lineno}"
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
        if frames:
            where = f" at {frames[-1].filename}:{frames[-1].lineno}"
    text = (str(exc).splitlines() or [""])[0]
    return f"subject plugin {module!r} raised {type(exc).__name__}{where} while it was imported: {text}; fix the module"
