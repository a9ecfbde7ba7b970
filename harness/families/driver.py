"""The one property driver: what every family shares, written once.

    runs -> every rank executes them -> gather to rank 0 -> the family measures
         -> vacuity (the same rules for every family) -> one verdict, shared with all ranks

A family (harness/families/<name>.py) supplies only what is its own, as a `Family`:

* `properties`: the names of the properties it supports (each an ep_harness.properties.Property);
* `params`: its parameter dataclass (an ep_harness.params.CommonParams; it owns the defaults);
* `protocol`: the Protocol its subjects implement (harness/subject.py);
* `runs(prop, p, world_size)`: the runs a property compares, each with the `Copy`s of the
  probe it yields, in comparison order (where each copy sits: what the vacuity rules read);
  `p` here and below is the check's parameter dataclass, read by attribute (`p.hidden`);
* `observe(subject, ctx, p, prop, runs)`: on every rank, execute the runs and return what
  this rank saw (picklable: it is gathered to rank 0; a small named type, not a bare tuple);
* `measure(check, subject, ctx, p, runs, gathered)`: on rank 0, a `Measurement`, with
  `sensitivity` set to how many probe elements some reordering would change.

Vacuity, decided here for every family and property from what the property compares
(harness/properties.py; a check that could not fail is `vacuous`, never `ok`, and a check
that measured a difference is never `vacuous`: the rules estimate, the count is measured):

* none for a property compared with a reference (its every element is compared);
* fewer than two compared copies, or one run of a property that repeats runs
  (`repeats = 1`, a one-element sweep);
* every compared copy from the same placement (`batch_sizes = [8, 8, 8]`, a single token
  whose "first", "middle" and "last" positions coincide), except for a property that
  repeats one placement by design (run-to-run, graph-invariance);
* a property compared across destinations (rank-invariance) with the probe on a single
  destination;
* no probe element that any reordering the property could expose would change;
* no element compared at all (a reference check whose every token was left out).
"""
from __future__ import annotations

import contextvars
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ep_harness import kernel_trace, properties, threads
from ep_harness.bits import int_view
from ep_harness.compare import nonfinite_counts
from ep_harness.context import RankContext
from ep_harness.measurement import Measurement
from ep_harness.subject import description, hook

@dataclass(frozen=True)
class Copy:
    """One compared copy of the probe: everything that fixes its inputs and position, and
    the rank that holds it."""

    placement: tuple
    destination: int = 0


@dataclass(frozen=True)
class Run:
    """One execution a property compares; `spec` is the family's own description of it."""

    label: str
    copies: tuple[Copy, ...]
    spec: Any


@dataclass(frozen=True)
class Precompile:
    """The kernels a family's checks compile on their first call, made once before the checks
    (Family.precompile): harness/run/precompile.py makes the planned calls in worker processes
    beside the launches, and the checks find the kernels cached.

    * `calls(check)`: the calls the check will make ([] for none), or None when they are
      decided only at run time (the check then compiles its own, after the others);
    * `call`: the class of the calls made on this family's subjects (a worker rebuilds them
      with it), whichever family planned them (moe_layer plans calls of its GEMM subject).

    A call is a frozen dataclass, equal to another where they build the same kernel, naming
    its `subject`, with `needed_by` (the first check that makes it) and `timeout_s`; it has
    `key()` (a stable string, which the cache's manifest remembers), `describe()`, `group()`
    (calls likely to build one kernel share it), `to_json()`, `from_json(d)` on its class,
    `family` (the family whose `call` it is) and `make(subject, device)`: in a worker, the
    call once on zero-valued inputs (harness/families/gemm_calls.py is one)."""

    calls: Callable[[Any], list | None]
    call: type | None = None


