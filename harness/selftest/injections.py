"""The defects `ep-harness selftest` plants, one class at a time (no torch here: the head
plans with these; harness/selftest/wrap.py applies them on the ranks).

An injection is a *defect* (what is wrong with the output), a *place* (which elements) and
a *trigger* (on which rank, call, batch or thread count it happens). Every defect is a value a kernel
could really produce: a step of one unit in the last place (the bit pattern's integer
magnitude plus one, the smallest change an order of summation makes; never an xor of
elements), NaN, +Inf, a value kept from the previous call (from its next row: another
token's, as a buffer reused across batches holds; the previous call of a selftest often
computed the same tokens in the same rows), or a write into the input.

A call is one call of the subject's output-producing method within one check (the
collective's reduce_scatter, the GEMM's run, quantize, the dispatcher's combine, or its
dispatch for `reference`, which compares the dispatched rows, the MoE layer's forward),
counted from 0 on each rank; the harness makes one call per compared run (CUDA-graph
warm-ups, whose output the replay overwrites, are not counted).

Places: `element` is one element of the output (flat index `element`); `column` is one
element of every output row, so that whichever row a check compares (its probe may sit in
any row) carries it; `all` is every element (another summation order moves many); `row` is
every element of one row (row `element`, or for `rare` a row drawn per call). Which
element of each row a `column` defect takes is `element` when given; otherwise the selftest
plants it once at each spot of SPOTS (the first, middle and last element of every row, and a
seeded element that differs from row to row), each its own injected check, and a check must
catch all of them: one that compares a subset of each row is `blind` (issue 32).

`rare` fires on about 1 call in `threshold` (50), on one rank: call c's draw is seeded by c
alone, so every rank agrees on whether call c fires, on which rank and in which row, without
talking (DeepEP #700's defect class: one wrong row on a few percent of calls).

Parameters can be changed on the command line: `--injections ulp:call=1:rank=2,nan`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ep_harness.errors import HarnessError

DEFECTS = ("ulp", "nan", "inf", "stale", "write-input")
PLACES = ("element", "column", "all", "row")
SPOTS = ("first", "middle", "last", "seeded")  # where in each row a `column` defect lands (harness/selftest/wrap.py)
WHEN = ("always", "rows-above", "bytes-above", "in-graph", "rare", "threads-above")


@dataclass(frozen=True)
class Injection:
    name: str
    defect: str  # one of DEFECTS
    place: str  # one of PLACES
    summary: str
    rank: int | None = None  # only on this rank (None: every rank)
    call: int | None = None  # only on this call of the check (None: every call)
    element: int | None = None  # the element (place=element; None: 0) or of each row (place=column; None: `at`)
    at: str | None = None  # place=column without an element: one of SPOTS (None: every spot, see placements)
    when: str = "always"  # one of WHEN
    threshold: int | None = None  # rows-above / bytes-above: the size to exceed (None: the check's first call);
    # rare: 1 call in `threshold`
    gpu_only: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Injection:
        return cls(**d)

    @property
    def label(self) -> str:
        """The name of one placement: `ulp.middle` for a spot, the class name otherwise."""
        return f"{self.name}.{self.at}" if self.at else self.name

    def placements(self) -> list[Injection]:
        """The injections the selftest plants for this class: a `column` defect with no
        element given, once at every spot; anything else as it is."""
        if self.place != "column" or self.element is not None or self.at is not None:
            return [self]
        return [replace(self, at=spot) for spot in SPOTS]

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("rank", "call", "element", "at", "threshold")
                 if getattr(self, k) is not None]
        if self.place == "column" and self.element is None and self.at is None:
            parts.append(f"at={'|'.join(SPOTS)}")
        return f"{self.name} ({self.summary}{'; ' + ', '.join(parts) if parts else ''})"


CLASSES: dict[str, Injection] = {i.name: i for i in (
    Injection("ulp", "ulp", "column", "1 ULP at one element of every row, on one call", call=0),
    Injection("nan", "nan", "element", "one output element set to NaN, on one rank", rank=0),
    Injection("inf", "inf", "element", "one output element set to +Inf, on one rank", rank=0),
    Injection("order-above-size", "ulp", "all",
              "another summation order (1 ULP on every element) once the message exceeds a size",
              when="bytes-above"),
    Injection("kth-call", "ulp", "all", "another summation order (1 ULP on every element) on the k-th call only",
              call=2),
    # Rank 0: it holds a copy of the probe in every family's rank-invariance layout (with
    # uneven shards the last ranks may own no row at all).
    Injection("one-rank", "ulp", "all", "1 ULP on every element on one rank only", rank=0),
    Injection("in-graph", "ulp", "all", "1 ULP on every element only during CUDA-graph capture",
              when="in-graph", gpu_only=True),
    Injection("batch-above", "ulp", "all", "1 ULP on every element for batches above a size", when="rows-above"),
    Injection("more-threads", "ulp", "all", "another summation order (1 ULP on every element) when the call runs on "
              "more intra-op threads than its launch pinned", when="threads-above"),
    Injection("out-of-slice", "write-input", "all",
              "a write outside the output: 1 ULP on every input element outside this rank's output slice"),
    Injection("rare", "ulp", "row", "1 ULP on every element of one row of one rank's output, on about 1 call "
              "in 50 (seeded per call)", when="rare", threshold=50),
    Injection("stale", "stale", "column",
              "one element of every row keeps the previous call's value from the next row, another "
              "token's (the previous call of the same subject on this rank, of any check, with rows "
              "of the same width and dtype)"),
)}


def parse(text: str | None) -> list[Injection]:
    """`ulp,nan` or `ulp:call=1:rank=2,stale` -> injections; None or empty: every class."""
    if not text:
        return list(CLASSES.values())
    out = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        name, *settings = item.split(":")
        if name not in CLASSES:
            raise HarnessError(f"unknown injection {name!r}; known: {', '.join(CLASSES)}")
        changes = {}
        numeric = {"rank", "call", "element", "threshold"}
        for setting in settings:
            key, sep, value = setting.partition("=")
            if sep and key == "at":
                if value not in SPOTS or CLASSES[name].place != "column":
                    raise HarnessError(f"injection {item!r}: at={value!r} is not one of {', '.join(SPOTS)}"
                                       + ("" if CLASSES[name].place == "column" else
                                          f" (and {name} is not planted in every row)"))
                changes["at"] = value
                continue
            if not sep or key not in numeric:
                raise HarnessError(f"injection {item!r}: {setting!r} is not one of "
                                   f"{', '.join(sorted(numeric))} = N or at={'|'.join(SPOTS)} (e.g. ulp:call=1:rank=2)")
            try:
                changes[key] = None if value in ("any", "none") else int(value)
            except ValueError:
                raise HarnessError(f"injection {item!r}: {key}={value!r} is not a number (or `any`)") from None
            if changes[key] is not None and changes[key] < 0:
                raise HarnessError(f"injection {item!r}: {key} must be >= 0")
        out.append(replace(CLASSES[name], **changes))
    names = [i.name for i in out]
    if len(set(names)) != len(names):
        raise HarnessError(f"--injections names a class twice ({', '.join(names)}); give each once")
    return out

