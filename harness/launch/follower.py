"""A non-head node of a multi-node run (`ep-harness verify --node-rank K`, torchrun
launcher): it joins the head's store, beats there every NODE_BEAT_S, checks every launch the
head publishes before using any of it (_validated_launch), starts this node's torchrun agent
for it and ends that agent's processes when the launch is over (harness/launch/processes.py). The
head's side is harness/launch/launcher.py.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from pathlib import Path

from ep_harness import console

from ep_harness.launch import protocol
from ep_harness.launch.channel import RUN_ID, Channel, current_run, parse_endpoint, run_channel, tcp_store
from ep_harness.errors import HarnessError
from ep_harness.launch.launcher import NODE_LOCAL, POLL_S, local_groups, rank_states, redact_logs
from ep_harness.launch.nodes import START_TIMEOUT_S, Nodes, identity_difference
from ep_harness.launch.processes import Interrupted, agent_command, child_env, interruptible, kill_launch, spawn

NODE_BEAT_S = 0.5  # how often a follower tells the head it is alive (the head's NODE_TIMEOUT_S: when it is not)
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a launch's directory: one plain path component


def _node_beat(channel: Channel, node: int, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            channel.put(protocol.node_key(node),
                        protocol.NodeBeat(time=time.time(), host=socket.gethostname(), pid=os.getpid()).to_wire())
        except Exception:  # the head is gone; the follower's own loop notices
            return
        stop.wait(NODE_BEAT_S)


def _validated_launch(launch, channel: Channel, run: str, k: int, nodes: Nodes, plugins) -> dict:
    """A launch as the head published it, checked before anything of it is used: its
    namespace, rendezvous id and ranks per node are this run's, its directory name is one
    plain path component, its variables are allowlisted (no LD_PRELOAD, no library or file,
    no path), and the head runs the same harness and plugins as this node."""
    from ep_harness.environment import applicable_env

    where = f"node {nodes.node_rank}: launch {k} from the head at {nodes.endpoint}"
    if not isinstance(launch, dict):
        raise HarnessError(f"{where} is not a table; refusing it")
    difference = identity_difference(launch.get("identity"), plugins)
    if difference:
        raise HarnessError(f"node {nodes.node_rank}: refusing the head's run {run}: {difference}; run the same "
                           f"ep-harness checkout and plugins on every node")
    expected = {"namespace": channel.key(protocol.launch_namespace(k)), "rdzv_id": protocol.rdzv_id(run, k),
                "nproc": nodes.nproc_per_node}
    for key, value in expected.items():
        if launch.get(key) != value:
            raise HarnessError(f"{where}: {key} = {str(launch.get(key))[:80]!r}, expected {value!r}; refusing it")
    if not isinstance(launch.get("job"), str) or not JOB_NAME.fullmatch(launch["job"]):
        raise HarnessError(f"{where}: its directory {str(launch.get('job'))[:80]!r} is not one plain name under "
                           f"--out; refusing it")
    local = launch.get("node_local") or []
    if not isinstance(local, list) or not set(local) <= set(NODE_LOCAL):
        raise HarnessError(f"{where}: node-local variables {str(local)[:80]} are not the harness's; refusing them")
    env = applicable_env(launch.get("env"), where)
    env.update({name: NODE_LOCAL[name]() for name in local})  # this node's own cache directory
    return {**launch, "env": env}


def follow(nodes: Nodes, out_dir: Path, quiet: bool = False, plugins=()) -> int:
    """A non-head node of a torchrun-launched run: join the head's store, start this node's
    torchrun agent for every launch the head publishes, report how it ended, and stop when
    the head says done or is gone. Logs stay on this node, under out_dir.

    Nothing is taken from the store unchecked: every value must be signed with the run's
    secret (--run-secret), and every launch pass _validated_launch; anything else ends this
    node with a one-line error (and a note to the head) before it starts anything."""
    host, port = parse_endpoint(nodes.endpoint)
    try:
        store = tcp_store(host, port, is_master=False, timeout_s=START_TIMEOUT_S)
    except Exception as exc:
        raise HarnessError(f"node {nodes.node_rank}: no head at {nodes.endpoint} within {START_TIMEOUT_S:.0f} s "
                           f"({type(exc).__name__}); start node rank 0 with the same --rdzv-endpoint") from None
    deadline = time.time() + START_TIMEOUT_S
    run = None
    while run is None and time.time() < deadline:
        run = current_run(store)
        time.sleep(0.2)
    if run is None:
        raise HarnessError(f"node {nodes.node_rank}: the store at {nodes.endpoint} serves no ep-harness run")
    if not RUN_ID.fullmatch(run):
        raise HarnessError(f"node {nodes.node_rank}: the store at {nodes.endpoint} names run {run[:80]!r}, which is "
                           f"not a run id; refusing it")
    channel = run_channel(store, run, nodes.run_secret)
    stop = threading.Event()
    beat = threading.Thread(target=_node_beat, args=(channel, nodes.node_rank, stop), daemon=True)
    beat.start()
    out_dir = out_dir / f"node{nodes.node_rank}-{run}"
    out_dir.mkdir(parents=True, exist_ok=True)
    if not quiet:
        console.current().line(f"# node {nodes.node_rank}: joined run {run} at {nodes.endpoint}; logs in {out_dir}")
    k, code = 0, 0
    try:
        with interruptible():
            while True:
                try:
                    launch = channel.wait(protocol.launch_key(k), 24 * 3600.0)
                    if protocol.RunOver.announced_by(launch):
                        channel.put(protocol.node_done_key(nodes.node_rank), True)
                        break
                    if launch is not None:
                        launch = protocol.Launch.from_wire(_validated_launch(launch, channel, run, k, nodes, plugins),
                                                           channel.key(protocol.launch_key(k)))
                except HarnessError as exc:  # forged, malformed or not ours to run: tell the head, start nothing
                    with contextlib.suppress(Exception):
                        refusal = protocol.NodeRefusal(str(exc)).to_wire()
                        channel.put(protocol.node_refused_key(nodes.node_rank), refusal)
                    raise
                except Exception:
                    raise HarnessError(f"node {nodes.node_rank}: the head at {nodes.endpoint} is gone") from None
                if launch is None:
                    channel.put(protocol.node_done_key(nodes.node_rank), True)
                    break
                job_dir = out_dir / launch.job
                job_dir.mkdir(parents=True, exist_ok=True)
                ns = channel.sub(protocol.launch_namespace(k))
                proc = spawn(agent_command(nodes, launch.nproc, launch.rdzv_id, nodes.endpoint, job_dir),
                             child_env(launch.env, nodes.endpoint, ns.namespace, job_dir, nodes, nodes.run_secret),
                             job_dir / f"torchrun-launch{k}.log", fork=launch.forked_agents)
                try:
                    while proc.poll() is None:
                        time.sleep(POLL_S)
                        try:
                            if ns.has(protocol.ABORT):
                                break
                        except Exception:
                            raise HarnessError(f"node {nodes.node_rank}: the head at {nodes.endpoint} is gone; "
                                               f"this node's ranks were ended") from None
                finally:
                    lenient = Channel(store, ns.namespace, nodes.run_secret, strict=False)  # teardown never stops
                    states = rank_states(lenient, launch.nproc * nodes.nnodes)
                    kill_launch(proc, local_groups(states, nodes.node_rank), namespace=ns.namespace)
                redact_logs(job_dir)
                channel.put(protocol.node_exit_key(nodes.node_rank, k), protocol.NodeExit(proc.returncode).to_wire())
                k += 1
    except Interrupted as exc:
        code = 128 + exc.signum
    finally:
        stop.set()
        # Joined, not left to die at exit: a daemon thread killed inside a store call aborts
        # the interpreter ("terminate called without an active exception", exit -6).
        beat.join(timeout=2 * NODE_BEAT_S + 5)
    if not quiet:
        console.current().line(f"# node {nodes.node_rank}: {k} launch(es) done; the records are on the head node")
    return code
