"""Defaults that reach each defect class (issue 32): for every new default of the CPU suite, a
planted defect of its class (tests/planted_defaults.py) that the old default missed (`ok`) and
the new one catches (`unexpected`, with its count). One real 4-rank gloo launch of
tests/cases/defaults.toml (beside tests/cases/model.toml's cases: tests/shared_runs.py), whose `-new` cases are held equal to the smoke cases they copy."""
import math
import tomllib
from dataclasses import fields

import pytest
import torch

from ep_harness import inputs as gen
from ep_harness.errors import HarnessError
from ep_harness.check import typed_params
from ep_harness.families.gemm import GemmParams
from ep_harness.families.moe_scenario import DispatchParams
from ep_harness.subject import get
from ep_harness.subjects.collective.common import fold_in_order
from tests.conftest import REPO
from tests.shared_runs import DEFAULTS_SUITE, case_names, model_and_defaults_run  # noqa: F401  (a fixture)

SMOKE_TWIN = {  # defaults.toml case -> the smoke case whose grid and params it runs
    "fp16-accumulator-new": "fold-reference", "scale-before-sum-new": "fold-reference",
    "remainder-new": "fold-reference", "gemm-tail-new": "gemm-fixed-order", "gemm-offset-new": "gemm-fixed-order",
    "second-chunk-new": "dispatch-a2a", "row-remainder-new": "fold-reference", "negative-zero-new": "fold-reference",
    "column-tail-new": "gemm-tails", "k-tail-new": "gemm-tails", "row-index-new": "gemm-tails",
    "rare-fold-new": "fold-rare", "first-call-new": "fold-reference",
}


def _cases(path):
    return {c["name"]: c for c in tomllib.loads(path.read_text())["case"]}


def test_the_new_cases_run_what_the_smoke_suite_runs():
    smoke, planted = _cases(REPO / "cases" / "smoke.toml"), _cases(REPO / "tests" / "cases" / "defaults.toml")
    for name, twin in SMOKE_TWIN.items():
        mine, theirs = planted[name], smoke[twin]
        assert mine["properties"] == theirs["properties"] and mine.get("params") == theirs.get("params"), name
        for key, values in theirs["grid"].items():  # the planted GEMMs take the contiguous layout only
            assert set(mine["grid"][key]) <= set(values) and (key == "layout" or mine["grid"][key] == values), name


def test_the_old_defaults_are_gone_from_the_families():
    gemm = {f.name: f for f in fields(GemmParams)}
    assert gemm["position_m"].default == 199 and 199 % 64 and 199 % 128  # was 256: no tail tile
    assert gemm["other_loads"].default_factory()[0] == 37  # was 0: the other experts empty in the M sweep
    assert gemm["probe_group"].default is None  # completed to 1 (was 0: the probe always at row 0 of A)
    assert {f.name: f for f in fields(DispatchParams)}["tokens"].default == 136 > 128  # was 16: one chunk


def _gemm(layout, **raw):
    return typed_params("gemm", {"dtype": "bfloat16", "layout": layout, **raw}, get("torch_mm"), "t")


