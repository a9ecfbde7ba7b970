"""A test-only subject for tests/test_precompile_overlap.py: the all-gather fold that, when
OVERLAP_STAMPS names a file, appends the time of each of its calls on rank 0 with its input's
width (which tells the suite's checks apart): when each check ran, seen from outside the ranks."""
import json
import os
import time

import torch.distributed as dist

from ep_harness.subject import register
from ep_harness.subjects.collective.all_gather_fold import AllGatherFold


@register
class StampedFold(AllGatherFold):
    name = "overlap_stamped_fold"
    summary = "all-gather + fold that notes when it runs"

    def reduce_scatter(self, out, inp, sizes, group):
        path = os.environ.get("OVERLAP_STAMPS")
        if path and dist.get_rank(group) == 0:
            with open(path, "a") as f:  # one short line per write: appends stay whole
                f.write(json.dumps({"width": inp.shape[-1], "time": time.time()}) + "\n")
        super().reduce_scatter(out, inp, sizes, group)
