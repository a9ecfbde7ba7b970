"""GEMM and quantization: references, layouts, and a planted batch-variance bug."""
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_harness.bits import int_view
from ep_harness.families import gemm as gemm_family
from ep_harness.families.gemm_problem import build, weights
from ep_harness.families.gemm import GemmParams
from ep_harness.reference import gemm as ref_gemm
from ep_harness.reference import quant as ref_quant
from tests.planted import SPLIT_K_ROWS, split_k, whole_k


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=-448.0, max_value=448.0, allow_nan=False, width=32))
def test_e4m3_rounding_matches_torch_on_float32_inputs(v):
    """One rounding from a float32 value: torch's cast and the reference must agree."""
    got = ref_quant.round_to_e4m3(torch.tensor([v], dtype=torch.float64))
    want = torch.tensor([v], dtype=torch.float32).to(torch.float8_e4m3fn)
    assert got.view(torch.int8).item() == want.view(torch.int8).item()


def test_e4m3_ties_go_to_even_and_saturate():
    v = torch.tensor([336.0, 1.0625, 2.0 ** -10, 460.0, 1000.0, -336.0000087], dtype=torch.float64)
    assert ref_quant.round_to_e4m3(v).float().tolist() == [320.0, 1.0, 0.0, 448.0, 448.0, -352.0]


def test_group_scales_and_ue8m0():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    x[0, 5], x[0, 200] = 448.0, -3.0
    s = ref_quant.group_scales(x)
    assert s.tolist() == [[1.0, 3.0 / 448.0]] or s[0, 1].item() == pytest.approx(3.0 / 448.0)
    assert s[0, 0].item() == 1.0
    u = ref_quant.group_scales(x, ue8m0=True)
    assert u[0, 1].item() == 2.0 ** math.ceil(math.log2(3.0 / 448.0))
    q, _ = ref_quant.quantize_per_token_group(x, ue8m0=True)
    assert q[0, 5].float().item() == 448.0


def _rounding_by_log2(v):
    """The rounding written with log2/exp2 (the module's first form): exact on the CPU, but
    a GPU's log2 may round its last bit, hence the frexp form. Both must give the same bits."""
    mag = v.abs()
    exp = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag)))).clamp_min(-6)
    quantum = torch.exp2(exp - 3)
    return torch.copysign((torch.round(mag / quantum) * quantum).clamp_max(448.0), v).to(torch.float8_e4m3fn)


def test_exact_rounding_agrees_bit_for_bit_with_the_log2_form():
    """Every e4m3 value, every tie between two, one float64 step either side of each tie and
    of every power of two, signed zeros, subnormals, non-finite values and seeded spread
    values: the frexp form (device-independent) rounds exactly as the log2 form did."""
    g = torch.Generator().manual_seed(7)
    spread = torch.randn(200_000, generator=g, dtype=torch.float64) * \
        torch.exp2(torch.randint(-30, 30, (200_000,), generator=g).double())
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    e4m3 = torch.sort(e4m3[torch.isfinite(e4m3)].unique()).values
    ties = (e4m3[1:] + e4m3[:-1]) / 2
    powers = torch.exp2(torch.arange(-1074, 1024, dtype=torch.float64))
    step = lambda t, way: torch.nextafter(t, torch.full_like(t, way))  # noqa: E731
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 464.0, 480.0, 5e-324, 1e308])
    v = torch.cat([spread, e4m3, ties, step(ties, 0.0), step(ties, 1e9), powers, step(powers, 0.0),
                   step(powers, math.inf), specials])
    v = torch.cat([v, -v])
    assert torch.equal(ref_quant.round_to_e4m3(v).view(torch.uint8), _rounding_by_log2(v).view(torch.uint8))


def test_ue8m0_scales_and_powers_of_two_are_exact():
    e = torch.arange(-1022, 1024)
    assert ref_quant.power_of_two(e).tolist() == [2.0 ** int(k) for k in e]
    g = torch.Generator().manual_seed(8)
    s = torch.cat([torch.rand(100_000, generator=g) * torch.exp2(torch.randint(-40, 40, (100_000,), generator=g).float()),
                   torch.exp2(torch.arange(-126, 128).float()), torch.tensor([math.nan, math.inf])])
    by_log2 = torch.exp2(torch.ceil(torch.log2(s.double()))).float()
    assert torch.equal(ref_quant.round_up_to_power_of_two(s).view(torch.int32), by_log2.view(torch.int32))


def test_scales_are_one_correctly_rounded_division():
    """amax / 448 in float32 is the float64 quotient rounded once (exact: 53 >= 2 * 24 + 2
    bits); a multiplication by the reciprocal, which CUDA uses for a Python-scalar divisor,
    rounds otherwise for about half of these values."""
    g = torch.Generator().manual_seed(9)
    amax = (torch.rand(200_000, generator=g, dtype=torch.float64) *
            torch.exp2(torch.randint(-20, 20, (200_000,), generator=g).double())).float()
    correctly_rounded = (amax.double() / 448.0).float()
    assert torch.equal(ref_quant.scale_of(amax), correctly_rounded)
    assert (amax * (1 / 448.0) != correctly_rounded).float().mean() > 0.3  # what the reciprocal would give