def test_the_gemm_probe_sits_in_expert_1_except_where_there_is_one_expert():
    assert _gemm("contiguous").probe_group == _gemm("masked").probe_group == 1
    assert _gemm("dense").probe_group == 0 and _gemm("contiguous", groups=1).probe_group == 0
    assert _gemm("contiguous", probe_group=0).probe_group == 0  # a case may still name one
    with pytest.raises(HarnessError, match="probe_group = 2 with layout = 'dense': a dense problem is one expert"):
        _gemm("dense", probe_group=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_top_of_range_data_reaches_the_top_and_every_sum_of_8_stays_finite(dtype):
    x = gen.values((8, 4, 2048), dtype, 3, "top-test", data="top")
    ceiling_sum = 15 * 2.0 ** (math.floor(math.log2(torch.finfo(dtype).max)) + 1 - gen.TOP_HEADROOM_BITS)
    assert ceiling_sum < torch.finfo(dtype).max  # 15 values at the ceiling, same sign: still finite
    ceiling = 2.0 ** (math.floor(math.log2(torch.finfo(dtype).max)) + 1 - gen.TOP_HEADROOM_BITS)  # fp16: 2^12
    assert ceiling / 2 <= x.abs().max() <= ceiling  # its top binade reached, 2^4 below the dtype's
    assert (x > 0).any() and (x < 0).any()
    for order in (range(8), reversed(range(8)), [3, 1, 7, 0, 5, 2, 6, 4]):  # rounded after every add
        assert torch.isfinite(fold_in_order(x, order)).all()
    assert torch.isfinite(x.double().sum(0).to(dtype)).all()
    assert not torch.isfinite((x * 2 ** gen.TOP_HEADROOM_BITS).sum(0)).all()  # a scale before the sum overflows


def test_the_looked_up_powers_of_two_are_exp2s_bits():
    """`spread` and `top` data scale by 2^e looked up, not computed: the same bits as torch.exp2
    gave (the NCCL fixtures' digests were recorded on inputs made with it), over every
    exponent a double holds, subnormal ones included, in one vectorized call and in tails."""
    e = torch.randint(-1074, 1024, (10_007,), generator=torch.Generator().manual_seed(0))
    for part in (e, e[:3], e.view(1, -1)[:, 5:]):
        assert torch.equal(gen.powers_of_two(part, -1074, 1023).view(torch.int64),
                           torch.exp2(part.double()).view(torch.int64))
    e = e.clamp(-1000, 1000)
    assert not torch.equal(gen.powers_of_two(e + 1, -999, 1001), torch.exp2(e.double()))  # an exponent off by one shows


def test_top_of_range_data_is_for_collectives_only():
    with pytest.raises(HarnessError, match=r"data = 'top'; choose one of spread, randn"):
        _gemm("contiguous", data="top")


@pytest.fixture(scope="module")
def defaults_run(model_and_defaults_run):
    """The records of defaults.toml's cases, from its launch shared with tests/cases/model.toml
    (tests/shared_runs.py), which exits 1 as defaults.toml alone does (its `-new` cases fail)."""
    proc, records = model_and_defaults_run
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    mine = {check: r for check, r in records.items() if check.split("/")[0] in case_names(DEFAULTS_SUITE)}
    assert {check.split("/")[0] for check in mine} == case_names(DEFAULTS_SUITE), sorted(records)
    return mine


def _of(run, case):
    records = [r for c, r in run.items() if c.startswith(f"{case}/")]
    assert records, case
    return records


@pytest.mark.parametrize("case", ["fp16-accumulator", "scale-before-sum", "remainder", "gemm-tail", "gemm-offset",
                                  "second-chunk", "row-remainder", "negative-zero", "column-tail", "k-tail",
                                  "row-index", "rare-fold"])
def test_the_old_default_misses_the_planted_defect(defaults_run, case):
    for r in _of(defaults_run, f"{case}-old"):
        assert (r["status"], r["mismatched"]) == ("ok", 0), (r["check"], r["reason"])


def _caught(run, check):
    r = run[check]
    assert r["status"] == "unexpected" and r["mismatched"] > 0, (check, r["status"], r["reason"])
    assert r["reason"].startswith(f"expected to hold, but {r['mismatched']:,} / {r['total']:,} differ")
    return r


@pytest.mark.parametrize("world_size", [3, 4])
def test_top_of_range_catches_an_fp16_accumulator_and_a_scale_before_the_sum(defaults_run, world_size):
    r = _caught(defaults_run, f"fp16-accumulator-new/reference/dtype=bfloat16/world_size={world_size}")
    assert "Inf where the reference is finite" in r["reason"]
    fp16 = defaults_run[f"fp16-accumulator-new/reference/dtype=float16/world_size={world_size}"]
    assert fp16["status"] == "ok"  # fp16 data in an fp16 accumulator is the correct fold
    for dtype in ("bfloat16", "float16"):
        r = _caught(defaults_run, f"scale-before-sum-new/reference/dtype={dtype}/world_size={world_size}")
        assert "Inf where the reference is finite" in r["reason"]


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_hidden_size_with_a_remainder_catches_the_remainder_loop(defaults_run, dtype, world_size):
    r = _caught(defaults_run, f"remainder-new/reference/dtype={dtype}/world_size={world_size}")
    hidden = r["params"]["hidden"]
    rows = r["total"] // hidden
    assert hidden % 128 and r["mismatched"] <= rows * (hidden % 128)  # only the remainder columns
    assert defaults_run[f"remainder-new/run-to-run/dtype={dtype}/world_size={world_size}"]["status"] == "ok"


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tail_rows_catch_a_partial_row_block_and_a_negative_zero_sum(defaults_run, dtype, world_size):
    point = f"reference/dtype={dtype}/world_size={world_size}"
    r = _caught(defaults_run, f"row-remainder-new/{point}")
    tail, hidden = r["params"]["tail_rows"], r["params"]["hidden"]
    assert tail == 67 and r["mismatched"] <= world_size * (tail % 16) * hidden  # the partial block's rows only
    r = _caught(defaults_run, f"negative-zero-new/{point}")
    zeros = world_size * tail * hidden // 7  # every 7th element of the tail layout sums to zero (less the probe's)
    assert zeros * 0.9 < r["mismatched"] <= zeros + world_size
    assert r["reason"].endswith(f"{r['mismatched']:,} signed zeros (+0.0 vs -0.0)")
    for case in ("row-remainder-new", "negative-zero-new"):
        assert defaults_run[f"{case}/run-to-run/dtype={dtype}/world_size={world_size}"]["status"] == "ok"


def test_m_not_a_multiple_of_64_catches_the_tail_tile(defaults_run):
    r = _caught(defaults_run, "gemm-tail-new/reference/dtype=bfloat16/layout=contiguous")
    p = r["params"]
    tail = p["position_m"] % 64
    assert p["position_m"] > 64 and 0 < r["mismatched"] <= p["groups"] * tail * p["n"]  # the tail rows only
    r = _caught(defaults_run, "gemm-tail-new/position-invariance/dtype=bfloat16/layout=contiguous")
    assert r["mismatched"] == p["n"]  # the last row, in the tail tile, against the first


def test_the_probe_past_row_0_with_the_others_loaded_catches_an_offset_dependent_gemm(defaults_run):
    r = _caught(defaults_run, "gemm-offset-new/batch-invariance/dtype=bfloat16/layout=contiguous")
    assert (r["params"]["probe_group"], r["params"]["other_loads"][0]) == (1, 37)
    assert r["first_mismatch"]["row"] == "m=1 others=0"  # the one run whose probe starts at row 0
    assert defaults_run["gemm-offset-new/reference/dtype=bfloat16/layout=contiguous"]["status"] == "ok"  # in bound


@pytest.mark.parametrize("quant", ["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_a_second_128_token_chunk_catches_the_chunked_dispatcher(defaults_run, quant, layout):
    point = f"expert_quant={quant}/layout={layout}/world_size=4"
    r = _caught(defaults_run, f"second-chunk-new/reference/{point}")
    p = r["params"]
    if quant == "bf16":  # every (token, slot) row of tokens 128..135 on every rank, bit for bit
        assert r["mismatched"] == (p["tokens"] - 128) * p["world_size"] * p["topk"] * p["hidden"]
    _caught(defaults_run, f"second-chunk-new/combine-reference/{point}")


GEMM_TAILS = "reference/dtype=bfloat16/layout=contiguous"


def test_n_and_k_past_whole_blocks_catch_the_tail_columns_and_the_last_k_step(defaults_run):
    r = _caught(defaults_run, f"column-tail-new/{GEMM_TAILS}")
    p = r["params"]
    rows = p["groups"] * p["position_m"]
    assert p["n"] % 64 and 0 < r["mismatched"] <= rows * (p["n"] % 64)  # the tail columns only
    r = _caught(defaults_run, f"k-tail-new/{GEMM_TAILS}")
    assert r["params"]["k"] % 64 and r["mismatched"] > rows * p["n"] // 2  # every element misses K's last 8


def _rows_of_a_past(p, index):
    """The reference's rows at `index` or past in A (each expert's rows padded to `alignment`)."""
    padded = -(-p["position_m"] // p["alignment"]) * p["alignment"]
    return sum(max(0, g * padded + p["position_m"] - max(g * padded, index)) for g in range(p["groups"]))


def test_more_than_1024_rows_catch_a_row_index_that_wraps(defaults_run):
    r = _caught(defaults_run, f"row-index-new/{GEMM_TAILS}")
    p, old = r["params"], defaults_run[f"row-index-old/{GEMM_TAILS}"]["params"]
    assert _rows_of_a_past(old, 1024) == 0 < _rows_of_a_past(p, 1024)  # the old A: 4 x 256 rows, indices < 1,024
    assert 0 < r["mismatched"] <= _rows_of_a_past(p, 1024) * p["n"]


def test_150_repeats_catch_a_corruption_on_one_call_in_50(defaults_run):
    r = _caught(defaults_run, "rare-fold-new/run-to-run/dtype=bfloat16/world_size=4")
    p = r["params"]
    assert (p["repeats"], p["rows_per_rank"]) == (150, 1)
    runs = r["mismatched"] // p["hidden"]  # each corrupted call: one row of `hidden` elements 1 ULP off
    assert r["mismatched"] % p["hidden"] == 0 and 2 <= runs <= 3, r["mismatched"]


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_run_to_run_on_a_group_of_its_own_catches_an_order_of_the_group_s_first_call(defaults_run, dtype, world_size):
    point = f"dtype={dtype}/world_size={world_size}"
    r = _caught(defaults_run, f"first-call-new/run-to-run/{point}")
    copies = r["detail"]["rows"] // r["params"]["repeats"]  # one per rank
    assert r["detail"]["rows_differing"] == (r["params"]["repeats"] - 1) * copies  # every later repeat differs
    for control in ("reference", "thread-invariance"):  # in bound; repeats on the launch's group, used before
        c = defaults_run[f"first-call-new/{control}/{point}"]
        assert (c["status"], c["mismatched"]) == ("ok", 0), (control, c["reason"])
