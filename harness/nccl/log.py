"""What NCCL really did, read from its NCCL_DEBUG=INFO log (subsystems INIT, GRAPH, TUNING).

Every NCCL rank of a launch writes its own log (NCCL_DEBUG_FILE, line-buffered by NCCL).
`parse` turns one rank's text into a `RankLog`; `merge` combines the ranks into the
communicator's `Topology` (version, nodes, transports, rings and trees per channel, the
thread limits the channel split depends on); `calls` lists the collectives rank 0 logged
with the algorithm, protocol and channels NCCL chose for each (NCCL logs them on rank 0 only,
src/enqueue.cc). Lines this module does not know are ignored: the log is NCCL's, not ours.
Whether the launch's pins held in these calls is harness/nccl/pins.py's question.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

ALGORITHMS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
PROTOCOLS = ("LL", "LL128", "Simple")

_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)")
_COMM = re.compile(r"comm \S+ rank (\d+) nRanks (\d+) nNodes (\d+) localRanks (\d+) localRank (\d+)")
_RING = re.compile(r"NCCL INFO Channel (\d+)/(\d+) : ((?:\d+ ?)+)$")
_TREES = re.compile(r"NCCL INFO Trees (.*)$")
_TREE_ENTRY = re.compile(r"\[(\d+)\] (-?\d+)/(-?\d+)/(-?\d+)->(\d+)->(-?\d+)")
# Across nodes "... [send] via NET/Socket/0"; within one node "... 0[0] -> 1[0] via P2P/CUMEM".
_VIA = re.compile(r"(?:\[(send|receive)\] )?via (\S+)$")
_THRESHOLDS = re.compile(r"threadThresholds (.*)$")
_COLL_CHANNELS = re.compile(r"(\d+) coll channels")
_CALL = re.compile(r"NCCL INFO (\w+)( \[Symmetric\])?: (\d+) Bytes -> (?:Algo (\S+) proto (\S+) "
                   r"channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\}|Kernel (\S+) nchannels (\d+))")
_ENV = re.compile(r"NCCL INFO (NCCL_\w+) set by environment to (.*?)\.?$")
_ALGO_HEADER = re.compile(r"NCCL INFO\s+Algorithm\s+\|(.*)$")
_NTHREADS = re.compile(r"NCCL INFO\s+Max NThreads\s+\|(.*)$")


@dataclass
class Call:
    """One collective as rank 0 logged it."""

    function: str  # AllReduce, ReduceScatter, ...
    nbytes: int
    algorithm: str  # RING, TREE, PAT, ... (NCCL's upper-case spelling), or the symmetric kernel
    protocol: str
    channels: tuple[int, int]  # lowest and highest channel used
    symmetric: bool = False

    def describe(self) -> str:
        lo, hi = self.channels
        return f"{self.function} {self.nbytes:,} B: {self.algorithm}/{self.protocol}, channels {lo}..{hi}"


@dataclass
class RankLog:
    rank: int | None = None
    nranks: int | None = None
    nnodes: int | None = None
    local_ranks: int | None = None
    version: str | None = None
    rings: dict[int, list[int]] = field(default_factory=dict)
    trees: dict[int, tuple[list[int], int]] = field(default_factory=dict)  # channel -> (down, up)
    transports: set[str] = field(default_factory=set)
    thread_thresholds: dict[str, dict[str, int]] = field(default_factory=dict)
    max_threads: dict[str, dict[str, int]] = field(default_factory=dict)
    coll_channels: int | None = None
    calls: list[Call] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # the variables NCCL says it read


def relevant(line: str) -> bool:
    """Whether `parse` reads this line (to keep committed log excerpts small)."""
    patterns = (_VERSION, _COMM, _RING, _TREES, _THRESHOLDS, _COLL_CHANNELS, _CALL, _ALGO_HEADER, _NTHREADS, _ENV)
    return any(p.search(line) for p in patterns) or bool(_VIA.search(line) and "Channel 00" in line)


def _table_row(cells: str) -> list[str]:
    return [c.strip() for c in cells.split("|") if c.strip()]


def parse(text: str) -> RankLog:
    log = RankLog()
    algo_columns: list[str] = []
    for line in text.splitlines():
        if m := _CALL.search(line):
            func, sym, nbytes = m.group(1), bool(m.group(2)), int(m.group(3))
            if m.group(4):
                log.calls.append(Call(func, nbytes, m.group(4), m.group(5), (int(m.group(6)), int(m.group(7))), sym))
            else:
                n = int(m.group(9))
                log.calls.append(Call(func, nbytes, m.group(8), "-", (0, n - 1), True))
        elif m := _VERSION.search(line):
            log.version = m.group(1)
        elif m := _ENV.search(line):
            log.env[m.group(1)] = m.group(2).strip()
        elif m := _COMM.search(line):
            log.rank, log.nranks, log.nnodes, log.local_ranks = (int(m.group(i)) for i in (1, 2, 3, 4))
        elif m := _RING.search(line):
            log.rings[int(m.group(1))] = [int(x) for x in m.group(3).split()]
        elif m := _TREES.search(line):
            for channel, d0, d1, d2, rank, up in _TREE_ENTRY.findall(m.group(1)):
                down = [int(d) for d in (d0, d1, d2) if int(d) >= 0]
                log.trees[int(channel)] = (down, int(up))
        elif (m := _VIA.search(line)) and "Channel" in line:
            log.transports.add(re.sub(r"(/\d+)+$", "", m.group(2)))  # NET/Socket/0 -> NET/Socket
        elif m := _THRESHOLDS.search(line):
            # "8/8/64 | 32/8/64 | 512 | 512": Tree and Ring per protocol, then single values
            for algo, group in zip(ALGORITHMS, m.group(1).split("|")):
                values = [int(v) for v in group.split("/")]
                if len(values) == len(PROTOCOLS):
                    log.thread_thresholds[algo] = dict(zip(PROTOCOLS, values))
        elif m := _COLL_CHANNELS.search(line):
            log.coll_channels = int(m.group(1))
        elif m := _ALGO_HEADER.search(line):
            algo_columns = _table_row(m.group(1))
        elif (m := _NTHREADS.search(line)) and algo_columns:
            values = [int(v) for v in _table_row(m.group(1))]
            for i, algo in enumerate(algo_columns):
                log.max_threads[algo] = dict(zip(PROTOCOLS, values[3 * i:3 * i + 3]))
    return log


@dataclass
class Topology:
    """The communicator as NCCL built it, from every rank's log."""

    version: str | None
    nranks: int | None
    nnodes: int | None
    local_ranks: int | None
    transports: list[str]
    rings: dict[int, list[int]]  # channel -> ring order (rank 0's view)
    trees: dict[int, dict[int, tuple[list[int], int]]]  # channel -> rank -> (down, up)
    thread_thresholds: dict[str, dict[str, int]]
    max_threads: dict[str, dict[str, int]]
    coll_channels: int | None
    env: dict[str, str] = field(default_factory=dict)  # rank 0's "NCCL_X set by environment to Y"

    def ring(self) -> list[int] | None:
        """The ring when every channel has the same one (the ring models need that)."""
        distinct = {tuple(r) for r in self.rings.values()}
        return list(distinct.pop()) if len(distinct) == 1 else None

    def channel_trees(self) -> list[dict[int, tuple[list[int], int]]]:
        return [self.trees[c] for c in sorted(self.trees)]

    def summary(self) -> dict:
        d = asdict(self)
        d["rings"] = {str(k): v for k, v in self.rings.items()}
        d["trees"] = {str(c): {str(r): [down, up] for r, (down, up) in t.items()} for c, t in self.trees.items()}
        return d


def merge(ranks: list[RankLog]) -> Topology:
    first = next((r for r in ranks if r.rank == 0), ranks[0] if ranks else RankLog())
    trees: dict[int, dict[int, tuple[list[int], int]]] = {}
    for r in ranks:
        for channel, entry in r.trees.items():
            if r.rank is not None:
                trees.setdefault(channel, {})[r.rank] = entry
    return Topology(
        version=first.version, nranks=first.nranks, nnodes=first.nnodes, local_ranks=first.local_ranks,
        transports=sorted(set().union(*(r.transports for r in ranks))) if ranks else [],
        rings=dict(first.rings), trees=trees, thread_thresholds=first.thread_thresholds,
        max_threads=first.max_threads, coll_channels=first.coll_channels, env=dict(first.env),
    )


def read_ranks(paths: list[Path]) -> Topology:
    return merge([parse(p.read_text(errors="replace")) for p in paths if p.exists()])


class LogTail:
    """Rank 0's own NCCL log, read from a mark: the calls one check made."""

    def __init__(self, path: Path):
        self.path = path

    def mark(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def calls_since(self, mark: int) -> list[Call]:
        try:
            with open(self.path, "rb") as f:
                f.seek(mark)
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return parse(text).calls
