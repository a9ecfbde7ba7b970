"""Each CPU rank runs on the cores harness/cores.py's policy gives it: blocks of cores that hold
its threads, ranks in blocks where there are more ranks than cores, the scheduler's choice
where a block cannot hold the threads. The records say where every rank's threads ran; the
positive controls are a run whose ranks the policy leaves unplaced (4 ranks of 2 threads on a
machine of fewer than 8 cores) and EP_HARNESS_PIN_RANKS=0."""
import json
import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from ep_harness.cores import SWITCH, cpu_list, rank_cores, thread_cores
from tests.shared_runs import pass_run  # noqa: F401 (a fixture)

ALLOWED = sorted(os.sched_getaffinity(0))  # what the commands the tests start may use too


def test_the_policy_places_ranks_in_blocks_that_hold_their_threads():
    two, eight = {0, 1}, set(range(8))
    assert [rank_cores(r, 4, 1, two) for r in range(4)] == [[0], [0], [1], [1]]  # the CPU default
    assert [rank_cores(r, 3, 1, two) for r in range(3)] == [[0], [0], [1]]
    assert [rank_cores(r, 2, 1, two) for r in range(2)] == [[0], [1]]
    assert rank_cores(0, 1, 1, two) == [0, 1]  # one rank: every core
    assert [rank_cores(r, 4, 2, eight) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [rank_cores(r, 3, 2, eight) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [rank_cores(r, 2, 1, {3, 9, 12, 40}) for r in range(2)] == [[3, 9], [12, 40]]  # the cores allowed
    # where a block cannot hold a rank's threads, the scheduler places it
    assert {rank_cores(r, 4, 2, two) for r in range(4)} == {None}
    assert rank_cores(0, 3, 4, eight) is None
    assert rank_cores(0, 1, 1, set()) is None and rank_cores(4, 4, 1, two) is None


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, 255), min_size=1, max_size=64), st.integers(1, 130), st.integers(1, 8))
def test_placements_are_the_allowed_cores_shared_evenly(allowed, ranks, threads):
    placed = [rank_cores(r, ranks, threads, allowed) for r in range(ranks)]
    cores = len(allowed)
    if ranks <= cores and cores // ranks >= threads:  # disjoint blocks of one width, each holding its threads
        assert all(p is not None and set(p) <= allowed and len(p) == cores // ranks >= threads for p in placed)
        assert len(set().union(*map(set, placed))) == ranks * (cores // ranks)
        assert all(max(a) < min(b) for a, b in zip(placed, placed[1:]))  # in rank order
    elif ranks > cores and threads == 1:  # a core each, every core used, ranks in blocks
        assert all(p is not None and len(p) == 1 and p[0] in allowed for p in placed)
        per_core = [sum(p == [c] for p in placed) for c in sorted(allowed)]
        assert min(per_core) >= 1 and max(per_core) - min(per_core) <= 1
        assert [p[0] for p in placed] == sorted(p[0] for p in placed)
    else:
        assert placed == [None] * ranks


# A process of its own (not a fork of this multi-threaded one): one thread started before the
# pin and one after, then where all of them may run.
_CHILD = """
import json, sys, threading
from ep_harness.cores import pin_rank, thread_cores
waiting = threading.Event()
threading.Thread(target=waiting.wait, daemon=True).start()
pin_rank(int(sys.argv[1]), int(sys.argv[2]), 1)
threading.Thread(target=waiting.wait, daemon=True).start()
print(json.dumps(thread_cores()))
"""


def _child_cores(switch: str | None, local_rank: int, local_ranks: int) -> list[int]:
    """thread_cores() of a child that calls pin_rank (SWITCH set to `switch`, or unset) between
    starting one thread and another."""
    env = {k: v for k, v in os.environ.items() if k != SWITCH} | ({SWITCH: switch} if switch is not None else {})
    child = subprocess.run([sys.executable, "-c", _CHILD, str(local_rank), str(local_ranks)], env=env,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout)


def test_a_rank_pins_every_thread_and_the_switch_leaves_it_to_the_scheduler():
    ranks = len(ALLOWED)  # one core each where there is more than one
    pinned = _child_cores(None, ranks - 1, ranks)
    assert pinned == rank_cores(ranks - 1, ranks, 1, ALLOWED) == [ALLOWED[-1]]
    assert _child_cores("1", 0, ranks) == [ALLOWED[0]]
    assert _child_cores("0", ranks - 1, ranks) == ALLOWED  # the control: left where it was
    assert pinned != ALLOWED or len(ALLOWED) == 1
    assert thread_cores() == ALLOWED  # the test process itself was never pinned


def test_cores_are_written_as_linux_writes_them():
    assert cpu_list([0]) == "0" and cpu_list([1, 0]) == "0-1" and cpu_list([]) == ""
    assert cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    with open("/proc/self/status") as status:  # this process's own, as the kernel writes it
        kernel = next(line.split(":")[1].strip() for line in status if line.startswith("Cpus_allowed_list"))
    assert cpu_list(os.sched_getaffinity(0)) == kernel


def recorded_cores(run_dir) -> list[tuple[str, str]]:
    """(recorded, expected) cores of every rank of every launch of a run: each rank on its
    rank_cores for its launch's ranks and the threads it reported, or where the policy leaves it
    to the scheduler, on every core."""
    environment = json.loads((run_dir / "environment.json").read_text())
    pairs = []
    for ranks in environment["ranks"].values():
        for local_rank, rank in enumerate(ranks):
            placed = rank_cores(local_rank, len(ranks), rank["threads"], ALLOWED)
            pairs.append((rank["cpus"], cpu_list(placed or ALLOWED)))
    assert pairs
    return pairs


def test_each_rank_records_the_cores_the_policy_gives_it(smoke_run, pass_run):
    smoke = recorded_cores(smoke_run[1])
    assert all(recorded == expected for recorded, expected in smoke)
    _, pass_dir, _ = pass_run  # --threads 2: unplaced below 8 cores
    two_threads = recorded_cores(pass_dir)
    assert all(recorded == expected for recorded, expected in two_threads)
    if 1 < len(ALLOWED) < 8:  # the two runs' placements differ: the records are not a constant
        assert {r for r, _ in smoke} != {r for r, _ in two_threads}
