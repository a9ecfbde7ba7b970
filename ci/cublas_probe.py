"""Find GEMM shapes where cuBLAS torch.mm is not batch-invariant on this GPU.

    python ci/cublas_probe.py OUT.json       # on a GPU machine

For each (N, K) the probe row's output at every M is compared bit for bit with its output
at the smallest M; the count of differing elements per M is written to OUT.json.
"""
import json
import os
import sys

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
torch.use_deterministic_algorithms(True)
SHAPES = [(4096, 4096), (4096, 7168), (7168, 2048), (2048, 7168), (256, 16384), (128, 8192), (512, 4096),
          (4096, 2048), (64, 16384)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]

g = torch.Generator(device="cuda").manual_seed(0)
found = {}
for n, k in SHAPES:
    a = torch.randn(max(MS), k, device="cuda", generator=g).bfloat16()
    b = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    base = None
    row = {}
    for m in MS:
        y = torch.mm(a[:m], b.t())[0]
        if base is None:
            base = y.clone()
        row[m] = int((y.view(torch.int16) != base.view(torch.int16)).sum())
    found[f"{n}x{k}"] = row
    print(n, k, row, flush=True)
json.dump(found, open(sys.argv[1], "w"), indent=1)
