"""The launcher <-> rank protocol (harness/launch/protocol.py): every message kind survives its wire
form and the run's signed store, anything else is refused with one line naming the key and
the field, a rank that garbles a message ends its check with that line as the error, and no
module but protocol.py formats a store key."""
import ast
import dataclasses
import json
import os
import random
import time

import pytest

from ep_harness.launch import protocol
from ep_harness.launch.channel import Channel, tcp_store
from ep_harness.measurement import Measurement
from tests.conftest import REPO, REPO_ON_PYTHONPATH, run_cli

SECRET = "protocol-test-secret-0123456789"
KEY = "ep-harness/20261201-120000-abcd/launch0/progress/1"


def samples(seed: int) -> list[protocol.Message]:
    """One message of every kind, its values drawn from `seed` (optional fields both set and not)."""
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice("abcdefgh-_/") for _ in range(rng.randint(1, 12)))  # noqa: E731
    measured = Measurement(comparison="bitwise", mismatched=rng.randint(0, 9), total=64, held=False).to_json()
    return [
        protocol.Launch(namespace=word(), nproc=rng.randint(1, 8), rdzv_id=word(), job=word(),
                        env={word(): word() for _ in range(3)}, node_local=[word()], identity={"version": word()},
                        forked_agents=rng.choice([True, False])),
        protocol.RunOver(),
        protocol.Job(backend=rng.choice(["gloo", "nccl"]), plugins=[word(), word()],
                     checks=[{"id": word(), "params": {"world_size": rng.randint(1, 8)}}], start=rng.randint(0, 5),
                     emulate=rng.choice([None, "hosts"]), nccl=rng.choice([None, "2.30.7"]),
                     pinned_env={word(): word()}, collective_timeout_s=rng.uniform(60, 600),
                     precompile=rng.choice([None, {"marker": word(), "checks": [word()], "until": rng.random()}])),
        protocol.Progress(index=rng.randint(-1, 9), since=rng.random(), pid=rng.randint(1, 1 << 22), node=word(),
                          host=word()),
        protocol.Progress(index=rng.randint(0, 9), since=rng.random(), pid=rng.randint(1, 1 << 22), node=word(),
                          host=word(), waiting_until=rng.random()),
        protocol.RankError(index=rng.randint(0, 9), check=word(), rank=rng.randint(0, 7), time=rng.random(),
                           error=word(), traceback=word() + "\n" + word(), node=word(), host=word(),
                           pid=rng.randint(1, 99)),
        protocol.RankError(index=-1, check=None, rank=rng.randint(0, 7), time=rng.random(), error=word(),
                           traceback="", node=word(), host=word(), terminated=True),
        protocol.Stack(word() + "\n" + word()),
        protocol.Record(index=rng.randint(0, 9), check=word(), seconds=rng.random(), measured=measured,
                        warm_up_seconds=rng.choice([None, rng.random()])),
        protocol.RankEnvironments([{"rank": r, "host": word()} for r in range(rng.randint(1, 4))]),
        protocol.NcclTopology({"rings": [[rng.randint(0, 7) for _ in range(4)]]}),
        protocol.PrecompileWaited(round(rng.uniform(0, 30), 3)),
        protocol.NodeBeat(time=rng.random(), host=word(), pid=rng.randint(1, 99)),
        protocol.NodeRefusal(reason=word()),
        protocol.NodeExit(exit=rng.choice([0, 1, -9, None])),
    ]


def message_kinds() -> set[type]:
    return {v for v in vars(protocol).values() if isinstance(v, type) and issubclass(v, protocol.Message)
            and dataclasses.is_dataclass(v)}


def test_the_samples_cover_every_message_kind():
    assert {type(m) for m in samples(0)} == message_kinds()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_message_survives_its_wire_form(seed):
    for message in samples(seed):
        wire = json.loads(json.dumps(message.to_wire()))
        assert type(message).from_wire(wire, KEY) == message


def test_every_message_survives_the_runs_signed_store():
    store = tcp_store("127.0.0.1", 0, is_master=True, timeout_s=30)
    writer, reader = Channel(store, "ns", SECRET), Channel(store, "ns", SECRET)
    for i, message in enumerate(samples(3)):
        writer.put(f"m{i}", message.to_wire())
        assert reader.read(f"m{i}", type(message)) == message
    assert reader.read("absent", protocol.Progress) is None


