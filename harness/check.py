"""One point of a case's grid: what to run, with which parameters, expecting what.

Built by the planner (harness/run/plan.py) with typed, validated parameters; it travels to
the ranks as JSON (`to_json` / `from_json`) and becomes one record.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ep_harness import params
from ep_harness.params import CommonParams


@dataclass(frozen=True)
class Check:
    id: str
    suite: str
    case: str
    subject: str
    family: str
    property: str
    params: CommonParams  # the family's dataclass, every effective value (defaults and seed)
    expect: str  # holds | violated | model | measure
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)  # launch environment overrides
    topology: str = ""
    nccl: str | None = None  # the NCCL that runs (from the library: harness/nccl/library.py), on NCCL runs
    skip_reason: str | None = None

    @property
    def params_record(self) -> dict:
        """The parameters as a plain dict, as records store them. Families and subjects read
        the typed `params` (`check.params.hidden`): a renamed field is an AttributeError."""
        return asdict(self.params)

    @property
    def world_size(self) -> int:
        return self.params.world_size

    def to_json(self) -> dict:
        return {**asdict(self), "params": self.params_record}

    @classmethod
    def from_json(cls, d: dict) -> Check:
        from ep_harness import families

        return cls(**{**d, "params": families.get(d["family"]).params(**d["params"])})


def typed_params(family: str, raw: dict, subject, where: str, grid_keys=frozenset()) -> CommonParams:
    """The typed parameters of one check of `family`: `raw` validated against the dataclass its
    registered Family declares (ep_harness.params.build); `where` prefixes every error."""
    from ep_harness import families  # the registry imports every family module, and torch with them

    return params.build(families.get(family).params, family, raw, subject, where, grid_keys)


def single_check(subject, prop: str, raw_params: dict, backend: str = "gloo", check_id: str | None = None,
                 expect: str = "holds") -> Check:
    """A check outside any suite (explore, tests), its parameters validated like a case's."""
    typed = replace(typed_params(subject.family, raw_params, subject, f"{subject.name} {prop}"), backend=backend)
    return Check(id=check_id or f"{subject.name}/{prop}", suite="-", case="-", subject=subject.name,
                 family=subject.family, property=prop, params=typed, expect=expect, timeout_s=120.0)
