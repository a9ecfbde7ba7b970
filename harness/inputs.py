"""Seeded, order-sensitive inputs.

Every value is a pure function of (seed, role, rank, ...) so that any rank, or a later
rerun, can regenerate every other rank's inputs, and the order models can predict a
collective's bits without running it. Values get an exponent spread so that summing
them in another order changes the rounding (vLLM and SGLang tests do the same).
"""
from __future__ import annotations

import contextlib
import math
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
    "integers" (small integers: every sum is exact, so no order can change the bits), "top"
    (the spread near the top of the dtype's range: _top_of_range), or
    "subnormal" / "nonfinite" (spread values with subnormals, or NaN and +-Inf, at seeded
    places: does the subject propagate them as the reference does?).

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


def powers_of_two(exponents: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """2^e in float64 for integer exponents low <= e <= high, exact (math.ldexp) and looked
    up: the bits of torch.exp2 of the exponents as doubles (exact at integers), in a third of
    its time, which was most of `spread` data's cost after randn."""
    table = torch.tensor([math.ldexp(1.0, e) for e in range(low, high + 1)], dtype=torch.float64)
    return table.index_select(0, (exponents - low).flatten()).view(exponents.shape)


def _generate(shape: tuple, dtype: torch.dtype, seed: int, key: tuple, data: str) -> torch.Tensor:
    g = generator(seed, *key)
    if data == "spread":
        s = SPREAD[dtype]
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x = x * powers_of_two(torch.randint(-s, s + 1, shape, generator=g), -s, s)
    elif data == "randn":
        x = torch.randn(shape, generator=g, dtype=torch.float64)
    elif data == "uniform":
        x = torch.rand(shape, generator=g, dtype=torch.float64)
    elif data == "integers":
        x = torch.randint(-8, 9, shape, generator=g).to(torch.float64)
    elif data == "top":
        x = _top_of_range(shape, g, dtype)
    elif data in SPECIALS:
        x = _generate(shape, dtype, seed, key, "spread").to(torch.float64)
        x = SPECIALS[data](x, g, dtype)
    else:
        raise ValueError(f"unknown data kind {data!r}; known: spread, randn, uniform, integers, top, "
                         f"{', '.join(SPECIALS)}")
    return x.to(dtype)


# "top": |x| <= 2^(e_max + 1 - TOP_HEADROOM_BITS), e_max the exponent of the dtype's largest
# value, so a sum of up to 15 values stays finite when it is accumulated in float32 or rounded
# to the wire dtype after every add (fp16: |x| <= 2^12 and 15 * 2^12 = 61,440 < 65,504; any 8
# ranks sum below 2^15; bf16 and fp32: |x| <= 2^124). What overflows is what should not be
# there: bf16 operands carried in an fp16 accumulator (anything above 65,504), or a scale
# applied on the wrong side of the sum (x * 2^4 before the add, / 2^4 after: exact, so
# invisible at smaller values, and 2^12 * 2^4 = 2^16 is past fp16's range).
TOP_HEADROOM_BITS = 4


def _top_of_range(shape: tuple, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Spread values (SPREAD[dtype] + 1 binades, random signs) whose largest binade ends
    TOP_HEADROOM_BITS below the top of `dtype` (fp16: [2^7, 2^12]; bf16: [2^115, 2^124])."""
    s = SPREAD[dtype]
    top = int(math.log2(torch.finfo(dtype).max)) - TOP_HEADROOM_BITS  # fp16 11, bf16 and fp32 123
    mantissa = 1.0 + torch.rand(shape, generator=g, dtype=torch.float64)
    exponent = torch.randint(top - s, top + 1, shape, generator=g)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return sign * mantissa * powers_of_two(exponent, top - s, top)


def _every(x: torch.Tensor, g: torch.Generator, n: int) -> torch.Tensor:
    """A seeded choice of about one element in n."""
    return torch.randint(0, n, x.shape, generator=g) == 0


def _subnormal(x: torch.Tensor, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """One element in 16 replaced by a subnormal of `dtype` (a few ULPs above zero, either sign)."""
    tiny = torch.finfo(dtype).smallest_normal
    steps = torch.randint(1, 8, x.shape, generator=g).to(torch.float64) * (tiny * torch.finfo(dtype).eps)
    sign = torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return torch.where(_every(x, g, 16), sign * steps, x)


def _nonfinite(x: torch.Tensor, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """One element in 64 replaced by NaN, +Inf or -Inf (a third each)."""
    pick = torch.randint(0, 3, x.shape, generator=g)
    special = torch.where(pick == 0, torch.nan, torch.where(pick == 1, torch.inf, -torch.inf)).to(torch.float64)
    return torch.where(_every(x, g, 64), special, x)


# Inputs on request that check a subject propagates what the reference does: subnormals (a
# kernel that flushes them to zero) and NaN / +-Inf (one that scrubs or invents them).
SPECIALS = {"subnormal": _subnormal, "nonfinite": _nonfinite}