def test_optional_fields_at_their_default_stay_off_the_wire():
    progress = protocol.Progress(index=0, since=1.5, pid=7, node="0", host="h")
    assert progress.to_wire() == {"index": 0, "since": 1.5, "pid": 7, "node": "0", "host": "h"}
    assert protocol.RunOver().to_wire() == {"done": True} and protocol.RunOver.announced_by({"done": True})
    assert not protocol.RunOver.announced_by({"done": False}) and not protocol.RunOver.announced_by(["done"])
    launch = dataclasses.replace(samples(0)[0], forked_agents=False)  # a head whose agents are new interpreters
    assert "forked_agents" not in launch.to_wire() and protocol.Launch.from_wire(launch.to_wire()) == launch


GOOD_PROGRESS = {"index": 3, "since": 1.5, "pid": 7, "node": "0", "host": "h"}


@pytest.mark.parametrize("kind, wire, named", [
    (protocol.Progress, ["not", "an", "object"], "not a JSON object"),
    (protocol.Progress, {k: v for k, v in GOOD_PROGRESS.items() if k != "since"}, "no 'since'"),
    (protocol.Progress, {**GOOD_PROGRESS, "index": "3"}, "'index' is '3', not int"),
    (protocol.Progress, {**GOOD_PROGRESS, "index": True}, "'index' is True, not int"),  # a bool is no index
    (protocol.Progress, {**GOOD_PROGRESS, "since": None}, "'since' is None, not float"),
    (protocol.Progress, {**GOOD_PROGRESS, "waiting_until": "soon"}, "'waiting_until' is 'soon'"),
    (protocol.Progress, {**GOOD_PROGRESS, "extra": 1}, "unknown field(s) extra"),
    (protocol.Job, {**dataclasses.asdict(samples(0)[2]), "plugins": ["a", 1]}, "'plugins' is ['a', 1]"),
    (protocol.Launch, {**samples(0)[0].to_wire(), "env": {"A": 1}}, "'env' is {'A': 1}"),
    (protocol.Launch, {**samples(0)[0].to_wire(), "forked_agents": "yes"}, "'forked_agents' is 'yes', not bool"),
    (protocol.RankError, {**samples(0)[5].to_wire(), "terminated": "yes"}, "'terminated' is 'yes', not bool"),
    (protocol.Record, {**samples(0)[8].to_wire(), "measured": {"comparison": "bitwise"}}, "measurement does not parse"),
    (protocol.Stack, {"text": "a stack"}, "is not str"),
    (protocol.PrecompileWaited, "3.5", "'3.5' is not float"),
    (protocol.NodeBeat, {"time": 1.0, "host": "h"}, "no 'pid'"),
    (protocol.NodeExit, {}, "no 'exit'"),
])
def test_a_malformed_message_is_refused_in_one_line_naming_key_and_field(kind, wire, named):
    with pytest.raises(protocol.Malformed) as caught:
        kind.from_wire(wire, KEY)
    message = str(caught.value)
    assert named in message and KEY in message and f"not a {kind.KIND} message" in message
    assert "\n" not in message and len(message) < 400


def test_a_malformed_value_stops_a_strict_reader_and_is_noted_by_a_lenient_one():
    store = tcp_store("127.0.0.1", 0, is_master=True, timeout_s=30)
    Channel(store, "ns", SECRET).put("progress/1", {**GOOD_PROGRESS, "pid": "7"})
    with pytest.raises(protocol.Malformed, match="'pid' is '7', not int"):
        Channel(store, "ns", SECRET).read("progress/1", protocol.Progress)  # a rank, a follower
    head = Channel(store, "ns", SECRET, strict=False)
    assert head.read("progress/1", protocol.Progress) is None
    assert list(head.malformed) == ["ns/progress/1"] and "'pid' is '7'" in head.malformed["ns/progress/1"]
    Channel(store, "ns", SECRET).put("progress/2", GOOD_PROGRESS)  # positive control: a good one is read
    assert head.read("progress/2", protocol.Progress) == protocol.Progress(**GOOD_PROGRESS)
    assert list(head.malformed) == ["ns/progress/1"]


