"""Order models against hand-computed orders on small exact inputs.

bf16 has 8 significand bits, so at 1.0 one ULP is 2^-7 and 1 + 2^-8 is a tie that rounds
to 1. With x = (1, h, h), h = 2^-8: (h + h) + 1 = 1 + 2^-7 but (1 + h) + h = 1. Which of
the two an element gets tells which order the model used.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_harness.reference import orders
from ep_harness.reference.collectives import reduce_scatter, shard_offsets

H = 2.0 ** -8
BIG = 1.0 + 2.0 ** -7  # (h + h) + 1
SMALL = 1.0  # 1 first, then h, then h


def ranks(*values, n=1, dtype=torch.bfloat16):
    return torch.tensor([[v] * n for v in values], dtype=torch.float64).to(dtype)


def test_fold_rounds_after_every_hop():
    x = ranks(1.0, H, H)
    assert orders.chain_fold(x, [1, 2, 0]).item() == BIG
    assert orders.chain_fold(x, [0, 1, 2]).item() == SMALL
    assert orders.chain_fold(x.double(), [0, 1, 2]).item() == 1.0 + 2 * H  # float64: exact


def test_nccl_ring_reduce_scatter_starts_at_successor():
    # Chunk d ends on d: d=0 sums x1, x2, x0 -> BIG; d=1 sums x2, x0, x1 -> SMALL; d=2: x0, x1, x2.
    x = ranks(1.0, H, H, n=3)
    outs = orders.nccl_ring_reduce_scatter(x, [1, 1, 1])
    assert [o.item() for o in outs] == [BIG, SMALL, SMALL]


def test_nccl_ring_follows_the_ring_not_the_rank_numbers():
    x = ranks(1.0, H, H, n=3)
    # Ring 0 -> 2 -> 1: chunk 0 sums x2, x1, x0 -> BIG; chunk 2 sums x1, x0, x2 -> SMALL.
    outs = orders.nccl_ring_reduce_scatter(x, [1, 1, 1], ring=[0, 2, 1])
    assert [o.item() for o in outs] == [BIG, SMALL, SMALL]
    assert orders.ring_walk([0, 2, 1], 2) == [1, 0, 2]


def test_gloo_ring_sums_downwards_per_chunk():
    # N=6, W=3: 2 segments per rank of 1 element -> chunk length 2: elements 0-1 chunk 0, ...
    # Chunk c sums x[c-1], x[c-2], ..., x[c]: c=0: x2, x1, x0 -> BIG; c=1: x0, x2, x1; c=2: x1, x0, x2.
    x = ranks(1.0, H, H, n=6)
    assert orders.gloo_segments(6, 3) == 2
    assert orders.gloo_ring_all_reduce(x).tolist() == [BIG, BIG, SMALL, SMALL, SMALL, SMALL]


def test_gloo_chunks_cover_uneven_sizes():
    # N=7, W=3: 6 segments of ceil(7/6)=2 elements, 2 per rank -> chunk length 4; chunk 1 = 4..6.
    assert orders.gloo_segments(7, 3) == 4
    x = ranks(1.0, H, H, n=7)
    assert orders.gloo_ring_all_reduce(x).tolist() == [BIG] * 4 + [SMALL] * 3


def test_tree_chain_adds_the_leaf_first():
    x = ranks(1.0, H, H, n=4)
    assert orders.tree_chain_all_reduce(x, [0, 1, 2]).tolist() == [BIG] * 4  # x2 + x1, then x0
    assert orders.tree_chain_all_reduce(x, [1, 2, 0]).tolist() == [SMALL] * 4  # x0 + x2, then x1


def test_nccl_ring_all_reduce_chunking_with_tail():
    # W=3, 2-element chunks: a full loop is 6 elements -> chunks 0,0,1,1,2,2; the 2-element
    # tail gets ceil(2/3)=1-element chunks -> 0,1.
    assert orders.nccl_ring_chunk_of(8, 3, 2, 1).tolist() == [0, 0, 1, 1, 2, 2, 0, 1]
    x = ranks(1.0, H, H, n=8)
    got = orders.nccl_ring_all_reduce(x, chunk_elems=2, align_elems=1).tolist()
    assert got == [BIG, BIG, SMALL, SMALL, SMALL, SMALL, BIG, SMALL]


def test_order_sensitivity_needs_three_ranks():
    assert not orders.order_sensitive(ranks(1.0, H, n=5)).any()  # a + b == b + a
    assert orders.order_sensitive(ranks(1.0, H, H, n=5)).all()
    assert not orders.order_sensitive(ranks(1.0, 2.0, 4.0, n=5)).any()  # exact sums


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(2, 6),
    n=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_every_model_is_exact_on_small_integers(world, n, seed, data):
    """Integer contributions add exactly in any order, so every model equals float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (world, n), generator=g).to(torch.bfloat16)
    exact = x.double().sum(0)
    ring = data.draw(st.permutations(list(range(world))))
    assert torch.equal(orders.gloo_ring_all_reduce(x).double(), exact)
    assert torch.equal(orders.tree_chain_all_reduce(x, ring).double(), exact)
    assert torch.equal(orders.nccl_ring_all_reduce(x, chunk_elems=3, ring=ring).double(), exact)
    sizes = data.draw(st.lists(st.integers(0, n), min_size=world, max_size=world))
    sizes[-1] = n - sum(sizes[:-1]) if sum(sizes[:-1]) <= n else 0
    if sum(sizes) == n:
        outs = orders.nccl_ring_reduce_scatter(x, sizes, ring)
        ref = reduce_scatter(x.unsqueeze(-1), sizes)
        for o, r in zip(outs, ref):
            assert torch.equal(o.double(), r.squeeze(-1))


def test_reference_reduce_scatterv_handles_empty_shards():
    x = torch.arange(3 * 6, dtype=torch.float32).reshape(3, 6, 1)
    outs = reduce_scatter(x, [1, 0, 5])
    assert [o.shape[0] for o in outs] == [1, 0, 5]
    assert outs[0].item() == 0 + 6 + 12
    assert shard_offsets([1, 0, 5]) == [0, 1, 1]
    with pytest.raises(ValueError, match="summing to 6"):
        reduce_scatter(x, [1, 1, 1])