def test_k_order_sensitivity_is_an_exact_construction():
    """Products 1, 0, 2^-24, 2^-24: one after the other, each 2^-24 is a tie that rounds back
    to 1; as halves, (1 + 0) + (2^-24 + 2^-24) = 1 + 2^-23. A float32 output sees it, a bf16
    one (8 bits) does not, and a row of equal products has no order to see."""
    row = torch.ones(4, dtype=torch.bfloat16)
    weight = torch.tensor([[1.0, 0.0, 2.0 ** -24, 2.0 ** -24], [1.0, 1.0, 1.0, 1.0]], dtype=torch.bfloat16)
    assert ref_gemm.k_order_sensitive(row, weight, torch.float32) == 1
    assert ref_gemm.k_order_sensitive(row, weight, torch.bfloat16) == 0
    assert ref_gemm.k_order_sensitive(row[:1], weight[:, :1], torch.float32) == 0  # one product, one order


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 40), st.sampled_from([torch.float32, torch.bfloat16]))
def test_k_order_sensitivity_counts_what_float32_arithmetic_says(seed, k, out):
    """Against numpy float32 scalars added one by one (IEEE single precision wherever it runs),
    on seeded rows whose exponents lie far apart, so that order shows."""
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    row = (torch.randn(k, generator=g) * 2.0 ** torch.randint(-12, 13, (k,), generator=g)).bfloat16()
    weight = torch.randn(6, k, generator=g).bfloat16()
    products = (weight.float() * row.float()).numpy()

    def added(values):
        total = np.float32(values[0])
        for v in values[1:]:
            total = np.float32(total + np.float32(v))
        return total

    want = 0
    for p in products:
        half = k // 2
        whole = added(p)
        split = np.float32(added(p[:half]) + added(p[half:])) if half else whole
        a, b = torch.tensor(float(whole)).to(out), torch.tensor(float(split)).to(out)
        want += int(not torch.equal(int_view(a), int_view(b)))
    assert ref_gemm.k_order_sensitive(row, weight, out) == want


def test_contiguous_layout_aligns_and_marks_padding():
    w, _ = weights(0, 3, 16, 128, "bfloat16", "randn")
    rows = {g: torch.full((c, 128), float(g + 1), dtype=torch.bfloat16) for g, c in enumerate([3, 0, 130])}
    p = build("contiguous", "bfloat16", rows, [3, 0, 130], w, None, 128, 128)
    assert p.starts == [0, 128, 128] and p.a.shape[0] == 128 + 256
    assert p.grouped_layout[:3].tolist() == [0, 0, 0] and (p.grouped_layout[3:128] == -1).all()
    assert (p.a[3:128] == 0).all() and (p.grouped_layout[128:258] == 2).all()
    exact = ref_gemm.grouped_contiguous(p.a, p.b, p.grouped_layout)
    assert torch.equal(exact[130], p.a[130].double() @ p.b[2].double().T)
    assert (exact[3:128] == 0).all()
    m = build("masked", "bfloat16", rows, [3, 0, 130], w, None, 128, 128)
    assert m.a.shape == (3, 256, 128) and m.masked_m.tolist() == [3, 0, 130]


def test_fp8_problem_dequantizes_exactly():
    w, ws = weights(0, 2, 128, 256, "float8_e4m3fn", "randn")
    rows = {0: torch.randn(5, 256).to(torch.bfloat16), 1: torch.randn(2, 256).to(torch.bfloat16)}
    p = build("contiguous", "float8_e4m3fn", rows, [5, 2], w, ws, 256, 128)
    assert p.a.dtype == torch.float8_e4m3fn and p.a_scale.shape == (256, 2) and p.b_scale.shape == (2, 1, 2)


@pytest.mark.slow
def test_planted_split_k_is_caught_with_the_right_count(planted_run):
    rec = planted_run["split-k/batch-invariance"]
    assert rec["status"] == "unexpected" and rec["held"] is False
    # The same count, computed here from the probe row alone: every run whose expert holds
    # more than SPLIT_K_ROWS rows differs from the first run wherever the two sums round apart.
    p = GemmParams(**rec["params"])  # every effective parameter is in the record
    assert p.layout == "contiguous"
    w, _ = weights(p.seed, p.groups, p.n, p.k, "bfloat16", p.data, p.cancel)
    probe = gemm_family.probe_row(p, torch.bfloat16).unsqueeze(0)
    b = w[p.probe_group]
    differ = int((whole_k(probe, b).to(torch.bfloat16) != split_k(probe, b).to(torch.bfloat16)).sum())
    split_runs = sum(m > SPLIT_K_ROWS for m in p.m_values)
    assert differ > 0 and rec["mismatched"] == split_runs * differ


@pytest.mark.slow
def test_smoke_gemm_and_quant_records(smoke_run):
    _, run_dir = smoke_run
    recs = {json.loads(line)["check"]: json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()}
    gemm = [r for r in recs.values() if r["family"] == "gemm" and r["status"] != "skipped"]
    assert gemm and all(r["status"] == "ok" for r in gemm)
    assert all(r["detail"]["order_sensitive"] > 0 for r in gemm if r["property"] != "reference")
    skipped = [r for r in recs.values() if r["subject"].startswith("deepgemm")]
    assert skipped and all(r["status"] == "skipped" and "needs an NVIDIA GPU" in r["reason"] for r in skipped)
    q = recs["quant-fp32-scales/reference/ue8m0=False"]
    causes = q["detail"]["explained"]
    assert q["status"] == "ok" and q["mismatched"] > 0
    assert causes["values_by_double_rounding"] + causes["values_by_scale"] == causes["values_differ"] == q["mismatched"]
    assert recs["quant-ue8m0/reference/ue8m0=True"]["mismatched"] == 0
