"""The contract a subject implements, and the registry that finds subjects by name.

A subject is a small adapter around one production implementation. It knows nothing of
the properties that check it. The built-in families' Protocols are declared here; each
family names its own in its `Family` (harness/families), and `register` checks a subject
against the Protocol of the family it names (the data they exchange: harness/contracts.py).
Beyond its family's contract a subject may define the hooks of `OptionalHooks` (per-launch
`setup` and `teardown`, the kernels it must launch, what exactly ran, its order models,
...): that Protocol is the one place they are documented, `register` checks the signature of
each one a subject defines, and the harness reaches them only through the accessors below
it. Built-in subjects live in `harness/subjects/`, one file each; third-party packages add
theirs through the entry-point group `ep_harness.subjects` (each entry point names a module
that registers on import).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Callable, Protocol, runtime_checkable

from ep_harness.errors import HarnessError, did_you_mean, plugin_import_problem

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
    emulation: str | None = None  # several NCCL ranks per GPU: "hosts" or "single-node" (harness/emulation.py)
    nccl: str | None = None  # the NCCL library's own version (not torch's compile-time one), NCCL runs only
    nodes: int = 1  # machines (or torchrun agents) the ranks are spread over

    @property
    def topology(self):
        from ep_harness.emulation import Topology

        if self.device != "cuda":
            return Topology("cpu-gloo", self.ranks, 0, self.nodes)
        kind = {"hosts": "emulated-hosts", "single-node": "single-node"}.get(self.emulation, "gpus")
        return Topology(kind, self.ranks, self.gpus or self.ranks, self.nodes, self.gpu_name)


@dataclass(frozen=True)
class OrderModel:
    """How a collective subject accumulates, as a function of all ranks' inputs.

    `predict(inputs [world_size, N] flat, sizes [elements per destination], nccl)` returns
    the per-destination outputs; `nccl` (an ep_harness.nccl.models.NcclContext, None on gloo)
    tells what NCCL logged for the call, and a model raises
    ep_harness.nccl.models.NoPrediction when it cannot say. `exact` says the model is known to
    reproduce the backend bit for bit (a measured count that differs from its prediction is
    then a failure). `elementwise` says an output element depends on that element of every
    rank's input (and on positions and sizes) alone, never on another element's value, as in
    a plain sum whatever its order; the harness then predicts the probe from the probe's rows
    alone, the other rows zero. Leave it False for a model that reads other elements (a
    quantized all-reduce with per-block scales).
    """

    name: str
    predict: Callable
    exact: bool
    elementwise: bool = False


@runtime_checkable
class Subject(Protocol):
    name: str
    family: str
    summary: str

    def unavailable(self, platform: Platform, params) -> str | None:
        """Why this subject cannot run here with these params (None when it can). `params`: the
        family's parameter dataclass (ep_harness.params), read by attribute (`params.hidden`)."""


