"""The model subject's building blocks: weight shards and the RMS norm. The weights, the
prompts and what one served batch returns are the family's and the contract's
(harness/families/model_inputs.py, ep_harness.contracts.Served).
"""
from __future__ import annotations

import torch

NORM_EPS = 1e-6


def shard_rows(t: torch.Tensor, rank: int, world: int, blocks: int = 1) -> torch.Tensor:
    """Rank `rank`'s share of each of `blocks` equal row blocks of t (q/k/v heads, gate/up),
    concatenated: a column-parallel weight shard."""
    per_block = t.shape[0] // blocks
    share = per_block // world
    return torch.cat([t[b * per_block + rank * share:b * per_block + (rank + 1) * share] for b in range(blocks)])


def shard_cols(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s columns of t: a row-parallel weight shard (its output is a partial sum)."""
    share = t.shape[1] // world
    return t[:, rank * share:(rank + 1) * share].contiguous()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per row in float32, rounded once to bf16. The mean square is summed in float64 (the
    float32 squares are exact there) and rounded once: a GPU reduction picks its threads per
    row from the number of rows, so a float32 sum would depend on the batch."""
    xf = x.float()
    ms = x.double().pow(2).mean(-1, keepdim=True).float()
    return (xf * torch.rsqrt(ms + NORM_EPS) * weight.float()).to(torch.bfloat16)
