"""The optional subject hooks (harness/subject.py OptionalHooks): declared in one Protocol,
checked by `register` wherever a subject defines one, and looked up nowhere else."""
import ast
from pathlib import Path

import pytest

from ep_harness import subject as registry
from ep_harness.errors import HarnessError

HARNESS = Path(__file__).resolve().parent.parent / "harness"


def _collective(**members):
    body = {"name": "hook_probe", "family": "collective", "summary": "s",
            "unavailable": lambda self, platform, params: None,
            "reduce_scatter": lambda self, out, inp, sizes, group: None, **members}
    return type("HookProbe", (), body)


@pytest.fixture
def register():
    yield registry.register
    registry._REGISTRY.pop("hook_probe", None)


def test_every_hook_is_declared_with_a_docstring():
    assert set(registry.HOOKS) >= {"setup", "teardown", "compiles_kernels", "kernels", "describe", "order_model",
                                   "reduce_shards", "shards_order_model", "combine_model", "rounds_partials"}
    methods = [n for n in registry.HOOKS if callable(vars(registry.OptionalHooks).get(n))]
    assert all(vars(registry.OptionalHooks)[n].__doc__ for n in methods)
    assert set(registry.HOOKS) - set(methods) == {"rounds_partials"}  # the one attribute


@pytest.mark.parametrize("name, wrong, expected", [
    ("setup", lambda self: None, "setup() takes 0 argument(s), the contract passes 1 (expected def setup(self, ctx)"),
    ("teardown", lambda self, ctx, more: None, "teardown() takes 2 argument(s), the contract passes 1"),
    ("describe", lambda self: {}, "describe() takes 0 argument(s), the contract passes 1 "
                                  "(expected def describe(self, params) -> dict)"),
    ("kernels", ("nccl",), "kernels is a tuple, not a method (expected def kernels(self, params)"),
    ("shards_order_model", lambda self: None, "shards_order_model() takes 0 argument(s), the contract passes 1"),
    ("rounds_partials", "yes", "rounds_partials is a str, the contract reads a bool"),
])
def test_register_refuses_a_hook_of_the_wrong_shape_in_one_line(register, name, wrong, expected):
    with pytest.raises(HarnessError) as err:
        register(_collective(**{name: wrong}))
    message = str(err.value)
    assert expected in message and "'hook_probe'" in message and "\n" not in message, message
    assert "hook_probe" not in registry._REGISTRY


def test_hooks_of_the_right_shape_or_set_to_none_are_registered(register):
    # the control of the test above: the same probe with each hook as declared
    register(_collective(setup=lambda self, ctx: None, describe=lambda self, params: {"v": 1},
                         kernels=lambda self, params: ("nccl",), rounds_partials=True, shards_order_model=None))
    probe = registry.get("hook_probe")
    assert registry.description(probe, None) == {"v": 1} and registry.rounds_partials(probe)
    assert registry.shards_order_model_of(probe, "gloo") is None  # None counts as absent
    assert registry.order_model_of(probe, "gloo") is None and registry.compiles_kernels(probe, None) is False


def test_asking_for_a_hook_that_is_not_declared_fails():
    with pytest.raises(KeyError, match="'order_modle' is not an optional hook"):
        registry.hook(object(), "order_modle")


def hook_lookups(source: str) -> list[str]:
    """getattr / hasattr calls that name an optional hook by its string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in registry.HOOKS:
            found.append(f"{node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_module_but_subject_py_looks_a_hook_up_itself():
    offending = {str(p.relative_to(HARNESS)): hook_lookups(p.read_text()) for p in HARNESS.rglob("*.py")
                 if p != HARNESS / "subject.py"}
    assert not {k: v for k, v in offending.items() if v}


def test_the_lookup_scan_sees_a_planted_lookup():
    planted = 'def f(subject, p):\n    if hasattr(subject, "describe"):\n        return getattr(subject, "kernels")(p)\n'
    assert hook_lookups(planted) == ["hasattr(..., 'describe')", "getattr(..., 'kernels')"]
