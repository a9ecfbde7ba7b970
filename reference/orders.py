"""Accumulation-order models: the exact bits a software collective produces.

A model names, for every element, the sequence of ranks whose contributions are added,
and rounds to the wire dtype after every hop (one `+` on the wire is one rounding; a
float32 add rounded to bf16/fp16 gives the same bits as a native bf16/fp16 add, since
float32 has at least 2p+2 bits of precision for those formats).

Models (all take `inputs` [world_size, N] flat, one row per rank):

* `nccl_ring_reduce_scatter`: chunk d ends on rank d and starts at its ring successor:
  out[d] = ((x[s1] + x[s2]) + ...) + x[d], s1 = next(d), s2 = next(s1), ...
* `nccl_ring_all_reduce`: the same walk per chunk, but chunks are cut from loops of
  world_size * chunk_elems elements, so an element's order depends on its offset and on N.
* `nccl_ring_all_reduce_channels`: NCCL's ring all-reduce as it runs: the message split
  over channels (`ep_harness.reference.nccl_plan`), each channel's part reduced around its own ring
  in its own loops and chunks.
* `tree_chain_all_reduce`: single-node NCCL tree, a chain; the leaf is added first and
  the root last, identically for every element.
* `nccl_tree_all_reduce`: NCCL's tree all-reduce over any trees (one per channel, as NCCL
  logs them; across nodes a double binary tree), with NCCL's split of the message over
  channels (`nccl_channel_split`): an element's order is its channel's tree.
* `ep_harness.reference.nccl_pat.pat_reduce_scatter`: NCCL's PAT reduce-scatter (one rank per node).
* `gloo_ring_all_reduce`: gloo's ring; chunk c (2 segments per rank) is summed
  x[c-1], x[c-2], ..., x[c] (descending), so the order depends on the element's offset.
* `chain_fold`: a fixed, explicit order for every element (the deterministic folds).

Layout-size orders (inputs [V, N]: V fixed TP shards of one logical tensor, W ranks holding
V / W consecutive shards each):

* `block_partials`: each rank's fp32 sum of its shards in ascending order, rounded once (a
  GEMM over the rank's K slice); the [W, N] partials the collective then reduces.
* `balanced_tree`: adjacent pairs added level by level, rounded after every add; the rank's
  block of V / W shards (both powers of two) is one of its subtrees, whatever W is.
"""
from __future__ import annotations

import torch


