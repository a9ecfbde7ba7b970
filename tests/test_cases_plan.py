"""Case files and the planner: validation errors name the file and the fix; grids expand;
what the machine cannot run is skipped with its reason."""
import pytest

from ep_harness import subject as registry
from ep_harness.cases import load_suite
from ep_harness.environment import pinned_env
from ep_harness.nccl.pins import nccl_algo_for_tree
from ep_harness.errors import HarnessError
from ep_harness.run.plan import expand, jobs
from ep_harness.subject import Platform

CPU4 = Platform(backend="gloo", device="cpu", ranks=4)
GPU4 = Platform(backend="nccl", device="cuda", ranks=4, gpu_name="H200")

GOOD = """
[[case]]
name = "rs"
subject = "reduce_scatter_native"
properties = ["rank-invariance", "batch-invariance"]
expect = { gloo = "violated", nccl = "violated" }
[case.grid]
dtype = ["bfloat16", "float32"]
world_size = [3, 4, 8]
"""


@pytest.fixture(autouse=True)
def subjects():
    registry.load_all()


def write(tmp_path, text, name="suite.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_grid_expands_and_skips_with_reasons(tmp_path):
    checks = expand(load_suite(write(tmp_path, GOOD)), CPU4)
    assert len(checks) == 2 * 2 * 3
    skipped = [c for c in checks if c.skip_reason]
    assert {c.world_size for c in skipped} == {8}
    assert skipped[0].skip_reason == "needs 8 ranks; this run has 4 (the CPU default of 4 gloo ranks)"
    assert checks[0].id == "rs/rank-invariance/dtype=bfloat16/world_size=3"
    assert [ws for ws, _, _ in jobs(checks)] == [3, 4]


def test_expectation_follows_the_backend(tmp_path):
    text = GOOD.replace('{ gloo = "violated", nccl = "violated" }', '{ gloo = "violated", nccl = "holds" }')
    suite = load_suite(write(tmp_path, text))
    assert {c.expect for c in expand(suite, CPU4)} == {"violated"}
    assert {c.expect for c in expand(suite, GPU4)} == {"holds"}


def test_graph_mode_needs_a_gpu(tmp_path):
    text = GOOD.replace('properties = ["rank-invariance", "batch-invariance"]', 'properties = ["graph-invariance"]')
    checks = expand(load_suite(write(tmp_path, text.replace("reduce_scatter_native", "all_gather_fold"))), CPU4)
    assert {c.skip_reason for c in checks if c.world_size < 8} == {"CUDA graphs need a GPU"}


def test_uneven_shards_are_refused_by_the_even_only_subject(tmp_path):
    text = GOOD + '[case.params]\nshards = "uneven"\n'
    checks = expand(load_suite(write(tmp_path, text)), CPU4)
    assert "uneven shards are reduce_scatterv_native" in checks[0].skip_reason


@pytest.mark.parametrize("text, message", [
    ("[[case]\nname='x'", "malformed TOML"),
    (GOOD.replace('subject = "reduce_scatter_native"', 'subject = "nope"'), "unknown subject 'nope'"),
    (GOOD.replace('"rank-invariance", ', '"rank-invariant", '), "property 'rank-invariant' is not defined"),
    (GOOD.replace('"bfloat16", ', '"bf16", '), "dtype = 'bf16'; choose one of bfloat16, float16, float32"),
    (GOOD.replace("world_size = [3, 4, 8]", "world_size = [0]"), "world_size = 0: values below 1 are impossible"),
    (GOOD.replace('name = "rs"', 'name = "rs"\ncolour = "red"'), "unknown key(s) colour"),
    (GOOD.replace('expect = { gloo = "violated", nccl = "violated" }', 'expect = "maybe"'), "expect gloo = 'maybe'"),
    (GOOD.replace("[case.grid]", 'env = { NCCL_NVLS_ENABLE = "1" }\n[case.grid]'), "NCCL_NVLS_ENABLE=1 is refused"),
    (GOOD.replace("dtype = [", "dtype = 3 #"), "grid.dtype = 3 is not a non-empty list"),
    (GOOD + GOOD, "the name is used twice"),
    ("[suite]\nname='x'\n", "no [[case]] tables"),
    (GOOD.replace('name = "rs"', 'name = "rs\\n# OK: 99 ok"'), "contains the control character '\\n'"),
    (GOOD.replace("[case.grid]", '[case.params]\nshards = "even\\u001b[31m"\n[case.grid]'),
     "the case.params.shards contains the control character '\\x1b'"),
])
def test_bad_case_files_name_the_problem(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(HarnessError) as err:
        expand(load_suite(path), CPU4)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_case_file(tmp_path):
    with pytest.raises(HarnessError, match="not found"):
        load_suite(tmp_path / "nope.toml")


@pytest.mark.parametrize("version, algo", [((2, 28, 9), "allreduce:tree"), ((2, 24, 0), "allreduce:tree"),
                                           ((2, 23, 4), "Tree"), (None, "Tree")])
def test_nccl_algo_is_spelled_by_version(version, algo):
    assert nccl_algo_for_tree(version) == algo


def test_pinned_env_never_enables_multicast():
    env = pinned_env(GPU4, {"NCCL_ALGO": "reducescatter:ring", "NCCL_NVLS_ENABLE": "1"})
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["NCCL_ALGO"] == "reducescatter:ring"
    assert env["NCCL_MIN_NCHANNELS"] == env["NCCL_MAX_NCHANNELS"]
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # NCCL's own log is how the harness knows which algorithm ran: always on, TUNING included.
    quiet = pinned_env(GPU4, {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "NET"})
    assert quiet["NCCL_DEBUG"] == "INFO" and quiet["NCCL_DEBUG_SUBSYS"] == "NET,INIT,GRAPH,TUNING,ENV"
    assert "NCCL_DEBUG" not in pinned_env(CPU4, {})


def test_emulated_hosts_are_a_topology_of_their_own(tmp_path):
    emulated = Platform(backend="nccl", device="cuda", ranks=8, gpu_name="NVIDIA H200", gpus=1, emulation="hosts")
    assert (emulated.topology.kind, emulated.topology.ranks, emulated.topology.gpus) == ("emulated-hosts", 8, 1)
    assert "not an NVLink node" in emulated.topology.describe()
    assert GPU4.topology.kind == "gpus" and CPU4.topology.kind == "cpu-gloo"
    checks = expand(load_suite(write(tmp_path, GOOD)), emulated)
    assert {c.topology for c in checks} == {emulated.topology.describe()}
    assert all(c.skip_reason is None for c in checks if c.world_size <= 8)


def test_gpu_only_cases_are_skipped_on_the_cpu(tmp_path):
    text = GOOD + "[case.params]\ngpu_only = true\n"
    suite = load_suite(write(tmp_path, text))
    assert {c.skip_reason for c in expand(suite, CPU4) if c.world_size < 8} == \
        {"sized for GPUs (gpu_only = true in the case file)"}
    assert all(c.skip_reason is None for c in expand(suite, GPU4) if c.world_size <= 4)


def test_deep_gemm_kernels_are_cached_in_a_stable_directory(monkeypatch, tmp_path):
    nccl = Platform(backend="nccl", device="cuda", ranks=1, gpus=1, gpu_name="NVIDIA H200")
    monkeypatch.delenv("DG_JIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert pinned_env(nccl, {})["DG_JIT_CACHE_DIR"] == str(tmp_path / "ep-harness" / "deep_gemm")
    monkeypatch.setenv("DG_JIT_CACHE_DIR", "/mine")  # a user's own setting wins
    assert pinned_env(nccl, {})["DG_JIT_CACHE_DIR"] == "/mine"


def test_only_jit_compiling_subjects_are_warmed_up_before_timing():
    from ep_harness.families.collective import CollectiveParams
    from ep_harness.families.gemm import GemmParams
    from ep_harness.families.moe_scenario import MoeParams
    from ep_harness.families.quant import QuantParams
    from ep_harness.subject import compiles_kernels

    registry.load_all()
    fp8 = GemmParams(dtype="float8_e4m3fn", layout="contiguous")
    assert compiles_kernels(registry.get("deepgemm_fp8_contiguous"), fp8)
    assert compiles_kernels(registry.get("deepgemm_fp8_quant"), QuantParams())
    assert not compiles_kernels(registry.get("torch_mm"), GemmParams(dtype="bfloat16", layout="contiguous"))
    assert not compiles_kernels(registry.get("reduce_scatter_native"), CollectiveParams(dtype="bfloat16"))
    moe = registry.get("composed_moe")  # the MoE layer compiles when one of its stages does
    assert compiles_kernels(moe, MoeParams(gemm="deepgemm_bf16_contiguous")) and not compiles_kernels(moe, MoeParams())
