"""The batch-invariant Triton matmul: its configuration rule and subject on any machine, and
its index logic in float32 under Triton's interpreter (skipped where triton is absent).

The interpreter is no bit oracle for bf16 (it computes bf16 arithmetic and bf16 `tl.dot`
wrongly and rounds fp32 -> bf16 by truncation), so it runs float32 only, in a child process:
`TRITON_INTERPRET` is read
when a kernel is decorated, i.e. when ep_harness.kernels.bi_matmul is first imported, and this
test process may already have imported it (every subject registers on import).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
from dataclasses import replace

import pytest
import torch

from ep_harness.kernels import bi_matmul as kernel
from ep_harness.families.gemm import GemmParams
from ep_harness.subject import Platform, load_all
from tests.conftest import REPO, REPO_ON_PYTHONPATH, completed, once_per_session, run_cli

CPU = Platform("gloo", "cpu", 1)
H200 = Platform("nccl", "cuda", 1, "NVIDIA H200", (9, 0), gpus=1)


def test_tiles_follow_m_but_the_k_walk_does_not():
    """Tiles may change with M (small M: thin tiles for every SM); what orders an element's
    additions (`k_walk`: K steps, kernel) must be the same at every M of one (N, K, dtype)."""
    m_values = (1, 7, 16, 64, 100, 129, 256, 1000, 2048, 8192)
    shapes = [(4096, 4096, "bfloat16"), (2048, 7168, "bfloat16"), (7168, 2048, "bfloat16"), (3072, 1536, "bfloat16"),
              (100, 36, "bfloat16"), (48, 200, "float32")]
    changed = 0
    for n, k, dtype in shapes:
        plans = {m: kernel.launch_plan(m, n, k, dtype, torch.device("cpu"))[0] for m in m_values}
        assert len({kernel.k_walk(cfg, k) for cfg in plans.values()}) == 1, (n, k, dtype)
        if len(set(plans.values())) > 1:  # where tiles change, no K depth pads K with zero steps of its own
            assert all(k % cfg.block_k == 0 or cfg.block_k == kernel.REFERENCE_TILES.block_k for cfg in plans.values())
            changed += 1
    assert changed >= 3  # not vacuous: the tuned shapes and an untuned one do change tiles with M
    assert kernel.tile_config(1, 4096, 4096, "bfloat16").tma and not kernel.tile_config(1, 100, 36, "bfloat16").tma
    assert list(inspect.signature(kernel.k_walk).parameters) == ["config", "k"]  # no M in the walk


def test_a_table_entry_that_walks_k_otherwise_is_refused(tmp_path):
    good = {"max_m": None, "config": kernel.REFERENCE_TILES.__dict__}
    bad = {"max_m": 64, "config": {**kernel.REFERENCE_TILES.__dict__, "block_k": 96}}  # 4096 % 96 != 0
    table = tmp_path / "tiles.json"
    table.write_text(json.dumps({"shapes": {"4096x4096": [bad, good]}}))
    with pytest.raises(ValueError, match="walk K differently"):
        kernel.tuned_tiles(table)
    table.write_text(json.dumps({"shapes": {"4096x4096": [{**good, "max_m": 64}]}}))
    with pytest.raises(ValueError, match="the last must cover every M"):
        kernel.tuned_tiles(table)
    # a split count is the shape's, not the M's: split small M with unsplit large M is refused
    split = {"max_m": 64, "config": {**kernel.REFERENCE_TILES.__dict__, "k_splits": 2, "split_parallel": True}}
    table.write_text(json.dumps({"shapes": {"4096x4096": [split, good]}}))
    with pytest.raises(ValueError, match="walk K differently"):
        kernel.tuned_tiles(table)
    serial = {"max_m": None, "config": kernel.walk_reference(2).__dict__}
    table.write_text(json.dumps({"shapes": {"4096x4096": [split, serial]}}))
    assert [plan.main.k_splits for _, plan in kernel.tuned_tiles(table)[(4096, 4096)]] == [2, 2]
    odd = {"max_m": None, "config": {**kernel.walk_reference(3).__dict__}}  # 4096 is not 3 segments of 64
    table = tmp_path / "odd.json"  # tuned_tiles caches by path
    table.write_text(json.dumps({"shapes": {"4096x4096": [odd]}}))
    with pytest.raises(ValueError, match="walk K differently"):
        kernel.tuned_tiles(table)


def test_a_split_walk_that_cannot_cut_k_says_how_to_fix_it():
    assert kernel.tile_problem(kernel.walk_reference(2), 4096) is None
    assert "k_splits x block_k dividing K" in kernel.tile_problem(kernel.walk_reference(3), 4096)
    assert "needs the TMA kernel" in kernel.tile_problem(kernel.TileConfig(64, 64, 64, 8, 4, 3, k_splits=2), 4096)
    assert ">= 2 with split_parallel" in kernel.tile_problem(kernel.TileConfig(64, 64, 64, 8, 4, 3, True,
                                                                               split_parallel=True), 4096)
    with pytest.raises(ValueError, match="k_splits x block_k dividing K"):
        kernel.bi_matmul(torch.zeros(2, 96), torch.zeros(3, 96), config=kernel.walk_reference(2))


def test_masked_rows_without_tma_says_so():
    assert "a TMA kernel's option" in kernel.tile_problem(kernel.TileConfig(64, 32, 64, 8, 4, 3, masked_rows=True), 64)
    with pytest.raises(ValueError, match="a TMA kernel's option"):
        kernel.bi_matmul(torch.zeros(2, 64), torch.zeros(3, 64), config=kernel.TileConfig(16, 16, 32, 2, 4, 2,
                                                                                         masked_rows=True))


def test_a_parked_walk_of_other_than_two_segments_says_what_it_needs():
    parked = kernel.TileConfig(128, 256, 64, 8, 8, 3, True, k_splits=2, parked=True)
    assert kernel.tile_problem(parked, 4096) is None
    for wrong in ({"k_splits": 4}, {"split_parallel": True}, {"block_n": 48}, {"schedule": "flatten"}):
        assert "parked walks K in 2 segments in one program" in kernel.tile_problem(replace(parked, **wrong), 4096)


def test_bad_operands_get_one_line_errors():
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        kernel.tile_config(1, 64, 64, "float16")
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[N, K\]"):
        kernel.bi_matmul(torch.zeros(4, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="both operands"):
        kernel.bi_matmul(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be \[4, 3\]"):
        kernel.bi_matmul(torch.zeros(4, 8), torch.zeros(3, 8), out=torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"out must be \[4, 3\] torch.float32 on cpu; got \(4, 3\) torch.float32 on meta"):
        kernel.bi_matmul(torch.zeros(4, 8), torch.zeros(3, 8), out=torch.zeros(4, 3, device="meta"))


def test_registered_as_a_dense_gemm_subject():
    subject = load_all()["triton_bi_matmul"]
    assert (subject.family, subject.layouts, subject.dtypes) == ("gemm", ("dense",), ("bfloat16", "float32"))
    reason = subject.unavailable(CPU, GemmParams(layout="dense", dtype="bfloat16"))
    assert reason.startswith("needs a CUDA GPU") and "interpreter computes bf16 wrongly" in reason
    assert "no contiguous layout" in subject.unavailable(H200, GemmParams(layout="contiguous", dtype="bfloat16"))
    assert "does not take float8_e4m3fn" in subject.unavailable(H200, GemmParams(layout="dense", dtype="float8_e4m3fn"))


def test_gpu_without_triton_says_so(monkeypatch):
    subject = load_all()["triton_bi_matmul"]
    monkeypatch.setattr(kernel, "triton", None)
    assert "triton cannot be imported" in subject.unavailable(H200, GemmParams(layout="dense", dtype="bfloat16"))
    with pytest.raises(RuntimeError, match="needs triton"):
        kernel.bi_matmul(torch.zeros(2, 8), torch.zeros(3, 8))


@pytest.mark.skipif(not torch.cuda.is_available() or kernel.triton is None,
                    reason="needs a CUDA GPU and triton (the tiled kernels' bits are the GPU's; run on the GPU machine)")
def test_every_tuned_tile_shape_gives_the_reference_tiles_bits_on_the_gpu():
    """The table's claim, on this GPU: at each tuned (N, K), every tile shape the table uses
    gives every output bit the reference tiles give (rows at tile edges included), and
    the reference with K rotated by half a segment does not (the comparison sees an order change)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    table = kernel.tuned_tiles()
    assert table, "bi_matmul_tiles.json holds no tuned shape"
    for (n, k), buckets in table.items():
        a = torch.randn(300, k, generator=g, device="cuda").bfloat16()
        b = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).bfloat16()
        reference = kernel.walk_reference(buckets[0][1].main.k_splits)
        want = kernel.bi_matmul(a, b, config=reference)
        for _, plan in buckets:
            for cfg in filter(None, (plan.main, plan.tail)):
                got = kernel.bi_matmul(a, b, config=cfg)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, k, cfg)
                compiled = kernel.compiled_resources(a, b, cfg)  # what the tuner records of each candidate
                assert compiled["registers"] > 0 and compiled["spills"] >= 0 and compiled["shared_bytes"] > 0, compiled
            if plan.tail is not None:  # the two launches of a plan, at an M where both run
                m = next(m for m in range(plan.main.block_m, 8193, plan.main.block_m)
                         if len(kernel.row_slices(m, n, plan, 132)) == 2)
                rows = torch.randn(m, k, generator=g, device="cuda").bfloat16()
                tiles_only = replace(plan, library="")  # the tiles' own two launches, not a library route
                assert torch.equal(kernel.bi_matmul(rows, b, config=tiles_only).view(torch.int16),
                                   kernel.bi_matmul(rows, b, config=reference).view(torch.int16))
        shift = k // (2 * reference.k_splits)  # half a segment: a whole one would only swap two segments' sums
        rotated = kernel.bi_matmul(a.roll(shift, 1).contiguous(), b.roll(shift, 1).contiguous(), config=reference)
        assert int((rotated.view(torch.int16) != want.view(torch.int16)).sum()) > 0


