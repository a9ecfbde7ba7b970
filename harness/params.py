"""Each family's parameters, declared once with their types, defaults and limits, and
validated when the plan is built: before any rank starts, and before anything is written.

A case's `[case.params]` and `[case.grid]` keys are the fields of its family's dataclass
(plus the common ones). An unknown key, a missing required one, a wrong type or an
impossible value is a one-line `HarnessError` naming the case, the key and the fix. Every
record stores every value (defaults and seed included), so a check can be rerun from its
record alone.

The dataclass itself travels to the family, its scenario builders and its subjects (each
hook: `unavailable`, `kernels`, `describe`, `compiles_kernels`), which read it by attribute
(`p.hidden`): the dataclass owns the defaults, and a field read that it lacks is an
AttributeError, which planning turns into one line naming it (`unknown_field`). Records
store its plain dict (`Check.params_record`). A dispatcher is told a
ep_harness.contracts.DispatchConfig, read the same way.
"""
from __future__ import annotations

import difflib
import functools
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace

from ep_harness.errors import HarnessError

DTYPES_WIRE = ("bfloat16", "float16", "float32")
DATA_KINDS = ("spread", "randn", "uniform", "integers", "subnormal", "nonfinite")
# "top" (harness/inputs.py): sums of a few values near the top of the wire dtype's range, for
# collectives only (a GEMM's K products of such values overflow in any correct kernel)
COLLECTIVE_DATA = (*DATA_KINDS, "top")
ROUTINGS = ("uniform", "zipf", "empty", "one-rank", "single")
SEED_MAX = 2**31 - 1


def _opt(default, *, minimum=None, maximum=None, choices=None, nonempty=False):
    """A field with a default (lists are copied per instance) and its limits."""
    meta = {"min": minimum, "max": maximum, "choices": choices, "nonempty": nonempty}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _required(*, choices=None):
    return field(metadata={"min": None, "choices": choices, "nonempty": False})


@dataclass(frozen=True, kw_only=True)
class CommonParams:
    """Keys every check has. `backend` is set by the planner, not by case files."""

    world_size: int = _opt(1, minimum=1)
    backend: str = _opt("gloo", choices=("gloo", "nccl"))
    # inputs.generator shifts the seed 32 bits into torch's 64-bit seed (and scenarios add
    # small offsets): a larger one overflows in the worker, so it is refused at plan time
    seed: int = _opt(0, minimum=0, maximum=SEED_MAX)
    mode: str = _opt("eager", choices=("eager", "graph"))
    gpu_only: bool = _opt(False)

    def validate(self, subject) -> str | None:
        """Family-specific limits across fields: a message, or None."""
        return None

    def completed(self, subject) -> CommonParams:
        """Defaults that depend on the subject, filled in (before `validate`)."""
        return self


@dataclass(frozen=True, kw_only=True)
class LayoutParams(CommonParams):
    """What the layout-size properties (tp-size-invariance, ep-size-invariance) read:
    the world sizes they run the same logical inputs through (subgroups of ranks 0..w-1 of
    the check's ranks; [] is every power of two up to min(world_size, virtual_shards)), and
    how many fixed TP shards the logical input is cut into, V / w of them on each rank
    (harness/families/layout.py)."""

    layout_sizes: list[int] = _opt([], minimum=1)
    virtual_shards: int = _opt(8, minimum=1)

    def validate(self, subject):
        for size in self.layout_sizes:
            if size > self.world_size:
                return (f"layout_sizes = {self.layout_sizes}: {size} exceeds world_size = {self.world_size}; "
                        f"run the check at world_size = {max(self.layout_sizes)}")
            if self.virtual_shards % size:
                return (f"layout_sizes = {self.layout_sizes}: virtual_shards = {self.virtual_shards} does not split "
                        f"over {size} ranks; use a multiple of every size")
        return None


@dataclass(frozen=True, kw_only=True)
class CollectiveParams(LayoutParams):
    dtype: str = _required(choices=DTYPES_WIRE)
    hidden: int = _opt(2048, minimum=1)
    rows_per_rank: int = _opt(2, minimum=1)
    batch_sizes: list[int] = _opt([1, 2, 3, 8, 32, 128], minimum=1, nonempty=True)
    position_rows: int = _opt(8, minimum=1)
    repeats: int = _opt(3, minimum=1)
    shards: str = _opt("even", choices=("even", "uneven"))
    data: str = _opt("spread", choices=COLLECTIVE_DATA)
    message_bytes: list[int] = _opt([4096, 65536, 1 << 20, 16 << 20], minimum=1, nonempty=True)
    # prefill-decode-invariance: prefill probes one row inside each of this many equal parts
    channel_probes: int = _opt(8, minimum=1)
    # NCCL: every call of the check must use one channel range (the launch's channel pin)
    channel_pin: bool = _opt(False)


