"""GPU-only checks of the harness's own device code. Skipped with the reason on machines
without CUDA; `ci/h200_run.sh` runs them on the lent H200 (`pytest -m gpu`)."""
import pytest
import torch

from harness.compare import compare_bitwise
from harness.kernels.bitcompare import bitwise_stats, triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU, found none"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_comparison_agrees_with_torch(dtype):
    if triton is None:
        pytest.skip("triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(3_000_017, device="cuda", generator=g).to(dtype)
    b = a.clone()
    for i, idx in enumerate([5, 77_777, 3_000_016]):
        b[idx] = -b[idx] if i % 2 else b[idx] * 3
    fused, plain = bitwise_stats(a, b, use_triton=True), bitwise_stats(a, b, use_triton=False)
    assert fused == plain and fused[0] == 3 and fused[2] == 5
    assert bitwise_stats(a, a.clone(), use_triton=True) == (0, 0, None)


def test_comparison_stays_on_the_device():
    a = torch.zeros(4, 4096, device="cuda", dtype=torch.bfloat16)
    b = a.clone()
    b[2, 100] = 1.0
    m = compare_bitwise(b, a[0], ["r0", "r1", "r2", "r3"])
    assert (m.mismatched, m.first_mismatch["index"], m.first_mismatch["row"]) == (1, [2, 100], "r2")
    assert m.mismatch_map["fraction"][2][1] > 0
