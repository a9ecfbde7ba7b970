"""On the ranks: a subject wrapped so that its output carries one injected defect.

harness/run/worker.py calls `wrapped(subject, injection, check, ctx)` for a check whose job entry
says `inject` (only `ep-harness selftest` sends one): the real subject runs first, then the
wrapper changes its output (or input) as harness/selftest/injections.py describes. Every
other attribute (the order model, unavailable, layouts, ...) is the real subject's. The
wrapper is the family's own (its Family.selftest_wrapper, beside its module): a subclass of
`Wrapped` that calls the real method and hands its output, and the input a stray write
would land in, to `_inject`; a family without one has no injected cells.

Each call whose defect changed at least one bit is logged to
$EP_HARNESS_JOB_DIR/injections-rank<R>.jsonl, so that the head can tell a check that missed
an injection from one the injection never reached (a check with fewer calls than `call`,
a batch never above the size, a value that happened to be right already). During CUDA-graph
capture nothing may synchronise, so such calls are logged with `changed: -1` (unknown).
"""
from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import torch

from ep_harness import threads
from ep_harness.families.driver import SENTINEL_BITS, still_sentinel
from ep_harness.selftest.injections import Injection

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_previous: dict[tuple, torch.Tensor] = {}  # the stale defect's memory: (subject, dtype, width) -> last true output
# A stale element takes the previous call's value one row further on: another token's. The
# previous call of a selftest launch often computed the same tokens in the same rows (the
# check's other runs, or another case on the same seed: moe-sigmoid's layer on moe's tokens,
# its output within the MoE bound of moe's), where the kept value is right or within rounding
# of right; in a serving engine the previous call was another batch, laid out otherwise.
STALE_ROW_SHIFT = 1


def _finite(t: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(t.float() if t.element_size() == 1 else t)  # FP8 has no isfinite


def step_ulp(t: torch.Tensor) -> None:
    """In place: every finite element one unit in the last place away from zero (its bit
    pattern's magnitude plus one), or towards zero where that would overflow to infinity."""
    bits = t.view(_INT[t.element_size()])
    up = bits + 1  # two's complement: for a negative float this also grows the magnitude
    new = torch.where(_finite(up.view(t.dtype)), up, bits - 1)
    bits.copy_(torch.where(_finite(t), new, bits))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, t.shape[-1]) if t.dim() else t.view(1, 1)


_SEED = 0x5EED  # the seeded spot: a fixed mix of the row index, so that a rerun plants the same elements


def rare_draw(call: int, one_in: int, world: int) -> tuple[bool, int, float]:
    """The `rare` injection's draw for call `call`, the same on every rank: whether it fires
    (probability 1 / one_in), on which rank, and where among the rows (a fraction)."""
    r = random.Random(f"ep-harness rare injection, call {call}")
    return r.random() < 1.0 / one_in, r.randrange(world), r.random()


