"""A batch-invariant dense matmul in Triton: C[M, N] = A[M, K] @ B[N, K]^T.

Why it is batch-invariant (cuBLAS is not: it picks kernel, tile and split-K from M):

* The tile configuration is a function of (N, K, dtype) only (`tile_config`), never of M.
* No split-K: one program computes a whole output tile, walking K from 0 upward in fixed
  BLOCK_K steps into one float32 accumulator, so every output element sees the same
  sequence of additions whatever M is. Rows are independent inside `tl.dot`: a row's
  result does not depend on the other rows of its tile (masked rows load zeros).
* The compiled kernel is the same for every M: M and the program count are excluded from
  Triton's value specialization (`do_not_specialize`), which would otherwise compile a
  separate variant for M == 1 or M divisible by 16.
* Persistent: min(SMs, tiles) programs each take tiles pid, pid + programs, ... . Which
  program computes a tile changes with M; what it computes does not.

Two kernels with the same tile walk: operands through TMA descriptors (bf16 where rows are
16-byte aligned: the fast path on Hopper), or through masked pointer loads. Which one runs is
part of the (N, K, dtype) configuration too. bf16 and float32 operands, float32 accumulation,
output in the operand dtype. float32 uses IEEE products (`input_precision="ieee"`), not TF32,
so it stays within the float32 bound (and runs on the FMA units, far below cuBLAS).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines without triton: the subject says why it is unavailable
    triton = None

DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # tiles of M walked together, for L2 reuse of B (order of tiles only)
    num_warps: int
    num_stages: int
    tma: bool = False  # operands and output through TMA descriptors (Hopper)


# Measured on the H200 (bf16, M = 1 .. 8192 at 4096 x 4096, 7168 x 7168, 2048 x 7168, candidates
# timed against cuBLAS interleaved, 2026-12-01): TMA 128 x 128 x 64 tiles, 4 warps, 5 stages came within 1.16x of cuBLAS for
# M >= 512 everywhere and at M = 256 on 7168 x 7168; 128 x 256 tiles matched cuBLAS (1.00-1.04x)
# from M = 1024 up but were 1.7-3.7x slower at M = 256-512 (too few tiles for 132 SMs without
# split-K). fp32 runs IEEE products on the FMA units (no tensor cores): small tiles.
_TMA_BF16 = TileConfig(128, 128, 64, 8, 4, 5, tma=True)
_POINTERS_BF16 = TileConfig(128, 128, 64, 8, 8, 4)  # rows not 16-byte aligned: no TMA
_FP32 = TileConfig(64, 64, 32, 8, 4, 3)


def tile_config(n: int, k: int, dtype: str) -> TileConfig:
    """The one tile configuration used for every M at this (N, K, dtype). Takes no M on
    purpose: choosing tiles by M is exactly what makes cuBLAS batch-variant."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"bi_matmul takes bfloat16 or float32 operands, not {dtype}")
    if n < 1 or k < 1:
        raise ValueError(f"bi_matmul needs N >= 1 and K >= 1, got N={n}, K={k}")
    if dtype == "float32":
        return _FP32
    return _TMA_BF16 if n % 8 == 0 and k % 8 == 0 else _POINTERS_BF16  # TMA: 16-byte row strides


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def program_count(tiles: int, device: torch.device) -> int:
    """Persistent grid: one program per SM at most (all tiles when fewer)."""
    if device.type != "cuda":  # the interpreter: few programs, so each walks several tiles
        return max(1, min(tiles, 4))
    return max(1, min(tiles, _sm_count(device.index if device.index is not None else torch.cuda.current_device())))


if triton is not None:

    @triton.jit
    def _tile_at(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        """(tile row, tile column) of the tile-th tile in grouped order: GROUP_M tile rows
        share each column of B while it is in L2. Both kernels walk tiles this way."""
        tiles_per_group = GROUP_M * tiles_n
        first_m = (tile // tiles_per_group) * GROUP_M
        rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (tile % tiles_per_group) % rows_here, (tile % tiles_per_group) // rows_here

    @triton.jit(do_not_specialize=["M", "num_programs"])
    def _bi_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, num_programs,
                          stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                          K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # K is a compile-time constant (one kernel per (N, K, dtype) anyway): the K loop
        # then has static bounds, which Triton pipelines and its interpreter can run.
        tiles_m, tiles_n, tile = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), tl.program_id(0)
        while tile < tiles_m * tiles_n:  # persistent: this program's tiles, num_programs apart
            tile_m, tile_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
            offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :] * stride_bk
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):  # K from 0 upward, the same steps for every tile
                a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K - k0), other=0.0)
                b = tl.load(b_ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < K - k0), other=0.0)
                acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
            tile += num_programs

    @triton.jit(do_not_specialize=["M", "num_programs"])
    def _bi_matmul_tma_kernel(a_desc, b_desc, c_desc, M, N, num_programs,
                              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # The same tile walk as _bi_matmul_kernel; TMA zero-fills reads past M (and K) and
        # clips the store, so no masks.
        tiles_m, tiles_n, tile = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), tl.program_id(0)
        while tile < tiles_m * tiles_n:  # persistent: this program's tiles, num_programs apart
            tile_m, tile_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
            off_m = tile_m * BLOCK_M
            off_n = tile_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):  # K from 0 upward, the same steps for every tile
                a = a_desc.load([off_m, k0])
                b = b_desc.load([off_n, k0])
                acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
            tile += num_programs


def launch_plan(m: int, n: int, k: int, dtype: str, device: torch.device,
                config: TileConfig | None = None) -> tuple[TileConfig, int]:
    """(tile configuration, programs) for one call. The configuration depends on (N, K,
    dtype) only; the program count may follow M (it changes who computes a tile, not how)."""
    config = config or tile_config(n, k, dtype)
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    return config, program_count(tiles, device)


def bi_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
              config: TileConfig | None = None) -> torch.Tensor:
    """C = a @ b.T with a [M, K], b [N, K] (both bf16 or both float32); writes `out` [M, N]
    (the operand dtype) when given. `config` overrides the (N, K, dtype) table (tests)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"bi_matmul needs a [M, K] and b [N, K]; got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in DTYPES:
        raise ValueError(f"bi_matmul needs both operands bfloat16 or both float32; got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"bi_matmul operands are on {a.device} and {b.device}; put both on one device")
    m, k = a.shape
    n = b.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != a.dtype:
        raise ValueError(f"out must be [{m}, {n}] {a.dtype}; got {tuple(out.shape)} {out.dtype}")
    if triton is None:
        raise RuntimeError("bi_matmul needs triton; pip install 'ep-harness[gpu]'")
    if m == 0:
        return out
    cfg, programs = launch_plan(m, n, k, DTYPES[a.dtype], a.device, config)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    if cfg.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        for name, t in (("a", a), ("b", b), ("out", out)):
            if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
                raise ValueError(f"bi_matmul's TMA path needs {name} with unit column stride, 16-byte aligned "
                                 f"start and row stride; pass {name}.contiguous() (a fresh allocation)")

        _bi_matmul_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(b, [cfg.block_n, cfg.block_k]),
            TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n]),
            m, n, programs, K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out
    _bi_matmul_kernel[(programs,)](
        a, b, out, m, n, programs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
