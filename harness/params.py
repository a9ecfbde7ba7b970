"""The machinery of every family's parameters: declared once with their types, defaults and
limits, and validated when the plan is built, before any rank starts and before anything is
written. Each family declares its own dataclass beside its module (harness/families/: the
collective's, GEMM's, quantization's and model's in their modules, dispatch's and the MoE
layer's in moe_scenario.py, which they share), derived from `CommonParams` here, with
fields made by `_opt` and `_required`; its registered Family names it, and the planner finds
it there (ep_harness.check.typed_params). This module imports no family.

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
from dataclasses import MISSING, dataclass, field, fields, is_dataclass

from ep_harness.errors import HarnessError

DTYPES_WIRE = ("bfloat16", "float16", "float32")
DATA_KINDS = ("spread", "randn", "uniform", "integers", "subnormal", "nonfinite")
# "top" (harness/inputs.py): sums of a few values near the top of the wire dtype's range, for
# collectives only (a GEMM's K products of such values overflow in any correct kernel)
COLLECTIVE_DATA = (*DATA_KINDS, "top")
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


def build(cls: type[CommonParams], family: str, raw: dict, subject, where: str,
          grid_keys=frozenset()) -> CommonParams:
    """The typed parameters of one check of `family`, whose dataclass is `cls` (the registry
    knows which: ep_harness.check.typed_params); `where` prefixes every error ("cases/x.toml:
    case 'y'")."""
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