def test_a_malformed_record_is_never_taken_for_a_measurement():
    from ep_harness.launch.launcher import _collect

    store = tcp_store("127.0.0.1", 0, is_master=True, timeout_s=30)
    rank0, head = Channel(store, "ns", SECRET), Channel(store, "ns", SECRET, strict=False)

    class Check:  # what _collect reads of a check
        def __init__(self, i):
            self.id = f"check-{i}"

    good = samples(0)[8]
    rank0.put(protocol.record_key(0), dataclasses.replace(good, index=0).to_wire())
    rank0.put(protocol.record_key(1), {**good.to_wire(), "seconds": "fast"})
    outcomes = {}
    _collect(head, [Check(0), Check(1), Check(2)], 0, outcomes)
    assert list(outcomes) == ["check-0"] and outcomes["check-0"].measured == good.measurement()
    assert "'seconds' is 'fast'" in head.malformed[head.key(protocol.record_key(1))]


def test_a_node_whose_heartbeat_is_malformed_is_lost_with_that_line():
    from ep_harness.launch.channel import run_channel
    from ep_harness.launch.launcher import Head
    from ep_harness.launch.nodes import Nodes

    run = "20261201-120000-abcd"
    head = Head(Nodes(nnodes=3, nproc_per_node=1, endpoint="127.0.0.1:0"), run)
    follower = run_channel(tcp_store("127.0.0.1", head.store.port, is_master=False, timeout_s=30), run, head.secret)
    follower.put(protocol.node_key(1), protocol.NodeBeat(time=time.time(), host="h1", pid=1).to_wire())  # control
    follower.put(protocol.node_key(2), {"time": "now", "host": "h2", "pid": 2})
    head.wait_for_nodes()
    assert list(head.lost) == [2]
    assert f"{run}/node/2 in the run's store is not a node heartbeat message ('time' is 'now', not float)" in \
        head.lost[2]
    follower.put(protocol.node_key(1), protocol.NodeBeat(time=time.time(), host="h1", pid=1).to_wire())
    assert head.silent_nodes() == {2: head.lost[2]}  # node 1 beat just now: alive


def test_a_follower_forks_its_agents_only_where_the_heads_launch_says_the_heads_are_forks(monkeypatch, tmp_path):
    """protocol.Launch.forked_agents: the head's agents are forks of its command where it serves
    them (harness/launch/forks.py; on several nodes too, never under --fresh-processes), and a
    follower asked for a new interpreter starts one although its own server would fork it."""
    import sys

    from ep_harness.launch import forks, processes
    from ep_harness.launch.launcher import Head
    from ep_harness.launch.nodes import Nodes
    from ep_harness.run.verify import RunOptions, _forks_agents

    two = Nodes(nnodes=2, nproc_per_node=1, endpoint="127.0.0.1:0")
    assert _forks_agents(two, RunOptions("smoke")) and not _forks_agents(two, RunOptions("smoke", fresh_processes=2))
    head = Head(two, "20261201-120000-abcd")
    job = dataclasses.replace(samples(0)[2], plugins=[])
    for server, forked in ((None, False), (object(), True)):
        monkeypatch.setattr(forks, "_current", server)
        head.publish(job, {}, 1, "job")
        assert head.channel.read(protocol.launch_key(head.launches - 1), protocol.Launch).forked_agents is forked

    class ForksEverything:
        def spawn(self, *args):
            raise AssertionError("forked where the head's launch asked for a new interpreter")

    monkeypatch.setattr(forks, "_current", ForksEverything())
    proc = processes.spawn([sys.executable, "-c", "pass"], dict(os.environ), tmp_path / "agent.log", fork=False)
    assert type(proc).__name__ == "Popen" and proc.wait(30) == 0


SUITE = """
[suite]
name = "protocol"
plugins = ["tests.planted_protocol"]

[[case]]
name = "garbled"
subject = "planted_garbled_progress"
properties = ["rank-invariance"]
expect = "holds"
[case.params]
dtype = "bfloat16"
world_size = 3
hidden = 256

[[case]]
name = "after"
subject = "all_gather_fold"
properties = ["rank-invariance"]
expect = "holds"
[case.params]
dtype = "bfloat16"
world_size = 3
hidden = 256
"""