@dataclass(frozen=True, kw_only=True)
class GemmParams(CommonParams):
    dtype: str = _required(choices=("bfloat16", "float32", "float8_e4m3fn"))
    layout: str | None = _opt(None, choices=("contiguous", "masked", "dense"))  # None: the subject's first
    n: int = _opt(256, minimum=1)
    k: int = _opt(512, minimum=2)
    groups: int = _opt(4, minimum=1)
    # None: expert 1 where there is one (dense: 0), so the probe's rows start past row 0 of A
    # once expert 0 is loaded; other_loads[0] loads the other experts during the M sweep
    # (37: not a multiple of any tile), and the sweep's later runs move the probe's row offset
    probe_group: int | None = _opt(None, minimum=0)
    m_values: list[int] = _opt([1, 3, 17, 128, 1000], minimum=1, nonempty=True)
    other_loads: list[int] = _opt([37, 0, 512], minimum=0, nonempty=True)
    expected_m_values: list[int] = _opt([1, 64, 1024], minimum=1, nonempty=True)
    # the reference's rows per expert and the position sweep's: 199 = 3 * 64 + 7 leaves a
    # partial tail tile for every power-of-two tile height from 2 to 128
    position_m: int = _opt(199, minimum=1)
    repeats: int = _opt(3, minimum=1)
    alignment: int = _opt(128, minimum=1)
    data: str = _opt("randn", choices=DATA_KINDS)
    cancel: bool = _opt(True)

    def completed(self, subject):
        p = self if self.layout is not None else replace(self, layout=subject.layouts[0])
        if p.probe_group is None:
            p = replace(p, probe_group=0 if p.layout == "dense" or p.groups == 1 else 1)
        return p

    def validate(self, subject):
        if self.layout == "dense" and self.probe_group:
            return f"probe_group = {self.probe_group} with layout = 'dense': a dense problem is one expert; use 0"
        if self.probe_group >= self.groups:
            return f"probe_group = {self.probe_group} but there are only {self.groups} groups (0..{self.groups - 1})"
        if self.layout not in subject.layouts:
            return f"layout = {self.layout!r}: {subject.name} takes {', '.join(subject.layouts)}"
        if self.dtype not in subject.dtypes:
            return f"dtype = {self.dtype!r}: {subject.name} takes {', '.join(subject.dtypes)}"
        return None


@dataclass(frozen=True, kw_only=True)
class QuantParams(CommonParams):
    dtype: str = _opt("bfloat16", choices=("bfloat16",))
    rows: int = _opt(64, minimum=1)
    cols: int = _opt(2048, minimum=128)
    ue8m0: bool = _opt(False)
    batch_sizes: list[int] = _opt([1, 7, 64, 1000], minimum=1, nonempty=True)
    repeats: int = _opt(3, minimum=1)
    data: str = _opt("spread", choices=DATA_KINDS)

    def validate(self, subject):
        return f"cols = {self.cols} is not a multiple of the 128-wide quantization group" if self.cols % 128 else None


@dataclass(frozen=True, kw_only=True)
class TokenParams(LayoutParams):
    """What dispatch and the MoE layer share: tokens, experts and routing."""

    tokens: int = _opt(16, minimum=1)
    hidden: int = _opt(256, minimum=2)
    num_experts: int = _opt(16, minimum=1)
    topk: int = _opt(4, minimum=1)
    routing: str = _opt("uniform", choices=ROUTINGS)
    layout: str = _opt("contiguous", choices=("contiguous", "masked"))
    alignment: int = _opt(16, minimum=1)
    batch_sizes: list[int] = _opt([1, 3, 16, 64], minimum=1, nonempty=True)
    repeats: int = _opt(3, minimum=1)

    def validate(self, subject):
        if self.num_experts % self.world_size:
            return f"num_experts = {self.num_experts} does not split over world_size = {self.world_size} ranks"
        if self.topk > self.num_experts:
            return f"topk = {self.topk} exceeds num_experts = {self.num_experts}"
        for size in self.layout_sizes:
            if self.num_experts % size:
                return f"layout_sizes = {self.layout_sizes}: num_experts = {self.num_experts} does not split over {size} ranks"
        return super().validate(subject)