def fold(inputs: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Sum contributions in a per-element rank order, rounding after every hop.

    inputs: [world_size, N]; order: [world_size, N] long, order[j, e] is the rank added at
    hop j for element e (hop 0 is the starting value). Returns [N] in inputs.dtype.
    """
    if order.shape != inputs.shape:
        raise ValueError(f"order shape {tuple(order.shape)} != inputs shape {tuple(inputs.shape)}")
    return _fold_rows(torch.gather(inputs, 0, order))


def _fold_rows(rows) -> torch.Tensor:
    """rows[0] + rows[1] + ... (a [hops, N] tensor or a list of [N] rows), each add in float32
    (float64 for float64) rounded to the dtype. Whole rows at a time: torch rounds a float32
    NaN to fp16 with other bits in its vector loop than in its scalar tail, so adding range by
    range would move the tails and NaN's bits."""
    acc = rows[0].clone()
    wide = torch.float64 if acc.dtype == torch.float64 else torch.float32
    for row in rows[1:]:
        acc = (acc.to(wide) + row.to(wide)).to(acc.dtype)
    return acc


def ring_walk(ring: list[int], end: int) -> list[int]:
    """Ranks in the order they add to the chunk that ends on `end`: successor first."""
    k = ring.index(end)
    n = len(ring)
    return [ring[(k + 1 + j) % n] for j in range(n)]


def _check(inputs: torch.Tensor, ring: list[int] | None) -> list[int]:
    world_size = inputs.shape[0]
    ring = list(range(world_size)) if ring is None else list(ring)
    if sorted(ring) != list(range(world_size)):
        raise ValueError(f"ring {ring} is not a permutation of range({world_size})")
    return ring


def nccl_ring_reduce_scatter(
    inputs: torch.Tensor, sizes: list[int], ring: list[int] | None = None
) -> list[torch.Tensor]:
    """Per-destination outputs of NCCL's ring reduce-scatter(v).

    inputs: [world_size, N] flat; sizes: elements per destination (sum N).
    """
    ring = _check(inputs, ring)
    outs, offset = [], 0
    for dest, size in enumerate(sizes):
        outs.append(chain_fold(inputs[:, offset:offset + size], ring_walk(ring, dest)))
        offset += size
    return outs


def nccl_ring_chunk_of(n: int, world_size: int, chunk_elems: int, align_elems: int) -> torch.Tensor:
    """Chunk (ring index) that finalises each element of an N-element ring all-reduce.

    Full loops are world_size * chunk_elems elements; in the tail loop NCCL shrinks the
    chunk to alignUp(divUp(remaining, world_size), align_elems).
    """
    chunk = torch.empty(n, dtype=torch.long)
    loop = world_size * chunk_elems
    start = 0
    while start < n:
        remaining = n - start
        size = chunk_elems
        if remaining < loop:
            per = -(-remaining // world_size)
            size = -(-per // align_elems) * align_elems
        end = min(n, start + world_size * size)
        idx = torch.arange(end - start)
        chunk[start:end] = torch.clamp(idx // size, max=world_size - 1)
        start = end
    return chunk


def nccl_ring_all_reduce(
    inputs: torch.Tensor,
    chunk_elems: int,
    ring: list[int] | None = None,
    align_elems: int | None = None,
) -> torch.Tensor:
    """Output of NCCL's ring all-reduce (identical on every rank); inputs [world_size, N]."""
    ring = _check(inputs, ring)
    world_size, n = inputs.shape
    align = align_elems or max(1, 16 // inputs.element_size())
    return fold_ranges(inputs, [(start, end, ring_walk(ring, ring[k]))
                                for start, end, k in nccl_ring_chunks(n, world_size, chunk_elems, align)])


def nccl_ring_all_reduce_channels(inputs: torch.Tensor, channel_rings: list[list[int]],
                                  channel_counts: list[int], chunk_elems: int) -> torch.Tensor:
    """Output of NCCL's ring all-reduce (identical on every rank); inputs [world_size, N].

    Channel c reduces its contiguous part (channel_counts[c] elements, from
    `ep_harness.reference.nccl_plan.channel_counts`) around channel_rings[c] in loops of
    world_size * chunk_elems elements; the tail loop's chunk is alignUp(divUp(rest, W), 16 B)
    (src/device/all_reduce.h runRing: chunk k of a loop starts at ring index k + 1 and is
    finalised at ring index k).
    """
    if sum(channel_counts) != inputs.shape[1]:
        raise ValueError(f"channel counts {channel_counts} do not add up to {inputs.shape[1]} elements")
    world_size = inputs.shape[0]
    align = max(1, 16 // inputs.element_size())
    out = torch.empty(inputs.shape[1], dtype=inputs.dtype)
    offset = 0
    for channel, count in enumerate(channel_counts):
        ring = _check(inputs, channel_rings[channel])
        for start, end, k in nccl_ring_chunks(count, world_size, chunk_elems, align):
            part = inputs[:, offset + start:offset + end]
            out[offset + start:offset + end] = chain_fold(part, ring_walk(ring, ring[k]))
        offset += count
    return out


def nccl_ring_chunks(n: int, world_size: int, chunk_elems: int, align_elems: int) -> list[tuple[int, int, int]]:
    """(start, end, k) of every non-empty chunk of an N-element ring all-reduce: elements
    [start, end) are finalised at ring index k (the same cut as `nccl_ring_chunk_of`)."""
    out, start, loop = [], 0, world_size * chunk_elems
    while start < n:
        remaining = n - start
        size = chunk_elems if remaining >= loop else -(-(-(-remaining // world_size)) // align_elems) * align_elems
        for k in range(world_size):
            lo, hi = start + k * size, min(n, start + (k + 1) * size)
            if lo < hi:
                out.append((lo, hi, k))
        start = min(n, start + world_size * size)
    return out


def tree_chain_all_reduce(inputs: torch.Tensor, chain: list[int] | None = None) -> torch.Tensor:
    """Single-node NCCL tree all-reduce: chain[0] is the root, chain[-1] the leaf.

    Sum = ((x[chain[-1]] + x[chain[-2]]) + ...) + x[chain[0]], the same for every element.
    """
    chain = _check(inputs, chain)
    return chain_fold(inputs, list(reversed(chain)))


def nccl_channel_split(count: int, element_size: int, traffic_per_byte: int, comm_channels: int,
                       max_threads: int, thread_threshold: int) -> list[int]:
    """Elements per channel (channels 0, 1, ...) of one Simple-protocol collective alone in
    its plan: NCCL first lowers the channel count for small messages, then deals the message
    out in cells (`ep_harness.reference.nccl_plan`, which also covers LL and LL128). traffic_per_byte:
    2 for all-reduce, W for reduce-scatter and all-gather.
    """
    from ep_harness.reference import nccl_plan

    allowed = nccl_plan.max_channels(count * element_size, comm_channels, max_threads, thread_threshold)
    return nccl_plan.channel_counts(count, element_size, traffic_per_byte, "Simple", comm_channels, allowed)


def nccl_tree_all_reduce(inputs: torch.Tensor, channel_trees: list[dict[int, tuple[list[int], int]]],
                         channel_counts: list[int]) -> torch.Tensor:
    """Output of NCCL's tree all-reduce (identical on every rank); inputs [world_size, N].

    channel_trees[c][rank] = (down, up): rank's children in order and its parent (-1 at the
    root), as NCCL_DEBUG=INFO prints them ("Trees [c] d0/d1/d2->rank->up"). Every node adds
    its children's partial sums to its own input in `down` order, rounding after each add
    (src/device/all_reduce.h runTreeSplit; the root finalises and broadcasts its bits).
    channel_counts: elements per channel, from `nccl_channel_split`.
    """
    if sum(channel_counts) != inputs.shape[1]:
        raise ValueError(f"channel counts {channel_counts} do not add up to {inputs.shape[1]} elements")
    wide = torch.float64 if inputs.dtype == torch.float64 else torch.float32
    pieces, offset = [], 0
    for channel, count in enumerate(channel_counts):
        tree = channel_trees[channel % len(channel_trees)]
        part = inputs[:, offset:offset + count]

        def subtree(rank: int) -> torch.Tensor:
            acc = part[rank]
            for child in tree[rank][0]:
                acc = (acc.to(wide) + subtree(child).to(wide)).to(inputs.dtype)
            return acc

        roots = [r for r, (_, up) in tree.items() if up == -1]
        if len(roots) != 1 or sorted(tree) != list(range(inputs.shape[0])):
            raise ValueError(f"channel {channel}: not one tree over every rank ({tree})")
        pieces.append(subtree(roots[0]))
        offset += count
    return torch.cat(pieces)


def chain_fold(inputs: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Every element summed in the same explicit rank order (order[0] first): `fold` with that
    order in every column, the same bits, without its [world_size, N] index and gather."""
    _check(inputs, order)
    return _fold_rows([inputs[rank] for rank in order])


def fold_ranges(inputs: torch.Tensor, pieces) -> torch.Tensor:
    """`fold` for an order that is one walk per contiguous range of elements: `pieces` are
    (start, end, walk), together covering [0, N) once. Every model whose order changes only
    at chunk or channel boundaries is one. Each range's rows are copied in walk order into one
    [world_size, N] buffer, then added as whole rows (`fold`'s bits, NaN's too), without
    `fold`'s [world_size, N] index of 8 bytes an element and its gather."""
    n = inputs.shape[1]
    ordered = torch.empty(inputs.shape, dtype=inputs.dtype)
    covered = torch.zeros(n, dtype=torch.bool)
    for start, end, walk in pieces:
        _check(inputs, walk)
        if not 0 <= start <= end <= n or covered[start:end].any():
            raise ValueError(f"range [{start}, {end}) is outside [0, {n}) or overlaps another")
        for hop, rank in enumerate(walk):  # row slices: plain copies, no index tensor
            ordered[hop, start:end] = inputs[rank, start:end]
        covered[start:end] = True
    if not covered.all():
        raise ValueError(f"the ranges leave {int((~covered).sum())} of {n} elements out")
    return _fold_rows(ordered)


def gloo_segments(n: int, world_size: int, max_segment_elems: int | None = None) -> int:
    """Elements per chunk of gloo's ring all-reduce (a chunk is segments-per-rank segments)."""
    by_size = 1 if max_segment_elems is None else -(-n // max_segment_elems)
    num_segments = -(-max(by_size, 2 * world_size) // world_size) * world_size
    segment = -(-n // num_segments)
    return segment * (num_segments // world_size)


def gloo_ring_all_reduce(inputs: torch.Tensor, max_segment_elems: int | None = None) -> torch.Tensor:
    """Output of gloo's ring all-reduce for inputs [world_size, N].

    Chunk c (elements [c*L, (c+1)*L)) starts at rank c-1 and walks down: x[c-1], x[c-2],
    ..., x[c]; L = segments-per-rank * ceil(N / num_segments).
    """
    world_size, n = inputs.shape
    chunk_len = gloo_segments(n, world_size, max_segment_elems)
    ends = [min(n, (c + 1) * chunk_len) for c in range(world_size - 1)] + [n]  # the last chunk takes the rest
    starts = [0] + ends[:-1]
    return fold_ranges(inputs, [(lo, hi, [(c - 1 - j) % world_size for j in range(world_size)])
                                for c, (lo, hi) in enumerate(zip(starts, ends)) if lo < hi])


def order_sensitive(inputs: torch.Tensor) -> torch.Tensor:
    """Elements whose sum changes bits under some rotation of the ring.

    inputs: [world_size, N]. Returns a bool [N] mask: True where at least two of the
    world_size cyclic summation orders disagree. A check whose compared elements are all
    False here cannot observe a reordering (e.g. world_size 2, where a + b == b + a).
    """
    world_size, n = inputs.shape
    first = chain_fold(inputs, list(range(world_size)))
    sensitive = torch.zeros(n, dtype=torch.bool)
    for shift in range(1, world_size):
        order = [(shift + j) % world_size for j in range(world_size)]
        other = chain_fold(inputs, order)
        sensitive |= first.view(_int_view(first.dtype)) != other.view(_int_view(other.dtype))
    return sensitive


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty(0, dtype=dtype).element_size()]


def block_partials(inputs: torch.Tensor, world_size: int) -> torch.Tensor:
    """[V, N] -> [world_size, N]: rank r's shards r*V/W .. (r+1)*V/W - 1 summed in float32 in
    that order and rounded once to inputs.dtype (one GEMM's fp32 accumulator over its slice)."""
    shards = inputs.shape[0]
    if shards % world_size:
        raise ValueError(f"{shards} shards do not split over {world_size} ranks")
    per = shards // world_size
    wide = torch.float64 if inputs.dtype == torch.float64 else torch.float32
    out = []
    for r in range(world_size):
        acc = inputs[r * per].to(wide)
        for s in range(r * per + 1, (r + 1) * per):
            acc = acc + inputs[s].to(wide)
        out.append(acc.to(inputs.dtype))
    return torch.stack(out)


def balanced_tree(inputs: torch.Tensor) -> torch.Tensor:
    """[n, ...] -> [...]: ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) ..., each add in
    float32 (float64 for float64) rounded to inputs.dtype; n a power of two."""
    n = inputs.shape[0]
    if n < 1 or n & (n - 1):
        raise ValueError(f"a balanced tree needs a power-of-two number of leaves, got {n}")
    wide = torch.float64 if inputs.dtype == torch.float64 else torch.float32
    level = inputs
    while level.shape[0] > 1:
        level = (level[0::2].to(wide) + level[1::2].to(wide)).to(inputs.dtype)
    return level[0].clone()
