"""What every GEMM subject checks before it runs: layout and dtype support."""
from __future__ import annotations


def unsupported(subject, params) -> str | None:
    """Why `subject` cannot take a check's GEMM parameters (the gemm family's), or None."""
    if params.layout not in subject.layouts:
        return f"{subject.name} has no {params.layout} layout (it has {', '.join(subject.layouts)})"
    if params.dtype not in subject.dtypes:
        return f"{subject.name} does not take {params.dtype} operands (it takes {', '.join(subject.dtypes)})"
    return None


def each_expert(problem, out, product) -> None:
    """`product(a_rows, b, out_rows)` for the whole dense problem, or once per expert with
    rows (contiguous: its segment of `a`; masked: its first `count` rows), empty experts left
    out: the walk every per-expert GEMM subject shares."""
    if problem.layout == "dense":
        product(problem.a, problem.b, out)
        return
    for g, count in enumerate(problem.counts):
        if count == 0:
            continue
        if problem.layout == "contiguous":
            s = problem.starts[g]
            product(problem.a[s:s + count], problem.b[g], out[s:s + count])
        else:
            product(problem.a[g, :count], problem.b[g], out[g, :count])