@dataclass(frozen=True, kw_only=True)
class DispatchParams(TokenParams):
    # 136 = 128 + 8 tokens per rank: every check crosses into a second 128-token chunk (the
    # unit DeepEP-style kernels walk tokens in), with a partial one
    tokens: int = _opt(136, minimum=1)
    expert_quant: str = _opt("bf16", choices=("bf16", "fp8"))
    wire: str = _opt("auto", choices=("auto", "bf16", "fp8"))
    ue8m0: bool = _opt(True)
    data: str = _opt("spread", choices=DATA_KINDS)
    probe_experts: list[int] = _opt([4, 5, 0, 1], minimum=0, nonempty=True)
    # corruption-rate: this many calls at each token count per rank (600 clean calls bound the
    # per-call rate below 0.5 % at 95 %; DeepEP #700 corrupted 1.5-3.3 % of calls at 256 tokens)
    calls: int = _opt(600, minimum=1)
    call_tokens: list[int] = _opt([256], minimum=1, nonempty=True)

    def validate(self, subject):
        if self.hidden % 128 and self.expert_quant == "fp8":
            return f"hidden = {self.hidden} is not a multiple of 128, which FP8 dispatch needs"
        probe = [e % self.num_experts for e in self.probe_experts[:self.topk]]
        if self.topk <= self.num_experts and len(set(probe)) < self.topk:  # the probe token's own top-k
            return (f"probe_experts = {self.probe_experts} gives the probe {sorted(probe)} (mod num_experts = "
                    f"{self.num_experts}), not topk = {self.topk} distinct experts; list {self.topk} distinct experts")
        return super().validate(subject)


@dataclass(frozen=True, kw_only=True)
class MoeParams(TokenParams):
    tokens: int = _opt(8, minimum=1)
    intermediate: int = _opt(128, minimum=1)
    batch_sizes: list[int] = _opt([1, 3, 8, 32], minimum=1, nonempty=True)
    # prefill-decode-invariance: the probe decoded alone (1 token per rank) against the same
    # token inside prefill batches of these many tokens per rank (2 or more: one is a decode),
    # on every rank at its chunk's first and last rows and one row in each of `channel_probes`
    # equal slices (harness/moe_scenario.py prefill_rows)
    prefill_tokens: list[int] = _opt([32, 256], minimum=2, nonempty=True)
    channel_probes: int = _opt(8, minimum=1)
    data: str = _opt("randn", choices=DATA_KINDS)
    cancel: bool = _opt(True)
    scoring: str = _opt("softmax", choices=("softmax", "sigmoid"))
    tp_reduce: str = _opt("all_gather_fold")  # stage subjects, by registered name
    dispatch: str = _opt("torch_a2a_dispatch")
    gemm: str = _opt("torch_mm")

    def validate(self, subject):
        # The router's fp32 scores must order the experts as its float64 logits do, up to the
        # rounding margin (families/moe_layer.py): spread values (subnormal builds on them) give
        # logits of 100s whose fp32 softmax underflows to tied zeros; NaN and Inf leave no order.
        if self.data in ("spread", "subnormal", "nonfinite"):
            why = ("NaN and Inf in the hidden state leave the router's top-k undefined" if self.data == "nonfinite"
                   else "spread values give router logits of 100s, whose fp32 scores underflow to tied zeros "
                        "that the float64 router tells apart (a correct layer fails)")
            return f"data = {self.data!r} for the MoE layer: {why}; use randn, uniform or integers"
        return super().validate(subject)


@dataclass(frozen=True, kw_only=True)
class ModelParams(LayoutParams):
    """A small random-weight MoE decoder (harness/families/model.py): its shape, its
    prompts, and the stage subjects it is composed of (by registered name)."""

    dtype: str = _opt("bfloat16", choices=("bfloat16",))
    vocab: int = _opt(512, minimum=2)
    hidden: int = _opt(256, minimum=2)
    layers: int = _opt(4, minimum=1)
    heads: int = _opt(4, minimum=1)
    num_experts: int = _opt(8, minimum=1)
    topk: int = _opt(2, minimum=1)
    intermediate: int = _opt(128, minimum=1)
    shared_intermediate: int = _opt(128, minimum=1)
    prompt_lengths: list[int] = _opt([3, 12], minimum=1, nonempty=True)  # [shortest, longest], seeded between
    new_tokens: int = _opt(3, minimum=1)
    batch_sizes: list[int] = _opt([1, 3, 6], minimum=1, nonempty=True)
    shuffles: int = _opt(3, minimum=1)
    repeats: int = _opt(2, minimum=1)
    layout: str = _opt("contiguous", choices=("contiguous", "masked"))
    alignment: int = _opt(16, minimum=1)
    tp_reduce: str = _opt("all_gather_fold")  # stage subjects, by registered name
    dispatch: str = _opt("torch_a2a_dispatch")
    gemm: str = _opt("torch_mm")
    dense_gemm: str = _opt("torch_mm")
    # every TP product per virtual shard (harness/subjects/model/composed.py); the layout-size
    # properties run with it set, whatever the case says
    virtual_tp: bool = _opt(False)
    virtual_shards: int = _opt(4, minimum=1)  # one head per shard at the default 4 heads

    def validate(self, subject):
        w = self.world_size
        if self.num_experts % w:
            return f"num_experts = {self.num_experts} does not split over world_size = {w} ranks"
        if self.topk > self.num_experts:
            return f"topk = {self.topk} exceeds num_experts = {self.num_experts}"
        if self.hidden % self.heads:
            return f"hidden = {self.hidden} is not a multiple of heads = {self.heads}"
        if self.heads % w:
            return f"heads = {self.heads} do not split over world_size = {w} TP ranks; use a multiple of {w}"
        if self.shared_intermediate % w:
            return f"shared_intermediate = {self.shared_intermediate} does not split over world_size = {w} ranks"
        if len(self.prompt_lengths) != 2 or self.prompt_lengths[0] > self.prompt_lengths[1]:
            return f"prompt_lengths = {self.prompt_lengths!r}; give [shortest, longest]"
        if self.heads % self.virtual_shards or self.shared_intermediate % self.virtual_shards:
            return (f"virtual_shards = {self.virtual_shards} does not split heads = {self.heads} and "
                    f"shared_intermediate = {self.shared_intermediate}; use a divisor of both")
        for size in self.layout_sizes:
            if self.num_experts % size:
                return f"layout_sizes = {self.layout_sizes}: num_experts = {self.num_experts} does not split over {size} ranks"
        return super().validate(subject)


