"""What every GEMM subject checks before it runs: layout and dtype support."""
from __future__ import annotations

from ep_harness.params import GemmParams


def unsupported(subject, params: GemmParams) -> str | None:
    if params.layout not in subject.layouts:
        return f"{subject.name} has no {params.layout} layout (it has {', '.join(subject.layouts)})"
    if params.dtype not in subject.dtypes:
        return f"{subject.name} does not take {params.dtype} operands (it takes {', '.join(subject.dtypes)})"
    return None