@dataclass(frozen=True)
class Family:
    """One family, registered by ep_harness.families.register: its name, the names of the
    properties it supports (harness/properties.py), its parameter dataclass (a subclass of
    ep_harness.params.CommonParams), how it runs and measures a check, and the Protocol its
    subjects implement (harness/subject.py checks each subject against it when registered;
    `optional` names the Protocol's members a subject may leave out). Optional, each the
    family's own: the kernels its checks compile (`precompile`, a Precompile), what
    `ep-harness explore` varies, the wrapper `ep-harness selftest` plants its defects
    through, and what the selftest holds every property of the family to."""

    name: str
    properties: tuple[str, ...]
    params: type
    runs: Callable[[str, Any, int], list[Run]]  # (property, the params dataclass, world size)
    observe: Callable
    measure: Callable
    protocol: type | None = None  # None: only the members every subject has (ep_harness.subject.Subject)
    optional: tuple[str, ...] = ()
    precompile: Precompile | None = None  # the kernels its checks compile, made before them
    # (hypothesis.strategies) -> {parameter: strategy}; None: explore refuses the family's subjects
    search_space: Callable[[Any], dict] | None = None
    # an ep_harness.selftest.wrap.Wrapped subclass; None: the family's selftest cells are not applicable
    selftest_wrapper: type | None = None
    # injections every property of the family must catch beyond its own row (harness/selftest/expectations.py)
    must_catch: frozenset[str] = frozenset()
    # properties whose checks of several ranks each run on a process group made for them at the
    # check (harness/run/worker.py), so that their first call is the group's first: an order
    # that changes on a group's first call shows (every other check shares its launch's group)
    own_group: frozenset[str] = frozenset()


def kept(t: torch.Tensor) -> torch.Tensor:
    """What a rank observed, as a CPU copy of its own. `.cpu()` of a CPU tensor is the tensor
    itself: a subject that writes its next result into the same buffer would change what was
    observed before the comparison (a combine alternating its order in one reused buffer
    would compare equal to itself)."""
    return t.detach().to("cpu", copy=True)


# What a harness-owned output buffer holds before each call: a quiet NaN whose payload no
# kernel makes (a computed NaN carries the default payload or an input's; the inputs never
# hold this one), so an element still holding it after the call was never written.
SENTINEL_BITS = {torch.float64: 0x7FFCA5A5A5A5A5A5, torch.float32: 0x7FE5A5A5, torch.bfloat16: 0x7FE5,
                 torch.float16: 0x7E5A}
SENTINEL_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
                torch.float16: torch.int16}


@dataclass
class CallLog:
    """What the subject's calls of one check did on this rank beside their results: the
    inputs whose bits changed (by name) and how many output elements were never written."""

    modified: list[str] = field(default_factory=list)
    unwritten: int = 0
    outputs: int = 0  # output elements the calls had to write
    # thread-invariance: the intra-op thread count of each call in turn (None: the rank's own),
    # and the count each call ran on
    thread_plan: list[int] | None = None
    threads: list[int] = field(default_factory=list)
    strays: list[tuple[int, int]] = field(default_factory=list)  # (run, count): a later call on another count
    # every input a call left alone, by identity: (name, tensor, its bits after the call), compared
    # again when the check's calls are done (a write after the call returned: a deferred or
    # asynchronous write, or the next call writing into this one's input); emptied by `recheck`
    watched: dict = field(default_factory=dict, repr=False)

    def recheck(self) -> None:
        """The watched inputs against their bits after their own call; a change is a modified input."""
        for name, tensor, copy in self.watched.values():
            label = f"{name} (after its call returned)"
            if not torch.equal(_bits(tensor), _bits(copy)) and label not in self.modified:
                self.modified.append(label)
        self.watched.clear()


_LOG: contextvars.ContextVar[CallLog | None] = contextvars.ContextVar("ep_harness_call_log", default=None)


