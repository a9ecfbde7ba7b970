"""The tile tuner's choices and table on any machine (its measurements need a GPU), the
L2-cold rotation, and the batch_invariant_ops subject's availability."""
from __future__ import annotations

import json

import pytest

from ep_harness.cost import timing, tune_bi_matmul as tune
from ep_harness.families.gemm import GemmParams
from ep_harness.kernels import bi_matmul as kernel
from ep_harness.subject import Platform, load_all

H200 = Platform("nccl", "cuda", 1, "NVIDIA H200", (9, 0), gpus=1)
CPU = Platform("gloo", "cpu", 1)


def _point(m, warm, cold):
    return {"m": m, "warm": {n: {"time_vs_baseline": r} for n, r in warm.items()},
            "cold": {n: {"time_vs_baseline": r} for n, r in cold.items()}}


def test_the_choice_is_the_smallest_worse_ratio_of_warm_and_cold():
    point = _point(1, {"a": 0.90, "b": 1.02}, {"a": 1.30, "b": 1.03})  # a: fast warm, slow cold
    assert tune.choose(point, ["a", "b"]) == "b"
    assert tune.choose(point, ["a"]) == "a"  # only bit-identical names are offered


def test_table_buckets_merge_equal_neighbours_and_the_last_covers_every_m(tmp_path):
    small, large = tune.CANDIDATES["small"][0], tune.CANDIDATES["large"][0]
    tiles = {tune.name_of(small): small, tune.name_of(large): large}
    points = [dict(m=m, chosen=tune.name_of(cfg)) for m, cfg in ((1, small), (16, small), (1024, large), (8192, large))]
    entries = tune.table_entries(points, tiles)
    assert [e["max_m"] for e in entries] == [16, None]
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"shapes": {"4096x4096": entries}}))
    loaded = kernel.tuned_tiles(path)[(4096, 4096)]
    assert loaded == ((16, kernel.TilePlan(small)), (None, kernel.TilePlan(large)))


def test_candidates_share_the_reference_k_walk_at_the_tuned_shapes_and_names_are_unique():
    names = [tune.name_of(c) for group in tune.CANDIDATES.values() for c in group]
    assert len(set(names)) == len(tune.all_candidates())
    for n, k in tune.SHAPES:
        for cfg in tune.all_candidates().values():
            assert k % cfg.block_k == 0 and kernel.k_walk(cfg, k) == kernel.k_walk(kernel.REFERENCE_TILES, k)


def test_rows_past_the_whole_waves_go_to_the_tail_tiles():
    big, small = kernel.TileConfig(128, 256, 64, 8, 8, 3, True), kernel.TileConfig(128, 128, 64, 8, 4, 5, True)
    plan = kernel.TilePlan(big, small)
    # M = 2048, N = 7168: 16 x 28 = 448 tiles of 128 x 256 = 3 waves of 132 (396 tiles = 14 tile rows) + 52
    assert kernel.row_slices(2048, 7168, plan, 132) == [(0, 1792, big), (1792, 2048, small)]
    assert kernel.row_slices(100, 7168, plan, 132) == [(0, 100, big)]  # less than a wave: one launch
    assert kernel.row_slices(2048, 7168, kernel.TilePlan(big), 132) == [(0, 2048, big)]  # no tail
    assert kernel.row_slices(1792, 7168, plan, 132) == [(0, 1792, big)]  # 2.97 waves: the last nearly full
    assert kernel.row_slices(4224, 7168, plan, 132) == [(0, 4224, big)]  # 924 tiles: 7 whole waves


def test_a_candidate_is_identical_only_with_no_mismatch_and_no_error():
    assert tune.identical({"mismatched": {1: 0, 100: 0}})
    assert not tune.identical({"mismatched": {1: 0, 100: 3}})
    assert not tune.identical({"error": "CompilationError: out of shared memory"})


def test_the_committed_table_loads_and_is_used_for_its_shapes():
    table = kernel.tuned_tiles()
    assert set(table) == set(tune.SHAPES)
    for (n, k), buckets in table.items():
        for max_m, plan in buckets:
            assert kernel.tile_plan(max_m or 8192, n, k, "bfloat16") == plan


def test_the_tuner_refuses_a_machine_without_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal is for machines without one")
    assert tune.main(["--out", "x"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_rotation_takes_sets_in_turn_and_counts_copies_past_l2():
    rotation = timing.Rotation(["a", "b", "c"])
    assert [rotation.take() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    l2 = 60 * 2 ** 20
    assert timing.Rotation.copies(32 * 2 ** 20, l2) == 6  # 4096 x 4096 bf16 weights: 6 x 32 MiB >= 3 x 60 MiB
    assert timing.Rotation.copies(2 * 2 ** 30, l2) == 2  # never fewer than two: one set is L2-warm
    with pytest.raises(ValueError, match="at least one operand set"):
        timing.Rotation([])


def test_batch_invariant_ops_subject_says_why_it_cannot_run(monkeypatch):
    from ep_harness.subjects.gemm import batch_invariant_ops as bio

    subject = load_all()["batch_invariant_ops_matmul"]
    dense = GemmParams(layout="dense", dtype="bfloat16")
    assert "needs a CUDA GPU" in subject.unavailable(CPU, dense)
    assert "no contiguous layout" in subject.unavailable(H200, GemmParams(layout="contiguous", dtype="bfloat16"))

    def missing():
        raise ImportError("No module named 'batch_invariant_ops'")
    monkeypatch.setattr(bio, "library", missing)
    reason = subject.unavailable(H200, dense)
    assert "cannot be imported" in reason and "thinking-machines-lab/batch_invariant_ops" in reason
