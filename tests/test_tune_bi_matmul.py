"""The tile tuner's choices and table on any machine (its measurements need a GPU), the
L2-cold rotation, and the batch_invariant_ops subject's availability."""
from __future__ import annotations

import collections
import json
from dataclasses import asdict, replace

import pytest

from ep_harness.cost import bench_gemm_cost, timing, tune_bi_matmul as tune
from ep_harness.families.gemm import GemmParams
from ep_harness.kernels import bi_matmul as kernel, library_route
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
    configs = {c for group in tune.CANDIDATES.values() for c in group}  # a config may sit in two groups
    assert len({tune.name_of(c) for c in configs}) == len(configs)  # no name stands for two configs
    for k_splits in tune.SPLITS:
        split = {walked for group in tune.split_candidates(7168, k_splits).values() for walked in group.values()}
        assert len({tune.name_of(c) for c in split}) == len(split)
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


def test_one_launch_plans_are_offered_where_rows_split_and_kept_in_the_table(tmp_path):
    names = {tune.name_of(c) for group in tune.CANDIDATES.values() for c in group}
    plans = tune.plans_at(2048, 7168, names, 132)
    one = {name: plan for name, plan in plans.items() if plan.one_launch}
    assert one and len(one) < len(plans)  # beside the two-launch plans
    assert all(kernel.plan_problem(plan) is None and "+one-launch-tail:" in name for name, plan in one.items())
    assert tune.plans_at(1792, 7168, names, 132) == {}  # 2.97 waves: no plan splits the rows
    # not offered where its main tiles are not bit-identical
    main = tune.name_of(next(iter(one.values())).main)
    assert not any(p.one_launch and tune.name_of(p.main) == main
                   for p in tune.plans_at(2048, 7168, names - {main}, 132).values())
    name, plan = next(iter(one.items()))
    entries = tune.table_entries([dict(m=2048, chosen=name)], {name: plan})
    assert entries == [{"max_m": None, "config": asdict(plan.main), "tail": asdict(plan.tail), "one_launch": True}]
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"shapes": {"7168x7168": entries}}))
    assert kernel.tuned_tiles(path)[(7168, 7168)] == ((None, plan),)


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


def test_a_shape_to_tune_is_n_x_k(capsys):
    assert tune.parse_shape("2048x7168") == (2048, 7168)
    for bad in ("2048", "2048x", "x7168", "0x7168", "2048*7168"):
        with pytest.raises(SystemExit) as exit_info:
            tune.main(["--out", "x", "--shape", bad])
        assert exit_info.value.code == 2
        assert "write it as 2048x7168" in capsys.readouterr().err


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


def test_split_candidates_cut_k_into_whole_segments_and_keep_their_walk():
    for n, k in tune.SHAPES:
        unsplit = set(tune.split_candidates(k, 1)["small"])
        for k_splits in tune.SPLITS:
            groups = tune.split_candidates(k, k_splits)
            assert groups["small"] and not unsplit & set(groups["small"])  # names say the split
            for group, configs in groups.items():
                for cfg in configs.values():
                    assert kernel.tile_problem(cfg, k) is None
                    assert kernel.k_walk(cfg, k) == kernel.k_walk(kernel.walk_reference(k_splits), k)
                    if group != "mid":  # small: few tiles, a program per segment; large: one per tile
                        assert cfg.split_parallel == (group == "small")
                    assert kernel.stages_that_fit(cfg) == cfg.num_stages  # side-by-side segments' stages fit
    big = kernel.TileConfig(128, 256, 64, 8, 8, 4, True, k_splits=2)  # 2 x 48 KiB a stage beside a 64 KiB tile
    assert kernel.stages_that_fit(big) == 1 and kernel.stages_that_fit(kernel.REFERENCE_TILES) == 5
    assert tune.name_of(replace(big, num_stages=1)) not in tune.split_candidates(7168, 2)["large"]  # does not pipeline
    # 7168 is not 4 segments of 512-deep steps: those tiles are left out at 4, kept at 2
    assert any(c.block_k == 512 for c in tune.split_candidates(7168, 2)["small"].values())
    assert not any(c.block_k == 512 for c in tune.split_candidates(7168, 4)["small"].values())


