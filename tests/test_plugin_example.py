"""Written the way a user of the pytest plugin would write it: my own reduce-scatter,
checked for rank invariance with `ep_world` and `assert_invariant` (no harness internals)."""
import pytest
import torch
import torch.distributed as dist

from ep_harness.pytest_plugin import assert_bitwise_equal, assert_invariant

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


def raise_on_rank2(rank, world_size):
    if rank == 2:
        raise ValueError("planted on rank 2")
    return rank


def hang_on_rank1(rank, world_size):
    import time

    while rank == 1:
        time.sleep(0.2)
    return rank


def test_a_failing_rank_is_named_with_its_remote_traceback(ep_world):
    from ep_harness.pytest_plugin import RankFailed

    with pytest.raises(RankFailed) as err:
        ep_world(4).run(raise_on_rank2)
    text = str(err.value)
    assert text.startswith("rank 2 raised ValueError: planted on rank 2")
    assert "remote traceback" in text and "in raise_on_rank2" in text


def test_a_hung_rank_fails_within_its_timeout_with_every_stack(ep_world):
    with pytest.raises(pytest.fail.Exception) as err:
        ep_world(3, timeout_s=4).run(hang_on_rank1)
    text = str(err.value)
    assert "did not finish within 4 s" in text and "--- rank 1 ---" in text and "hang_on_rank1" in text


def test_closures_are_refused_in_one_line(ep_world):
    factor = 2
    with pytest.raises(TypeError, match="pass a module-level function"):
        ep_world(2).run(lambda rank, world_size: rank * factor)


def test_no_silent_change_of_backend(ep_world):
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has 4 GPUs: NCCL is available")
    with pytest.raises(pytest.skip.Exception, match="needs 4 GPUs for 4 NCCL ranks, found"):
        ep_world(4, backend="nccl")


def test_shape_and_dtype_mismatches_are_assertion_errors():
    a = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="attribute 'dtype' do not match"):
        assert_bitwise_equal(a, a[0].float())
    with pytest.raises(AssertionError, match="attribute 'shape' do not match"):
        assert_bitwise_equal(a, torch.zeros(3, dtype=torch.bfloat16))
