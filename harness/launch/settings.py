"""The harness's own environment variables that tune it (timeouts and on/off switches), read
in one place: a malformed value is one HarnessError naming the variable, what it takes and how
to go back to the default, when a command starts rather than a traceback from wherever the
value is first used. (EP_HARNESS_PRECOMPILE_WORKERS is read by the precompile step, which
says the same of it.)"""
from __future__ import annotations

import math
import os

from ep_harness.errors import HarnessError

SECONDS = {  # name: (default, what it limits)
    "EP_HARNESS_START_TIMEOUT_S": (180.0, "how long ranks may take to start, and other nodes to join"),
    "EP_HARNESS_NODE_TIMEOUT_S": (6.0, "how long a node launcher may be silent before it is taken as gone"),
    "EP_HARNESS_PRECOMPILE_WAIT_S": (900.0, "how long the checks wait for the DeepGEMM compile; "
                                            "EP_HARNESS_PRECOMPILE=0 compiles in the checks instead"),
}
SWITCHES = {  # name: what 0 turns off
    "EP_HARNESS_PIN_RANKS": "CPU ranks placed on cores",
    "EP_HARNESS_AGENT_FORKS": "torchrun agents forked from the command",
    "EP_HARNESS_PRECOMPILE": "DeepGEMM kernels compiled beside the launch",
}


def positive_seconds(text: str) -> float | None:
    """`text` as a finite positive number of seconds, or None (0, NaN and infinity included:
    a limit that ends everything at once, or never)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < math.inf else None


def seconds(name: str) -> float:
    default, what = SECONDS[name]
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    limit = positive_seconds(value)
    if limit is None:
        raise HarnessError(f"{name}={value!r} needs a positive number of seconds ({what}); "
                           f"unset it for {default:g} s")
    return limit


def switch_on(name: str) -> bool:
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise HarnessError(f"{name}={value!r} takes 0 (off: no {SWITCHES[name]}) or 1 (on); unset it for on")
    return value != "0"


def check_all() -> None:
    """Every variable above read once: the first malformed one is the command's error."""
    for name in SECONDS:
        seconds(name)
    for name in SWITCHES:
        switch_on(name)
