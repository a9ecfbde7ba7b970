"""Red-team holes of a multi-node run (issue 23, item 6): a follower used to take its `env`,
job and launch parameters from the unauthenticated rendezvous store, so a fake head made it
run an LD_PRELOAD library and write outside --out. Here a fake head writes forged launches
into a real TCPStore, and a real follower (`ep-harness verify --node-rank 1`) must refuse
each with one line, having started nothing and written nothing outside its --out."""
import fnmatch
import json
import os
import subprocess
from pathlib import Path

import pytest

from ep_harness import __version__
from ep_harness.launch.channel import Channel, Forged, publish_run, run_channel, tcp_store
from ep_harness.errors import HarnessError
from ep_harness.launch.follower import _validated_launch
from ep_harness.launch import nodes as nodes_module
from ep_harness.launch.nodes import Nodes, identity_difference
from tests.conftest import REPO_ON_PYTHONPATH, once_per_session
from tests.forked_cli import cli_batch
from tests.test_multinode import EXE, RUN_SECRET, free_port, node, single_agent, two_nodes  # noqa: F401  (fixtures)

RUN = "20261201-120000-abcd"
SECRET = "redteam-secret-0123456789abcdef"
COMMIT = "redteam-commit"


def genuine_launch(**changes) -> dict:
    """What a real head of this checkout publishes as launch 0 of RUN, with `changes`."""
    launch = {"namespace": f"ep-harness/{RUN}/launch0", "nproc": 2, "rdzv_id": f"{RUN}-0", "job": "00-ws4",
              "env": {"NCCL_ALGO": "allreduce:tree", "PYTHONHASHSEED": "0"}, "node_local": [],
              "identity": {"version": __version__, "commit": COMMIT, "plugins": {}}}
    launch.update(changes)
    return launch


def serve(run=RUN):
    """A TCPStore at a free port that serves `run`, as a head would."""
    store = tcp_store("127.0.0.1", free_port(), is_master=True, timeout_s=30)
    publish_run(store, run)
    return store


def follower_env() -> dict:
    env = {**os.environ, **REPO_ON_PYTHONPATH, "EP_HARNESS_COMMIT": COMMIT, "EP_HARNESS_START_TIMEOUT_S": "20"}
    env.pop("EP_HARNESS_RUN_SECRET", None)
    return env


