"""The contract a subject implements, and the registry that finds subjects by name.

A subject is a small adapter around one production implementation. It knows nothing of
the properties that check it. Optionally it has `setup(ctx)` and `teardown(ctx)`, called
once per launch on every rank (before its first check, after the last) with the rank's
harness.context.RankContext: where an engine creates its own parallel state (e.g. its
`initialize_model_parallel`) once and reuses it for every check of the launch. Built-in subjects live in `harness/subjects/`, one file
each; third-party packages add theirs through the entry-point group
`ep_harness.subjects` (each entry point names a module that registers on import).
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Callable, Protocol, runtime_checkable

from harness.errors import HarnessError

FAMILIES = ("collective", "gemm", "quant", "dispatch", "moe_layer", "model")
ENTRY_POINT_GROUP = "ep_harness.subjects"


@dataclass(frozen=True)
class Platform:
    """What the run executes on, as the planner and subjects see it."""

    backend: str  # "gloo" or "nccl"
    device: str  # "cpu" or "cuda"
    ranks: int  # the largest world size this run may launch
    gpu_name: str | None = None
    capability: tuple[int, int] | None = None
    gpus: int = 0  # GPUs the ranks use
    emulated_hosts: bool = False  # several NCCL ranks per GPU, one emulated host each
    nodes: int = 1  # machines (or torchrun agents) the ranks are spread over

    @property
    def topology(self):
        from harness.emulation import Topology

        if self.device != "cuda":
            return Topology("cpu-gloo", self.ranks, 0, self.nodes)
        kind = "emulated-hosts" if self.emulated_hosts else "gpus"
        return Topology(kind, self.ranks, self.gpus or self.ranks, self.nodes, self.gpu_name)


@dataclass(frozen=True)
class OrderModel:
    """How a collective subject accumulates, as a function of all ranks' inputs.

    `predict(inputs [world_size, N] flat, sizes [elements per destination], nccl)` returns
    the per-destination outputs; `nccl` (a harness.nccl_models.NcclContext, None on gloo)
    tells what NCCL logged for the call, and a model raises
    harness.nccl_models.NoPrediction when it cannot say. `exact` says the model is known to
    reproduce the backend bit for bit (a measured count that differs from its prediction is
    then a failure).
    """

    name: str
    predict: Callable
    exact: bool


@runtime_checkable
class Subject(Protocol):
    name: str
    family: str
    summary: str

    def unavailable(self, platform: Platform, params: dict) -> str | None:
        """Why this subject cannot run here with these params (None when it can)."""

    # Optional: `compiles_kernels(params) -> bool`, True where the first call of a shape
    # compiles a kernel (DeepGEMM's JIT). Such a check is run once untimed before it is timed,
    # and the warm-up's seconds are recorded apart (harness.families.driver.warm_up).


def compiles_kernels(subject, params: dict) -> bool:
    hook = getattr(subject, "compiles_kernels", None)
    return bool(hook(params)) if hook is not None else False


class CollectiveSubject(Subject, Protocol):
    def reduce_scatter(self, out, inp, sizes: list[int], group) -> None:
        """Sum rows [offset(d), offset(d) + sizes[d]) of every rank's `inp` into rank d's `out`.

        inp: [sum(sizes), hidden] on every rank; out: [sizes[rank], hidden], which may alias
        a slice of `inp`. Must not modify `inp` except through such an alias.
        """

    def order_model(self, backend: str) -> OrderModel | None:
        """The accumulation order this implementation follows on `backend`, if known."""


class GemmSubject(Subject, Protocol):
    layouts: tuple[str, ...]  # of "contiguous", "masked", "dense"; the first is the default
    dtypes: tuple[str, ...]  # operand dtypes: "bfloat16", "float32", "float8_e4m3fn"

    def run(self, problem, out) -> None:
        """Write D = A @ B^T per expert into `out` (see harness.gemm_problem.GemmProblem)."""


class DispatchSubject(Subject, Protocol):
    def dispatch(self, x, topk_idx, topk_weights, cfg: dict, group):
        """Send each (token, slot) row of x [T, H] to the rank owning expert topk_idx[t, slot]
        (-1: none); return a harness.subjects.dispatch.common.Received in cfg["layout"]."""

    def combine(self, expert_out, handle, topk_weights, group):
        """expert_out in the Received layout -> the top-k weighted sum [T, H] on the source ranks."""


class QuantSubject(Subject, Protocol):
    def quantize(self, x, ue8m0: bool):
        """x [rows, cols] bf16 -> (float8_e4m3fn [rows, cols], float32 scales [rows, cols // 128])."""


class MoeLayerSubject(Subject, Protocol):
    def forward(self, partials, weights: dict, params: dict, group):
        """partials [T, H] (this rank's TP partial sums) -> (output [T, H], chosen experts [T, k])."""


class ModelSubject(Subject, Protocol):
    def generate(self, prompts, score_from, new_tokens: int, weights: dict, params: dict, group, tracer):
        """Serve one batch: prefill `prompts` (lists of token ids), return the log-softmax rows
        that predict tokens score_from[i] .. len(prompts[i]) of each prompt, then greedily decode
        `new_tokens` - 1 more (a harness.subjects.model.common.Served). `tracer` (a
        harness.divergence.Tracer, or None) is told each op's inputs and outputs per token."""


PROTOCOLS = {"collective": CollectiveSubject, "gemm": GemmSubject, "quant": QuantSubject,
             "dispatch": DispatchSubject, "moe_layer": MoeLayerSubject, "model": ModelSubject}

_REGISTRY: dict[str, Subject] = {}
_loaded = False


def _contract_problems(subject, protocol) -> list[str]:
    """What `subject` lacks of its family's Protocol: members, and the arity of each method."""
    problems = []
    for klass in protocol.__mro__:
        if klass in (Protocol, object) or not getattr(klass, "_is_protocol", False):
            continue
        for name in [*getattr(klass, "__annotations__", {}), *vars(klass)]:
            if name.startswith("_") or name in ("name", "family", "summary") and hasattr(subject, name):
                continue
            wanted = vars(klass).get(name)
            if not hasattr(subject, name):
                problems.append(f"missing {name!r}")
            elif callable(wanted):
                need = len(inspect.signature(wanted).parameters) - 1  # without self
                try:
                    params = inspect.signature(getattr(subject, name)).parameters.values()
                except (TypeError, ValueError):
                    continue
                positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
                if not any(p.kind == p.VAR_POSITIONAL for p in params) and len(positional) != need:
                    problems.append(f"{name}() takes {len(positional)} argument(s), the contract passes {need}")
    return list(dict.fromkeys(problems))


def register(cls):
    """Class decorator: instantiate, check against its family's Protocol, and register a
    subject under its `name` (the way pluggy validates hook implementations)."""
    subject = cls()
    for attr in ("name", "family", "summary"):
        if not isinstance(getattr(subject, attr, None), str):
            raise ValueError(f"subject class {cls.__name__} needs a string `{attr}`")
    if subject.family not in FAMILIES:
        raise ValueError(f"subject {subject.name!r} has unknown family {subject.family!r}; known: {FAMILIES}")
    problems = _contract_problems(subject, PROTOCOLS[subject.family])
    if problems:
        raise ValueError(f"subject {subject.name!r} does not implement the {subject.family} contract "
                         f"({PROTOCOLS[subject.family].__name__} in harness/subject.py): {'; '.join(problems)}")
    if subject.name in _REGISTRY and type(_REGISTRY[subject.name]) is not cls:
        raise ValueError(f"two subjects are named {subject.name!r}")
    _REGISTRY[subject.name] = subject
    return cls


def import_plugins(modules: list[str]) -> None:
    """Import plugin modules by name; the working directory is searched last, so nothing in
    it can shadow the standard library or the harness's own modules."""
    if modules and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise HarnessError(
                f"cannot import subject plugin {module!r} ({exc}); check the module path or PYTHONPATH"
            ) from None


def load_all(plugins: list[str] = ()) -> dict[str, Subject]:
    """Import built-in subjects, entry-point subjects and explicit plugin modules."""
    global _loaded
    if not _loaded:
        importlib.import_module("harness.subjects")
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()
            except Exception as exc:  # a broken third-party plugin must not hide the others
                raise HarnessError(
                    f"subject entry point {ep.name!r} ({ep.value}) failed to load: {exc}; "
                    f"fix or uninstall the package that provides it"
                ) from None
        _loaded = True
    import_plugins(list(plugins))
    return dict(_REGISTRY)


def get(name: str) -> Subject:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise HarnessError(
            f"unknown subject {name!r}; registered subjects: {known} "
            f"(add one with @register, a --plugin module, or the {ENTRY_POINT_GROUP!r} entry point)"
        ) from None
