"""Written the way a user of the pytest plugin would write it: my own reduce-scatter,
checked for rank invariance with `ep_world` and `assert_invariant` (no harness internals)."""
import pytest
import torch
import torch.distributed as dist

from harness.pytest_plugin import assert_invariant

HIDDEN = 1024


def my_reduce_scatter(x: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """A TP reduce-scatter as an inference engine might write it."""
    world = dist.get_world_size()
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    if not deterministic:
        dist.reduce_scatter_tensor(out, x)
        return out
    gathered = x.new_empty((world * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(gathered, x)
    mine = gathered.view(world, *x.shape)[:, dist.get_rank() * out.shape[0]:(dist.get_rank() + 1) * out.shape[0]]
    acc = mine[0].float()
    for r in range(1, world):
        acc = (acc + mine[r].float()).to(x.dtype).float()
    return acc.to(x.dtype)


def probe_on_every_rank(rank, world_size, deterministic):
    """The same token placed so that it lands on every destination; rank 0 compares."""
    g = torch.Generator().manual_seed(1000 + rank)  # this rank's partial sum of the token
    token = (torch.randn(HIDDEN, generator=g) * torch.exp2(torch.randint(-8, 9, (HIDDEN,), generator=g))).bfloat16()
    out = my_reduce_scatter(token.repeat(world_size, 1), deterministic)
    copies = [torch.empty_like(out) for _ in range(world_size)]
    dist.all_gather(copies, out.contiguous())
    if rank == 0:
        assert_invariant([c[0] for c in copies], [f"rank {d}" for d in range(world_size)])
    return True


def test_deterministic_reduce_scatter_is_rank_invariant(ep_world):
    assert ep_world(4).run(probe_on_every_rank, True) == [True] * 4


def test_native_reduce_scatter_fails_with_the_mismatch_text(ep_world):
    with pytest.raises(AssertionError) as err:
        ep_world(4).run(probe_on_every_rank, False)
    text = str(err.value)
    assert text.startswith("Tensor-likes are not equal!")
    assert "Mismatched elements: " in text and " / 4096 (" in text
    assert "First mismatch: index (" in text


@pytest.mark.gpus(4)
def test_gpus_marker_skips_with_the_reason():
    assert torch.cuda.device_count() >= 4