@pytest.mark.skipif(not torch.cuda.is_available() or kernel.triton is None,
                    reason="needs a CUDA GPU and triton (the library's bits are the GPU's; run on the GPU machine)")
def test_the_library_route_gives_the_unsplit_walks_bits_on_the_gpu():
    """Where the table routes an M to DeepGEMM: its output at M = 1 (a row), 17 (a partial tile),
    300 and the routed M themselves is the unsplit reference tiles', bit for bit, and bi_matmul
    gives those bits too, through DeepGEMM at the routed M (counted). Signed zeros included: a zero
    row of A against a column of B that is negative at every K gives products that are all -0,
    where a kernel that starts from the first step's sum and one that adds it to +0 could differ."""
    from ep_harness.kernels import library_route

    routed = {(n, k): sorted({max_m or 8192 for max_m, plan in buckets if plan.library})
              for (n, k), buckets in kernel.tuned_tiles().items()}
    routed = {shape: ms for shape, ms in routed.items() if ms}
    if not routed:
        pytest.skip("the committed tile table routes no M to a library")
    device = torch.device("cuda", torch.cuda.current_device())
    gemm = library_route.library_gemm("deepgemm", device)
    if gemm is None:  # then the routed M run the table's tiles, which the test above checks
        pytest.skip("the route is off here: deep_gemm does not import or this GPU is not a Hopper "
                    "(pip install 'ep-harness[deepgemm]' on an H100 or H200)")
    assert library_route.usable("deepgemm", device, kernel.TILES_FILE), (
        "the table's routes were measured with another deep_gemm than this one: re-tune, or install "
        f"{library_route.table_versions(kernel.TILES_FILE)}")
    g = torch.Generator(device="cuda").manual_seed(5)
    for (n, k), ms in routed.items():
        b = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).bfloat16()
        b[0] = -b[0].abs() - 2 ** -8  # column 0 of the output: negative products at every K
        for m in sorted({1, 17, 300, *ms}):
            a = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            a[m // 2] = 0.0  # +0 x negative: every product of row m // 2, column 0 is -0
            want = kernel.bi_matmul(a, b, config=kernel.REFERENCE_TILES).view(torch.int16)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")  # unwritten: NaN
            gemm(a, b, out)
            assert int((out.view(torch.int16) != want).sum()) == 0, (n, k, m, out[m // 2, :4], want[m // 2, :4])
            calls = library_route.ROUTED_CALLS[("deepgemm", n, k, m)]
            assert torch.equal(kernel.bi_matmul(a, b).view(torch.int16), want), (n, k, m)
            routes = kernel.tile_plan(m, n, k, "bfloat16").library == "deepgemm"  # the routed M and their buckets
            assert library_route.ROUTED_CALLS[("deepgemm", n, k, m)] == calls + routes, (n, k, m)


# --- float32 under the interpreter (child process) --------------------------------------------

SMALL = {  # blocks small enough for many tiles and K steps at test sizes
    "pointers": dict(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2),
    "tma": dict(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2, tma=True),
    # A's rows and C's through masked pointers, B through TMA (small M on the GPU)
    "tma-masked-rows": dict(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2, tma=True,
                            masked_rows=True),
    "pointers-k16": dict(block_m=32, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=2),
}
M_VALUES = (1, 2, 5, 16, 17, 33, 64)
M_MAX = 64
# Rows move by whole tiles of every variant: the interpreter's tl.dot is numpy's BLAS, whose
# bits for a row may depend on where in the block the row sits, which is not the kernel's logic.
ROLL = 32


def interpreter_checks() -> dict:
    """Run in a child with TRITON_INTERPRET=1; returns plain numbers for the parent to assert."""
    from ep_harness.tolerances import gemm_bound

    g = torch.Generator().manual_seed(7)
    k, n, m_max = 200, 40, M_MAX  # K not a multiple of BLOCK_K (masked tail), N not of BLOCK_N
    spread = 2.0 ** torch.randint(-6, 7, (m_max, k), generator=g)  # exponents far apart: order shows
    a_all = (torch.randn(m_max, k, generator=g) * spread).float()
    b = torch.randn(n, k, generator=g).float()
    exact = a_all.double() @ b.double().T
    tol = gemm_bound("float32", k)
    bound = tol["u_out"] * exact.abs() + tol["gamma"] * (a_all.double().abs() @ b.double().abs().T)
    out = {}
    for name, fields in SMALL.items():
        cfg = kernel.TileConfig(**fields)
        full = kernel.bi_matmul(a_all, b, config=cfg)
        per_m = {}
        for m in M_VALUES:
            part = kernel.bi_matmul(a_all[:m].contiguous(), b, config=cfg)
            per_m[m] = int((part.view(torch.int32) != full[:m].view(torch.int32)).sum())
        rolled = kernel.bi_matmul(a_all.roll(ROLL, 0).contiguous(), b, config=cfg)
        out[name] = {
            "worst_fraction_of_bound": float(((full.double() - exact).abs() / bound).max()),
            "batch_mismatches": per_m,
            "position_mismatches": int((rolled.view(torch.int32) != full.roll(ROLL, 0).view(torch.int32)).sum()),
            "programs": sorted({kernel.launch_plan(m, n, k, "float32", a_all.device, cfg)[1] for m in M_VALUES}),
            "tiles_at_m_max": -(-m_max // cfg.block_m) * -(-n // cfg.block_n),
            "tile_rows": cfg.block_m,
            "bits": full.view(torch.int32).tolist(),
        }
    out["split"] = split_checks(g)
    out["one_launch"] = one_launch_checks(g)
    return out


def one_launch_checks(g) -> dict:
    """A one-launch plan (main tiles over whole waves of 132 programs' worth, the tail's rows in
    the same launch) against the same tiles in one plain launch and in two. The tail shares
    main's tile shape here: the interpreter's dot is numpy's, whose bits may follow the tile
    shape, which is not the kernel's logic. N = 72 makes 5 tile columns, so that 130 main tiles
    leave the interpreter's 4 programs uneven and every tail item starts on another program."""
    k, n = 64, 72
    tiles = kernel.TileConfig(16, 16, 32, 2, 4, 2, True)
    out = {}
    for m in (470, 480):  # the last tail tile partial, and whole
        a = (torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-6, 7, (m, k), generator=g)).float()
        b = torch.randn(n, k, generator=g).float()
        plain = kernel.bi_matmul(a, b, config=tiles)
        got = {}
        for one in (True, False):
            c = torch.full((m, n), float("nan"))
            got[one] = kernel.bi_matmul(a, b, out=c, config=kernel.TilePlan(tiles, tiles, one_launch=one))
        out[m] = {"slices": [s[:2] for s in kernel.row_slices(m, n, kernel.TilePlan(tiles, tiles), kernel.H200_SMS)],
                  "one_vs_plain": int((got[True].view(torch.int32) != plain.view(torch.int32)).sum()),
                  "two_vs_plain": int((got[False].view(torch.int32) != plain.view(torch.int32)).sum()),
                  "unwritten": int(got[True].isnan().sum())}
    # a tail of other tiles than main's (as on a GPU: 128 x 256, then 128 x 128), on small
    # integers, whose sums are exact in any order: where every element lands is what differs
    wide = kernel.TileConfig(32, 32, 32, 2, 4, 2, True)
    a = torch.randint(-3, 4, (1590, k), generator=g).float()
    b = torch.randint(-3, 4, (n, k), generator=g).float()
    c = torch.full((1590, n), float("nan"))
    kernel.bi_matmul(a, b, out=c, config=kernel.TilePlan(wide, tiles, one_launch=True))
    out["other_tail"] = {"slices": [s[:2] for s in kernel.row_slices(1590, n, kernel.TilePlan(wide, tiles),
                                                                     kernel.H200_SMS)],
                         "vs_exact": int((c.double() != a.double() @ b.double().T).sum())}
    return out


SPLIT = dict(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2, tma=True)


def split_checks(g) -> dict:
    """K in 2, 3 and 4 segments, each walked by one program per segment (partial sums through the
    workspace, the last arrival adds them) and by one program per tile: the same bits."""
    from ep_harness.tolerances import gemm_bound

    k, n, m_max = 384, 40, M_MAX  # 2, 3 or 4 segments of whole 32-deep K steps
    a_all = (torch.randn(m_max, k, generator=g) * 2.0 ** torch.randint(-6, 7, (m_max, k), generator=g)).float()
    b = torch.randn(n, k, generator=g).float()
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    unsplit = kernel.bi_matmul(a_all, b, config=kernel.TileConfig(**SPLIT))
    exact = a_all.double() @ b.double().T
    tol = gemm_bound("float32", k)
    bound = tol["u_out"] * exact.abs() + tol["gamma"] * (a_all.double().abs() @ b.double().abs().T)
    out = {}
    for k_splits in (2, 3, 4):  # side by side in one loop (2, 4) or one after the other (3)
        serial = kernel.bi_matmul(a_all, b, config=kernel.TileConfig(**SPLIT, k_splits=k_splits))
        parallel_cfg = kernel.TileConfig(**SPLIT, k_splits=k_splits, split_parallel=True)
        runs = [kernel.bi_matmul(a_all, b, config=parallel_cfg) for _ in range(3)]  # the counters carry over calls
        per_m = {m: int((bits(kernel.bi_matmul(a_all[:m].contiguous(), b, config=parallel_cfg)) != bits(serial[:m])).sum())
                 for m in M_VALUES}
        out[k_splits] = {
            "parallel_vs_serial": [int((bits(r) != bits(serial)).sum()) for r in runs],
            "batch_mismatches": per_m,
            "vs_unsplit": int((bits(serial) != bits(unsplit)).sum()),
            "worst_fraction_of_bound": float(((serial.double() - exact).abs() / bound).max()),
            "programs": kernel.launch_plan(m_max, n, k, "float32", a_all.device, parallel_cfg)[1],
            "items": -(-m_max // SPLIT["block_m"]) * -(-n // SPLIT["block_n"]) * k_splits,
            "counters_whole": all(int(t.remainder(k_splits).max()) == 0
                                  for key, t in kernel._ARRIVALS.items() if key[2] == k_splits),
        }
    # two segments one after the other, the first's sum parked in the program's slot (reused
    # tile after tile: fewer programs than tiles), against the side-by-side walk of the same
    # tiles (the interpreter's dot is numpy's, whose bits may follow the tile's shape)
    wide = {**SPLIT, "block_n": 32}  # N = 40: the last tile's right half lies past N
    parked_cfg = kernel.TileConfig(**wide, k_splits=2, parked=True)
    serial = kernel.bi_matmul(a_all, b, config=kernel.TileConfig(**wide, k_splits=2))
    out[2]["parked_vs_serial"] = {m: int((bits(kernel.bi_matmul(a_all[:m].contiguous(), b, config=parked_cfg))
                                          != bits(serial[:m])).sum()) for m in M_VALUES}
    out[2]["parked_programs"] = kernel.launch_plan(m_max, n, k, "float32", a_all.device, parked_cfg)[1]
    out[2]["parked_tiles"] = -(-m_max // parked_cfg.block_m) * -(-n // parked_cfg.block_n)
    return out


@pytest.fixture(scope="session")
def interpreted(tmp_path_factory):
    pytest.importorskip("triton", reason="triton is not installed here (pip install triton: ~190 MB wheel)")
    env = {**os.environ, **REPO_ON_PYTHONPATH, "TRITON_INTERPRET": "1"}
    proc = subprocess.CompletedProcess(**once_per_session(tmp_path_factory, "triton-interpreted", lambda _: completed(
        run_cli(cwd=REPO, env=env, timeout=300, module="tests.test_triton_matmul"))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("variant", list(SMALL))
def test_interpreter_float32_within_the_reference_bound(interpreted, variant):
    assert interpreted[variant]["worst_fraction_of_bound"] <= 1.0


@pytest.mark.parametrize("variant", list(SMALL))
def test_interpreter_float32_rows_do_not_depend_on_m_or_tile(interpreted, variant):
    result = interpreted[variant]
    assert ROLL % result["tile_rows"] == 0 and M_MAX % result["tile_rows"] == 0
    assert result["batch_mismatches"] == {str(m): 0 for m in M_VALUES}
    assert result["position_mismatches"] == 0
    # not vacuous: persistent programs walked several tiles, and their number changed with M
    assert max(result["programs"]) < result["tiles_at_m_max"] and len(result["programs"]) > 1


def test_interpreter_comparison_sees_another_k_order(interpreted):
    """Positive control: the same product with 16-wide K steps instead of 32 (a different
    summation order) changes output bits, so the zero counts above could have been non-zero."""
    k32 = torch.tensor(interpreted["pointers"]["bits"])
    k16 = torch.tensor(interpreted["pointers-k16"]["bits"])
    assert int((k32 != k16).sum()) > 0
    assert torch.equal(k32, torch.tensor(interpreted["tma"]["bits"]))  # same walk through TMA: same bits
    assert torch.equal(k32, torch.tensor(interpreted["tma-masked-rows"]["bits"]))  # and with A's rows masked


def test_interpreter_split_walk_is_the_same_in_one_program_or_one_per_segment(interpreted):
    for k_splits, result in interpreted["split"].items():
        assert result["parallel_vs_serial"] == [0, 0, 0], k_splits
        assert result["batch_mismatches"] == {str(m): 0 for m in M_VALUES}, k_splits
        assert result["counters_whole"], k_splits  # every tile's arrivals a whole number of calls
        assert result["worst_fraction_of_bound"] <= 1.0, k_splits
        # not vacuous: programs each took several (tile, segment) items, and splitting K changed the sum
        assert result["programs"] < result["items"]
        assert result["vs_unsplit"] > 0, k_splits
    parked = interpreted["split"]["2"]
    assert set(parked["parked_vs_serial"].values()) == {0}, parked["parked_vs_serial"]
    assert parked["parked_programs"] < parked["parked_tiles"]  # slots were reused tile after tile


def test_interpreter_one_launch_plan_gives_the_plain_launchs_bits(interpreted):
    results = dict(interpreted["one_launch"])
    other = results.pop("other_tail")
    for m, result in results.items():
        assert result["slices"] == [[0, 416], [416, int(m)]], result  # main and tail rows: both ran
        assert (result["one_vs_plain"], result["two_vs_plain"], result["unwritten"]) == (0, 0, 0), (m, result)
    assert other["slices"] == [[0, 1408], [1408, 1590]] and other["vs_exact"] == 0, other  # NaN (unwritten) differs


def test_a_one_launch_plan_says_what_it_needs():
    main, tail = kernel.TileConfig(128, 256, 64, 8, 8, 3, True), kernel.TileConfig(128, 128, 64, 8, 8, 3, True)
    assert kernel.plan_problem(kernel.TilePlan(main, tail, one_launch=True)) is None
    assert kernel.plan_problem(kernel.TilePlan(main, replace(tail, num_warps=4))) is None  # two launches may differ
    for wrong in (kernel.TilePlan(main, replace(tail, num_warps=4), one_launch=True),
                  kernel.TilePlan(main, replace(tail, k_splits=2), one_launch=True)):
        assert "must share warps, stages, k_splits" in kernel.plan_problem(wrong)
    for wrong in (kernel.TilePlan(main, None, one_launch=True),
                  kernel.TilePlan(replace(main, schedule="flatten"), tail, one_launch=True)):
        assert "one_launch needs a tail, and TMA tiles" in kernel.plan_problem(wrong)
    with pytest.raises(ValueError, match="must share warps"):
        kernel.bi_matmul(torch.zeros(2, 64), torch.zeros(3, 64),
                         config=kernel.TilePlan(main, replace(tail, num_stages=4), one_launch=True))


def patch_the_language_once_a_launch() -> None:
    """Triton's interpreter (3.x) patches triton.language anew at every call of a nested
    @triton.jit function (`_patch_lang`: inspect.getmembers over tl, tl.core, tl.math and the
    tensor classes, to replace what is already replaced), a third of this child's CPU (9.4 ->
    6.4 CPU-s, the same output bit for bit). Within one launch, a function whose module's
    language the launch has patched is not patched again; the launch's own patch is undone when
    it ends, and a nested one is left, as Triton leaves it. Where those internals are missing
    (another triton), nothing changes."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None:
        return
    launches = []  # per running launch: ids of the module globals whose language it patched

    class AlreadyPatched:
        def restore(self) -> None:
            pass

    def patch_once(fn):
        if launches:  # a nested function's call, within a launch
            if id(fn.__globals__) in launches[-1]:
                return AlreadyPatched()
            launches[-1].add(id(fn.__globals__))
            return patch(fn)
        scope = patch(fn)  # the launch itself
        launches.append({id(fn.__globals__)})
        restore = scope.restore

        def end() -> None:
            launches.pop()
            restore()
        scope.restore = end
        return scope

    interpreter._patch_lang = patch_once


if __name__ == "__main__":  # the child process of `interpreted`
    patch_the_language_once_a_launch()
    print(json.dumps(interpreter_checks()))