class OptionalHooks(Protocol):
    """What a subject may define beyond its family's contract; without a hook the harness does
    what each docstring says. `params` is always the check's parameter dataclass, read by
    attribute; `ctx` an ep_harness.context.RankContext. A hook set to None counts as absent.
    `register` checks the arity of every hook a subject defines (and that an attribute hook
    has its type); the harness calls them only through the accessors below."""

    def setup(self, ctx) -> None:
        """Called once per launch on every rank, before the subject's first check: where an engine
        creates its own parallel state (its `initialize_model_parallel`) once and reuses it for
        every check of the launch."""

    def teardown(self, ctx) -> None:
        """Called once per launch on every rank, after its last check (a collective call is safe:
        every rank of the launch makes it)."""

    def compiles_kernels(self, params) -> bool:
        """True where the first call of this shape compiles a kernel (DeepGEMM's JIT): the check
        is run once untimed before it is timed, and the warm-up's seconds are recorded apart
        (ep_harness.families.driver.warm_up). Without it: False."""

    def kernels(self, params) -> tuple[str, ...]:
        """Substrings of the names of kernels the measured calls must launch (DeepGEMM's, DeepEP's,
        NCCL's): a check during which one of them ran on no rank, a silent fallback, is an
        `error` (harness/kernel_trace.py). On the CPU only a subject that declares some is
        traced, by profiler events (`torch.profiler.record_function` labels)."""

    def describe(self, params) -> dict:
        """What exactly ran (library version, its configuration), kept in the record's
        `detail.subject_info`."""

    def order_model(self, backend: str) -> OrderModel | None:
        """Collective: the accumulation order this implementation follows on `backend`, if known.
        Without it counts are measured but not predicted, and `expect = "model"` is refused."""

    def reduce_shards(self, out, shards, sizes, group) -> None:
        """Collective, the layout-size properties (docs/layout-invariance.md): reduce this rank's
        virtual shards [k, rows, H] into `out` itself. Without it the rank's shards are summed
        in float32 and rounded once (harness/shards.py local_partial), then `reduce_scatter`."""

    def shards_order_model(self, backend: str) -> OrderModel | None:
        """Collective, the layout-size properties: the order `reduce_shards` follows over all
        virtual shards. Without it the prediction folds the ranks' partials by `order_model`."""

    def forward_shards(self, shards, weights: dict, params, group):
        """MoE layer, the layout-size properties: `forward` from this rank's virtual TP shards
        [k, T, H] instead of its partial sums; a moe_layer subject that runs those properties
        needs it."""

    def combine_model(self) -> Callable:
        """Dispatch: the exact order of combine, `model(expert_outputs [k, H], weights [k],
        experts [k], experts_per_rank) -> [H]` (reference/deepep.py), which predicts the
        invariance checks' bits from the inputs alone. Without it nothing is predicted."""

    rounds_partials: bool
    """Dispatch: True where combine rounds each weighted row (or per-rank partial) to bf16
    before the reduction, one more rounding the combine-reference bound allows. Default False."""


HOOKS = tuple(name for name in OptionalHooks.__dict__ if not name.startswith("_")) + tuple(
    OptionalHooks.__annotations__)


def hook(subject, name: str):
    """The subject's hook `name` of OptionalHooks, or None where it has none."""
    if name not in HOOKS:
        raise KeyError(f"{name!r} is not an optional hook; known: {', '.join(HOOKS)}")
    return getattr(subject, name, None)


def set_up(subject, ctx) -> None:
    if (own := hook(subject, "setup")) is not None:
        own(ctx)


def tear_down(subject, ctx) -> None:
    if (own := hook(subject, "teardown")) is not None:
        own(ctx)


def compiles_kernels(subject, params) -> bool:
    own = hook(subject, "compiles_kernels")
    return bool(own(params)) if own is not None else False


def description(subject, params) -> dict:
    """What the subject says ran (its `describe`); {} where it has no `describe`."""
    own = hook(subject, "describe")
    return own(params) if own is not None else {}


def order_model_of(subject, backend: str) -> OrderModel | None:
    """The subject's order model on `backend`; None where it has none."""
    own = hook(subject, "order_model")
    return own(backend) if own is not None else None


def shards_order_model_of(subject, backend: str) -> OrderModel | None:
    own = hook(subject, "shards_order_model")
    return own(backend) if own is not None else None


def combine_model_of(subject) -> Callable | None:
    own = hook(subject, "combine_model")
    return own() if own is not None else None


def rounds_partials(subject) -> bool:
    return bool(hook(subject, "rounds_partials"))


# Optional: `jit`, for a subject whose kernels a JIT compiles per shape into a cache that every
# process of the run shares (DeepGEMM): its families plan the calls of its checks
# (Family.precompile) and harness/run/precompile.py makes them once, in worker processes, before
# the checks. `jit.ready()` runs in such a worker before its first call (None, or why no call
# can be made there); `jit.identity(platform)` says what decides the kernels besides the shapes.

def jit_of(subject):
    """The subject's `jit`, or None."""
    return getattr(subject, "jit", None)


class CollectiveSubject(Subject, Protocol):
    def reduce_scatter(self, out, inp, sizes: list[int], group) -> None:
        """Sum rows [offset(d), offset(d) + sizes[d]) of every rank's `inp` into rank d's `out`.

        inp: [sum(sizes), hidden] on every rank; out: [sizes[rank], hidden], which may alias
        a slice of `inp`. Must not modify `inp` except through such an alias.
        """