def test_a_rank_that_garbles_its_progress_ends_its_check_with_one_clear_error(tmp_path):
    (tmp_path / "suite.toml").write_text(SUITE)
    proc = _verify(tmp_path)
    records = [json.loads(line) for line in (tmp_path / "out" / "latest" / "results.jsonl").read_text().splitlines()]
    by_case = {r["case"]: r for r in records}
    garbled, after = by_case["garbled"], by_case["after"]
    assert garbled["status"] == "error", garbled
    assert "progress/1 in the run's store is not a progress message ('index' is 'garbage', not int)" in \
        garbled["reason"]
    assert "\n" not in garbled["reason"]
    assert after["status"] == "ok", after  # the relaunch runs the rest
    assert "Traceback" not in proc.stdout + proc.stderr and proc.returncode == 1, proc.stderr[-2000:]


def _verify(tmp_path):
    old = dict(os.environ)
    os.environ.update(REPO_ON_PYTHONPATH)
    try:
        return run_cli("verify", "--suite", str(tmp_path / "suite.toml"), "--gpus", "0", "--no-report",
                       "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=300)
    finally:
        os.environ.clear()
        os.environ.update(old)


# --- no store key formatted outside protocol.py ----------------------------------------------
#
# A module "formats a store key" when it either
#   1. calls a store or channel method (set, get, add, check, wait, has, put, read, count, sub,
#      key, delete_key, compare_set, multi_get, multi_set; not on `os.environ`, and not list's
#      append, which TCPStore shares) with a first argument that builds a string: an f-string,
#      `%` or `+` on a string, or str.format (also inside a list, as TCPStore.check takes); or
#   2. holds a string literal (docstrings aside) that spells part of a key: one that starts with
#      a key's fixed prefix (`launch/`, `node/`, `progress/`, ... , `ep-harness/`) or is a
#      multi-word launch name (`stacks-requested`, `nccl-topology`, `precompile-waited`),
#      which catches a key built into a variable before the call.

STORE_METHODS = {"set", "get", "add", "check", "wait", "has", "put", "read", "count", "sub", "key", "delete_key",
                 "compare_set", "multi_get", "multi_set"}
KEY_PREFIXES = ("launch/", "node/", "progress/", "error/", "stack/", "record/", "ep-harness/")
KEY_NAMES = {protocol.STACKS_REQUESTED, protocol.NCCL_TOPOLOGY, protocol.PRECOMPILE_WAITED}


def _builds_a_string(node) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.JoinedStr):
            return True
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, (ast.Mod, ast.Add)) and any(
                isinstance(side, ast.Constant) and isinstance(side.value, str) for side in (sub.left, sub.right)):
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "format":
            return True
    return False


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name)
                                                                           and node.id == "environ")


def _docstrings(tree) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def key_formatting(source: str) -> list[str]:
    """Where `source` formats a store key, as 'line N: what'."""
    tree = ast.parse(source)
    found, docstrings = [], _docstrings(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STORE_METHODS
                and not _is_environ(node.func.value) and node.args and _builds_a_string(node.args[0])):
            found.append(f"line {node.lineno}: .{node.func.attr}() of a formatted key")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings and (
                node.value.startswith(KEY_PREFIXES) or node.value in KEY_NAMES):
            found.append(f"line {node.lineno}: {node.value[:40]!r} spells a store key")
    return found


@pytest.mark.parametrize("planted", [
    'channel.put(f"progress/{rank}", {"index": 0})',
    'launch.get("record/%d" % index)',
    'self.store.check([f"{ROOT}/current"])',
    'store.set("{}/current".format(ROOT), run)',
    'ns.has("node/" + str(node))',
    'key = "error/" + str(rank)',  # built before the call
    'k = f"stack/{rank}"',
    'launch.add("stacks-requested")',
])
def test_the_key_check_catches_a_key_formatted_outside_the_protocol(planted):
    assert key_formatting(planted), planted


def test_the_key_check_passes_protocol_calls_and_unrelated_strings():
    source = ('def f(rank, name, attempt):\n    """ep-harness/<run>/ in a docstring"""\n'
              '    channel.put(protocol.progress_key(rank), msg)\n    os.environ.get(f"EP_{name}")\n'
              '    log = f"torchrun-{attempt}.log"\n')
    assert key_formatting(source) == []


def test_no_module_but_protocol_formats_a_store_key():
    harness = REPO / "harness"
    found = {str(path.relative_to(REPO)): key_formatting(path.read_text())
             for path in sorted(harness.rglob("*.py")) if path != harness / "launch" / "protocol.py"}
    assert {p: f for p, f in found.items() if f} == {}
    assert key_formatting((harness / "launch" / "protocol.py").read_text())  # positive control: the keys are all there
