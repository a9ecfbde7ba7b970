"""Turn a recording of ci/nccl_record.py into test fixtures: per configuration and world
size, every rank's NCCL log cut to the lines harness/nccl/log.py reads, and the digests.

    python ci/nccl_fixtures.py RECORD_DIR tests/fixtures/nccl-<version>-<topology>

A log is named after the rank its `comm ... rank R nRanks W` line gives (NCCL names its
files by pid). The cut keeps the lines `nccl_log.relevant` says the parser reads, so the
parser reads the same topology and calls from the fixture as from the whole log.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ep_harness.nccl import log as nccl_log  # noqa: E402

def rank_of(text: str) -> int:
    match = nccl_log._COMM.search(text)
    if match is None:
        raise SystemExit("a log without its communicator line (comm ... rank R nRanks W)")
    return int(match.group(1))


def cut(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if nccl_log.relevant(line))


def main(record: Path, fixtures: Path) -> None:
    for logs in sorted((record / "logs").iterdir()):
        hashes = record / f"hashes-{logs.name}.json"
        if not hashes.exists():
            print(f"{logs.name}: no digests (the recording failed?); skipped")
            continue
        out = fixtures / logs.name
        out.mkdir(parents=True, exist_ok=True)
        for log in logs.glob("nccl.*.log"):
            text = log.read_text(errors="replace")
            (out / f"rank{rank_of(text)}.log").write_text(cut(text))
        shutil.copy(hashes, out / "hashes.json")
        print(f"{logs.name}: {len(list(out.glob('rank*.log')))} rank logs")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
