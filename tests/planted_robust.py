"""Test-only subjects for tests/test_robust_inputs.py, registered through `--plugin
tests.planted_robust` (or a suite's `plugins`)."""
import os
import time

from ep_harness.subject import register
from ep_harness.subjects.collective.all_gather_fold import AllGatherFold


@register
class NeverAvailable(AllGatherFold):
    """A correct fold whose library is 'missing' everywhere: every check of it is skipped."""

    name = "planted_never_available"
    summary = "all-gather + fold that reports its library missing"

    def unavailable(self, platform, params):
        return "planted: libmissing is not installed"


@register
class HangsWhenRelaunched(AllGatherFold):
    """A correct fold in a run's first launch that hangs in its fresh-process relaunches
    (they run in job directories named `-freshK`), after saying so in EP_TEST_CHILD_PIDS."""

    name = "planted_hang_when_relaunched"
    summary = "all-gather + fold that hangs in a fresh-process relaunch"

    def reduce_scatter(self, out, inp, sizes, group):
        if "-fresh" not in os.environ.get("EP_HARNESS_JOB_DIR", ""):
            return super().reduce_scatter(out, inp, sizes, group)
        pid_dir = os.environ.get("EP_TEST_CHILD_PIDS")
        if pid_dir:
            with open(os.path.join(pid_dir, f"rank-{os.getpid()}"), "w") as f:
                f.write(str(os.getpid()))
        while True:
            time.sleep(1)