def test_a_split_count_is_tried_where_small_m_miss_and_chosen_by_the_worst_m():
    def walk(ratios):
        return [dict(_point(m, {"t": r}, {"t": r}), chosen="t") for m, r in ratios.items()]
    unsplit = walk({1: 1.30, 256: 1.00, 2048: 1.04})  # M = 1 at 1.30 / 1.10
    assert tune.score(unsplit) == pytest.approx(1.30 / 1.10)
    assert tune.misses_where_splits_help(unsplit)
    assert not tune.misses_where_splits_help(walk({1: 1.05, 256: 1.10, 2048: 1.20}))  # only a large M misses
    split = walk({1: 1.02, 256: 1.08, 2048: 1.06})  # worst: M = 2048 at 1.06 / 1.05
    assert tune.score(split) == pytest.approx(1.06 / 1.05) and tune.score(split) < tune.score(unsplit)
    assert [tune.target(m) for m in (1, 64, 65, 256, 512, 1024, 8192)] == [1.10, 1.10, 1.15, 1.15, 1.15, 1.05, 1.05]


def test_the_tuners_run_chooses_a_split_count_per_shape_and_writes_a_loadable_table(tmp_path, monkeypatch, capsys):
    """The tuner's bookkeeping with the GPU parts replaced (bits all identical, timings made
    up): the unsplit walk misses at M = 1 on the thin shape, K in 2 segments meets every
    target there, and the table it writes loads with one split count for every M."""
    import torch

    pytest.importorskip("triton")

    class FakeShape:
        def __init__(self, n, k, m_max, seed):
            self.n, self.k, self.a_all, self.b, self.unavailable, self.rivals = n, k, None, None, {}, {}
            self.device = None

    def fake_bits(a_all, b, candidates, reference, products=None):
        return {name: {"mismatched": {1: 0}, "elements": {1: 1}} for name in candidates} | \
            {"K rotated (control)": {"mismatched": {1: 5}, "elements": {1: 1}}}

    def fake_time(shape, m, tiles, repeats, warmup):
        def ratio(name):  # thin N at small M: only the split walk keeps up with cuBLAS
            cfg = tiles[name] if isinstance(tiles[name], kernel.TileConfig) else tiles[name].main
            slow = shape.n == 2048 and m <= 64 and cfg.k_splits == 1
            return (1.4 if slow else 1.0) + cfg.block_m / 1e4  # the smallest tile wins ties
        state = {name: {"median_ms": ratio(name), "time_vs_baseline": ratio(name)} for name in tiles}
        state["torch_mm"] = {"median_ms": 1.0, "time_vs_baseline": 1.0}
        redone = {"hold_ms": 8.0 if m == 1 else 2.0, "rounds_redone": 2 if m == 1 else 0}
        return {"m": m, "warm": state, "cold": state, "timing": {"warm": redone, "cold": redone}}

    monkeypatch.setattr(tune, "Shape", FakeShape)
    monkeypatch.setattr(tune, "bit_check", fake_bits)
    monkeypatch.setattr(tune, "time_point", fake_time)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: type("P", (), {"multi_processor_count": 132}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    result = tune.run(tmp_path, 1, 0, 0, shapes=((2048, 7168), (4096, 4096)))
    chosen = {(s["n"], s["k"]): s["chosen_k_splits"] for s in result["shapes"]}
    assert chosen == {(2048, 7168): 2, (4096, 4096): 1}
    said = capsys.readouterr().out.splitlines()  # a point's redone rounds are on its line, and only there
    redone = [line for line in said if "round(s) redone" in line]
    assert redone and all("M=    1:" in line and line.endswith("warm: 2 round(s) redone, hold 8 ms; cold: 2 round(s) "
                                                                "redone, hold 8 ms") for line in redone), said
    assert [w["k_splits"] for w in result["shapes"][1]["walks"]] == [1]  # no miss: no split tried
    table = kernel.tuned_tiles(tmp_path / "bi_matmul_tiles.json")
    assert {plan.main.k_splits for _, plan in table[(2048, 7168)]} == {2}
    assert any(plan.main.split_parallel for _, plan in table[(2048, 7168)])  # small M: a program per segment
    assert {plan.main.k_splits for _, plan in table[(4096, 4096)]} == {1}
    assert table[(7168, 7168)] == kernel.tuned_tiles()[(7168, 7168)]  # not tuned here: kept from the table in use


@pytest.mark.parametrize("library_mismatches, at_m, routed_m", [(0, {}, {256, 2048}), (3, {}, set()),
                                                                  (0, {256: 5}, {2048}), (0, {2048: "RuntimeError: x"}, {256})])
def test_an_m_goes_to_the_library_only_where_it_is_faster_and_bit_identical(tmp_path, monkeypatch, library_mismatches,
                                                                             at_m, routed_m):
    """The library route's bookkeeping with the GPU parts replaced: DeepGEMM (timed as its rival
    subject) beats every tile at M = 256 and 2,048 only. Bit-identical, those M route to it with
    that M's best tiles kept as the fallback, the others keep their tiles, and the table loads;
    with 3 mismatching elements at the bit check's M it is never routed, however fast, and an M
    where its own output differs (or the call raises) keeps its tiles."""
    import torch

    pytest.importorskip("triton")

    class FakeShape:
        def __init__(self, n, k, m_max, seed):
            self.n, self.k, self.a_all, self.b, self.unavailable, self.device = n, k, None, None, {}, None
            self.rivals = {tune.LIBRARY_RIVAL: object()}

    seen = {}

    def fake_bits(a_all, b, candidates, reference, products=None):
        seen["products"] = sorted(products or {})
        return {name: {"mismatched": {1: 0}, "elements": {1: 1}} for name in candidates} | \
            {name: {"mismatched": {1: 0, 100: library_mismatches}, "elements": {1: 1}} for name in products or {}}

    def fake_time(shape, m, tiles, repeats, warmup):
        def ratio(name):
            cfg = tiles[name] if isinstance(tiles[name], kernel.TileConfig) else tiles[name].main
            return 1.08 + cfg.block_m / 1e4
        state = {name: {"median_ms": ratio(name), "time_vs_baseline": ratio(name)} for name in tiles}
        state["torch_mm"] = {"median_ms": 1.0, "time_vs_baseline": 1.0}
        fast = m in (256, 2048)
        state[tune.LIBRARY_RIVAL] = {"median_ms": 0.5 if fast else 2.0, "time_vs_baseline": 0.5 if fast else 2.0}
        return {"m": m, "warm": state, "cold": state, "timing": {}}

    monkeypatch.setattr(tune, "Shape", FakeShape)
    monkeypatch.setattr(tune, "bit_check", fake_bits)
    monkeypatch.setattr(tune, "time_point", fake_time)
    checked = []

    def fake_library_mismatches(shape, m, product):
        checked.append(m)
        return at_m.get(m, 0)
    monkeypatch.setattr(tune, "library_mismatches", fake_library_mismatches)
    monkeypatch.setattr(library_route, "library_gemm", lambda name, device: (lambda a, b, out: None))
    monkeypatch.setattr(library_route, "installed_version", lambda name: "9.9")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: type("P", (), {"multi_processor_count": 132}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    result = tune.run(tmp_path, 1, 0, 0, shapes=((4096, 4096),))
    assert seen["products"] == [tune.LIBRARY_CHECK]  # DeepGEMM's output is bit-checked with the candidates
    [walk] = result["shapes"][0]["walks"]
    assert walk["library_routable"] is (library_mismatches == 0)
    chosen = {p["m"]: p["chosen"] for p in walk["points"]}
    routed = {m for m, name in chosen.items() if name.startswith("deepgemm, else ")}
    assert routed == routed_m, chosen
    # each M where it was faster was compared at that M, and only those
    assert checked == ([256, 2048] if library_mismatches == 0 else [])
    assert walk.get("library_bits", {}) == {f"M={m}": at_m.get(m, 0) for m in checked}
    written = json.loads((tmp_path / "bi_matmul_tiles.json").read_text())
    # the version the routes were measured with, for library_route.usable (other shapes: the table in use's)
    assert written.get("libraries") == ({"deepgemm": "9.9"} if routed else None)
    table = kernel.tuned_tiles(tmp_path / "bi_matmul_tiles.json")[(4096, 4096)]
    for m in tune.M_VALUES:
        plan = next(plan for max_m, plan in table if max_m is None or m <= max_m)
        assert plan.library == ("deepgemm" if m in routed else ""), (m, plan)
        assert kernel.plan_problem(plan) is None and plan.main.k_splits == 1
        if m in routed:  # the fallback is the M's best tiles, the name after "else"
            assert tune.name_of(plan.main) == chosen[m].removeprefix("deepgemm, else ")


def test_a_library_route_needs_the_unsplit_walk_and_a_known_library():
    split = replace(kernel.walk_reference(2), k_splits=2)
    assert "only library route is 'deepgemm'" in kernel.plan_problem(kernel.TilePlan(split, library="deepgemm"))
    assert "only library route" in kernel.plan_problem(kernel.TilePlan(kernel.REFERENCE_TILES, library="cublas"))
    assert kernel.plan_problem(kernel.TilePlan(kernel.REFERENCE_TILES, library="deepgemm")) is None
    with pytest.raises(ValueError, match="library 'cublas': the only library route is 'deepgemm'"):
        library_route.installed_version("cublas")


class _Operand:
    """What the route looks at of a [rows, cols] tensor, without a GPU: its rows `row_stride`
    elements apart (packed by default) from `address`."""

    def __init__(self, dtype=None, rows=4, cols=64, row_stride=None, address=4096, device="cuda"):
        import torch

        self.dtype, self.shape = dtype or torch.bfloat16, (rows, cols)
        self.device = torch.device(device, 0) if device == "cuda" else torch.device(device)
        self._strides, self._address = (row_stride or cols, 1), address

    def dim(self):
        return 2

    def stride(self, dim):
        return self._strides[dim]

    def element_size(self):
        return self.dtype.itemsize

    def data_ptr(self):
        return self._address


def test_the_library_route_runs_only_where_it_was_measured(monkeypatch, tmp_path):
    """run_routed hands a call to DeepGEMM only for bf16, contiguous, 16-byte aligned operands on
    a Hopper GPU (other architectures run other DeepGEMM kernels), with the deep_gemm version
    the table's routes were measured with; a call that raises falls back to the tiles with one
    warning and turns the route off on that device."""
    import torch

    from ep_harness.subjects.gemm import deepgemm

    calls = []
    fake = type("deep_gemm", (), {"__version__": "9.9", "bf16_gemm_nt": staticmethod(lambda a, b, out: calls.append(1))})
    monkeypatch.setattr(deepgemm, "deep_gemm", lambda: fake)
    monkeypatch.setattr(library_route, "_FAILED", set())
    monkeypatch.setattr(library_route, "ROUTED_CALLS", collections.Counter())
    capability = {"major": 9}
    monkeypatch.setattr(library_route, "_capability", lambda index: (capability["major"], 0))
    table = tmp_path / "tiles.json"
    table.write_text(json.dumps({"libraries": {"deepgemm": "9.9"}, "shapes": {}}))
    a, b, out = _Operand(), _Operand(), _Operand()
    assert library_route.run_routed(a, b, out, "deepgemm", table) and calls == [1]
    routed = {("deepgemm", 4, 64, 4): 1}  # (library, N, K, M): what the bench reports per M
    assert library_route.ROUTED_CALLS == routed and not library_route.failed()
    assert bench_gemm_cost.routed_m(4, 64, [1, 4], {}) == [4] and bench_gemm_cost.routed_m(4, 64, [1, 4], routed) == []
    assert not library_route.run_routed(_Operand(torch.float32), b, out, "deepgemm", table)
    assert not library_route.run_routed(_Operand(device="cpu"), b, out, "deepgemm", table)
    # each operand's layout is looked at: rows apart, a row view with a stride (contiguous to
    # torch, not to TMA), 8 bytes off, rows of 120 bytes (not a whole number of 16)
    for bad in (dict(row_stride=72), dict(rows=1, row_stride=72), dict(address=4104), dict(cols=60)):
        for operands in ((_Operand(**bad), b, out), (a, _Operand(**bad), out), (a, b, _Operand(**bad))):
            assert not library_route.run_routed(*operands, "deepgemm", table), (bad, operands)
    other = tmp_path / "other.json"  # measured with another release, or with none recorded
    other.write_text(json.dumps({"libraries": {"deepgemm": "9.8"}, "shapes": {}}))
    assert not library_route.run_routed(a, b, out, "deepgemm", other)
    assert not library_route.run_routed(a, b, out, "deepgemm", tmp_path / "missing.json")
    capability["major"] = 10  # Blackwell: DeepGEMM's sm100 kernel, whose walk was never measured
    assert not library_route.run_routed(a, b, out, "deepgemm", table)
    capability["major"] = 9
    assert calls == [1]

    def broken(a, b, out):
        raise RuntimeError("DeepGEMM JIT: nvcc failed")
    monkeypatch.setattr(fake, "bf16_gemm_nt", staticmethod(broken))
    with pytest.warns(RuntimeWarning, match=r"routes this M to deepgemm, whose call failed \(RuntimeError: DeepGEMM JIT"):
        assert not library_route.run_routed(a, b, out, "deepgemm", table)
    monkeypatch.setattr(fake, "bf16_gemm_nt", staticmethod(lambda a, b, out: calls.append(2)))
    assert not library_route.run_routed(a, b, out, "deepgemm", table) and calls == [1]  # off on this device now
    monkeypatch.setattr(library_route, "_FAILED", set())

    def silent(a, b, out):  # an error without a message still falls back with its one line
        raise RuntimeError()
    monkeypatch.setattr(fake, "bf16_gemm_nt", staticmethod(silent))
    with pytest.warns(RuntimeWarning, match=r"whose call failed \(RuntimeError: \); its Triton tiles run it"):
        assert not library_route.run_routed(a, b, out, "deepgemm", table)
    assert library_route.ROUTED_CALLS == routed and library_route.failed()  # only calls it ran count

    monkeypatch.setattr(library_route, "_FAILED", set())
    versionless = type("deep_gemm", (), {"bf16_gemm_nt": staticmethod(lambda a, b, out: calls.append(3))})
    monkeypatch.setattr(deepgemm, "deep_gemm", lambda: versionless)  # a build that names no version:
    unknown = tmp_path / "unknown.json"  # the table could not tell it from another
    unknown.write_text(json.dumps({"libraries": {"deepgemm": "unknown"}, "shapes": {}}))
    assert not library_route.run_routed(a, b, out, "deepgemm", unknown) and calls == [1]

    def unimportable():
        raise ImportError("libcuda.so.1: cannot open shared object file")
    monkeypatch.setattr(library_route, "_FAILED", set())
    monkeypatch.setattr(deepgemm, "deep_gemm", unimportable)
    assert not library_route.run_routed(a, b, out, "deepgemm", table) and calls == [1]


def test_kept_entries_drop_routes_measured_with_another_library_version(monkeypatch, tmp_path):
    small = asdict(tune.CANDIDATES["small"][0])
    entries = [{"max_m": 16, "config": small, "library": "deepgemm"}, {"max_m": None, "config": small}]
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"libraries": {"deepgemm": "9.9"}, "shapes": {"4096x4096": entries}}))
    monkeypatch.setattr(library_route, "installed_version", lambda name: "9.9")
    assert tune.kept_entries(path) == {"4096x4096": entries}
    monkeypatch.setattr(library_route, "installed_version", lambda name: "10.0")
    assert tune.kept_entries(path) == {"4096x4096": [{"max_m": 16, "config": small}, entries[1]]}


