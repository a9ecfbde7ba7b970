"""Whole lines on the terminal while more than one thread of the head prints (the DeepGEMM
compile's progress beside the launches' records): print() writes a line and its end
separately, so another thread's line could land between them."""
from __future__ import annotations

import sys
import threading

_LOCK = threading.Lock()


def line(text: str, stream=None) -> None:
    """`text` and its newline in one write, flushed, never inside another thread's line."""
    stream = stream if stream is not None else sys.stdout  # looked up now: tests replace sys.stdout
    with _LOCK:
        stream.write(text + "\n")
        stream.flush()
