"""A test-only subject for tests/test_protocol.py (`--plugin tests.planted_protocol`): a rank
that says something else than the protocol."""
import os
import time

import torch.distributed as dist

from ep_harness.launch import protocol
from ep_harness.launch.channel import SECRET_ENV, Channel, parse_endpoint, tcp_store
from ep_harness.subject import register
from ep_harness.subjects.collective.all_gather_fold import AllGatherFold


@register
class GarbledProgress(AllGatherFold):
    """A correct fold, except that rank 1 overwrites its own progress with a value the
    protocol does not know (signed with the run's secret, as a rank of another version
    would) and then waits for the launcher to end the launch."""

    name = "planted_garbled_progress"
    summary = "all-gather + fold whose rank 1 garbles its progress in the run's store"

    def reduce_scatter(self, out, inp, sizes, group):
        if dist.get_rank() != 1:
            return super().reduce_scatter(out, inp, sizes, group)
        host, port = parse_endpoint(os.environ["EP_HARNESS_STORE"])
        channel = Channel(tcp_store(host, port, is_master=False), os.environ["EP_HARNESS_CHANNEL"],
                          os.environ[SECRET_ENV])
        channel.put(protocol.progress_key(1), {"index": "garbage", "since": time.time()})
        while True:  # the launcher sees it at its next poll and ends the launch
            time.sleep(1)
