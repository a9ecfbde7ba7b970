"""User-facing errors: one line that names the problem and the fix."""


class HarnessError(Exception):
    """Bad input or an unusable environment; printed as one line, exit code 2."""


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
