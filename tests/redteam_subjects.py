"""Test-only subjects that attack the harness from inside a check (issue 23, item 6).
Registered through `--plugin tests.redteam_subjects`, as a third-party subject would be."""
import os
import subprocess

import torch.distributed as dist

from ep_harness.subject import register
from ep_harness.subjects.collective.all_gather_fold import AllGatherFold


@register
class EscapesItsSession(AllGatherFold):
    """Correct all-gather + fold whose every rank starts, once, a child in a session of its own
    (`setsid sleep 600`) and a daemon (a `sleep 600` whose parent exits at once, so init adopts
    it): neither is in any process group of the launch. Their pids go to $EP_TEST_CHILD_PIDS."""

    name = "redteam_setsid_child"
    summary = "all-gather + fold that leaves a setsid child and a daemon behind"

    def reduce_scatter(self, out, inp, sizes, group):
        if not getattr(self, "spawned", False):
            self.spawned = True
            pid_dir = os.environ["EP_TEST_CHILD_PIDS"]
            rank = dist.get_rank()
            subprocess.Popen(["setsid", "sh", "-c", f"echo $$ > {pid_dir}/setsid-{rank}; exec sleep 600"])
            subprocess.run(["setsid", "sh", "-c", f"sleep 600 & echo $! > {pid_dir}/daemon-{rank}"], check=True)
        super().reduce_scatter(out, inp, sizes, group)


@register
class FailsOnceCounted(AllGatherFold):
    """All-gather + fold that raises on every call, after appending one line per call to
    $EP_TEST_CALLS: how many times the check was run shows in that file."""

    name = "redteam_fails_counted"
    summary = "all-gather + fold that raises, counting its calls"

    def reduce_scatter(self, out, inp, sizes, group):
        if dist.get_rank() == 0:
            with open(os.environ["EP_TEST_CALLS"], "a") as f:
                f.write(f"{os.getpid()}\n")
        raise RuntimeError("planted failure: this check must be reported failed, once")
