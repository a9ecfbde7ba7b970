"""NCCL's PAT reduce-scatter (NCCL >= 2.23, one rank per node): its accumulation order.

PAT (parallel aggregated trees) sends partial sums along distances 2^k: rank r sends to
r + 2^k and receives from r - 2^k. Which partial sum travels where is computed on the
device by a schedule (NCCL's `PatRSAlgorithm::getNextOp`, a `__host__ __device__` class in
src/include/collectives.h) that the worker threads execute with `patReduce`
(src/device/prims_simple.h). This module re-implements both from reading that source
(NCCL 2.28): `pat_schedule` yields the steps of one rank, and `pat_sum_trees` runs every
rank's steps over symbolic buffers to learn, for each destination, the exact binary tree
of additions that produces its output. `pat_reduce_scatter` evaluates those trees with a
rounding after every addition, as NCCL does.

The simulation follows one chunk; every element of a destination takes the same tree, so
the tree does not depend on the data, only on (world size, aggregation parameters).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

STEPS = 8  # NCCL_STEPS: slots per connection
MAX_PARALLEL = 16  # NCCL_PAT_NWORKERS / WARP_SIZE


def _log2_up(x: int) -> int:
    n = 0
    while (1 << n) < x:
        n += 1
    return n


def _mirror_invert(i: int, top: int) -> int:
    ret, mask, imask = 0, 1, top // 2
    while mask < top:
        if i & mask == 0:
            ret += imask
        mask <<= 1
        imask >>= 1
    return ret


def _first_bit(i: int, top: int) -> int:
    return (i & -i).bit_length() - 1 if i else top


def _new_peer(i: int, pow2: int) -> bool:
    return bin((i ^ (pow2 - 1)) + 1).count("1") == 1


@dataclass
class PatStep:
    recv_dim: int
    send_dim: int
    recv_offset: int
    send_offset: int
    step_offset: int
    post_recv: int
    post_send: int
    inp_rank: int  # whose data (destination rank) this step touches
    skipped: bool
    last: int


def pat_schedule(rank: int, nranks: int, agg_factor_hint: int = 1, parallel: int = MAX_PARALLEL,
                 chunks: int = 1) -> list[PatStep]:
    """The steps of one rank for `chunks` chunks (NCCL's getNextOp, one chunk per loop).

    agg_factor_hint: the aggregation factor NCCL derives from the step size over the chunk
    size (1 when a chunk fills a step); the step depth then raises it (as in the source).
    """
    nr_pow2 = 1 << _log2_up(nranks)
    agg_delta = nr_pow2
    agg = 1
    while agg < agg_factor_hint and agg < nranks // 2:
        agg *= 2
        agg_delta //= 2
    post_freq = agg
    parallel = min(parallel, post_freq)
    d = STEPS
    while d > 1 and agg < nranks // 2:
        d //= 2
        agg *= 2
        agg_delta //= 2

    st = {"phase": 0, "scale": 1, "as": agg_delta - 1, "a": 0, "send_skipped": 0, "step_offset": 0,
          "last_a": 0, "chunk": 0}

    def reset_a():
        st["a"] = 0
        st["send_skipped"] = st["step_offset"] = 0
        last_a = agg
        if st["phase"] >= 2:
            last_a //= 2 * st["scale"]
        if st["phase"] == 4:
            last_a = 1
        st["last_a"] = last_a

    def reset():
        st["phase"], st["scale"], st["as"] = 0, 1, agg_delta - 1
        reset_a()

    reset()
    steps = []
    while True:
        a, phase, last_a, scale, as_ = st["a"], st["phase"], st["last_a"], st["scale"], st["as"]
        nelem = 1
        ps = PatStep(-1, -1, -1, -1, st["step_offset"], 0, 0, rank, False, 0)
        skip = False
        if a >= last_a:
            skip = True
        elif phase == 0:
            s = _mirror_invert(a, last_a) * agg_delta + as_
            if s >= nranks:
                skip = True
            ps.inp_rank = (rank + s) % nranks
            ps.recv_dim, ps.send_dim, ps.recv_offset = -1, 0, -1
            ps.send_offset = (a % post_freq) * nelem
            ps.post_send = 1 if ((a % post_freq) + 1 >= post_freq or a == last_a - 1) else 0
            ps.post_recv = 0
        elif phase == 1:
            s = _mirror_invert(a, last_a) * agg_delta + as_
            if s >= nranks:
                skip = True
            ps.recv_dim = _first_bit(s, nr_pow2)
            ps.send_offset = (a % post_freq) * nelem
            ps.recv_offset = (a % post_freq) * nelem
            ps.post_send = 0
            boundary = (a % post_freq) + 1 >= post_freq or a == last_a - 1
            if ps.recv_dim == 0 and boundary:
                ps.post_send = 1
            ps.post_recv = 1 if boundary else 0
            s -= 1 << ps.recv_dim
            ps.inp_rank = (rank + nranks + s) % nranks
            ps.send_dim = _first_bit(s, nr_pow2) if s else -1
            if ps.send_dim == -1:
                ps.send_offset = -1
            elif as_ - (1 << ps.recv_dim) == 0:
                if _new_peer(a, agg):
                    st["send_skipped"] = a
                    ps.step_offset = st["step_offset"] = 0
                ps.send_offset = ((a - st["send_skipped"]) % post_freq) * nelem
            recv_dim = ps.recv_dim
            if s < nranks and skip:
                ps.recv_dim, ps.recv_offset, ps.post_recv = -1, -1, 0
                skip = False
            if recv_dim > 0 and ((a - st["send_skipped"]) % post_freq) + 1 >= post_freq and not skip:
                st["step_offset"] += 1
        elif phase == 2:
            s = (2 * _mirror_invert(a, last_a) + 1) * scale * agg_delta + 1
            ps.post_recv = 0
            if s >= nranks:
                skip = True
            ps.recv_dim = 0
            ps.post_send = 1 if a == last_a - 1 else 0
            s -= 1
            if s < nranks and skip:
                ps.recv_dim, ps.recv_offset = -1, -1
                skip = False
            elif not skip:
                f = a + agg - agg // scale
                ps.post_recv |= 1 if (f + 1) % post_freq == 0 else 0
                ps.recv_offset = (f % post_freq) * nelem
            ps.inp_rank = (rank + nranks + s) % nranks
            ps.send_dim = _first_bit(s, nr_pow2) if s else -1
            ps.post_send |= 1 if (a + 1) % post_freq == 0 else 0
            ps.send_offset = (a % post_freq) * nelem
        elif phase == 3:
            s = (2 * _mirror_invert(a, last_a) + 1) * scale * agg_delta
            ps.post_recv = 1 if a == last_a - 1 else 0
            if s >= nranks:
                skip = True
            ps.recv_dim = _first_bit(s, nr_pow2)
            ps.post_send = 0
            s -= 1 << ps.recv_dim
            ps.post_recv |= 1 if (a + 1) % post_freq == 0 else 0
            ps.recv_offset = (a % post_freq) * nelem
            ps.inp_rank = (rank + nranks + s) % nranks
            ps.send_dim = _first_bit(s, nr_pow2) if s else -1
            if s < nranks and skip:
                ps.recv_dim, ps.recv_offset, ps.post_recv = -1, -1, 0
                skip = False
            if _new_peer(a, agg // (2 * scale)):
                st["send_skipped"] = a
                ps.step_offset = st["step_offset"] = 0
            f = a - st["send_skipped"]
            if f % post_freq + 1 >= post_freq and not skip:
                st["step_offset"] += 1
            ps.send_offset = (f % post_freq) * nelem if ps.send_dim >= 0 else -1
        elif phase == 4:
            ps.recv_dim, ps.send_dim = 0, -1
            ps.inp_rank = rank
            ps.recv_offset = ((agg - 1) % post_freq) * nelem
            ps.send_offset, ps.post_recv, ps.post_send = -1, 1, 0
            st["chunk"] += 1
        st["a"] += 1
        if st["a"] >= last_a and st["a"] >= parallel:
            p = phase
            if p == 1:
                st["as"] -= 1
            if p == 3:
                st["scale"] *= 2
            if p == 0:
                st["phase"] = (2 if agg > 1 else 4) if st["as"] == 1 else 1
            elif p == 1:
                st["phase"] = 0 if st["as"] % 2 == 1 else 1
            elif p == 2:
                st["phase"] = 3
            elif p == 3:
                st["phase"] = 2 if st["scale"] < agg else 4
            else:
                st["phase"] = 5
            if p == 4:
                if st["chunk"] >= chunks:
                    ps.last = 2
                else:
                    reset()
            else:
                reset_a()
        elif phase == 4 and st["chunk"] >= chunks:
            ps.last = 1
        ps.skipped = skip
        steps.append(ps)
        if ps.last == 2:
            return steps


class _Conn:
    """One connection's buffer, indexed by absolute step (NCCL's FIFO never wraps here)."""

    def __init__(self, slot: int):
        self.slot = slot
        self.data: dict[int, object] = {}
        self.acc_size = 0  # sender side: NCCL's peer->accSize
        self.send_step = 0
        self.recv_step = 0
        self.posted = 0  # tail: slots the receiver may read


def pat_sum_trees(nranks: int, agg_factor_hint: int = 1, parallel: int = MAX_PARALLEL) -> list:
    """For every destination, the nested tuple of additions NCCL's PAT performs.

    A leaf is a source rank (int); a pair (a, b) is one rounded addition of two partial sums.
    """
    slot = 1 << 20  # element slots per step; any size larger than the offsets used
    scheds = [pat_schedule(r, nranks, agg_factor_hint, parallel) for r in range(nranks)]
    # (sender, dimension k) -> the connection from the sender to sender + 2^k
    send = {(r, k): _Conn(slot) for r in range(nranks) for k in range(_log2_up(nranks))}
    output: dict[int, object] = {}
    local_acc = [0] * nranks
    pc = [0] * nranks
    while any(pc[r] < len(scheds[r]) for r in range(nranks)):
        progressed = False
        for r in range(nranks):
            while pc[r] < len(scheds[r]):
                ps = scheds[r][pc[r]]
                if ps.skipped:
                    pc[r] += 1
                    continue
                recv_val = None
                if ps.recv_dim >= 0:
                    src = (r - (1 << ps.recv_dim)) % nranks
                    conn = send[(src, ps.recv_dim)]
                    if conn.posted <= conn.recv_step:
                        break  # the sender has not posted this slot yet
                    recv_val = conn.data[conn.recv_step * slot + ps.recv_offset]
                mine = ("x", r, ps.inp_rank)
                if ps.send_dim >= 0:
                    out = send[(r, ps.send_dim)]
                    pos = (out.send_step + ps.step_offset) * slot + ps.send_offset
                    base = mine if out.acc_size < pos + 1 else out.data[pos]
                else:
                    pos = ps.inp_rank  # our own output (one chunk)
                    if local_acc[r] < 1:
                        base = mine
                        local_acc[r] = 1
                    else:
                        base = output[r]
                value = base if recv_val is None else (recv_val, base)
                if ps.send_dim >= 0:
                    out.data[pos] = value
                else:
                    output[r] = value
                if ps.recv_dim >= 0 and ps.post_recv:
                    send[((r - (1 << ps.recv_dim)) % nranks, ps.recv_dim)].recv_step += 1
                if ps.send_dim >= 0:
                    # NCCL's accSize is updated by the thread that waited to send, whose copy
                    # of the step counter is the one from before this step's post.
                    out.acc_size = max(out.acc_size, ps.send_offset + 1 + (out.send_step + ps.step_offset) * slot)
                    if ps.post_send:
                        out.send_step += 1
                        out.posted = out.send_step
                pc[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"PAT simulation deadlocked at steps {pc} (nranks {nranks})")
    trees = []
    for d in range(nranks):
        trees.append(_strip(output[d], d))
    return trees


def _strip(node, dest):
    if isinstance(node, tuple) and node and node[0] == "x":
        if node[2] != dest:
            raise AssertionError(f"PAT simulation mixed destinations: {node} into {dest}")
        return node[1]
    return (_strip(node[0], dest), _strip(node[1], dest))


def _leaves(tree) -> list[int]:
    return [tree] if isinstance(tree, int) else _leaves(tree[0]) + _leaves(tree[1])


@lru_cache(maxsize=None)
def sum_trees(nranks: int) -> tuple:
    trees = tuple(pat_sum_trees(nranks))
    for d, t in enumerate(trees):
        if sorted(_leaves(t)) != list(range(nranks)):
            raise AssertionError(f"PAT tree for destination {d} does not sum every rank once: {t}")
    return trees


def evaluate(tree, parts: torch.Tensor) -> torch.Tensor:
    """parts [world_size, n]: the tree's additions, each rounded to parts.dtype."""
    if isinstance(tree, int):
        return parts[tree]
    wide = torch.float64 if parts.dtype == torch.float64 else torch.float32
    return (evaluate(tree[0], parts).to(wide) + evaluate(tree[1], parts).to(wide)).to(parts.dtype)


def pat_reduce_scatter(inputs: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Per-destination outputs of NCCL's PAT reduce-scatter; inputs [world_size, N] flat."""
    world_size = inputs.shape[0]
    trees = sum_trees(world_size)
    outs, offset = [], 0
    for dest, size in enumerate(sizes):
        outs.append(evaluate(trees[dest], inputs[:, offset:offset + size]))
        offset += size
    return outs
