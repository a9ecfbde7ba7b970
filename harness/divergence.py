"""Where two runs first diverge: per-item fingerprints of every op's inputs and outputs, and
the first op whose inputs agreed and outputs did not.

A run that computes the same things in another arrangement (another batch, a prefill instead
of decode steps, another order) cannot be compared op by op as whole tensors: the tensors
hold other rows. So every op is recorded per *item* (for a model: one token of one prompt,
named by the prompt and position, never by its row in this run's batch), each side as named
*parts* (a TP partial of rank r, the expert output of slot j, ...) with the fingerprint of
their bits (ep_harness.fingerprint: order-sensitive) and the rank that held them. An op's inputs
are everything its output for that item depends on (for attention: the keys and values of
every earlier token, folded into one prefix fingerprint), so "inputs agreed, outputs did not"
pins the op itself, not something upstream of it.

    tracer = Tracer(rank)                        # on every rank, one per run
    tracer.record(op, items, "in", "x", rows)    # rows[i] belongs to items[i] (None: untracked)
    ...
    merged = merge([every rank's tracer.events]) # on rank 0
    first_divergence(merged_a, merged_b)         # -> Divergence | None

Ops are visited in `Op.order`; a coarse op (a whole layer) orders after the stages inside it,
so the finest op that diverged is named.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import asdict, dataclass

import torch

from ep_harness.fingerprint import DIGEST_BYTES, bits_fingerprint, combine


@dataclass(frozen=True)
class Op:
    """One op instance of a forward: where it sits (`order`, sortable), what it is."""

    order: tuple
    stage: str  # "attention.tp_reduce", "moe.combine", "layer", ...
    layer: int | None = None
    subject: str | None = None  # the stage subject that ran it, where it is one
    collective: bool = False

    def describe(self) -> str:
        where = f"layer {self.layer} " if self.layer is not None else ""
        return f"{where}{self.stage}" + (f" ({self.subject})" if self.subject else "")


class Tracer:
    """One rank's record of one run: {op: {item: {"in"|"out": {part: (fingerprint, rank)}}}}."""

    def __init__(self, rank: int, name=None):
        self.rank = rank
        self.name = name or (lambda key: None)  # the subject's row key -> item name, None: untracked
        self.events: dict[Op, dict[str, dict[str, dict]]] = {}
        self._chains: dict = {}

    def record(self, op: Op, items: list, side: str, part: str, rows) -> None:
        """rows: a tensor whose row i belongs to items[i], or a list of fingerprints / tensors.
        Items that are None are not tracked."""
        if not any(item is not None for item in items):
            return
        if isinstance(rows, torch.Tensor):
            rows = rows_of(rows, [item is not None for item in items])
        per_op = self.events.setdefault(op, {})
        part = sys.intern(part)  # one copy of each name in the gathered trace
        for item, row in zip(items, rows):
            if item is None:
                continue
            fp = row if isinstance(row, str) else bits_fingerprint(row)
            per_op.setdefault(item, {"in": {}, "out": {}})[side][part] = (fp, self.rank)

    def chain(self, key, rows) -> list[str]:
        """Prefix fingerprints: element i covers every row appended under `key` so far, in
        order (a sequence's keys and values up to a token). rows: tensor rows or fingerprints."""
        out = []
        for row in rows:
            fp = row if isinstance(row, str) else bits_fingerprint(row)
            self._chains[key] = combine([self._chains.get(key, ""), fp])
            out.append(self._chains[key])
        return out


def merge(per_rank: list[dict]) -> dict:
    """Every rank's events as one trace (parts are named so that ranks never collide)."""
    merged: dict = {}
    for events in per_rank:
        for op, items in events.items():
            into = merged.setdefault(op, {})
            for item, sides in items.items():
                slot = into.setdefault(item, {"in": {}, "out": {}})
                slot["in"].update(sides["in"])
                slot["out"].update(sides["out"])
    return merged


def _values(parts: dict) -> dict:
    return {name: fp for name, (fp, _) in parts.items()}


@dataclass
class Divergence:
    """The first op whose inputs agreed in both runs for some item and whose outputs did not."""

    op: str
    layer: int | None
    stage: str
    subject: str | None
    collective: bool
    items: int  # items of this op present in both runs
    same_inputs: int  # of them, with identical inputs
    diverged: int  # of those, with other output bits
    first_item: str
    parts: list[str]  # the first item's output parts that differ
    ranks: list[int]  # the ranks that produced them in the first run
    other_ranks: list[int]  # ... and in the other run

    def describe(self) -> str:
        where = "/".join(map(str, self.ranks))
        if self.other_ranks != self.ranks:
            where += f" (rank {'/'.join(map(str, self.other_ranks))} in the other run)"
        return (f"first divergence: {self.op} on rank {where}: outputs differ for {self.diverged} of the "
                f"{self.same_inputs} items whose inputs agreed ({self.items} compared; first: {self.first_item}, "
                f"{', '.join(self.parts)})")

    def to_dict(self) -> dict:
        return asdict(self)


def first_divergence(a: dict, b: dict) -> Divergence | None:
    """Walk the ops of two merged traces in order; None when no op's outputs differ on
    agreeing inputs (both runs agree everywhere, or what differs was never traced)."""
    for op in sorted(set(a) & set(b), key=lambda o: o.order):
        common = [i for i in a[op] if i in b[op]]
        same = [i for i in common if _values(a[op][i]["in"]) == _values(b[op][i]["in"])]
        differ = [i for i in same if _values(a[op][i]["out"]) != _values(b[op][i]["out"])]
        if differ:
            first = differ[0]
            out_a, out_b = a[op][first]["out"], b[op][first]["out"]
            parts = sorted(p for p in set(out_a) | set(out_b) if out_a.get(p, (None,))[0] != out_b.get(p, (None,))[0])
            ranks = [sorted({side[p][1] for p in parts if p in side}) for side in (out_a, out_b)]
            return Divergence(op.describe(), op.layer, op.stage, op.subject, op.collective, len(common), len(same),
                              len(differ), first, parts, *ranks)
    return None


def localise(traces_a: list[dict], traces_b: list[dict]) -> dict:
    """What a record's detail says: the first divergence between two runs from every rank's
    events, or that none of the traced ops diverged."""
    found = first_divergence(merge(traces_a), merge(traces_b))
    if found is None:
        return {"first_divergence": None,
                "note": "no traced op's outputs differ on agreeing inputs: the difference is outside the traced ops"}
    return {"first_divergence": found.to_dict(), "note": found.describe()}


def rows_of(t: torch.Tensor, wanted: list[bool] | None = None) -> list[str | None]:
    """bits_fingerprint(t[i]) for each row i (None where not wanted), from one transfer to the
    CPU and one byte view: the per-row cost is the digest alone (tested equal to
    ep_harness.fingerprint.bits_fingerprint row by row)."""
    cpu = t.detach().contiguous().cpu()
    if cpu.dim() == 0 or cpu.shape[0] == 0:
        return []
    header = f"{cpu.dtype}|{tuple(cpu.shape[1:])}|".encode()
    raw = cpu.reshape(cpu.shape[0], -1).view(torch.uint8).numpy()
    out = []
    for i in range(cpu.shape[0]):
        if wanted is not None and not (i < len(wanted) and wanted[i]):
            out.append(None)
            continue
        h = hashlib.blake2b(header, digest_size=DIGEST_BYTES)
        if raw.shape[1]:
            h.update(raw[i].tobytes())
        out.append(f"blake2b:{h.hexdigest()}")
    return out
