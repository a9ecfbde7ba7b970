"""Run under harness/launch/agent/: each rank writes where it was forked from (the thread count and
command line of its parent, the fork server) and its garbage collector's state, without a process group."""
import gc
import json
import os
from pathlib import Path

from ep_harness.launch.processes import process_state


def rank_main(out_dir):
    parent = os.getppid()
    threads = process_state(parent).threads
    command = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    Path(out_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps({"threads": threads, "command": command,
                                                                       "environ": sorted(os.environ),
                                                                       "gc": [gc.isenabled(), gc.get_freeze_count()]}))
