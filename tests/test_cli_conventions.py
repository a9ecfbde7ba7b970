"""The CLI as a user meets it: --version, the plugin contract's one-line errors, a plugin
installed as a distribution (its name and version recorded), and argparse conventions."""
import json
import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from harness import subject as registry
from harness.errors import HarnessError
from tests.conftest import REPO

PYPROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def harness(*args, cwd=REPO, extra_path=(), env=None, timeout=600):
    """`python -m harness ARGS` with the checkout (and `extra_path`) importable."""
    path = os.pathsep.join([*map(str, extra_path), str(REPO)])
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": path, **(env or {})})


# --- version --------------------------------------------------------------------------


def test_version_names_the_pyproject_version_and_the_commit():
    proc = harness("--version")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"ep-harness {PYPROJECT_VERSION} ({head}"), proc.stdout


def test_version_outside_a_checkout_says_the_commit_is_unknown(tmp_path, monkeypatch):
    from harness import environment, version

    monkeypatch.delenv("EP_HARNESS_COMMIT", raising=False)
    monkeypatch.setattr(environment, "git_commit", lambda: None)
    assert "commit unknown" in version.version_line()
    monkeypatch.setenv("EP_HARNESS_COMMIT", "abc123")
    monkeypatch.setattr(environment, "git_commit", lambda: os.environ["EP_HARNESS_COMMIT"])
    assert version.version_line().endswith("(abc123)")


def test_the_package_version_is_pyprojects():
    import harness
    from harness.version import harness_version

    assert harness_version() == PYPROJECT_VERSION == harness.__version__


# --- plugins: an installed distribution, optional order_model, contract errors --------

FOLD_PLUGIN = '''
import torch.distributed as dist

from harness.subject import register


@register
class DemoFold:
    """A deterministic reduce-scatter that states no order model (order_model is optional)."""
    name = "demo_fold"
    family = "collective"
    summary = "all-gather + fold 0..W-1, no order model"

    def unavailable(self, platform, params):
        return None

    def reduce_scatter(self, out, inp, sizes, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        gathered = inp.new_empty((world * inp.shape[0], *inp.shape[1:]))
        dist.all_gather_into_tensor(gathered, inp.contiguous(), group=group)
        start = sum(sizes[:rank])
        mine = gathered.view(world, *inp.shape)[:, start:start + sizes[rank]]
        acc = mine[0].clone()
        for r in range(1, world):
            acc = acc + mine[r]
        out.copy_(acc)
'''


def install_distribution(site, module: str, source: str, dist: str, version: str) -> None:
    """A distribution as pip leaves it: the module and a dist-info with an ep_harness.subjects
    entry point naming it."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[ep_harness.subjects]\n{module} = {module}\n")
    (info / "top_level.txt").write_text(module + "\n")
    (info / "RECORD").write_text(f"{module}/__init__.py,,\n")


@pytest.mark.slow
def test_an_installed_collective_plugin_without_order_model_runs_and_is_recorded(tmp_path):
    site = tmp_path / "site"
    install_distribution(site, "demo_fold_plugin", FOLD_PLUGIN, "demo-fold-plugin", "1.2.3")
    suite = tmp_path / "demo.toml"
    suite.write_text(textwrap.dedent('''
        [[case]]
        name = "demo"
        subject = "demo_fold"
        properties = ["rank-invariance"]
        expect = "holds"
        [case.grid]
        dtype = ["bfloat16"]
        world_size = [3]
    '''))
    listing = harness("list", cwd=tmp_path, extra_path=[site])
    assert listing.returncode == 0, listing.stderr
    assert "demo_fold" in listing.stdout
    proc = harness("verify", "--suite", str(suite), "--gpus", "0", "--cpu-ranks", "3", "--out", "runs",
                   "--no-report", cwd=tmp_path, extra_path=[site])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [record] = [json.loads(line) for line in (tmp_path / "runs/latest/results.jsonl").read_text().splitlines()]
    assert record["status"] == "ok" and record["held"] is True, record
    assert record.get("predicted_mismatched") is None and record["mismatched"] == 0  # measured, not predicted
    assert record["subject_distribution"] == {"distribution": "demo-fold-plugin", "version": "1.2.3"}
    assert record["harness_version"] == PYPROJECT_VERSION
    env = json.loads((tmp_path / "runs/latest/environment.json").read_text())
    assert env["harness_version"] == PYPROJECT_VERSION
    assert env["plugin_distributions"] == {"demo_fold": {"distribution": "demo-fold-plugin", "version": "1.2.3"}}


def test_a_built_in_subject_names_no_plugin_distribution():
    registry.load_all()
    assert registry.plugin_distribution("all_gather_fold") is None
    assert "all_gather_fold" not in registry.plugin_distributions()


WRONG_SIGNATURE = '''
from harness.subject import register


@register
class Wrong:
    name = "wrong_arity"
    family = "collective"
    summary = "reduce_scatter without the group"

    def unavailable(self, platform, params):
        return None

    def reduce_scatter(self, out, inp, sizes):
        pass
'''


def _one_line_contract_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_plugin_module_with_a_wrong_signature_is_one_line_exit_2(tmp_path):
    (tmp_path / "wrong_plugin.py").write_text(WRONG_SIGNATURE)
    proc = harness("list", "--plugin", "wrong_plugin", cwd=tmp_path)
    _one_line_contract_error(proc, "'wrong_arity'", "reduce_scatter() takes 3 argument(s), the contract passes 4",
                             "expected def reduce_scatter(self, out, inp, sizes: list[int], group)")


def test_an_entry_point_plugin_with_a_missing_method_is_one_line_exit_2(tmp_path):
    site = tmp_path / "site"
    source = WRONG_SIGNATURE.replace("def reduce_scatter(self, out, inp, sizes):", "def scatter(self):")
    install_distribution(site, "missing_plugin", source, "missing-plugin", "0.1")
    proc = harness("list", cwd=tmp_path, extra_path=[site])
    _one_line_contract_error(proc, "entry point 'missing_plugin'", "'wrong_arity'",
                             "missing 'reduce_scatter' (expected def reduce_scatter(self, out, inp, sizes")


def _collective(**methods):
    body = {"name": "optional_probe", "family": "collective", "summary": "s",
            "unavailable": lambda self, platform, params: None, **methods}
    return type("OptionalProbe", (), body)


def test_order_model_is_optional_but_reduce_scatter_is_not():
    try:
        registry.register(_collective(reduce_scatter=lambda self, out, inp, sizes, group: None))
        assert registry.order_model_of(registry.get("optional_probe"), "gloo") is None
    finally:
        registry._REGISTRY.pop("optional_probe", None)
    # control: the same class without its required method is refused, as a HarnessError
    with pytest.raises(HarnessError, match=r"missing 'reduce_scatter' \(expected def reduce_scatter"):
        registry.register(_collective())
    # and a wrong arity of the optional method is still refused
    with pytest.raises(HarnessError, match=r"order_model\(\) takes 0 argument\(s\), the contract passes 1"):
        registry.register(_collective(reduce_scatter=lambda self, out, inp, sizes, group: None,
                                      order_model=lambda self: None))
    assert "optional_probe" not in registry._REGISTRY
