"""The comparison engine: counts, ULP distances, first mismatch, and the message text."""
import math

import torch

from ep_harness.bits import hex_bits, ulp_distance
from ep_harness.compare import compare_bitwise
from ep_harness.reports.text import mismatch_text


def nextafter(x: torch.Tensor, steps: int) -> torch.Tensor:
    out = x.clone()
    for _ in range(steps):
        out = torch.nextafter(out.float(), torch.tensor(math.inf)).to(x.dtype) if x.dtype == torch.float32 else \
            (out.view(torch.int16) + 1).view(x.dtype)
    return out


def test_counts_and_first_mismatch():
    expected = torch.ones(8, dtype=torch.bfloat16)
    actual = expected.repeat(2, 1)
    actual[1, 3] = nextafter(expected[3], 1)
    actual[1, 5] = nextafter(expected[5], 3)
    m = compare_bitwise(actual, expected, ["dest 0", "dest 1"])
    assert (m.mismatched, m.total) == (2, 16)
    assert m.first_mismatch["index"] == [1, 3] and m.first_mismatch["row"] == "dest 1"
    assert m.first_mismatch["expected_bits"] == "0x3f80" and m.first_mismatch["actual_bits"] == "0x3f81"
    assert m.max_ulp == 3 and m.max_ulp_index == [1, 5]
    assert m.ulp_histogram["1"] == 1 and m.ulp_histogram["3-4"] == 1
    assert m.mismatch_map["rows"] == ["dest 0", "dest 1"] and max(m.mismatch_map["fraction"][0]) == 0


def test_equal_tensors_have_no_detail():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    m = compare_bitwise(x, x.clone())
    assert (m.mismatched, m.max_ulp, m.first_mismatch, m.mismatch_map) == (0, 0, None, None)


def test_signed_zero_and_nan_are_bitwise():
    a = torch.tensor([0.0, float("nan"), 1.0])
    b = torch.tensor([-0.0, float("nan"), 1.0])
    m = compare_bitwise(a, b)
    assert m.mismatched == 1  # +0 vs -0 differ in bits; identical NaN bits match
    assert m.max_ulp == 0  # ... yet they are 0 ULP apart
    assert ulp_distance(torch.tensor([-1.0]), torch.tensor([1.0])).item() == 2 * 0x3F800000


def test_hex_bits_widths():
    assert hex_bits(torch.tensor(1.0, dtype=torch.float16)) == "0x3c00"
    assert hex_bits(torch.tensor(-2.0)) == "0xc0000000"


def test_message_speaks_assert_close():
    actual = torch.zeros(2, 4096)
    actual[1, :1275] = 1.0
    m = compare_bitwise(actual, torch.zeros(4096), ["copy 0", "copy 1"])
    rec = {"property": "rank-invariance", "mismatched": m.mismatched, "total": m.total, "max_abs": m.max_abs,
           "max_ulp": m.max_ulp, "first_mismatch": m.first_mismatch, "rerun": "ep-harness verify --check x",
           "detail": {"max_abs_index": m.max_abs_index, "max_ulp_index": m.max_ulp_index}}
    text = mismatch_text(rec)
    assert text.startswith("Tensor-likes are not equal!")
    assert "Mismatched elements: 1275 / 8192 (15.6%)" in text
    assert "Greatest absolute difference: 1 at index (1, 0)" in text
    assert "First mismatch: index (1, 0) (copy 1): 1.0 (0x3f800000) != 0.0 (0x00000000)" in text
    assert text.endswith("Rerun: ep-harness verify --check x")