def unknown_field(exc: AttributeError, who: str) -> str | None:
    """The one-line error for `who` reading a field that a parameter dataclass does not have
    (a renamed or mistyped field), or None when `exc` is about something else."""
    obj = getattr(exc, "obj", None)
    if not (is_dataclass(obj) and not isinstance(obj, type)) or exc.name in {f.name for f in fields(obj)}:
        return None
    known = sorted(f.name for f in fields(obj))
    close = difflib.get_close_matches(exc.name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"its fields are: {', '.join(known)}"
    return f"{who} reads {type(obj).__name__}.{exc.name}, which is not a field; {hint}"


def family_params(family: str) -> type[CommonParams]:
    """The parameter dataclass of `family`, as its registered Family declares it."""
    from ep_harness import families

    return families.get(family).params


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _conforms(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # Optional[...] and X | None
        return any(_conforms(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _limits(name: str, value, meta: dict) -> str | None:
    items = value if isinstance(value, list) else [value]
    if meta.get("nonempty") and isinstance(value, list) and not value:
        return f"{name} = [] is empty"
    if meta.get("min") is not None:
        low = [v for v in items if v is not None and v < meta["min"]]
        if low:
            return f"{name} = {value!r}: values below {meta['min']} are impossible"
    if meta.get("max") is not None:
        high = [v for v in items if v is not None and v > meta["max"]]
        if high:
            return f"{name} = {value!r}: values above {meta['max']} are not supported; use 0 to {meta['max']}"
    if meta.get("choices") is not None and value is not None and value not in meta["choices"]:
        return f"{name} = {value!r}; choose one of {', '.join(map(str, meta['choices']))}"
    return None


@functools.cache
def _type_hints(cls) -> dict:
    """A class's resolved annotations, once: resolving them is most of planning's time."""
    return typing.get_type_hints(cls)


def build(family: str, raw: dict, subject, where: str, grid_keys=frozenset()) -> CommonParams:
    """The typed parameters of one check; `where` prefixes every error ("cases/x.toml: case 'y'")."""
    cls = family_params(family)
    hints = _type_hints(cls)
    known = {f.name for f in fields(cls)} - {"backend"}
    for key in raw:
        if key not in known:
            table = "[case.grid]" if key in grid_keys else "[case.params]"
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"{family} parameters are: {', '.join(sorted(known))}"
            raise HarnessError(f"{where}: unknown parameter {key!r} in {table}; {hint}")
    for f in fields(cls):
        if f.name not in raw:
            if f.default is MISSING and f.default_factory is MISSING:
                raise HarnessError(f"{where}: missing required parameter {f.name!r} for {family} subjects; "
                                   f"add {f.name} = ... to [case.params] or [case.grid]")
            continue
        value = raw[f.name]
        if not _conforms(value, hints[f.name]):
            raise HarnessError(f"{where}: {f.name} = {value!r} is not of type {_type_name(hints[f.name])}; fix its value")
        problem = _limits(f.name, value, f.metadata)
        if problem:
            raise HarnessError(f"{where}: {problem}")
    params = cls(**raw).completed(subject)
    problem = params.validate(subject)
    if problem:
        raise HarnessError(f"{where}: {problem}")
    return params
