"""What every GEMM subject checks before it runs: layout and dtype support."""
from __future__ import annotations


def unsupported(subject, params: dict) -> str | None:
    layout = params.get("layout", subject.layouts[0])
    if layout not in subject.layouts:
        return f"{subject.name} has no {layout} layout (it has {', '.join(subject.layouts)})"
    dtype = params.get("dtype")
    if dtype not in subject.dtypes:
        return f"{subject.name} does not take {dtype} operands (it takes {', '.join(subject.dtypes)})"
    return None