def test_the_bit_check_counts_an_unwritten_output_as_mismatched(monkeypatch):
    """The reference and the compared products write into outputs filled beforehand (+inf and
    NaN): a kernel that leaves its output, or its last row, unwritten, or a library call that
    writes nothing, cannot pass as bit-identical on a fresh allocation holding the reference's
    bits. The tiles stand in for the GPU's: torch's float32 product, the same bits for any M."""
    import torch

    def fake_bi_matmul(a, b, out=None, config=None):
        rows = {"writes nothing": 0, "skips its last row": a.shape[0] - 1}.get(config, a.shape[0])
        out[:rows] = (a.double() @ b.double().T)[:rows].float()
        return out
    monkeypatch.setattr(kernel, "bi_matmul", fake_bi_matmul)
    monkeypatch.setattr(kernel, "compiled_resources", lambda *args: {})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(tune, "BITS_M", (1, 17, 40))
    g = torch.Generator().manual_seed(3)
    a_all, b = torch.randn(40, 64, generator=g), torch.randn(48, 64, generator=g)
    shape = type("Shape", (), {"a_all": a_all, "b": b, "n": 48})()

    def writes_nothing(m):
        return tune.prefilled(a_all[:m], 48, tune.PRODUCT_FILL)
    bits = tune.bit_check(a_all, b, {name: name for name in ("same", "writes nothing", "skips its last row")},
                          kernel.REFERENCE_TILES, {"library": writes_nothing})
    assert bits["same"]["mismatched"] == {1: 0, 17: 0, 40: 0}
    assert bits["writes nothing"]["mismatched"] == bits["library"]["mismatched"] == {1: 48, 17: 17 * 48, 40: 40 * 48}
    assert bits["skips its last row"]["mismatched"] == {1: 48, 17: 48, 40: 48}
    assert tune.library_mismatches(shape, 17, writes_nothing) == 17 * 48
    assert tune.library_mismatches(shape, 17, lambda m: tune.product_bits(a_all[:m], b, "same")) == 0
    plans = {"one": kernel.TilePlan(kernel.REFERENCE_TILES, one_launch=True)}
    monkeypatch.setattr(kernel, "bi_matmul", lambda a, b, out=None, config=None:
                        fake_bi_matmul(a, b, out, "skips its last row" if config is plans["one"] else config))
    assert tune.one_launch_bits(shape, 17, plans, kernel.REFERENCE_TILES) == {"one": 48}
