"""A batch-invariant dense matmul in Triton: C[M, N] = A[M, K] @ B[N, K]^T.

Why it is batch-invariant (cuBLAS is not: it picks kernel and split-K from M):

* One K walk per (N, K, dtype), whatever M is: K cut into `k_splits` equal segments (1 unless
  the table says otherwise for that (N, K)), each walked from its start upward into its own
  float32 accumulator, the tensor cores adding 16 products at a time, then the segments'
  sums added in segment order. Every output element sees the same sequence of additions.
  Rows and columns are independent inside `tl.dot`: an element's result does not depend on
  the other rows or columns of its tile (masked rows load zeros).
* Split-K without changing that order: a split count is a property of (N, K), never of M. At
  small M (few tiles) each segment goes to its own program (`split_parallel`), which writes
  its float32 sum to a workspace; the tile's last program to arrive adds the segments in
  segment order and stores the tile. At larger M one program walks the segments side by side,
  each into its own accumulator, and adds them in the same order. Both give the same bits
  (checked on the GPU by the tuner).
* Tiles may follow M (`tile_config`), the walk may not: the tile's rows, columns, K depth per
  pipeline stage, warps and stages change how many programs share the work, not the order of
  an element's additions. Every table entry's K depth divides K (no zero-padded K steps), and
  the whole output of every tile shape in the table is measured bit-identical to the
  reference tiles' on the GPU before it is used (harness/cost/tune_bi_matmul.py; the table,
  bi_matmul_tiles.json, beside this file). Small M get small tiles so that they, too, use
  every SM (and, at a thin N, one program per K segment). Where main's tiles would
  leave a last wave part-filled, the rows past the whole waves go to smaller tiles
  (`TilePlan.tail`), in a second launch or in the same one (`one_launch`), again without
  changing any element's walk.
* The compiled kernel does not depend on M beyond its tiles: M and the program count are
  excluded from Triton's value specialization (`do_not_specialize`), which would otherwise
  compile a separate variant for M == 1 or M divisible by 16.
* Persistent: min(SMs x programs per SM, tiles) programs each take tiles pid, pid +
  programs, ... . Which program computes a tile changes with M; what it computes does not.
* Another kernel with the same walk may run an M (`TilePlan.library`): DeepGEMM's Hopper BF16
  dense GEMM zeroes one float32 accumulator per element and adds the tensor cores' 16-product
  steps from K = 0 upward, never splitting K, as the unsplit tiles do. The tuner routes an M of
  an unsplit (N, K) there only where its whole output matched the reference tiles' bit for bit
  and it ran faster; wherever the route may not run (library_route.py), the entry's tiles do.

Two kernels with the same tile walk: operands through TMA descriptors (bf16 where rows are
16-byte aligned: the fast path on Hopper; at small M, A's rows and C's through masked pointers,
`masked_rows`), or through masked pointer loads (one tile shape for every M). bf16 and float32
operands, float32 accumulation, output in the operand dtype. float32 uses IEEE products
(`input_precision="ieee"`), not TF32, so it stays within the float32 bound (and runs on the
FMA units, far below cuBLAS), with one tile shape.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ep_harness.kernels import library_route

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
    ctas_per_sm: int = 1  # persistent programs per SM (small tiles leave room for two)
    # Triton's software pipelining across tiles: "" (each tile's K loop alone), "flatten" (the
    # next tile's loads overlap this tile's epilogue) or "warp_specialize" (producer and
    # consumer warps). They schedule the same tile walk, not another order of additions.
    schedule: str = ""
    # K cut into this many equal segments, their sums added in segment order (part of the K
    # walk: every tile shape of one (N, K) has the same); `split_parallel`: one program per
    # segment, partial sums through a workspace, instead of one program walking them all.
    k_splits: int = 1
    split_parallel: bool = False
    # A's rows loaded and C's stored through masked pointer accesses (rows past M read as zeros,
    # never written), B still through TMA: a TMA box reaching far past A's last row was measured
    # 2x slower (H200, results/2026-12-02-cost-parked/tune.json: 64 x 32 tiles at N x K = 2048 x 7168
    # took 29 us at M = 1, 13 us at M = 64). The same walk.
    masked_rows: bool = False
    # Two segments one after the other in one program (`k_splits` = 2): the first's float32 sum
    # parked in a workspace slot of the program's own through TMA while the second is walked, then
    # read back and added, column half by column half. One accumulator in registers, so 128 x 256
    # tiles fit; the side-by-side walk's two leave room for 128 x 128 only. The same additions.
    parked: bool = False


@dataclass(frozen=True)
class TilePlan:
    """The tiles for one M: `main`, and `tail` for the rows past the last whole wave of main's
    tiles, in a second launch (M = 2,048 at N = 7,168 makes 3.4 waves of 128 x 256 tiles on 132
    SMs: 3 waves of them, then the last 256 rows in smaller tiles). Same K walk, so the same bits.
    `one_launch`: both in one persistent launch (TMA tiles of one walk, the same warps and
    stages), each program going on to tail tiles when its main tiles are done, with no gap
    between two launches and no second fill of the machine."""
    main: TileConfig
    tail: TileConfig | None = None
    one_launch: bool = False
    # "deepgemm": the call goes to DeepGEMM's BF16 dense GEMM, whose Hopper kernel walks K as the
    # unsplit tiles do, where the route may run (kernels/library_route.py says where), and to
    # these tiles elsewhere. The tuner routes an M there only after DeepGEMM's whole output
    # matched the unsplit reference's bit for bit.
    library: str = ""


# Measured on the H200 (bf16, 2026-12-01): TMA 128 x 128 x 64 tiles, 4 warps, 5 stages came
# within 1.16x of cuBLAS for M >= 512; the tiles every M used before the table, and the
# reference whose bits every tuned tile shape must reproduce.
REFERENCE_TILES = TileConfig(128, 128, 64, 8, 4, 5, tma=True)
_POINTERS_BF16 = TileConfig(128, 128, 64, 8, 8, 4)  # rows not 16-byte aligned: no TMA, one shape
_FP32 = TileConfig(64, 64, 32, 8, 4, 3)  # IEEE products on the FMA units: small tiles, one shape
# Untuned shapes: the largest of these whose tile count fills the SMs (all with K depth 64).
_LADDER = (TileConfig(128, 256, 64, 8, 8, 3, tma=True), REFERENCE_TILES, TileConfig(64, 128, 64, 8, 4, 6, tma=True),
           TileConfig(64, 64, 64, 8, 4, 6, tma=True), TileConfig(64, 32, 64, 8, 4, 6, tma=True))
TILES_FILE = Path(__file__).with_name("bi_matmul_tiles.json")
H200_SMS = 132


def k_walk(config: TileConfig, k: int) -> tuple:
    """What fixes an element's order of additions: the K steps (zero-padded to a multiple of
    the K depth), the kernel and the K segments. Every tile shape used at one (N, K, dtype)
    has the same; whether segments run in one program or several is not part of it."""
    return (-(-k // config.block_k) * config.block_k, config.tma, config.k_splits)


def tile_count(m: int, n: int, config: TileConfig) -> int:
    """Tiles of `config` over an [m, n] output."""
    return -(-m // config.block_m) * -(-n // config.block_n)


def walk_reference(k_splits: int = 1) -> TileConfig:
    """The reference tiles walking K in `k_splits` segments, one program per tile: the bits every
    tuned tile shape of an (N, K) with that split count must reproduce. Split, they are
    smaller: the segments' loads advance side by side, each with its own pipeline stages in
    shared memory."""
    if k_splits == 1:
        return REFERENCE_TILES
    return TileConfig(64, 64, 64, 8, 4, 2, tma=True, k_splits=k_splits)


def stages_that_fit(config: TileConfig, shared_bytes: int = 227 * 1024) -> int:
    """The most pipeline stages (at most config's) whose bf16 operand buffers fit in shared
    memory beside the output tile, with every segment of a one-program split walk loading side
    by side (Hopper: 227 KiB a block; fewer than 2 stages: the tiles do not pipeline there)."""
    side_by_side = config.k_splits if not (config.split_parallel or config.parked) else 1
    stage = side_by_side * (config.block_m + config.block_n) * config.block_k * 2
    room = shared_bytes - config.block_m * config.block_n * 2
    return min(config.num_stages, room // stage)


def tile_problem(config: TileConfig, k: int) -> str | None:
    """Why `config` cannot walk K = k (None: it can)."""
    if config.masked_rows and not config.tma:
        return "masked_rows is a TMA kernel's option (tma=True); the pointer kernel masks every row already"
    if config.k_splits < 1 or (config.split_parallel and config.k_splits < 2):
        return f"k_splits must be >= 1 (>= 2 with split_parallel), not {config.k_splits}"
    if config.k_splits > 1 and not config.tma:
        return "split K needs the TMA kernel (tma=True)"
    if config.parked and (config.k_splits != 2 or config.split_parallel or config.masked_rows or config.schedule
                          or config.block_n % 32):
        return ("parked walks K in 2 segments in one program (k_splits=2, not split_parallel, masked_rows or a "
                "schedule) with block_n a multiple of 32")
    if config.k_splits > 1 and k % (config.k_splits * config.block_k):
        return (f"K = {k} is not {config.k_splits} segments of whole {config.block_k}-deep K steps; "
                f"choose k_splits and block_k with k_splits x block_k dividing K")
    return None


def plan_problem(plan: TilePlan) -> str | None:
    """Why `plan` cannot run as it says (None: it can)."""
    if plan.library and (library_route.name_problem(plan.library) or plan.main.k_splits != 1):
        return (f"library {plan.library!r}: the only library route is 'deepgemm', for the unsplit K walk "
                "(k_splits=1)")
    if not plan.one_launch:
        return None
    tiles = (plan.main, plan.tail)
    if plan.tail is None or not all(c.tma and not (c.masked_rows or c.split_parallel or c.parked or c.schedule)
                                    for c in tiles):
        return ("one_launch needs a tail, and TMA tiles walked in one program each "
                "(no masked_rows, split_parallel, parked or schedule)")
    if len({(c.num_warps, c.num_stages, c.k_splits, c.ctas_per_sm) for c in tiles}) != 1:
        return ("one_launch's main and tail tiles must share warps, stages, k_splits and ctas_per_sm "
                "(one launch has one of each)")
    return None


@functools.lru_cache(maxsize=None)
def tuned_tiles(path: Path = TILES_FILE) -> dict[tuple[int, int], tuple[tuple[int | None, TilePlan], ...]]:
    """(N, K) -> ((largest M, tiles), ...) from the tuner's table; refuses an entry whose K
    walk is not the reference's (it would make bits follow M)."""
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    table = {}
    for shape, entries in raw["shapes"].items():
        n, k = (int(x) for x in shape.split("x"))
        buckets = tuple((e["max_m"], TilePlan(TileConfig(**e["config"]),
                                              TileConfig(**e["tail"]) if e.get("tail") else None,
                                              e.get("one_launch", False), e.get("library", "")))
                        for e in entries)
        configs = [cfg for _, plan in buckets for cfg in (plan.main, plan.tail) if cfg is not None]
        reference = walk_reference(configs[0].k_splits)
        for problem in filter(None, (plan_problem(plan) for _, plan in buckets)):
            raise ValueError(f"{path}: a {shape} plan: {problem}; re-run python3 -m ep_harness.cost.tune_bi_matmul")
        for cfg in configs:
            if k_walk(cfg, k) != k_walk(reference, k) or k % cfg.block_k or tile_problem(cfg, k):
                raise ValueError(f"{path}: the {shape} tiles {cfg} walk K differently from the reference tiles "
                                 f"(or from the shape's other tiles); re-run python3 -m ep_harness.cost.tune_bi_matmul")
        if buckets[-1][0] is not None:
            raise ValueError(f"{path}: the {shape} entries end at M = {buckets[-1][0]}; the last must cover every M")
        table[(n, k)] = buckets
    return table


def tile_config(m: int, n: int, k: int, dtype: str, sms: int = H200_SMS) -> TileConfig:
    """The main tiles for one call (`tile_plan`'s main)."""
    return tile_plan(m, n, k, dtype, sms).main


def tile_plan(m: int, n: int, k: int, dtype: str, sms: int = H200_SMS) -> TilePlan:
    """The tiles for one call. The K walk (`k_walk`) depends on (N, K, dtype) only; the tile
    shape follows M so that small M still make enough tiles for every SM."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"bi_matmul takes bfloat16 or float32 operands, not {dtype}")
    if n < 1 or k < 1:
        raise ValueError(f"bi_matmul needs N >= 1 and K >= 1, got N={n}, K={k}")
    if dtype == "float32":
        return TilePlan(_FP32)
    if n % 8 or k % 8:  # TMA needs 16-byte row strides
        return TilePlan(_POINTERS_BF16)
    for max_m, plan in tuned_tiles().get((n, k), ()):
        if max_m is None or m <= max_m:
            return plan
    for cfg in _LADDER:
        if tile_count(m, n, cfg) >= sms:
            return TilePlan(cfg)
    return TilePlan(_LADDER[-1])


def row_slices(m: int, n: int, plan: TilePlan, sms: int) -> list[tuple[int, int, TileConfig]]:
    """(first row, end row, tiles) of each launch: main's tiles over the rows that fill whole
    waves of programs, the tail's over the rest; one launch where there is no tail, or where
    main's last wave is at least half full (a second launch would cost more than it saves)."""
    main = plan.main
    tiles_n = -(-n // main.block_n)
    per_wave = sms * main.ctas_per_sm
    tiles = tile_count(m, n, main)
    whole_waves, rest = divmod(tiles, per_wave)
    rows = (whole_waves * per_wave // tiles_n) * main.block_m
    if plan.tail is None or rows <= 0 or rows >= m or rest * 2 >= per_wave:
        return [(0, m, main)]
    return [(0, rows, main), (rows, m, plan.tail)]


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def program_count(tiles: int, device: torch.device, ctas_per_sm: int = 1) -> int:
    """Persistent grid: `ctas_per_sm` programs per SM at most (all tiles when fewer)."""
    if device.type != "cuda":  # the interpreter: few programs, so each walks several tiles
        return max(1, min(tiles, 4))
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(tiles, sms * ctas_per_sm))


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

    @triton.jit
    def _a_tile(a, off_m, k, M, stride_am, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                MASKED_ROWS: tl.constexpr):
        """A's [BLOCK_M, BLOCK_K] tile at (off_m, k): `a` is a TMA descriptor (which zero-fills reads
        past M and K), or with MASKED_ROWS A's pointer, rows past M loaded as zeros."""
        if MASKED_ROWS:
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = k + tl.arange(0, BLOCK_K)
            return tl.load(a + rows[:, None].to(tl.int64) * stride_am + cols[None, :],
                           mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0)
        else:
            return a.load([off_m, k])

    @triton.jit
    def _store_tile(c, off_m, off_n, acc, M, N, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASKED_ROWS: tl.constexpr):
        """acc into C at (off_m, off_n) in C's dtype: through its TMA descriptor (which clips at M
        and N), or with MASKED_ROWS through C's pointer, rows past M and columns past N left alone."""
        if MASKED_ROWS:
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            tl.store(c + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], acc.to(c.dtype.element_ty),
                     mask=(rows[:, None] < M) & (cols[None, :] < N))
        else:
            c.store([off_m, off_n], acc.to(c.dtype))

    @triton.jit
    def _step(a, b_desc, off_m, off_n, k, acc, M, stride_am, K: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_K: tl.constexpr, MASKED_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """acc plus one K step's products (TMA zero-fills B's reads past N and K)."""
        a_tile = _a_tile(a, off_m, k, M, stride_am, K, BLOCK_M, BLOCK_K, MASKED_ROWS)
        return tl.dot(a_tile, b_desc.load([off_n, k]).T, acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _segment(a, b_desc, off_m, off_n, k_first, M, stride_am, K: tl.constexpr, K_SEGMENT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASKED_ROWS: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
        """One tile's products over K = k_first .. k_first + K_SEGMENT, from k_first upward into a
        float32 accumulator that starts at zero."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_SEGMENT, BLOCK_K):  # static bounds: Triton pipelines the loop
            acc = _step(a, b_desc, off_m, off_n, k_first + k0, acc, M, stride_am, K, BLOCK_M, BLOCK_K, MASKED_ROWS,
                        DOT_PRECISION)
        return acc

    @triton.jit
    def _tile_walk(a, b_desc, off_m, off_n, M, stride_am, K: tl.constexpr, K_SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASKED_ROWS: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
        """A whole tile in one program: K_SPLITS segments, their sums added in segment order (the
        order the split programs' last arrival adds them in). Two or four segments advance side
        by side in one pipelined loop, each into its own accumulator, each still from its start
        upward: the same additions as one segment after the other, without restarting the
        pipeline at every segment."""
        SEG: tl.constexpr = K // K_SPLITS
        if K_SPLITS == 1:
            total = _segment(a, b_desc, off_m, off_n, 0, M, stride_am, K, K, BLOCK_M, BLOCK_N, BLOCK_K, MASKED_ROWS,
                             DOT_PRECISION)
        elif K_SPLITS == 2:
            acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, SEG, BLOCK_K):
                acc0 = _step(a, b_desc, off_m, off_n, k0, acc0, M, stride_am, K, BLOCK_M, BLOCK_K, MASKED_ROWS,
                             DOT_PRECISION)
                acc1 = _step(a, b_desc, off_m, off_n, SEG + k0, acc1, M, stride_am, K, BLOCK_M, BLOCK_K, MASKED_ROWS,
                             DOT_PRECISION)
            total = acc0 + acc1
        elif K_SPLITS == 4:
            acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, SEG, BLOCK_K):
                acc0 = _step(a, b_desc, off_m, off_n, k0, acc0, M, stride_am, K, BLOCK_M, BLOCK_K, MASKED_ROWS,
                             DOT_PRECISION)
                acc1 = _step(a, b_desc, off_m, off_n, SEG + k0, acc1, M, stride_am, K, BLOCK_M, BLOCK_K, MASKED_ROWS,
                             DOT_PRECISION)
                acc2 = _step(a, b_desc, off_m, off_n, 2 * SEG + k0, acc2, M, stride_am, K, BLOCK_M, BLOCK_K,
                             MASKED_ROWS, DOT_PRECISION)
                acc3 = _step(a, b_desc, off_m, off_n, 3 * SEG + k0, acc3, M, stride_am, K, BLOCK_M, BLOCK_K,
                             MASKED_ROWS, DOT_PRECISION)
            total = ((acc0 + acc1) + acc2) + acc3
        else:  # other counts: one segment after the other
            total = _segment(a, b_desc, off_m, off_n, 0, M, stride_am, K, SEG, BLOCK_M, BLOCK_N, BLOCK_K, MASKED_ROWS,
                             DOT_PRECISION)
            for s in tl.static_range(1, K_SPLITS):
                total += _segment(a, b_desc, off_m, off_n, s * SEG, M, stride_am, K, SEG, BLOCK_M, BLOCK_N, BLOCK_K,
                                  MASKED_ROWS, DOT_PRECISION)
        return total

    @triton.jit(do_not_specialize=["M", "num_programs"])
    def _bi_matmul_tma_kernel(a, b_desc, c, M, N, num_programs, stride_am, stride_cm,
                              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                              K_SPLITS: tl.constexpr, MASKED_ROWS: tl.constexpr):
        # The same tile walk as _bi_matmul_kernel (in K_SPLITS segments); TMA (or the row mask)
        # clips the store.
        tiles_m, tiles_n, tile = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), tl.program_id(0)
        while tile < tiles_m * tiles_n:  # persistent: this program's tiles, num_programs apart
            tile_m, tile_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
            acc = _tile_walk(a, b_desc, tile_m * BLOCK_M, tile_n * BLOCK_N, M, stride_am, K, K_SPLITS,
                             BLOCK_M, BLOCK_N, BLOCK_K, MASKED_ROWS, DOT_PRECISION)
            _store_tile(c, tile_m * BLOCK_M, tile_n * BLOCK_N, acc, M, N, stride_cm, BLOCK_M, BLOCK_N, MASKED_ROWS)
            tile += num_programs

    @triton.jit(do_not_specialize=["M", "num_programs"])
    def _bi_matmul_tma_scheduled_kernel(a, b_desc, c, M, N, num_programs, stride_am, stride_cm,
                                        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                        K_SPLITS: tl.constexpr, MASKED_ROWS: tl.constexpr, FLATTEN: tl.constexpr,
                                        WARP_SPECIALIZE: tl.constexpr):
        # _bi_matmul_tma_kernel's walk as a tl.range loop, which Triton can pipeline across
        # tiles (FLATTEN) or split into producer and consumer warps (WARP_SPECIALIZE).
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=FLATTEN,
                             warp_specialize=WARP_SPECIALIZE):
            tile_m, tile_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
            acc = _tile_walk(a, b_desc, tile_m * BLOCK_M, tile_n * BLOCK_N, M, stride_am, K, K_SPLITS,
                             BLOCK_M, BLOCK_N, BLOCK_K, MASKED_ROWS, DOT_PRECISION)
            _store_tile(c, tile_m * BLOCK_M, tile_n * BLOCK_N, acc, M, N, stride_cm, BLOCK_M, BLOCK_N, MASKED_ROWS)

    @triton.jit(do_not_specialize=["M_MAIN", "M_TAIL", "num_programs"])
    def _bi_matmul_tma_one_launch_kernel(a, b_desc, c, a_tail, b_tail, c_tail, M_MAIN, M_TAIL, N, num_programs,
                                         K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                         BLOCK_K: tl.constexpr, TAIL_M: tl.constexpr, TAIL_N: tl.constexpr,
                                         TAIL_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                         K_SPLITS: tl.constexpr):
        # TilePlan.one_launch: main's tiles over the first M_MAIN rows (a, c), then the tail's
        # over the next M_TAIL (a_tail, c_tail: descriptors of those rows), each tile walked by
        # _tile_walk as in _bi_matmul_tma_kernel. A program's items continue from main into the
        # tail: the programs that ran out of main tiles first take the first tail tiles.
        tiles_n = tl.cdiv(N, BLOCK_N)
        main_tiles = tl.cdiv(M_MAIN, BLOCK_M) * tiles_n
        item = tl.program_id(0)
        while item < main_tiles:
            tile_m, tile_n = _tile_at(item, tl.cdiv(M_MAIN, BLOCK_M), tiles_n, GROUP_M)
            acc = _tile_walk(a, b_desc, tile_m * BLOCK_M, tile_n * BLOCK_N, M_MAIN, 0, K, K_SPLITS,
                             BLOCK_M, BLOCK_N, BLOCK_K, False, DOT_PRECISION)
            _store_tile(c, tile_m * BLOCK_M, tile_n * BLOCK_N, acc, M_MAIN, N, 0, BLOCK_M, BLOCK_N, False)
            item += num_programs
        item -= main_tiles  # (pid - main_tiles) mod num_programs: every tail item once
        tail_tiles_m, tail_tiles_n = tl.cdiv(M_TAIL, TAIL_M), tl.cdiv(N, TAIL_N)
        while item < tail_tiles_m * tail_tiles_n:
            tile_m, tile_n = _tile_at(item, tail_tiles_m, tail_tiles_n, GROUP_M)
            acc = _tile_walk(a_tail, b_tail, tile_m * TAIL_M, tile_n * TAIL_N, M_TAIL, 0, K, K_SPLITS,
                             TAIL_M, TAIL_N, TAIL_K, False, DOT_PRECISION)
            _store_tile(c_tail, tile_m * TAIL_M, tile_n * TAIL_N, acc, M_TAIL, N, 0, TAIL_M, TAIL_N, False)
            item += num_programs

    @triton.jit
    def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """acc's left and right column halves (a relabeling of the accumulator's registers)."""
        return acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()

    @triton.jit
    def _parked_written(token):
        """Wait until this thread's TMA stores have reached global memory (Triton's own wait
        only frees their shared-memory source), then order them before TMA reads."""
        return tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, $1;",
                                         "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit(do_not_specialize=["M", "num_programs"])
    def _bi_matmul_tma_parked_kernel(a, b_desc, c_half, park, M, N, num_programs, stride_am, stride_cm,
                                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                     ON_GPU: tl.constexpr):
        # _tile_walk's two segments, one after the other: the first's sum to this program's slot of
        # `park` (rows pid * BLOCK_M ..), the second's walked from zero, then slot + second, which
        # is acc0 + acc1 (float32 addition is commutative), stored through C's half-tile descriptor.
        HALF: tl.constexpr = BLOCK_N // 2
        SEG: tl.constexpr = K // 2
        tiles_m, tiles_n, tile = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), tl.program_id(0)
        slot = tl.program_id(0) * BLOCK_M
        while tile < tiles_m * tiles_n:  # persistent: this program's tiles, num_programs apart
            tile_m, tile_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
            off_m, off_n = tile_m * BLOCK_M, tile_n * BLOCK_N
            first = _segment(a, b_desc, off_m, off_n, 0, M, stride_am, K, SEG, BLOCK_M, BLOCK_N, BLOCK_K, False,
                             DOT_PRECISION)
            left, right = _halves(first, BLOCK_M, BLOCK_N)
            park.store([slot, 0], left)
            park.store([slot, HALF], right)
            second = _segment(a, b_desc, off_m, off_n, SEG, M, stride_am, K, SEG, BLOCK_M, BLOCK_N, BLOCK_K, False,
                              DOT_PRECISION)
            if ON_GPU:
                _parked_written(tile)
            tl.debug_barrier()
            left, right = _halves(second, BLOCK_M, BLOCK_N)
            c_half.store([off_m, off_n], (park.load([slot, 0]) + left).to(c_half.dtype))
            c_half.store([off_m, off_n + HALF], (park.load([slot, HALF]) + right).to(c_half.dtype))
            tile += num_programs

    @triton.jit(do_not_specialize=["M", "num_programs"])
    def _bi_matmul_tma_split_kernel(a, b_desc, c, partial_ptr, arrivals_ptr, M, N, num_programs, stride_am, stride_cm,
                                    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                    K_SPLITS: tl.constexpr, MASKED_ROWS: tl.constexpr):
        # Work item = (tile, segment). Each writes its segment's float32 sum to the workspace
        # [K_SPLITS, tiles, BLOCK_M x BLOCK_N], then arrives at the tile's counter; the last to
        # arrive adds the K_SPLITS sums in segment order (whichever program that is, the order
        # is the same) and stores the tile. Counters only ever grow, by K_SPLITS per tile and
        # call, so no call has to zero them.
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        tiles = tiles_m * tiles_n
        segment_stride = tiles.to(tl.int64) * (BLOCK_M * BLOCK_N)
        inside = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        item = tl.program_id(0)
        while item < tiles * K_SPLITS:  # persistent: this program's items, num_programs apart
            tile, segment = item // K_SPLITS, item % K_SPLITS
            tile_m, tile_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
            acc = _segment(a, b_desc, tile_m * BLOCK_M, tile_n * BLOCK_N, segment * (K // K_SPLITS), M, stride_am, K,
                           K // K_SPLITS, BLOCK_M, BLOCK_N, BLOCK_K, MASKED_ROWS, DOT_PRECISION)
            tile_base = partial_ptr + tile.to(tl.int64) * (BLOCK_M * BLOCK_N)
            tl.store(tile_base + segment * segment_stride + inside, acc)
            tl.debug_barrier()  # every thread's partial is written before the arrival is published
            arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived % K_SPLITS == K_SPLITS - 1:
                tl.debug_barrier()
                total = tl.load(tile_base + inside, cache_modifier=".cg")
                for s in tl.static_range(1, K_SPLITS):
                    total += tl.load(tile_base + s * segment_stride + inside, cache_modifier=".cg")
                _store_tile(c, tile_m * BLOCK_M, tile_n * BLOCK_N, total, M, N, stride_cm, BLOCK_M, BLOCK_N,
                            MASKED_ROWS)
            item += num_programs


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def launch_plan(m: int, n: int, k: int, dtype: str, device: torch.device,
                config: TileConfig | None = None) -> tuple[TileConfig, int]:
    """(main tile configuration, programs) for one call. Both may follow M: they change who
    computes an element and beside which others, not the order of its additions."""
    if config is None:
        config = tile_config(m, n, k, dtype, _device_sms(device))
    items = tile_count(m, n, config) * (config.k_splits if config.split_parallel else 1)
    return config, program_count(items, device, config.ctas_per_sm)


def bi_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
              config: TileConfig | TilePlan | None = None) -> torch.Tensor:
    """C = a @ b.T with a [M, K], b [N, K] (both bf16 or both float32); writes `out` [M, N]
    (the operand dtype) when given. `config` overrides the table's tiles (tests, the tuner)."""
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
    elif out.shape != (m, n) or out.dtype != a.dtype or out.device != a.device:
        raise ValueError(f"out must be [{m}, {n}] {a.dtype} on {a.device}; got {tuple(out.shape)} {out.dtype} "
                         f"on {out.device}")
    if triton is None:
        raise RuntimeError("bi_matmul needs triton; pip install 'ep-harness[gpu]'")
    if m == 0:
        return out
    if isinstance(config, TileConfig):
        slices = [(0, m, config)]
    else:
        problem = config and plan_problem(config)  # the table's plans were checked when it loaded
        if problem:
            raise ValueError(f"bi_matmul plan {config}: {problem}")
        plan = config or tile_plan(m, n, k, DTYPES[a.dtype], _device_sms(a.device))
        if plan.library and library_route.run_routed(a, b, out, plan.library, TILES_FILE):
            return out
        slices = row_slices(m, n, plan, _device_sms(a.device))
        if plan.one_launch and len(slices) == 2:
            _launch_one(a, b, out, slices[1][0], plan)
            return out
    for first, end, cfg in slices:
        rows = a if (first, end) == (0, m) else a[first:end]
        _launch(rows, b, out if (first, end) == (0, m) else out[first:end], cfg)
    return out


def compiled_resources(a: torch.Tensor, b: torch.Tensor, cfg: TileConfig) -> dict:
    """Registers a thread, spilled registers and shared memory of `cfg`'s compiled kernel for
    these operands (one launch): a slow candidate that spills says why (the tuner records it).
    None under Triton's interpreter, which compiles nothing."""
    out = torch.empty((a.shape[0], b.shape[0]), dtype=a.dtype, device=a.device)
    compiled = _launch(a, b, out, cfg)
    return {"registers": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
            "shared_bytes": getattr(getattr(compiled, "metadata", None), "shared", None)}


_ARRIVALS: dict[tuple, torch.Tensor] = {}


def _arrivals(device: torch.device, k_splits: int, tiles: int) -> torch.Tensor:
    """The split kernel's per-tile arrival counters for this device, stream and split count.
    They are never reset: every call adds k_splits to each of its tiles, so "last of the tile"
    is a count of k_splits - 1 modulo k_splits (int64: no wrap). Each stream has its own, so
    that calls on two streams cannot arrive at each other's tiles; a CUDA graph being
    captured gets its own zeroed ones (zeroed again at every replay)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(tiles, dtype=torch.int64, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, k_splits)
    counters = _ARRIVALS.get(key)
    if counters is None or counters.numel() < tiles:  # fresh zeros: every old count was 0 modulo k_splits
        counters = _ARRIVALS[key] = torch.zeros(max(tiles, 1024), dtype=torch.int64, device=device)
    return counters


def _launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, cfg: TileConfig):
    """One kernel launch over all of a's rows with the tiles `cfg`; Triton's compiled kernel."""
    m, k = a.shape
    n = b.shape[0]
    _require_walkable(cfg, k)
    _, programs = launch_plan(m, n, k, DTYPES[a.dtype], a.device, cfg)
    precision = _dot_precision(a.dtype)
    if cfg.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        _require_tma_operands(a, b, out)

        # masked_rows: A and C go as pointers, rows masked (the kernels read them either way)
        a_arg = a if cfg.masked_rows else TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        c_arg = out if cfg.masked_rows else TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n])
        b_desc = TensorDescriptor.from_tensor(b, [cfg.block_n, cfg.block_k])
        shape = dict(K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                     DOT_PRECISION=precision, K_SPLITS=cfg.k_splits, MASKED_ROWS=cfg.masked_rows,
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        strides = (a.stride(0), out.stride(0))
        if cfg.parked:
            park = torch.empty(programs * cfg.block_m, cfg.block_n, dtype=torch.float32, device=a.device)
            half = [cfg.block_m, cfg.block_n // 2]
            del shape["K_SPLITS"], shape["MASKED_ROWS"]
            return _bi_matmul_tma_parked_kernel[(programs,)](a_arg, b_desc, TensorDescriptor.from_tensor(out, half),
                                                             TensorDescriptor.from_tensor(park, half), m, n, programs,
                                                             *strides, **shape, ON_GPU=a.device.type == "cuda")
        if cfg.split_parallel:
            tiles = tile_count(m, n, cfg)
            partial = torch.empty(cfg.k_splits * tiles * cfg.block_m * cfg.block_n, dtype=torch.float32, device=a.device)
            return _bi_matmul_tma_split_kernel[(programs,)](a_arg, b_desc, c_arg, partial,
                                                            _arrivals(a.device, cfg.k_splits, tiles),
                                                            m, n, programs, *strides, **shape)
        if cfg.schedule:
            return _bi_matmul_tma_scheduled_kernel[(programs,)](a_arg, b_desc, c_arg, m, n, programs, *strides,
                                                                **shape, FLATTEN=cfg.schedule == "flatten",
                                                                WARP_SPECIALIZE=cfg.schedule == "warp_specialize")
        return _bi_matmul_tma_kernel[(programs,)](a_arg, b_desc, c_arg, m, n, programs, *strides, **shape)
    return _bi_matmul_kernel[(programs,)](
        a, b, out, m, n, programs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _require_walkable(cfg: TileConfig, k: int) -> None:
    problem = tile_problem(cfg, k)
    if problem:
        raise ValueError(f"bi_matmul tiles {cfg}: {problem}")


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 as IEEE products (not TF32, which would leave the float32 bound); bf16 is exact either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _require_tma_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            raise ValueError(f"bi_matmul's TMA path needs {name} with unit column stride, 16-byte aligned "
                             f"start and row stride; pass {name}.contiguous() (a fresh allocation)")


def _launch_one(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, rows: int, plan: TilePlan):
    """A one_launch plan over all of a's rows: main's tiles over rows [0, rows), the tail's over
    the rest, in one persistent launch."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    main, tail = plan.main, plan.tail
    m, k = a.shape
    n = b.shape[0]
    for cfg in (main, tail):
        _require_walkable(cfg, k)
    _require_tma_operands(a, b, out)
    items = tile_count(rows, n, main) + tile_count(m - rows, n, tail)
    programs = program_count(items, a.device, main.ctas_per_sm)
    descriptors = [TensorDescriptor.from_tensor(t, block) for cfg, lo, hi in ((main, 0, rows), (tail, rows, m))
                   for t, block in ((a[lo:hi], [cfg.block_m, cfg.block_k]), (b, [cfg.block_n, cfg.block_k]),
                                    (out[lo:hi], [cfg.block_m, cfg.block_n]))]
    return _bi_matmul_tma_one_launch_kernel[(programs,)](
        *descriptors, rows, m - rows, n, programs, K=k, BLOCK_M=main.block_m, BLOCK_N=main.block_n,
        BLOCK_K=main.block_k, TAIL_M=tail.block_m, TAIL_N=tail.block_n, TAIL_K=tail.block_k, GROUP_M=main.group_m,
        DOT_PRECISION=_dot_precision(a.dtype), K_SPLITS=main.k_splits,
        num_warps=main.num_warps, num_stages=main.num_stages)
