"""Where the probe sits in each collective property's calls."""

from ep_harness.families.collective import layouts
from ep_harness.families.collective import CollectiveParams


def params(**kw):
    return CollectiveParams(dtype="bfloat16", **kw)


def test_batch_invariance_probe_moves_between_destinations():
    runs = layouts("batch-invariance", params(batch_sizes=[1, 2, 3, 8]), 4)
    owners = [run.owner(run.probes[0]) for run in runs]
    assert owners == [(3, 0), (1, 1), (1, 0), (0, 3)]


def test_batch_invariance_probe_fits_unsorted_batches():
    # Found by `ep-harness explore`: the probe row came from the first batch size, not the
    # smallest, and fell outside smaller batches.
    runs = layouts("batch-invariance", params(batch_sizes=[8, 1, 3]), 4)
    assert all(run.probes[0] < run.rows for run in runs)


def test_rank_invariance_puts_the_probe_on_every_non_empty_shard():
    run = layouts("rank-invariance", params(shards="uneven"), 4)[0]
    assert run.sizes == (2, 8, 4, 0)
    assert [run.owner(r)[0] for r in run.probes] == [0, 1, 2]


def test_size_invariance_grows_the_message_around_a_fixed_probe():
    runs = layouts("size-invariance", params(hidden=1024, message_bytes=[8192, 1 << 20]), 4)
    assert [run.rows * 1024 * 2 for run in runs] == [8192, 1 << 20]
    assert all(run.owner(run.probes[0]) == (0, 0) for run in runs)
