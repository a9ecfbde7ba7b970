"""The model family's inputs: the probe model's random weights and its prompts, fixed by the
seed (its subject is handed them; reference/model.py reads the same weights).

Shapes (H hidden, V vocab, E experts, I expert intermediate, S shared-expert intermediate,
heads n of size d = H / n): embed [V, H]; per layer attn_norm [H], wqkv [3H, H] (q, k, v
heads in that order), wo [H, H], moe_norm [H], router [E, H] fp32, gate_up [E, 2I, H],
down [E, H, I], shared_gate_up [2S, H], shared_down [H, S]; final_norm [H], lm_head [V, H].
Everything bf16 unless said. Weights are scaled by fan-in^-1/2 so activations stay O(1).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ep_harness import inputs as gen

if TYPE_CHECKING:  # model.py, which declares it, imports this module
    from ep_harness.families.model import ModelParams


def weights(p: ModelParams) -> dict:
    return _weights(p.seed, p.vocab, p.hidden, p.layers, p.num_experts, p.intermediate,
                    p.shared_intermediate)


@functools.lru_cache(maxsize=2)
def _weights(seed: int, vocab: int, hidden: int, layers: int, experts: int, inter: int, shared: int) -> dict:
    """Cached per process (never modified by a caller): the checks of a case share them."""

    def w(shape, name, fan_in, dtype=torch.bfloat16, *key):
        return (gen.values(shape, torch.float64, seed, "model", name, *key, data="randn") * fan_in ** -0.5).to(dtype)

    def norm(name, *key):  # near 1, not 1: a wrong norm weight would show
        return (1 + 0.1 * gen.values((hidden,), torch.float64, seed, "model", name, *key, data="randn")).to(torch.bfloat16)

    out = {"embed": w((vocab, hidden), "embed", 1), "final_norm": norm("final-norm"),
           "lm_head": w((vocab, hidden), "lm-head", hidden), "layers": []}
    for layer in range(layers):
        out["layers"].append({
            "attn_norm": norm("attn-norm", layer),
            "wqkv": w((3 * hidden, hidden), "wqkv", hidden, torch.bfloat16, layer),
            "wo": w((hidden, hidden), "wo", hidden, torch.bfloat16, layer),
            "moe_norm": norm("moe-norm", layer),
            "router": w((experts, hidden), "router", hidden, torch.float32, layer),
            "gate_up": w((experts, 2 * inter, hidden), "gate-up", hidden, torch.bfloat16, layer),
            "down": w((experts, hidden, inter), "down", inter, torch.bfloat16, layer),
            "shared_gate_up": w((2 * shared, hidden), "shared-gate-up", hidden, torch.bfloat16, layer),
            "shared_down": w((hidden, shared), "shared-down", shared, torch.bfloat16, layer),
        })
    return out


def to_device(ws: dict, device) -> dict:
    return {k: ([to_device(layer, device) for layer in v] if k == "layers" else v.to(device, copy=True))
            for k, v in ws.items()}  # its own copy: the cached weights stay as generated


def prompts(p: ModelParams) -> list[list[int]]:
    """max(batch_sizes) prompts, lengths seeded in [shortest, longest], tokens uniform."""
    g = gen.generator(p.seed, "model-prompts")
    lo, hi = p.prompt_lengths
    count = max(p.batch_sizes)
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(0, p.vocab, (n,), generator=g).tolist() for n in lengths]
