"""GPU-only checks of the harness's own device code. Skipped with the reason on machines
without CUDA; `ci/h200_run.sh` runs them on the lent H200 (`pytest -m gpu`)."""
import pytest
import torch

from ep_harness.compare import compare_bitwise
from ep_harness.kernels.bitcompare import bitwise_stats, triton

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


def test_a_silent_fallback_from_deepgemm_to_torch_mm_is_an_error(tmp_path):
    """The real DeepGEMM kernel is listed in its record; a subject that declares it and runs
    torch.mm gets numbers as right as DeepGEMM's and is still an `error`."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    try:
        import deep_gemm  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"deep_gemm is not importable ({exc}); install the deepgemm extra (docs/gpu.md)")
    proc = subprocess.run([sys.executable, "-m", "ep_harness", "verify", "--suite", "tests/cases/gpu_fallback.toml",
                           "--gpus", "1", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    records = [json.loads(line) for line in (tmp_path / "latest" / "results.jsonl").read_text().splitlines()]
    by_case = {r["case"]: r for r in records}
    real, fallback = by_case["deepgemm"], by_case["fallback"]
    assert real["status"] == "ok", real["reason"]
    assert any("deep_gemm::sm90_" in k or "deep_gemm::sm100_" in k for k in real["kernels"])  # "void deep_gemm::..."
    assert fallback["status"] == "error" and "but none ran" in fallback["reason"], fallback
    assert fallback["held"] is True  # the numbers were right: only the proof of path is missing
    assert not any("deep_gemm::" in k for k in fallback.get("kernels", []))
    assert proc.returncode != 0  # an error makes the run fail


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_gemm_problems_built_on_the_gpu_have_the_cpus_bits(dtype):
    """The GEMM family builds its problems (weights' scaling, FP8 quantization) where the
    check runs: every step is exact or one IEEE rounding, so the bits must be the CPU's."""
    from ep_harness.families.gemm_problem import build, dequantized, weights
    from ep_harness.inputs import values

    shape = dict(seed=3, groups=2, n=256, k=512, dtype=dtype, data="spread", cancel=True)
    (w_cpu, s_cpu), (w_gpu, s_gpu) = weights(**shape, device="cpu"), weights(**shape, device="cuda")
    assert w_gpu.is_cuda and torch.equal(w_gpu.cpu().view(torch.uint8), w_cpu.view(torch.uint8))
    if s_cpu is not None:
        assert torch.equal(s_gpu.cpu(), s_cpu)
    counts = [5, 130]
    rows = {g: values((c, 512), torch.bfloat16, 3, "rows", g, data="spread") for g, c in enumerate(counts)}
    built = [build("contiguous", dtype, rows, counts, w, s, 512, 128) for w, s in ((w_cpu, s_cpu), (w_gpu, s_gpu))]
    for name in ("a", "a_scale", "b", "b_scale", "grouped_layout"):
        cpu, gpu = getattr(built[0], name), getattr(built[1], name)
        assert (cpu is None) == (gpu is None)
        if cpu is not None:
            assert gpu.is_cuda and torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8)), name
    a_cpu, b_cpu = dequantized(built[0])
    a_gpu, b_gpu = dequantized(built[1])
    assert torch.equal(a_gpu.cpu(), a_cpu) and torch.equal(b_gpu.cpu(), b_cpu)


def test_a_profiler_range_named_after_a_kernel_is_not_traced_as_one():
    """A torch.mm inside record_function("deep_gemm::sm90_..."): the range may be mirrored onto
    the GPU timeline as a CUDA event of that name; the trace lists kernels only."""
    from ep_harness import kernel_trace

    a = torch.ones(256, 256, device="cuda")
    with kernel_trace.kernel_names(torch.device("cuda"), True) as names:
        with torch.profiler.record_function("deep_gemm::sm90_fake_range"):
            a @ a
    assert names, "no kernel traced at all"  # control: the GEMM's own kernel is there
    assert kernel_trace.missing(("deep_gemm::sm90_",), [names]) == ["deep_gemm::sm90_"], sorted(names)
