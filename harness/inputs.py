"""Seeded, order-sensitive inputs.

Every value is a pure function of (seed, role, rank, ...) so that any rank, or a later
rerun, can regenerate every other rank's inputs, and the order models can predict a
collective's bits without running it. Values get an exponent spread so that summing
them in another order changes the rounding (vLLM and SGLang tests do the same).
"""
from __future__ import annotations

import contextlib
import zlib

import cachetools
import torch

# Exponent spread per wire dtype: wide enough that reordering changes rounding, narrow
# enough that sums of a few ranks stay finite (fp16 tops out at 65504).
SPREAD = {torch.bfloat16: 8, torch.float16: 4, torch.float32: 12, torch.float64: 12}

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,  # GEMM operands only; built by quantizing bf16 values
}


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def generator(seed: int, *key) -> torch.Generator:
    """A CPU generator seeded from the seed and a key, stable across processes."""
    digest = zlib.crc32(repr((seed, *key)).encode())
    return torch.Generator().manual_seed((seed << 32) ^ digest)


# Bounded by bytes, not entries: the smoke suite's inputs are 256 tensors, 135 MB in all on
# rank 0; one GEMM operand can be tens of MB.
_CACHE = cachetools.LRUCache(maxsize=256 * 2**20, getsizeof=lambda t: t.numel() * t.element_size())


def values(shape, dtype: torch.dtype, seed: int, *key, data: str = "spread") -> torch.Tensor:
    """Seeded float values in `dtype`.

    data: "spread" (randn times 2^k, k uniform in [-s, s]), "randn", "uniform" ([0, 1)),
    or "integers" (small integers: every sum is exact, so no order can change the bits).

    Rank 0 regenerates every rank's inputs to predict a collective's bits, and the properties
    of a case share inputs, so values are cached (generation in float64 was most of a check's
    time); each caller gets its own copy, free to modify.
    """
    args = (tuple(shape), dtype, seed, key, data)
    try:
        cached = _CACHE.get(args)
    except TypeError:  # a key that cannot be hashed: generate afresh
        return _generate(*args)
    if cached is None:
        cached = _generate(*args)
        with contextlib.suppress(ValueError):  # larger than the whole cache: not kept
            _CACHE[args] = cached
    return cached.clone()


def _generate(shape: tuple, dtype: torch.dtype, seed: int, key: tuple, data: str) -> torch.Tensor:
    g = generator(seed, *key)
    if data == "spread":
        s = SPREAD[dtype]
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x = x * torch.exp2(torch.randint(-s, s + 1, shape, generator=g).to(torch.float64))
    elif data == "randn":
        x = torch.randn(shape, generator=g, dtype=torch.float64)
    elif data == "uniform":
        x = torch.rand(shape, generator=g, dtype=torch.float64)
    elif data == "integers":
        x = torch.randint(-8, 9, shape, generator=g).to(torch.float64)
    else:
        raise ValueError(f"unknown data kind {data!r}; known: spread, randn, uniform, integers")
    return x.to(dtype)