class GemmSubject(Subject, Protocol):
    layouts: tuple[str, ...]  # of "contiguous", "masked", "dense"; the first is the default
    dtypes: tuple[str, ...]  # operand dtypes: "bfloat16", "float32", "float8_e4m3fn"

    def run(self, problem, out) -> None:
        """Write D = A @ B^T per expert into `out` (see ep_harness.contracts.GemmProblem)."""


class DispatchSubject(Subject, Protocol):
    def dispatch(self, x, topk_idx, topk_weights, cfg, group):
        """Send each (token, slot) row of x [T, H] to the rank owning expert topk_idx[t, slot]
        (-1: none); return an ep_harness.contracts.Received in cfg.layout (cfg: a
        ep_harness.contracts.DispatchConfig)."""

    def combine(self, expert_out, handle, topk_weights, group):
        """expert_out in the Received layout -> the top-k weighted sum [T, H] on the source ranks."""


class QuantSubject(Subject, Protocol):
    def quantize(self, x, ue8m0: bool):
        """x [rows, cols] bf16 -> (float8_e4m3fn [rows, cols], float32 scales [rows, cols // 128])."""


class MoeLayerSubject(Subject, Protocol):
    def forward(self, partials, weights: dict, params, group):
        """partials [T, H] (this rank's TP partial sums) -> (output [T, H], chosen experts [T, k])."""


class ModelSubject(Subject, Protocol):
    def generate(self, prompts, score_from, new_tokens: int, weights: dict, params, group, tracer):
        """Serve one batch: prefill `prompts` (lists of token ids), return the log-softmax rows
        that predict tokens score_from[i] .. len(prompts[i]) of each prompt, then greedily decode
        `new_tokens` - 1 more (an ep_harness.contracts.Served). `tracer` (a
        ep_harness.divergence.Tracer, or None) is told each op's inputs and outputs per token."""


_REGISTRY: dict[str, Subject] = {}
_ENTRY_POINT_DISTRIBUTIONS: dict[str, dict] = {}  # top-level module -> the distribution whose entry point loaded it
_loaded = False


class ContractError(HarnessError, ValueError):
    """A subject that does not implement its family's contract: one line, exit 2."""


def _signature_text(name: str, method) -> str:
    """`reduce_scatter(self, out, inp, sizes: list[int], group)`: the contract's method as written."""
    return f"{name}{inspect.signature(method)}".replace("'", "")


def _arity_problem(name: str, wanted, have) -> str | None:
    """Why `have` cannot be called as the contract's method `wanted` is (None: it can)."""
    need = len(inspect.signature(wanted).parameters) - 1  # without self
    try:
        params = inspect.signature(have).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not any(p.kind == p.VAR_POSITIONAL for p in params) and len(positional) != need:
        return (f"{name}() takes {len(positional)} argument(s), the contract passes {need} "
                f"(expected def {_signature_text(name, wanted)})")
    return None


def _contract_problems(subject, protocol, optional=()) -> list[str]:
    """What `subject` lacks of its family's Protocol: members, and the arity of each method
    (each problem names the expected signature); the `optional` ones may be absent. Then the
    optional hooks it defines (OptionalHooks): each one's arity, or an attribute's type."""
    problems = []
    for klass in protocol.__mro__:
        if klass in (Protocol, object) or not getattr(klass, "_is_protocol", False):
            continue
        for name in [*getattr(klass, "__annotations__", {}), *vars(klass)]:
            if name.startswith("_") or name in ("name", "family", "summary") and hasattr(subject, name):
                continue
            wanted = vars(klass).get(name)
            if not hasattr(subject, name):
                if name not in optional:
                    expected = f"def {_signature_text(name, wanted)}" if callable(wanted) else f"{name} = ..."
                    problems.append(f"missing {name!r} (expected {expected})")
            elif callable(wanted):
                problems.append(_arity_problem(name, wanted, getattr(subject, name)))
    for name in HOOKS:
        have, wanted = getattr(subject, name, None), vars(OptionalHooks).get(name)
        if have is None:
            continue
        if wanted is None:  # an attribute hook
            kind = OptionalHooks.__annotations__[name]
            kind = getattr(kind, "__name__", kind)  # a string under `from __future__ import annotations`
            if type(have).__name__ != kind:
                problems.append(f"{name} is a {type(have).__name__}, the contract reads a {kind} "
                                f"(expected {name}: {kind})")
        elif not callable(have):
            problems.append(f"{name} is a {type(have).__name__}, not a method (expected def "
                            f"{_signature_text(name, wanted)})")
        else:
            problems.append(_arity_problem(name, wanted, have))
    return list(dict.fromkeys(p for p in problems if p))


