"""The CLI as a user meets it: --version, the plugin contract's one-line errors, a plugin
installed as a distribution (its name and version recorded), and argparse conventions."""
import json
import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from ep_harness import subject as registry
from ep_harness.errors import HarnessError
from tests.conftest import REPO, completed, once_per_session, run_cli, shared_dir
from tests.forked_cli import cli_fork  # noqa: F401  (a fixture)

PYPROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def harness(*args, cwd=REPO, extra_path=(), env=None, timeout=600):
    """`python -m ep_harness ARGS` with the checkout (and `extra_path`) importable (forked where
    it can be: conftest.run_cli)."""
    path = os.pathsep.join([*map(str, extra_path), str(REPO)])
    return run_cli(*args, cwd=cwd, timeout=timeout, module=True,
                   env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})})


# --- version --------------------------------------------------------------------------


# A plugin module that prints what the command it loads into sees of its start.
PATH_PROBE = ('import json, sys\n'
              'main = sys.modules["__main__"].__spec__\n'
              'print("PROBE", json.dumps([sys.path[:3], sys.argv[0], main and main.name]))\n')


def test_a_forked_command_starts_with_the_path_a_new_interpreter_would(tmp_path):
    """tests/forked_cli.py reproduces two start-up differences in the fork: directories in
    front of its server's PYTHONPATH, and `python -m ep_harness`. What the command sees (the
    head of sys.path, argv[0], __main__) is what a new interpreter shows, or the console
    script's (its folder first); a directory holding a module the server has imported is not
    reproduced (a new interpreter would import that one instead)."""
    from tests.forked_cli import shared_server

    site = tmp_path / "site"
    site.mkdir()
    (site / "path_probe.py").write_text(PATH_PROBE)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}

    def seen(proc):
        [line] = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
        return json.loads(line.removeprefix("PROBE "))

    args = ("list", "--plugin", "path_probe")
    assert shared_server(env) is not None  # forked, not a new interpreter
    fresh = subprocess.run([sys.executable, "-m", "ep_harness", *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    forked = run_cli(*args, cwd=tmp_path, env=env, module=True)
    assert seen(forked) == seen(fresh) == [[str(tmp_path), str(site), str(REPO)], str(REPO / "harness" / "__main__.py"),
                                           "ep_harness.__main__"], (forked.stderr, fresh.stderr)
    script = run_cli(*args, cwd=tmp_path, env=env)
    assert seen(script)[0][:2] == [os.path.dirname(sys.executable), str(site)]  # the console script's folder first
    (site / "json.py").write_text("")  # json: imported by the server
    assert shared_server(env) is None


def test_a_forked_command_that_ends_at_once_is_read_to_its_status(cli_fork):
    """tests/forked_cli.py: a command that ends at once (0.05 s, with the fork's teardown
    skipped) sends its status right behind its pid; both answers are in the pipe before the
    first is read, and each is still read (a buffered reader held the second where select()
    could not see it, and the test waited out its timeout)."""
    import time

    server = cli_fork
    out, err = server.send(["verify", "--threads", "two"])
    time.sleep(1.0)  # the command has ended and both answers wait in the pipe
    assert server.status(timeout=10) == 2
    assert out.read_text() == "" and "--threads 'two' is not a thread count" in err.read_text()
    assert server("--version").returncode == 0  # and the server goes on serving


def test_a_started_forked_command_is_waited_for_or_ended_before_the_next(cli_fork):
    """ForkedCli.start (conftest.start_cli): the command's stderr in its output, its status
    once it has ended, and a command its test did not wait for (running, or ended and reaped by
    the server) is settled before the server makes the next, whose answers would otherwise be
    read as the first's."""
    import time

    server = cli_fork
    run = server.start("verify", "--threads", "two")
    output, _ = run.communicate(timeout=60)
    assert run.returncode == run.poll() == 2 and "--threads 'two' is not a thread count" in output
    for pause in (0.0, 1.0):  # the next command at once, and after this one has ended
        left = server.start("verify", "--threads", "three")
        time.sleep(pause)
        version = server("--version")
        assert left.returncode in (2, -9) and version.returncode == 0 and version.stdout.startswith("ep-harness ")
    assert "--threads 'two'" in run.communicate()[0]  # each started command's output is its own


def test_version_names_the_pyproject_version_and_the_commit():
    proc = harness("--version")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"ep-harness {PYPROJECT_VERSION} ({head}"), proc.stdout


def test_version_outside_a_checkout_says_the_commit_is_unknown(tmp_path, monkeypatch):
    from ep_harness import environment, version

    monkeypatch.delenv("EP_HARNESS_COMMIT", raising=False)
    monkeypatch.setattr(environment, "git_commit", lambda: None)
    assert "commit unknown" in version.version_line()
    monkeypatch.setenv("EP_HARNESS_COMMIT", "abc123")
    monkeypatch.setattr(environment, "git_commit", lambda: os.environ["EP_HARNESS_COMMIT"])
    assert version.version_line().endswith("(abc123)")


def test_the_package_version_is_pyprojects():
    import ep_harness
    from ep_harness.version import harness_version

    assert harness_version() == PYPROJECT_VERSION == ep_harness.__version__


# --- plugins: an installed distribution, optional order_model, contract errors --------

FOLD_PLUGIN = '''
import torch.distributed as dist

from ep_harness.subject import register
from ep_harness.subjects.collective.common import all_gather_single


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
        all_gather_single(gathered, inp.contiguous(), group=group)
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
from ep_harness.subject import register


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


# --- argparse conventions, did-you-mean, --check, -q, colour ----------------------------


def test_no_parser_abbreviates_options_and_an_unknown_one_gets_a_suggestion():
    from ep_harness.cli import Parser, build_parser

    parser = build_parser()
    subparsers = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"][0].choices
    assert {"verify", "list", "selftest", "explore", "nightly"} <= set(subparsers)
    for p in [parser, *subparsers.values()]:
        assert isinstance(p, Parser) and p.allow_abbrev is False, p.prog
    proc = harness("verify", "--suit", "smoke")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [  # one line, not the usage before it
        "ep-harness verify: error: unrecognized arguments: --suit smoke (did you mean '--suite'?) "
        "(see ep-harness verify --help)"] and proc.stdout == ""
    proc = harness("verfy", "--suite", "smoke")  # a mistyped subcommand: one line, the closest one named
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "ep-harness: error: unknown command 'verfy' (did you mean 'verify'?); choose from verify, report, gate, "
        "baseline, nightly, explore, selftest, doctor, list (see ep-harness --help)"]
    # positive control: the full option parses
    args = parser.parse_args(["verify", "--suite", "smoke", "-q"])
    assert args.suite == "smoke" and args.quiet


def test_unknown_suites_subjects_and_properties_get_a_suggestion(tmp_path):
    from ep_harness.cases import load_suite, resolve_suite_path
    from ep_harness.run.plan import expand
    from ep_harness.subject import Platform

    with pytest.raises(HarnessError, match=r"unknown suite 'smok' \(did you mean 'smoke'\?\); built-in suites: "):
        resolve_suite_path("smok")
    registry.load_all()
    with pytest.raises(HarnessError, match=r"unknown subject 'all_gather_fld' \(did you mean 'all_gather_fold'\?\)"):
        registry.get("all_gather_fld")
    suite = tmp_path / "s.toml"
    suite.write_text('[[case]]\nname = "c"\nsubject = "all_gather_fold"\nproperties = ["rank-invariants"]\n'
                     'expect = "holds"\n[case.grid]\ndtype = ["bfloat16"]\nworld_size = [2]\n')
    with pytest.raises(HarnessError, match=r"property 'rank-invariants' .*\(did you mean 'rank-invariance'\?\)"):
        expand(load_suite(suite), Platform(backend="gloo", device="cpu", ranks=4))
    # nothing close: no suggestion, the list instead
    with pytest.raises(HarnessError) as err:
        resolve_suite_path("zzzzzz")
    assert "did you mean" not in str(err.value) and "smoke" in str(err.value)


def test_list_names_a_bad_suite_before_torch_loads(tmp_path):
    """`list --suite` with a misspelled or malformed suite: one line and exit 2, in a tenth of
    a second (without torch, which the subjects need). Control: a good suite, listed next in
    the same process, loads it."""
    broken = tmp_path / "broken.toml"
    broken.write_text("[[case]\n")
    code = ("import sys; from ep_harness.cli import main\n"
            "for suite in sys.argv[1:]: print(main(['list', '--suite', suite]), 'torch' in sys.modules, flush=True)")
    proc = subprocess.run([sys.executable, "-c", code, "smok", str(broken), "smoke"], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    results = [w for w in map(str.split, proc.stdout.splitlines()) if w and w[-1] in ("True", "False")]
    assert results == [["2", "False"], ["2", "False"], ["0", "True"]], proc.stdout[-2000:] + proc.stderr
    assert "(did you mean 'smoke'?)" in proc.stderr and "malformed TOML" in proc.stderr, proc.stderr
    assert "rs-native/" in proc.stdout


def test_check_takes_a_case_name_or_an_id_prefix():
    from ep_harness.cases import load_suite
    from ep_harness.run.plan import expand, literal
    from ep_harness.subject import Platform

    registry.load_all()
    smoke = load_suite(REPO / "cases" / "smoke.toml")
    cpu = Platform(backend="gloo", device="cpu", ranks=4)
    every = [c.id for c in expand(smoke, cpu)]

    def ids(*selection):
        return [c.id for c in expand(smoke, cpu, list(selection))]

    assert any(i.startswith("rs-native-stable/") for i in every)  # the name a bare prefix would also catch
    by_case = ids("rs-native")
    assert by_case == [i for i in every if i.split("/")[0] == "rs-native"] and len(by_case) == 18
    assert ids("rs-native/rank-invariance") == [i for i in by_case if i.split("/")[1] == "rank-invariance"]
    assert ids("rs-native/rank-invariance/") == ids("rs-native/rank-invariance")
    assert ids("rs-native/*/dtype=float32/*") == [i for i in by_case if "/dtype=float32/" in i]  # globs as before
    assert ids(literal(by_case[0])) == [by_case[0]]
    with pytest.raises(HarnessError, match=r"--check rs-nativ matches no check .*\(did you mean 'rs-native'\?\)"):
        ids("rs-nativ")  # a prefix must end at a `/`


QUIET_SUITE = '''
[[case]]
name = "fold"
subject = "all_gather_fold"
properties = ["rank-invariance"]
expect = "holds"
[case.grid]
dtype = ["bfloat16"]
world_size = [3]

[[case]]
name = "native-claimed-to-hold"
subject = "reduce_scatter_native"
properties = ["rank-invariance"]
expect = "holds"
[case.grid]
dtype = ["bfloat16"]
world_size = [3]
'''


@pytest.fixture(scope="session")
def quiet_run(tmp_path_factory):
    """`verify -q` of one check that holds and one that fails (the native control claimed to hold),
    once per session."""
    def run(tmp):
        tmp.mkdir()
        (tmp / "q.toml").write_text(QUIET_SUITE)
        return completed(harness("verify", "-q", "--suite", str(tmp / "q.toml"), "--gpus", "0", "--out",
                                 str(tmp / "runs")))

    proc = subprocess.CompletedProcess(**once_per_session(tmp_path_factory, "quiet-run", run))
    return proc, shared_dir(tmp_path_factory) / "quiet-run" / "runs"


@pytest.mark.slow
def test_quiet_prints_only_failures_and_the_verdict(quiet_run):
    proc, runs = quiet_run
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3, proc.stdout
    assert lines[0].startswith("unexpected: native-claimed-to-hold/rank-invariance/dtype=bfloat16/world_size=3: "
                               "expected to hold, but ")
    assert lines[1].startswith("  rerun: ep-harness verify --suite ")
    run_dir = (runs / "latest").resolve()
    assert lines[2] == f"# FAILED: 1 ok, 1 unexpected ({run_dir})"
    assert (run_dir / "report.html").exists()  # -q prints less; it writes the same


def _on_a_terminal(args, env):
    """Run `python -m ep_harness ARGS` with stdout on a pseudo-terminal; returns what it printed."""
    import pty

    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ep_harness", *args], stdout=terminal, stderr=subprocess.DEVNULL,
                            cwd=REPO, env=env)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: the process is done writing
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=120)
    os.close(controller)
    return b"".join(chunks).decode()


@pytest.mark.slow
def test_colour_only_on_a_terminal_and_never_with_no_color(quiet_run):
    _, runs = quiet_run
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")} | {
        "PYTHONPATH": str(REPO), "TERM": "xterm"}
    args = ["report", str(runs / "latest"), "--out", str(runs / "copy.html")]
    coloured = _on_a_terminal(args, env)
    assert "\x1b[31munexpected\x1b[0m" in coloured and "\x1b[32mok" in coloured and "\x1b[31mFAILED\x1b[0m" in coloured
    assert "\x1b[" not in _on_a_terminal(args, env | {"NO_COLOR": "1"})
    piped = harness("report", *args[1:])
    assert piped.returncode == 1 and "unexpected" in piped.stdout and "\x1b[" not in piped.stdout  # a FAILED run


def test_the_no_gpu_error_speaks_in_cli_options():
    proc = harness("verify", "--gpus", "4", "--out", "/nonexistent/never-written")
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "--gpus 4 but this machine has 0 visible GPUs" in line and "use --gpus 0 (the CPU)" in line
    assert "GPUS=" not in line and "EMULATE_HOSTS" not in line and "--emulate hosts" in line


def test_expect_model_without_an_order_model_is_refused_at_planning(tmp_path):
    from ep_harness.cases import load_suite
    from ep_harness.run.plan import expand
    from ep_harness.subject import Platform

    text = ('[[case]]\nname = "c"\nsubject = "optional_probe"\nproperties = ["rank-invariance"]\n'
            'expect = "EXPECT"\n[case.grid]\ndtype = ["bfloat16"]\nworld_size = [3]\n')
    cpu = Platform(backend="gloo", device="cpu", ranks=4)
    try:
        registry.register(_collective(reduce_scatter=lambda self, out, inp, sizes, group: None))
        (tmp_path / "model.toml").write_text(text.replace("EXPECT", "model"))
        with pytest.raises(HarnessError, match=r"expect = \"model\" needs an order model and subject "
                                               r"'optional_probe' has none"):
            expand(load_suite(tmp_path / "model.toml"), cpu)
        (tmp_path / "holds.toml").write_text(text.replace("EXPECT", "holds"))  # control: any other expectation
        assert [c.expect for c in expand(load_suite(tmp_path / "holds.toml"), cpu)] == ["holds"]
    finally:
        registry._REGISTRY.pop("optional_probe", None)