def follower_args(tmp_path, port, *extra, secret=SECRET) -> list:
    args = ["verify", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--node-rank", "1", "--gpus", "0", "--out", str(tmp_path / "out"), *extra]
    if secret:
        args += ["--run-secret", secret]
    (tmp_path / "work").mkdir(parents=True, exist_ok=True)
    return args


def follower(tmp_path, port, *extra, secret=SECRET):
    args = follower_args(tmp_path, port, *extra, secret=secret)
    return subprocess.run([EXE, *args], cwd=tmp_path / "work", capture_output=True, text=True, timeout=120,
                          env=follower_env())


FORGED = [
    # no secret, or another one: a forged launch, whatever it says
    (genuine_launch(env={"LD_PRELOAD": "/tmp/evil.so"}), None, "not signed with this run's secret"),
    (genuine_launch(), "another-secret-0123456789", "not signed with this run's secret"),
    # signed (a head that has the secret but is not ours to obey in this): validated all the same
    (genuine_launch(env={"LD_PRELOAD": "/tmp/evil.so"}), SECRET, "LD_PRELOAD"),
    (genuine_launch(env={"NCCL_NET_PLUGIN": "evil"}), SECRET, "NCCL_NET_PLUGIN"),
    (genuine_launch(job="../../escape"), SECRET, "'../../escape' is not one plain name"),
    (genuine_launch(namespace="ep-harness/other/launch0"), SECRET, "namespace"),
    (genuine_launch(nproc=64), SECRET, "nproc = '64', expected 2"),
    (genuine_launch(node_local=["LD_PRELOAD"]), SECRET, "node-local variables"),
    (genuine_launch(identity={"version": __version__, "commit": "0" * 40, "plugins": {}}), SECRET,
     f"harness commit differs (here {COMMIT}, on the head {'0' * 40})"),
    (genuine_launch(identity={"version": "9.9.9", "commit": COMMIT, "plugins": {}}), SECRET,
     f"harness version differs (here {__version__}, on the head 9.9.9)"),
    (genuine_launch(identity={"version": __version__, "commit": COMMIT, "plugins": {"tests.planted": "0" * 12}}),
     SECRET, "plugin tests.planted differs"),
]


@pytest.fixture(scope="session")
def refused_followers(tmp_path_factory):
    """A fake head (its own store) and a real follower for every launch of FORGED, then for a
    follower with a plugin the head lacks and for a head that names a run outside --out, once
    per session: the followers run one after another in one interpreter (cli_batch; the one
    loading a plugin last). Per follower: the process, its directory (the test's tmp_path as
    it was) and what it told its head (node/1/refused, None where it has no head of FORGED)."""
    def make(folder):
        stores, jobs = [], []
        for i, (launch, secret, _) in enumerate(FORGED):
            stores.append(serve())
            run_channel(stores[-1], RUN, secret).put("launch/0", launch)
            jobs.append(follower_args(folder / f"case{i}", stores[-1].port))
        stores.append(serve("../../escape"))
        jobs.append(follower_args(folder / "outside", stores[-1].port))
        stores.append(serve())
        run_channel(stores[-1], RUN, SECRET).put("launch/0", genuine_launch())
        jobs.append(follower_args(folder / "plugin", stores[-1].port, "--plugin", "tests.planted"))
        dirs = [folder / f"case{i}" for i in range(len(FORGED))] + [folder / "outside", folder / "plugin"]
        procs = cli_batch([(args, d / "work") for args, d in zip(jobs, dirs)], follower_env())
        refusals = [run_channel(store, RUN, SECRET).get("node/1/refused") for store in stores[:len(FORGED)]]
        return [{"proc": proc, "dir": str(d), "refusal": refusal}
                for proc, d, refusal in zip(procs, dirs, refusals + [None, None])]

    done = once_per_session(tmp_path_factory, "redteam-followers", make)
    return [(subprocess.CompletedProcess(**f["proc"]), Path(f["dir"]), f["refusal"]) for f in done]


@pytest.mark.parametrize("launch, secret, named", FORGED)
def test_a_follower_refuses_a_forged_or_foreign_launch(refused_followers, launch, secret, named):
    [(proc, tmp_path, refusal)] = [refused_followers[i] for i, case in enumerate(FORGED) if case[0] is launch]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert named in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "escape").exists() and not (tmp_path / "out" / "escape").exists()
    assert not list(tmp_path.rglob("torchrun-*.log"))  # no agent was started
    written = [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()]
    assert written == [], written  # nothing but its own (empty) log directory under --out
    # the follower said why to the head (signed with its secret, so a real head can read it)
    assert refusal is not None and named in refusal["reason"]


def test_a_follower_with_a_plugin_the_head_lacks_is_refused(refused_followers):
    proc, _, _ = refused_followers[len(FORGED) + 1]
    assert proc.returncode == 2 and "plugin tests.planted is loaded here but not on the head" in proc.stderr, \
        proc.stderr


def test_a_follower_without_the_secret_is_refused_before_it_connects(tmp_path):
    proc = follower(tmp_path, 1, secret=None)
    assert proc.returncode == 2 and "needs --run-secret" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_fake_head_cannot_name_a_run_outside_out(refused_followers):
    proc, tmp_path, _ = refused_followers[len(FORGED)]
    assert proc.returncode == 2 and "which is not a run id" in proc.stderr, proc.stderr
    assert not (tmp_path / "escape").exists() and not (tmp_path / "out").exists()


def test_a_genuine_launch_passes_and_gets_this_nodes_own_paths(monkeypatch):
    """The positive control of the refusals above: what a real head publishes is accepted."""
    monkeypatch.setenv("EP_HARNESS_COMMIT", COMMIT)
    monkeypatch.setattr(nodes_module, "_COMMIT", [])  # the launcher's cached commit, if a test before read it
    monkeypatch.setenv("DG_JIT_CACHE_DIR", "/this/node/cache")
    store = tcp_store("127.0.0.1", free_port(), is_master=True, timeout_s=30)
    channel = run_channel(store, RUN, SECRET)
    nodes = Nodes(2, 2, "127.0.0.1:1", 1, "torchrun", SECRET)
    launch = _validated_launch(genuine_launch(node_local=["DG_JIT_CACHE_DIR"]), channel, RUN, 0, nodes, [])
    assert launch["env"] == {"NCCL_ALGO": "allreduce:tree", "PYTHONHASHSEED": "0",
                             "DG_JIT_CACHE_DIR": "/this/node/cache"}
    assert identity_difference(genuine_launch()["identity"]) is None