def named_tensors(obj, name: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in an input: nested dicts, lists, tuples and dataclasses, each by path."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from named_tensors(v, f"{name}.{k}" if name else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from named_tensors(v, f"{name}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from named_tensors(getattr(obj, f.name), f"{name}.{f.name}" if name else f.name)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return int_view(t.reshape(-1)) if t.dtype != torch.bool else t.reshape(-1)


def fill_sentinel(out: torch.Tensor) -> None:
    """Fill a harness-owned output with SENTINEL_BITS (floating outputs of 16 bits or more:
    FP8 and integer dtypes have no NaN payload to spare, and no value of theirs is one no
    kernel produces)."""
    if out.dtype not in SENTINEL_BITS:
        raise ValueError(f"no sentinel for a {out.dtype} output buffer; known: {', '.join(map(str, SENTINEL_BITS))}")
    out.view(SENTINEL_INT[out.dtype]).fill_(SENTINEL_BITS[out.dtype])


def still_sentinel(out: torch.Tensor) -> torch.Tensor:
    """Where `out` still holds the sentinel."""
    return out.view(SENTINEL_INT[out.dtype]) == SENTINEL_BITS[out.dtype]


@contextmanager
def subject_call(inputs: dict, outputs: list[tuple[torch.Tensor, torch.Tensor | None]] = (),
                 continues_run: bool = False):
    """One call of the subject, watched: `outputs` (harness-owned buffers, each with the mask
    of elements the call must write, None for all) are filled with the sentinel before it,
    and afterwards every tensor in `inputs` (by name: the call's operands, weights, routing)
    is compared bit for bit with a copy taken before it, and again when the check's calls are
    done (CallLog.recheck). What was found goes to the check's CallLog (driver.execute
    gathers it from every rank); outside a check, nowhere. `continues_run`: the call is the
    next of the same run as the call before it (a dispatch's combine), on that call's thread
    count under thread-invariance."""
    log = _LOG.get() or CallLog()
    before = [(name, t, t.clone()) for name, t in named_tensors(inputs)]
    for out, _ in outputs:
        fill_sentinel(out)
    with _threads_of_call(log, continues_run):
        yield
    after = dict(named_tensors(inputs))
    for name, tensor, copy in before:
        now = after.get(name)
        if now is None or now.shape != copy.shape or not torch.equal(_bits(now), _bits(copy)):
            if name not in log.modified:
                log.modified.append(name)
        else:
            log.watched[id(tensor)] = (name, tensor, copy)
    for out, valid in outputs:
        left = still_sentinel(out)
        if valid is None:
            log.unwritten, log.outputs = log.unwritten + int(left.sum()), log.outputs + out.numel()
            continue
        valid = valid.to(out.device)
        log.unwritten += int((left & valid).sum())
        log.outputs += int(valid.sum())
        out.masked_fill_(left & ~valid, 0)  # padding no call must write: zeros, as the buffer was made


@contextmanager
def _threads_of_call(log: CallLog, continues_run: bool):
    """The call on its run's count (a run's first call: the thread_plan's next; a call that
    continues the run: the count its first call ran on), then the rank's own again (even if it
    raised: the next check must not inherit another count). `log.threads`: one count a run."""
    if not log.thread_plan:
        yield
        return
    own, next_run = torch.get_num_threads(), not (continues_run and log.threads)
    torch.set_num_threads(log.thread_plan[len(log.threads) % len(log.thread_plan)] if next_run else log.threads[-1])
    try:
        yield
    finally:
        if next_run:
            log.threads.append(torch.get_num_threads())
        elif torch.get_num_threads() != log.threads[-1]:  # the subject set its own count in the call
            log.strays.append((len(log.threads) - 1, torch.get_num_threads()))
        torch.set_num_threads(own)


THREAD_INVARIANCE = "thread-invariance"
REPEATED = ("run-to-run", THREAD_INVARIANCE)  # one placement run again (families run both alike)


def repeat_labels(prop: str, repeats: int) -> list[str]:
    """The runs of a property in REPEATED: run-to-run's by number, thread-invariance's by the
    thread count each runs on (the rank's own count first)."""
    if prop == THREAD_INVARIANCE:
        return [f"{n} thread{'s' * (n > 1)}" for n in threads.varied_counts(torch.get_num_threads(), repeats)]
    return [f"repeat {k}" for k in range(repeats)]


def against_first_run(observed: torch.Tensor, per_run: int) -> torch.Tensor:
    """compare_bitwise's expected for copies of one placement repeated, `per_run` copies a run:
    each copy's twin in the first run (a run's copies are not compared with each other)."""
    return observed[:per_run].repeat(len(observed) // per_run, 1)


def judge_threads(m: Measurement, prop: str, runs: list[Run], logs: list[CallLog]) -> None:
    """thread-invariance: each run on its count (rank 0's, as every rank's plan is the same),
    its calls after the first marked as continuing it (subject_call), else an error; every run
    on one count is vacuous."""
    if prop != THREAD_INVARIANCE:
        return
    ran = logs[0].threads
    m.detail["threads"] = ran
    if len(ran) != len(runs):
        fix = "mark a run's later calls" if len(ran) > len(runs) else "mark only a run's later calls, never its first,"
        m.error = (f"thread-invariance runs each of its {len(runs)} runs on another thread count; this check's "
                   f"calls began {len(ran)} runs (its family should {fix} continues_run, or not declare the property)")
    elif len(set(ran)) < 2:
        m.vacuous_reason = f"every run ran on {ran[0]} thread(s): no thread count varied"
    strays = logs[0].strays
    if strays:  # what those calls computed did not follow the plan: say so beside the verdict
        m.detail["threads_of_later_calls"] = strays
        m.note = (f"{len(strays)} call(s) after a run's first ended on another thread count than the run's "
                  f"({', '.join(f'run {i}: {n}' for i, n in strays[:4])}): the subject sets its own count there")


def judge_calls(m: Measurement, logs: list[CallLog]) -> None:
    """Every rank's CallLog into the measurement: an output element never written makes the
    check an error (nothing the subject computed was measured there), a modified input a
    failure beside the count (as every family's subject must leave its inputs alone)."""
    unwritten = sum(log.unwritten for log in logs)
    if unwritten:
        where = [r for r, log in enumerate(logs) if log.unwritten]
        m.error = (f"{unwritten:,} of {sum(log.outputs for log in logs):,} output elements were never written "
                   f"(on ranks {where} they still hold the NaN the harness filled the output with before each call)")
    names = list(dict.fromkeys(n for log in logs for n in log.modified))
    if names:
        ranks = [r for r, log in enumerate(logs) if log.modified]
        add_failure(m, f"subject modified its input{'s' if len(names) > 1 else ''} {', '.join(names[:8])}"
                       f"{' ...' if len(names) > 8 else ''} on ranks {ranks}")


def add_failure(m: Measurement, text: str) -> None:
    m.held = False
    m.extra_failure = f"{m.extra_failure}; {text}" if m.extra_failure else text


def require_finite(m: Measurement, observed: torch.Tensor, reference: torch.Tensor) -> None:
    """Compared copies that agree with each other still fail where they are NaN or Inf and
    the probe's float64 (or exact) reference `reference` ([N], or [R, N] as `observed`) is
    finite: identical NaNs are bit-equal, and torch's deterministic fill leaves NaN in any
    output a subject allocated and never wrote."""
    counts = nonfinite_counts(observed, reference.to(observed.device).expand(observed.shape))
    bad = {k: counts.get(k, 0) for k in ("nan", "+inf", "-inf")}
    if sum(bad.values()):
        names = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf"}
        kinds = ", ".join(f"{n:,} {names[k]}" for k, n in bad.items() if n)
        add_failure(m, f"{sum(bad.values()):,} of {observed.numel():,} compared outputs are not finite where the "
                       f"float64 reference is ({kinds})")


def vacuity(prop: str, runs: list[Run], sensitivity: int | None, sensitivity_what: str | None) -> str | None:
    """Why a check of `prop` over `runs` could not have failed, or None: the rules follow
    what the property compares (harness/properties.py), whatever its name."""
    kind = properties.get(prop)
    if kind.needs_reference:
        return None
    copies = [c for r in runs for c in r.copies]
    if len(copies) < 2 or len(runs) < kind.min_runs:
        return f"only one run ({runs[0].label if runs else 'none'}): nothing to compare " \
               f"(a one-element sweep or repeats = 1)"
    if kind.compares != "repeat" and len({c.placement for c in copies}) < 2:
        return (f"the {len(copies)} compared runs are one and the same placement ({runs[0].label}): "
                f"nothing moved in the dimension {prop} names")
    if kind.compares == "destination" and len({c.destination for c in copies}) < 2:
        return "the probe lands on only one destination"
    if sensitivity == 0:
        return f"0 {sensitivity_what or 'probe elements change bits under any reordering this check could expose'}"
    return None


def compared_nothing(m: Measurement) -> str | None:
    """A comparison over no element (every token left out, an empty output) holds whatever
    the subject returned."""
    if m.total == 0 and m.held and not m.extra_failure and not m.error:
        return "0 elements were compared (every one left out or none produced)"
    return None


def judge_vacuity(m: Measurement, prop: str, runs: list[Run]) -> None:
    """Set `vacuous_reason` only where nothing differed: the rules above estimate what a
    reordering could show, and a measured difference (a wrong value, a signed zero, a NaN
    payload) is a result whatever they estimated; their reason is kept as
    `detail.vacuity_estimate`, and the verdict names it."""
    why = m.vacuous_reason or vacuity(prop, runs, m.sensitivity, m.sensitivity_what) or compared_nothing(m)
    if why and m.mismatched:
        m.detail["vacuity_estimate"] = why
        why = None
    m.vacuous_reason = why


def warm_up(family: Family, check, subject, ctx: RankContext) -> None:
    """Every run of the check executed once, untimed and unmeasured: a JIT-compiling subject
    compiles (or loads from its cache) each kernel the check will time."""
    p = check.params
    family.observe(subject, ctx, p, check.property, family.runs(check.property, p, ctx.world_size))


def execute(family: Family, check, subject, ctx: RankContext) -> Measurement | None:
    """Run an ep_harness.check.Check of `family` on this rank: its Measurement on rank 0, None
    on the others. Rank 0 alone records it, so the verdict is not sent back: on CPU ranks each
    collective costs milliseconds of wake-ups (two for an object broadcast), and the other
    ranks go on to the next check's first collective, which waits for rank 0 anyway."""
    p, prop = check.params, check.property
    runs = family.runs(prop, p, ctx.world_size)
    trace = kernel_trace.traced(subject, p, ctx.device)
    plan = threads.varied_counts(torch.get_num_threads(), len(runs)) if prop == THREAD_INVARIANCE else None
    log = CallLog(thread_plan=plan)  # what the subject's calls did beside their results (subject_call)
    with kernel_trace.kernel_names(ctx.device, trace) as ran:
        token = _LOG.set(log)
        try:
            local = family.observe(subject, ctx, p, prop, runs)
        finally:
            _LOG.reset(token)
            log.recheck()
    collected = ctx.gather_on_rank0((local, log, ran if trace else None))  # rank 0 alone measures
    result = None
    if ctx.rank == 0:
        gathered, logs, kernels = (list(x) for x in zip(*collected))
        result = family.measure(check, subject, ctx, p, runs, gathered)
        judge_calls(result, logs)
        judge_threads(result, prop, runs, logs)
        judge_vacuity(result, prop, runs)
        if trace:
            _prove_kernels(result, subject, p, kernels)
        if hook(subject, "describe") is not None:  # what exactly ran: library version, its configuration
            result.detail["subject_info"] = description(subject, p)
    return result


def _prove_kernels(result: Measurement, subject, p, kernels: list[set[str]]) -> None:
    """List what ran; a declared kernel that ran on no rank makes the check an error."""
    wanted = kernel_trace.declared(subject, p)
    result.kernels = kernel_trace.summarize(kernels, wanted)
    absent = kernel_trace.missing(wanted, kernels)
    if absent:
        ran = ", ".join(result.kernels[:6]) or "none"
        result.error = (f"{subject.name} declares kernels {absent} but none ran during the measured calls "
                        f"(a silent fallback?); ran: {ran}")
