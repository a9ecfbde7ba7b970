"""Where the parked walk's time goes (2048 x 7168, 128 x 256 tiles): each variant adds one piece
of it, timed interleaved with cuBLAS and the kernel module's own walks (README.md beside this file).

    python3 results/2026-12-07-cost-h100-parked-tma/probe_parked.py     # a GPU: $OUT/probe_parked.json
    TRITON_INTERPRET=1 python3 results/2026-12-07-cost-h100-parked-tma/probe_parked.py   # a CPU: bits only
"""
import json
import os
import torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from ep_harness.kernels import bi_matmul as kmod
from ep_harness.cost.timing import time_interleaved, median_ms

@triton.jit(do_not_specialize=["M", "num_programs"])
def probe_kernel(a, b_desc, c_half, park, M, N, num_programs, stride_am,
                 K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, VARIANT: tl.constexpr):
    HALF: tl.constexpr = BLOCK_N // 2
    SEG: tl.constexpr = K // 2
    tiles_m, tiles_n, tile = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), tl.program_id(0)
    slot = tl.program_id(0) * BLOCK_M
    while tile < tiles_m * tiles_n:
        tile_m, tile_n = kmod._tile_at(tile, tiles_m, tiles_n, GROUP_M)
        off_m, off_n = tile_m * BLOCK_M, tile_n * BLOCK_N
        if VARIANT == 0:  # one loop over all of K (the unsplit walk), stored in halves
            total = kmod._segment(a, b_desc, off_m, off_n, 0, M, stride_am, K, K, BLOCK_M, BLOCK_N, BLOCK_K, False, "tf32")
            left, right = kmod._halves(total, BLOCK_M, BLOCK_N)
            c_half.store([off_m, off_n], left.to(c_half.dtype))
            c_half.store([off_m, off_n + HALF], right.to(c_half.dtype))
        else:
            first = kmod._segment(a, b_desc, off_m, off_n, 0, M, stride_am, K, SEG, BLOCK_M, BLOCK_N, BLOCK_K, False, "tf32")
            left, right = kmod._halves(first, BLOCK_M, BLOCK_N)
            if VARIANT == 1:  # two loops, the first sum to C (bf16) and overwritten: no park
                c_half.store([off_m, off_n], left.to(c_half.dtype))
                c_half.store([off_m, off_n + HALF], right.to(c_half.dtype))
            else:
                park.store([slot, 0], left)
                park.store([slot, HALF], right)
            second = kmod._segment(a, b_desc, off_m, off_n, SEG, M, stride_am, K, SEG, BLOCK_M, BLOCK_N, BLOCK_K, False, "tf32")
            if VARIANT == 3:
                kmod._parked_written(tile)
                tl.debug_barrier()
            left, right = kmod._halves(second, BLOCK_M, BLOCK_N)
            if VARIANT >= 3:  # read back and add (3: with the completion wait, 4: without)
                left = park.load([slot, 0]) + left
                right = park.load([slot, HALF]) + right
            c_half.store([off_m, off_n], left.to(c_half.dtype))
            c_half.store([off_m, off_n + HALF], right.to(c_half.dtype))
        tile += num_programs

NAMES = {0: "one loop (unsplit)", 1: "two loops, no park", 2: "two loops + park store", 3: "parked (store, wait, load, add)",
         4: "parked without the wait"}

def main():
    n, k = 2048, 7168
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    b = (torch.randn(n, k, generator=g, device=dev) * k ** -0.5).to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"gpu": torch.cuda.get_device_name(0), "points": []}
    for bm, bn, bk, warps, stages in ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4)):
        for m in (2048, 8192):
            a = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
            tiles = -(-m // bm) * -(-n // bn)
            programs = min(tiles, sms)
            park = torch.empty(programs * bm, bn, dtype=torch.float32, device=dev)
            half = [bm, bn // 2]
            a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
            b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
            outs, calls, res = {}, {}, {}
            for v in NAMES:
                c = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                args = (a_desc, b_desc, TensorDescriptor.from_tensor(c, half), TensorDescriptor.from_tensor(park, half),
                        m, n, programs, a.stride(0))
                kw = dict(K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, VARIANT=v, num_warps=warps, num_stages=stages)
                try:
                    compiled = probe_kernel[(programs,)](*args, **kw)
                except Exception as exc:
                    res[v] = {"error": str(exc).splitlines()[0][:200]}
                    continue
                res[v] = {"registers": compiled.n_regs, "spills": compiled.n_spills, "shared": compiled.metadata.shared}
                calls[NAMES[v]] = (lambda args=args, kw=kw: probe_kernel[(programs,)](*args, **kw))
                outs[v] = c
            side = kmod.TileConfig(128, 128, 64, 8, 8, 3, True, k_splits=2, schedule="warp_specialize")
            cs = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            calls["side by side k2s (table)"] = lambda: kmod.bi_matmul(a, b, out=cs, config=side)
            parked = kmod.TileConfig(bm, bn, bk, 8, warps, stages, True, k_splits=2, parked=True)
            cp = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            calls["parked (kernel module)"] = lambda: kmod.bi_matmul(a, b, out=cp, config=parked)
            calls["cublas"] = lambda: torch.mm(a, b.t())
            times = time_interleaved(calls, repeats=30, warmup=5)
            torch.cuda.synchronize()
            ref2 = kmod.bi_matmul(a, b, config=kmod.walk_reference(2))
            bits = {name: int((o.view(torch.int16) != ref2.view(torch.int16)).sum()) for name, o in
                    [(NAMES[v], outs[v]) for v in outs if v >= 3] + [("parked (kernel module)", cp), ("k2s", cs)]}
            cub = median_ms(times["cublas"])
            row = {"tiles": f"{bm}x{bn}x{bk}-w{warps}-s{stages}", "m": m, "programs": programs,
                   "us": {name: round(median_ms(t) * 1e3, 1) for name, t in times.items()},
                   "vs_cublas": {name: round(median_ms(t) / cub, 3) for name, t in times.items()},
                   "compiled": {NAMES[v]: r for v, r in res.items()}, "bits_vs_2_segment_reference": bits}
            out["points"].append(row)
            print(json.dumps(row), flush=True)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "probe_parked.json")
    open(path, "w").write(json.dumps(out, indent=1))



def interpreted_smoke():
    """TRITON_INTERPRET=1 on a CPU: every variant runs, and the parked ones give the 2-segment bits."""
    m, n, k, bm, bn, bk = 40, 64, 128, 16, 32, 32
    a, b = torch.randn(m, k), torch.randn(n, k)
    ref = kmod.bi_matmul(a, b, config=kmod.TileConfig(bm, bn, bk, 2, 4, 2, True, k_splits=2))
    for v in [v for v in NAMES if v != 3]:  # 3's inline PTX does not run here
        c = torch.zeros(m, n)
        park = torch.zeros(4 * bm, bn)
        probe_kernel[(4,)](TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]),
                           TensorDescriptor.from_tensor(c, [bm, bn // 2]), TensorDescriptor.from_tensor(park, [bm, bn // 2]),
                           m, n, 4, a.stride(0), K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=2, VARIANT=v)
        print(v, NAMES[v], int((c.view(torch.int32) != ref.view(torch.int32)).sum()))


if __name__ == "__main__":
    interpreted_smoke() if os.environ.get("TRITON_INTERPRET") else main()