def _columns(inj: Injection, rows: int, width: int, device) -> torch.Tensor:
    """The element of each row a `column` defect takes (`element`, or the spot `at`); torch
    arithmetic on the device, so that it is safe during CUDA-graph capture."""
    r = torch.arange(rows, device=device, dtype=torch.int64)
    if inj.element is not None:
        return torch.full_like(r, inj.element % width)
    if inj.at == "seeded":  # a multiplicative hash (Knuth's): a different element in neighbouring rows
        return ((r + _SEED) * 2654435761 % 2**32) % width
    return torch.full_like(r, {"first": 0, "middle": width // 2, "last": width - 1}[inj.at or "first"])


def _region(out: torch.Tensor, inj: Injection, row_draw: float = 0.0) -> torch.Tensor | None:
    """The flat indices of `out` the defect changes (None: every element, or none can be).
    `row_draw`: for `rare`, where in [0, 1) of the rows this call's row lies."""
    if out.numel() == 0 or not out.is_contiguous():
        return None
    if inj.place == "element":
        return torch.tensor([(inj.element or 0) % out.numel()], device=out.device)
    rows = _rows(out)
    if inj.place == "row":
        row = int(row_draw * rows.shape[0]) if inj.when == "rare" else (inj.element or 0) % rows.shape[0]
        return torch.arange(rows.shape[1], device=out.device) + row * rows.shape[1]
    return torch.arange(rows.shape[0], device=out.device) * rows.shape[1] + \
        _columns(inj, rows.shape[0], rows.shape[1], out.device)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _graph_warm_up(out: torch.Tensor) -> bool:
    """A call harness/graphs.py makes on its side stream before capturing: its output is
    overwritten by the replay, so it is neither counted as a call nor changed."""
    return out.is_cuda and not _capturing() and torch.cuda.current_stream(out.device) != \
        torch.cuda.default_stream(out.device)


class Wrapped:
    """Delegates everything to the real subject; a family's subclass (its
    Family.selftest_wrapper) wraps the method whose output its checks compare."""

    def __init__(self, subject, injection: Injection, check, ctx=None):
        self._subject, self._inj, self._check, self._property = subject, injection, check.id, check.property
        # the rank and world size the check runs on (its group's: a one-rank check dealt to
        # rank 2 of a launch is rank 0 of 1, as in a launch of its own), else the launch's
        self._rank = ctx.rank if ctx is not None else int(os.environ.get("RANK", "0"))
        self._world = ctx.world_size if ctx is not None else int(os.environ.get("WORLD_SIZE", "1"))
        self._calls = 0
        self._first: tuple[int, int] | None = None  # rows and bytes of the check's first output
        self._row_draw = 0.0  # rare: where in [0, 1) of the rows the call's defect lands
        self._log = Path(os.environ.get("EP_HARNESS_JOB_DIR", ".")) / f"injections-rank{os.environ.get('RANK', '0')}.jsonl"

    def __getattr__(self, name):
        return getattr(self._subject, name)

    def _fires(self, call: int, out: torch.Tensor) -> bool:
        inj = self._inj
        rows, size = (out.numel() // out.shape[-1] if out.dim() and out.shape[-1] else out.numel()), out.nbytes
        if self._first is None:
            self._first = (rows, size)
        if inj.rank is not None and self._rank != inj.rank:
            return False
        if inj.call is not None and call != inj.call:
            return False
        if inj.when == "in-graph":
            return _capturing()
        if inj.when == "rare":
            fires, rank, self._row_draw = rare_draw(call, inj.threshold or 50, self._world)
            return fires and (inj.rank is not None or rank == self._rank)
        if inj.when == "rows-above":
            return rows > (self._first[0] if inj.threshold is None else inj.threshold)
        if inj.when == "bytes-above":
            return size > (self._first[1] if inj.threshold is None else inj.threshold)
        if inj.when == "threads-above":
            return torch.get_num_threads() > threads.of_env(os.environ)
        return True

    def _inject(self, out: torch.Tensor, inp: torch.Tensor | None = None, slice_rows: tuple[int, int] | None = None):
        """The defect, after the real call wrote `out`. `inp` and `slice_rows` (this rank's
        rows of the input, if it has such a slice) are for the write outside the output."""
        if _graph_warm_up(out):
            return
        call, self._calls = self._calls, self._calls + 1
        inj = self._inj
        key = (self._subject.name, out.dtype, out.shape[-1] if out.dim() else 0)
        previous = _previous.get(key)
        capturing = _capturing()
        if inj.defect == "stale" and not capturing and out.numel() and out.is_contiguous():
            _previous[key] = out.detach().clone()  # what this call computed: the next call's stale value
        if not self._fires(call, out):
            return
        if inj.defect == "write-input":
            self._change(self._outside(inp, slice_rows), call, capturing, previous)
        elif inj.place == "all":
            self._change([out] if out.numel() and out.is_contiguous() else [], call, capturing, previous)
        else:
            index = _region(out, inj, self._row_draw)
            if index is None:
                return
            flat = out.view(-1).view(_INT[out.element_size()])  # bit patterns: FP8 has no index_select
            values = flat.index_select(0, index)  # a copy: changed, then put back
            self._change([values.view(out.dtype)], call, capturing, previous, index)
            flat.index_copy_(0, index, values)

    def _change(self, targets, call, capturing, previous, index=None):
        """The defect on each target, in place; logged when a bit changed. `index`: the flat
        indices of the output the one target was taken from (for the stale value)."""
        inj = self._inj
        targets = [t for t in targets if t is not None and t.numel()]
        if not targets or (inj.defect == "stale" and (previous is None or capturing)):
            return
        before = None if capturing else [t.clone() for t in targets]
        for target in targets:
            if inj.defect in ("ulp", "write-input"):
                step_ulp(target)
            elif inj.defect == "nan":
                target.fill_(math.nan)
            elif inj.defect == "inf":
                target.fill_(math.inf)
            elif inj.defect == "stale":  # the same element of the previous call's next row (rows wrap round)
                old = _rows(previous)
                width = old.shape[1]
                rows = (torch.div(index, width, rounding_mode="floor") + STALE_ROW_SHIFT) % old.shape[0]
                bits = old.reshape(-1).view(_INT[old.element_size()])
                taken = bits.index_select(0, rows * width + index % width)
                if old.dtype in SENTINEL_BITS:  # padding the previous call never had to write: nothing kept
                    taken = torch.where(still_sentinel(taken.view(old.dtype)), target.view(bits.dtype), taken)
                target.view(bits.dtype).copy_(taken)
        changed = -1 if before is None else sum(_differ(b, t) for b, t in zip(before, targets))
        if changed:
            with open(self._log, "a") as f:
                f.write(json.dumps({"check": self._check, "rank": self._rank, "call": call,
                                    "changed": changed}) + "\n")

    @staticmethod
    def _outside(inp: torch.Tensor | None, slice_rows: tuple[int, int] | None) -> list[torch.Tensor]:
        """The input rows this rank's output does not come from (all of them without a
        slice), as views, so that the write lands in the caller's tensor."""
        if inp is None or not inp.is_floating_point() or not inp.is_contiguous() or inp.numel() == 0:
            return []
        if slice_rows is None:
            return [inp]
        rows = _rows(inp)
        return [rows[:slice_rows[0]], rows[slice_rows[1]:]]


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(_INT[a.element_size()]) != b.view(_INT[b.element_size()])).sum())


def wrapped(subject, injection: dict, check, ctx=None):
    """`subject` with the injection (as the job carries it, Injection.to_json) applied for
    one ep_harness.check.Check (its id names the check in the log; its property says, for a
    dispatcher, which output the property compares) on the check's RankContext `ctx`."""
    from ep_harness import families  # the registry imports the family modules, which import this one

    return families.get(subject.family).selftest_wrapper(subject, Injection.from_json(injection), check, ctx)