def test_every_value_is_bound_to_its_key_and_the_secret():
    store = tcp_store("127.0.0.1", free_port(), is_master=True, timeout_s=30)
    signed = Channel(store, "ns", SECRET)
    signed.put("job", {"plugins": ["x"]})
    assert signed.get("job") == {"plugins": ["x"]}
    store.set("ns/other", store.get("ns/job"))  # a genuine value replayed under another key
    with pytest.raises(Forged, match="ns/other"):
        signed.get("other")
    store.set("ns/plain", json.dumps({"plugins": ["evil"]}))  # an unsigned value
    with pytest.raises(Forged):
        signed.get("plain")
    with pytest.raises(Forged):
        Channel(store, "ns", "another-secret-0123456789").get("job")
    lenient = Channel(store, "ns", SECRET, strict=False)  # the head: a forgery reads as absent, and is noted
    assert lenient.get("plain", "absent") == "absent" and lenient.forged == ["ns/plain"]
    assert issubclass(Forged, HarnessError)


def test_the_secret_is_never_recorded(tmp_path):
    from ep_harness.environment import recorded_env

    assert recorded_env({"EP_HARNESS_RUN_SECRET": SECRET, "NCCL_ALGO": "ring"}) == {"NCCL_ALGO": "ring"}
    # the head's rerun commands never carry it (the other nodes are started as before)
    from ep_harness.run.verify import rerun_command

    assert SECRET not in rerun_command("s.toml", "c", None, [], nodes=Nodes(2, 2, "h:1", 0, "torchrun", SECRET))


@pytest.mark.slow
def test_the_head_names_a_follower_that_refused_its_run(tmp_path, node):
    """A real head and a follower of another commit: the follower refuses with one line, and
    every check of the head's run is an error that says why."""
    port = free_port()
    head = node(0, port, tmp_path / "node0", "--suite", "smoke", "--check", "rs-native/rank-invariance/*",
                "--no-report", env={"EP_HARNESS_COMMIT": "head-commit"})
    other = node(1, port, tmp_path / "node1", env={"EP_HARNESS_COMMIT": "other-commit"})
    other_out, _ = other.communicate(timeout=120)
    head_out, _ = head.communicate(timeout=120)
    assert other.returncode == 2, other_out[-2000:]
    assert "harness commit differs (here other-commit, on the head head-commit)" in other_out.splitlines()[-1]
    assert head.returncode == 1, head_out[-2000:]
    records = [json.loads(line) for line in
               (tmp_path / "node0" / "reports" / "out" / "latest" / "results.jsonl").read_text().splitlines()]
    assert records and all(r["status"] == "error" for r in records)
    assert "node 1 refused the run" in records[0]["reason"] and "harness commit differs" in records[0]["reason"]
    environment = (tmp_path / "node0" / "reports" / "out" / "latest" / "environment.json").read_text()
    assert "--run-secret <redacted>" in environment and RUN_SECRET not in environment  # the command, recorded


@pytest.mark.slow
def test_a_head_without_a_secret_draws_one_and_prints_the_followers_command(two_nodes, single_agent):
    """tests.test_multinode's two-node run: its head is given no --run-secret and node 1 is
    started with the command the head printed for the other nodes."""
    printed, lines = two_nodes["printed"], two_nodes["head_out"]
    assert printed, lines[-3000:]
    secret = printed[printed.index("--run-secret") + 1]
    assert len(secret) == 32 and printed[:2] == ["ep-harness", "verify"]
    assert two_nodes["head_rc"] == 0, lines[-3000:]
    assert two_nodes["other_rc"] == 0, two_nodes["other_out"][-2000:]
    latest = two_nodes["node0"] / "reports" / "out" / "latest"
    records = [json.loads(line) for line in (latest / "results.jsonl").read_text().splitlines()]
    assert len(records) == len(single_agent) and {r["status"] for r in records} <= {"ok", "vacuous"}  # none errored
    # the two checks this test ran on its own run before it shared tests.test_multinode's
    records = [r for r in records if fnmatch.fnmatchcase(r["check"], "rs-native/rank-invariance/dtype=bfloat16/*")]
    assert {r["status"] for r in records} == {"ok"} and len(records) == 2
    assert secret not in (latest / "environment.json").read_text()
