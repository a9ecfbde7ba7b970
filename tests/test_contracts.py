"""The contracts between families and subjects (harness/contracts.py): no family imports a
subject, no subject a family's input builder, and a dispatcher keeps no per-call state on its registered instance (the backend's
handle travels in `Received.native`), so two dispatches before their combines each combine
their own rows."""
import ast
from pathlib import Path

import pytest
import torch

from ep_harness import subject as registry
from ep_harness.contracts import DispatchConfig, Received
from ep_harness.families.dispatch import run_experts
from ep_harness.subjects.dispatch import deepep
from tests import fake_deep_ep

HARNESS = Path(__file__).resolve().parent.parent / "harness"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_no_family_imports_a_subject_and_contracts_import_neither():
    family_side = [*HARNESS.glob("families/*.py"), HARNESS / "contracts.py"]  # families/ holds their input builders
    offending = {p.name: sorted(m for m in imported_modules(p) if m.startswith("ep_harness.subjects"))
                 for p in family_side}
    assert not {k: v for k, v in offending.items() if v}
    assert not {m for m in imported_modules(HARNESS / "contracts.py") if m.startswith("ep_harness.families")}


def test_no_subject_imports_a_familys_input_builder():
    builders = ("ep_harness.families",)  # the family modules and their input builders (harness/families/)
    offending = {str(p.relative_to(HARNESS)): sorted(m for m in imported_modules(p) if m.startswith(builders))
                 for p in HARNESS.glob("subjects/**/*.py")}
    assert not {k: v for k, v in offending.items() if v}


def test_the_import_check_sees_a_subject_import(tmp_path):
    planted = tmp_path / "family.py"
    planted.write_text("from ep_harness.subjects.dispatch.common import quantize_wire\n")
    assert "ep_harness.subjects.dispatch.common" in imported_modules(planted)



def every_import(source: str) -> set[str]:
    """Every module a source imports, at its top or inside a function, `from ep_harness import
    families` counted as `ep_harness.families`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_family_registry_imports_params_and_params_imports_no_family():
    """No circle: params.py is the generic machinery below every family, never above one."""
    assert "ep_harness.params" in every_import((HARNESS / "families" / "__init__.py").read_text())
    assert not {m for m in every_import((HARNESS / "params.py").read_text()) if m.startswith("ep_harness.families")}


def test_the_circle_check_sees_a_lazy_registry_import():
    planted = "def family_params(name):\n    from ep_harness import families\n    return families.get(name).params\n"
    assert "ep_harness.families" in every_import(planted)

CFG = DispatchConfig(num_experts=8, topk=2, hidden=128, layout="contiguous", alignment=16, expert_quant="bf16",
                     wire="bf16", ue8m0=True, tokens_max=8)


def tokens(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, CFG.hidden, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(CFG.num_experts, generator=g)[:CFG.topk] for _ in range(n)])
    w = torch.rand(n, CFG.topk, generator=g)
    return x, idx, w


def served(subject, group, *batches, interleaved: bool):
    """Each batch dispatched, run through exact experts and combined: every dispatch first
    (interleaved), or each batch's dispatch and combine in turn."""
    received: list[Received] = []
    out = []
    for x, idx, w in batches:
        received.append(subject.dispatch(x, idx, w, CFG, group))
        if not interleaved:
            out.append(subject.combine(run_experts(received[-1], 0, CFG.num_experts), received[-1], w, group))
    if interleaved:  # combined in reverse order of dispatch
        for (x, idx, w), r in reversed(list(zip(batches, received))):
            out.insert(0, subject.combine(run_experts(r, 0, CFG.num_experts), r, w, group))
    return out


class LastHandle:
    """The defect the contract forbids: the handle kept on the instance, not in Received."""

    def __init__(self, inner):
        self.inner = inner

    def dispatch(self, x, idx, w, cfg, group):
        self.last = self.inner.dispatch(x, idx, w, cfg, group)
        return self.last

    def combine(self, expert_out, handle, w, group):
        return self.inner.combine(run_experts(self.last, 0, CFG.num_experts), self.last, w, group)


@pytest.fixture
def fake(monkeypatch):
    fake_deep_ep.CALLS.clear()
    monkeypatch.setattr(deepep._DeepEP, "module", staticmethod(lambda: fake_deep_ep))


@pytest.mark.parametrize("name", ["torch_a2a_dispatch", "deepep_v1", "deepep_v2"])
def test_two_dispatches_before_their_combines_each_combine_their_own(one_rank, fake, name):
    subject = registry.load_all()[name]  # the registered, shared instance
    batches = (tokens(1), tokens(2))
    alone = served(subject, one_rank.group, *batches, interleaved=False)
    assert not torch.equal(alone[0], alone[1])  # the two batches are told apart
    together = served(subject, one_rank.group, *batches, interleaved=True)
    for a, b in zip(alone, together):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_handle_kept_on_the_instance_is_caught(one_rank):
    subject = LastHandle(registry.load_all()["torch_a2a_dispatch"])
    batches = (tokens(1), tokens(2))
    alone = served(subject, one_rank.group, *batches, interleaved=False)
    together = served(subject, one_rank.group, *batches, interleaved=True)
    assert not torch.equal(alone[0], together[0])  # batch 1 combined with batch 2's rows
