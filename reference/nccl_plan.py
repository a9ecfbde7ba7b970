"""NCCL 2.28's plan for one collective alone in its kernel plan (src/enqueue.cc): how many
channels it may use, which contiguous elements each channel gets, and the chunk a channel's
loop works in. The order models need all three: a tree all-reduce adds in its channel's
tree, a ring all-reduce in an order fixed by the element's chunk within its channel.

* `max_channels` (topoGetAlgoInfo): small messages use fewer channels,
  `while nBytes < nc * nThreads * threadThreshold: nc--`. NCCL_MIN/MAX_NCHANNELS only set
  the communicator's count this starts from; NCCL_THREAD_THRESHOLDS changes the threshold.
* `channel_counts` (scheduleCollTasksToPlan): the message is cut into cells of 16 KiB of
  traffic (LL's traffic counted 4x) and dealt out as one "lo" channel, equal
  "mid" channels and a "hi" channel, each at least MinTrafficPerChannel = 16 KiB of traffic.
* `chunk_elements` (calcCollChunking): the chunk of a channel's loop, from the protocol's
  buffer size; for ring and tree (outside Tree/LL128) it does not depend on the size.
"""
from __future__ import annotations

MIN_TRAFFIC_PER_CHANNEL = 16 << 10
NCCL_STEPS = 8
# Default NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE, NCCL_BUFFSIZE (src/init.cc): LL lines per
# thread * LL threads * steps * 16-byte lines; LL128 elements per thread * threads * steps * 8 B.
DEFAULT_BUFF_SIZES = {"LL": 8 * 512 * NCCL_STEPS * 16, "LL128": 120 * 640 * NCCL_STEPS * 8, "SIMPLE": 1 << 22}
BUFF_SIZE_VARIABLES = {"LL": "NCCL_LL_BUFFSIZE", "LL128": "NCCL_LL128_BUFFSIZE", "SIMPLE": "NCCL_BUFFSIZE"}
# ncclProtoGrainSize: LL 16 B; LL128 a warp's shared-memory lines of data (32 * 8 / 16 * 15 * 8 B); Simple 512 B.
GRAIN_BYTES = {"LL": 16, "LL128": 32 * 8 // 16 * 15 * 8, "SIMPLE": 512}
RING_ALLREDUCE_CHUNK_STEPS = NCCL_STEPS // 2  # ALLREDUCE_CHUNKSTEPS; Simple ring only


def protocol_key(protocol: str) -> str:
    key = protocol.upper()
    if key not in GRAIN_BYTES:
        raise ValueError(f"unknown NCCL protocol {protocol!r}; known: LL, LL128, Simple")
    return key


def max_channels(nbytes: int, comm_channels: int, max_threads: int, thread_threshold: int) -> int:
    """The channel count NCCL allows a Ring or Tree collective of nbytes (topoGetAlgoInfo)."""
    nc = comm_channels
    while nbytes < nc * max_threads * thread_threshold and nc >= 2:
        nc -= 1
    return nc


def channel_counts(count: int, element_size: int, traffic_per_byte: int, protocol: str,
                   comm_channels: int, allowed_channels: int) -> list[int]:
    """Elements per channel (channels 0, 1, ...) of one collective alone in its plan.

    traffic_per_byte: ncclFuncTrafficPerByte, 2 for all-reduce and W for reduce-scatter or
    all-gather; allowed_channels: `max_channels` for the call; comm_channels: the
    communicator's channel count (the last channel takes whatever is left).
    """
    # LL moves 16-byte lines of 8 data bytes, and NCCL counts it 4x (ncclPrepareTasks, then
    # the cell size in scheduleCollTasksToPlan).
    cell_traffic_per_byte = traffic_per_byte * (4 if protocol_key(protocol) == "LL" else 1)
    task_traffic = max(MIN_TRAFFIC_PER_CHANNEL, count * element_size * cell_traffic_per_byte)
    per_channel = max(MIN_TRAFFIC_PER_CHANNEL, task_traffic // min(allowed_channels, comm_channels))
    cell_size = -(-(-(-MIN_TRAFFIC_PER_CHANNEL // cell_traffic_per_byte)) // 16) * 16
    per_cell = cell_size // element_size
    cells = -(-count * element_size // cell_size)
    cell_traffic = cell_size * cell_traffic_per_byte
    cells_per_channel = min(cells, -(-per_channel // cell_traffic))
    lo = cells if comm_channels == 1 else min(cells, -(-per_channel // cell_traffic))
    mid = (cells - lo) // cells_per_channel if cells_per_channel else 0
    hi = (cells - lo) % cells_per_channel if cells_per_channel else 0
    used = (lo != 0) + mid + (hi != 0)
    if comm_channels < used:  # more cells than channels: spread the rest over the others
        mid = comm_channels - 2
        cells_per_channel = (cells - lo) // (mid + 1)
        hi = cells_per_channel + (cells - lo) % (mid + 1)
    if hi == 0 and mid != 0:
        hi, mid = cells_per_channel, mid - 1
    counts = [lo * per_cell] + [cells_per_channel * per_cell] * mid + ([hi * per_cell] if hi else [])
    counts[-1] -= cells * per_cell - count  # the last cell is partial
    return counts


def chunk_elements(algorithm: str, protocol: str, element_size: int, buff_sizes: dict[str, int] | None = None) -> int:
    """Elements per chunk of a channel's loop for RING or TREE (calcCollChunking; the kernel
    reads it back as chunkGrains * grain). Not for Tree/LL128, whose chunk depends on size."""
    proto = protocol_key(protocol)
    algo = algorithm.upper()
    if algo == "TREE" and proto == "LL128":
        raise ValueError("Tree/LL128 chunks depend on the message size; not modelled")
    buff = (buff_sizes or {}).get(proto, DEFAULT_BUFF_SIZES[proto])
    chunk = buff // NCCL_STEPS * (RING_ALLREDUCE_CHUNK_STEPS if (algo == "RING" and proto == "SIMPLE") else 1)
    if proto == "LL":
        chunk //= 2  # half of every LL line is flags
    elif proto == "LL128":
        chunk = chunk // 16 * 15  # one of every 16 words is a flag
    chunk = chunk // GRAIN_BYTES[proto] * GRAIN_BYTES[proto]
    return chunk // element_size