def register(cls):
    """Class decorator: instantiate, check against its family's Protocol, and register a
    subject under its `name` (the way pluggy validates hook implementations)."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    try:
        subject = cls()
    except TypeError as exc:
        raise ContractError(f"subject class {where} cannot be made with no arguments ({exc}); "
                            f"@register instantiates it as cls()") from None
    for attr in ("name", "family", "summary"):
        if not isinstance(getattr(subject, attr, None), str):
            raise ContractError(f"subject class {where} needs a string `{attr}`; add {attr} = \"...\" to the class")
    from ep_harness import families  # the family registry (its modules import this one)

    family = families.FAMILIES.get(subject.family)
    if family is None:
        raise ContractError(f"subject {subject.name!r} ({where}) has unknown family {subject.family!r}; "
                            f"known: {', '.join(families.FAMILIES)}")
    protocol = family.protocol or Subject
    problems = _contract_problems(subject, protocol, family.optional)
    if problems:
        where_declared = protocol.__module__.replace(".", "/") + ".py"
        raise ContractError(f"subject {subject.name!r} ({where}) does not implement the {subject.family} contract "
                            f"({protocol.__name__} in {where_declared}): {'; '.join(problems)}")
    if subject.name in _REGISTRY and type(_REGISTRY[subject.name]) is not cls:
        raise ContractError(f"two subjects are named {subject.name!r} ({where} and "
                            f"{type(_REGISTRY[subject.name]).__module__}); rename one")
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
        except BaseException as exc:  # noqa: BLE001 (SystemExit too: a plugin must not end the command)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise HarnessError(plugin_import_problem(module, exc)) from None


def import_built_in() -> None:
    """Register the built-in subjects (the ep_harness.subjects package)."""
    importlib.import_module("ep_harness.subjects")


def load_all(plugins: list[str] = ()) -> dict[str, Subject]:
    """Import built-in subjects, entry-point subjects and explicit plugin modules."""
    global _loaded
    if not _loaded:
        import_built_in()
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.dist is not None:
                _ENTRY_POINT_DISTRIBUTIONS[ep.module.partition(".")[0]] = {"distribution": ep.dist.name,
                                                                           "version": ep.dist.version}
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
            f"unknown subject {name!r}{did_you_mean(name, _REGISTRY)}; registered subjects: {known} "
            f"(add one with @register, a --plugin module, or the {ENTRY_POINT_GROUP!r} entry point)"
        ) from None


def plugin_distribution(name: str) -> dict | None:
    """{"distribution", "version"} of the installed package that registers subject `name`;
    None for a built-in subject or a plugin module that no distribution installed."""
    subject = _REGISTRY.get(name)
    if subject is None:
        return None
    module = type(subject).__module__
    top = module.partition(".")[0]
    if top == __name__.partition(".")[0]:  # the harness's own subjects
        return None
    path = getattr(sys.modules.get(module), "__file__", None)
    return _ENTRY_POINT_DISTRIBUTIONS.get(top) or (_installed_distribution(top, path) if path else None)


@functools.cache
def _installed_distribution(top: str, path: str) -> dict | None:
    """The distribution that installed the file at `path` (a top-level name alone is
    not enough: several distributions ship a `tests` package, and a checkout may shadow one)."""
    from importlib.metadata import PackageNotFoundError, distribution, packages_distributions

    for dist_name in packages_distributions().get(top, ()):
        try:
            dist = distribution(dist_name)
        except PackageNotFoundError:
            continue
        root = os.path.realpath(dist.locate_file(top))
        if os.path.realpath(path).startswith(root + os.sep):
            return {"distribution": dist.metadata["Name"], "version": dist.version}
    return None


def plugin_distributions() -> dict[str, dict]:
    """Every registered plugin subject's distribution, by subject name (environment.json)."""
    return {name: found for name in sorted(_REGISTRY) if (found := plugin_distribution(name))}
