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


def _per_element_order(pieces, world: int, n: int) -> torch.Tensor:
    """The [world, n] order `fold` takes, spelled element by element from (start, end, walk)."""
    order = torch.full((world, n), -1, dtype=torch.long)
    for start, end, walk in pieces:
        order[:, start:end] = torch.tensor(walk).unsqueeze(1)
    assert (order >= 0).all()
    return order


@settings(max_examples=60, deadline=None)
@given(world=st.integers(2, 6), n=st.integers(0, 300), chunk=st.integers(1, 40), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       kind=st.sampled_from(["spread", "nonfinite", "subnormal"]), data=st.data())
def test_range_wise_models_give_the_bits_of_the_per_element_fold(world, n, chunk, seed, dtype, kind, data):
    """The ring models fold each chunk with one walk (fold_ranges); the general `fold`, given
    every element's rank order, must give the same bits on order-sensitive data, NaN's too
    (torch gives a float32 NaN other fp16 bits in its vector loop than in its scalar tail)."""
    from ep_harness import inputs as gen

    x = gen.values((world, n), dtype, seed, "ranges", data=kind)
    ring = data.draw(st.permutations(list(range(world))))
    align = max(1, 16 // x.element_size())
    walks = [(s, e, orders.ring_walk(ring, ring[k])) for s, e, k in orders.nccl_ring_chunks(n, world, chunk, align)]
    want = orders.fold(x, _per_element_order(walks, world, n))
    got = orders.nccl_ring_all_reduce(x, chunk_elems=chunk, ring=ring)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    length = orders.gloo_segments(n, world)
    gloo = [(c * length, n if c == world - 1 else min(n, (c + 1) * length), [(c - 1 - j) % world for j in range(world)])
            for c in range(world) if c * length < n]
    want = orders.fold(x, _per_element_order(gloo, world, n))
    assert torch.equal(orders.gloo_ring_all_reduce(x).view(torch.uint8), want.view(torch.uint8))


def test_range_wise_folds_differ_where_the_walks_do():
    """Control: the same ranges folded with the walks rotated by one rank change bits on the
    same kind of data, so the equality above compares orders, not only sums."""
    from ep_harness import inputs as gen

    x = gen.values((4, 512), torch.bfloat16, 7, "ranges")
    pieces = [(0, 256, [3, 2, 1, 0]), (256, 512, [0, 3, 2, 1])]
    rotated = [(s, e, walk[1:] + walk[:1]) for s, e, walk in pieces]
    assert torch.equal(orders.fold_ranges(x, pieces), orders.fold(x, _per_element_order(pieces, 4, 512)))
    assert not torch.equal(orders.fold_ranges(x, pieces).view(torch.int16),
                           orders.fold_ranges(x, rotated).view(torch.int16))
    with pytest.raises(ValueError, match="leave 256 of 512 elements out"):
        orders.fold_ranges(x, pieces[:1])
    with pytest.raises(ValueError, match=r"range \[128, 512\) is outside \[0, 512\) or overlaps another"):
        orders.fold_ranges(x, [pieces[0], (128, 512, [0, 1, 2, 3])])


def test_fp16_nan_bits_of_the_ring_models_are_those_of_whole_rows():
    """The case that once broke range-wise folding: fp16 data with NaN, world size 3, small
    chunks, so that many chunks end inside torch's vector loop."""
    from ep_harness import inputs as gen

    x = gen.values((3, 4099), torch.float16, 1, "nan-ranges", data="nonfinite")
    assert x.isnan().any()
    align = 8
    pieces = [(s, e, orders.ring_walk([0, 1, 2], k)) for s, e, k in orders.nccl_ring_chunks(4099, 3, 5, align)]
    want = orders.fold(x, _per_element_order(pieces, 3, 4099))
    got = orders.nccl_ring_all_reduce(x, chunk_elems=5)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def _probe_bits(model, p, dtype, world: int, layout, inputs) -> torch.Tensor:
    """The probe rows `model` predicts from `inputs(p, dtype, world, layout)`, as bits."""
    x = inputs(p, dtype, world, layout)
    outs = model.predict(x.reshape(world, -1), [s * p.hidden for s in layout.sizes], None)
    rows = []
    for row in layout.probes:
        dest, local = layout.owner(row)
        rows.append(outs[dest].view(-1, p.hidden)[local])
    return torch.stack(rows).view(torch.uint8)


def _gloo_models():
    from ep_harness import subject as registry
    from ep_harness.subject import order_model_of

    registry.import_built_in()
    return {s.name: order_model_of(s, "gloo") for s in registry.load_all().values() if s.family == "collective"}


def _distinct_elementwise_models() -> list[str]:
    """A subject per distinct elementwise model function (the first by name): the tests'
    planted collectives reuse all_gather_fold's, and which of them are registered depends on
    what the session imported before collecting this file."""
    first: dict = {}
    for name, model in sorted(_gloo_models().items()):
        if model is not None and model.elementwise:
            first.setdefault(model.predict, name)
    return sorted(first.values())


def _predicts_the_same_from_the_probe_rows(model, world: int, prop: str, dtype_name: str) -> bool:
    from ep_harness.families import collective
    from ep_harness.check import typed_params
    from ep_harness.subject import get

    p = typed_params("collective", {"dtype": dtype_name, "world_size": world, "hidden": 136, "seed": 11},
                     get("all_gather_fold"), "t")
    dtype = getattr(torch, dtype_name)
    return all(torch.equal(_probe_bits(model, p, dtype, world, layout, collective.all_inputs),
                           _probe_bits(model, p, dtype, world, layout, collective.probe_rows))
               for layout in collective.layouts(prop, p, world))


@pytest.mark.parametrize("name", _distinct_elementwise_models())
def test_an_elementwise_model_predicts_the_probe_from_its_rows_alone(name):
    """A model that says it is elementwise is given the probe's rows alone (the rest zero) when
    rank 0 predicts a check: on every layout the probe's bits must be those predicted from
    every rank's whole input."""
    for world, prop, dtype in ((4, "batch-invariance", "bfloat16"), (4, "position-invariance", "float16"),
                               (4, "size-invariance", "bfloat16"), (8, "rank-invariance", "float32")):
        assert _predicts_the_same_from_the_probe_rows(_gloo_models()[name], world, prop, dtype), (name, world, prop)


def test_a_model_that_reads_other_elements_is_caught_by_the_probe_rows_check():
    """Control: an all-reduce whose per-block scale reads the filler rows (quantized on the
    wire) predicts other probe bits from the probe rows alone, so the check above can fail."""
    from ep_harness.subject import OrderModel
    from ep_harness.subjects.collective.common import per_destination

    def block_scaled(x, sizes, nccl):
        blocks = x.float().view(x.shape[0], -1, 16)  # 136-element rows: blocks straddle rows
        scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 7
        wire = (blocks / scale).round() * scale  # 4-bit codes per block of 16
        return per_destination(orders.chain_fold(wire.view(x.shape[0], -1).to(x.dtype), list(range(x.shape[0]))),
                               sizes)

    model = OrderModel("block-scaled fold", block_scaled, exact=True, elementwise=True)
    assert not _predicts_the_same_from_the_probe_rows(model, 4, "batch-invariance", "bfloat16")
