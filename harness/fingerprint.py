"""Order-sensitive fingerprints of tensor bits (a record's `bits_fingerprint` and `bits_blocks`;
not the run's fingerprint that picks a baseline, harness/regress/gate.py).

A bits fingerprint is a digest of every byte of the tensor in its logical (row-major) order,
together with its dtype and shape: two tensors share one only if they hold the same bits in
the same places. An xor or a sum of elements would miss a reordering; a digest of the bytes
cannot. Used for golden bits kept in runs and baselines, and for naming the first op whose
outputs diverged.
"""
from __future__ import annotations

import hashlib

import torch

DIGEST_BYTES = 16


def bits_fingerprint(t: torch.Tensor) -> str:
    """'blake2b:<hex>' over dtype, shape and the raw bytes of `t` (copied to the CPU)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).cpu().numpy().tobytes())
    return f"blake2b:{h.hexdigest()}"


BLOCKS = 32
BLOCK_DIGEST_HEX = 8


def bits_blocks(t: torch.Tensor, blocks: int = BLOCKS) -> dict:
    """Short digests of consecutive blocks of the flattened tensor: two runs whose whole
    fingerprints differ can then say where (the first differing block's element range)
    without either keeping its outputs. {"block": elements per block, "digests": [...]}."""
    flat = t.detach().contiguous().reshape(-1)
    size = max(1, -(-flat.numel() // blocks))
    raw = flat.view(torch.uint8).cpu().numpy().tobytes()
    step = size * flat.element_size()
    digests = [hashlib.blake2b(raw[i:i + step], digest_size=BLOCK_DIGEST_HEX // 2).hexdigest()
               for i in range(0, len(raw), step)]
    return {"block": size, "digests": digests}


def combine(parts: list[str]) -> str:
    """One fingerprint for an ordered list of fingerprints (order matters)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(part.encode() + b"\n")
    return f"blake2b:{h.hexdigest()}"
