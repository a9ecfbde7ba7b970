"""Record what real NCCL computes for seeded inputs, so order models can be built and tested
on machines without a GPU.

    python ci/nccl_record.py OUT_DIR [--configs pins rsring free treefree treech1] [--world-sizes 3 4 8]
                                     [--emulate hosts|single-node]

For every NCCL configuration and world size it launches one torchrun job whose ranks share
the visible GPU(s), as emulated hosts (a distinct NCCL_HOSTID per rank; the default) or as
one NCCL node (`--emulate single-node`, NCCL >= 2.30: harness/emulation.py), runs
reduce_scatter_tensor and all_reduce on inputs from `ep_harness.inputs.values` (so a CPU can
regenerate every rank's input from the seed), and saves rank 0's gathered outputs, a
SHA-256 of every rank's output, and every rank's NCCL_DEBUG=INFO log under OUT_DIR.

Configurations: `pins` (the harness's pins), `rsring` (ring reduce-scatter), `free` (nothing
pinned: NCCL picks algorithm, protocol and channels; all-reduce over a sweep of sizes, where
it picks RING), `treefree` (tree all-reduce, no channel pin: decode to prefill sizes) and
`treech1` (tree all-reduce on one channel: NCCL_MIN/MAX_NCHANNELS and NCCL_MIN/MAX_CTAS 1).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ep_harness.emulation import MODES, emulation_env  # noqa: E402

PINS = {"NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8",
        "NCCL_MIN_CTAS": "8", "NCCL_MAX_CTAS": "8", "NCCL_COLLNET_ENABLE": "0"}
CONFIGS = {
    # The harness's pins: tree for all-reduce only; NCCL picks reduce-scatter's algorithm.
    "pins": {**PINS, "NCCL_ALGO": "allreduce:tree"},
    # The same with ring forced for reduce-scatter.
    "rsring": {**PINS, "NCCL_ALGO": "allreduce:tree;reducescatter:ring"},
    # Nothing pinned: what NCCL chooses by itself (algorithm, protocol, channels).
    "free": {},
    # Tree all-reduce, Simple, no channel pin: NCCL's own channel count for every size.
    "treefree": {"NCCL_ALGO": "allreduce:tree", "NCCL_PROTO": "Simple", "NCCL_COLLNET_ENABLE": "0"},
    # Tree all-reduce, Simple, one channel: the same channel range for every size.
    "treech1": {"NCCL_ALGO": "allreduce:tree", "NCCL_PROTO": "Simple", "NCCL_COLLNET_ENABLE": "0",
                "NCCL_MIN_NCHANNELS": "1", "NCCL_MAX_NCHANNELS": "1", "NCCL_MIN_CTAS": "1", "NCCL_MAX_CTAS": "1"},
}
CONFIG_WORLD_SIZES = {"pins": (3, 4, 8), "rsring": (3, 4, 8), "free": (3, 4, 8), "treefree": (4, 8), "treech1": (4, 8)}
DTYPES = ("bfloat16", "float16", "float32")
RS_ROWS = (2, 32)  # rows per destination; hidden 2048
HIDDEN = 2048
AR_BYTES = (4096, 65536, 262144, 1 << 20, 4 << 20)
AR_FULL_MAX_BYTES = 1 << 20  # outputs up to this size are saved whole, larger ones as hashes
# The sweep for the configurations added for the ring model and prefill vs decode: powers of
# two from decode to prefill sizes, plus sizes that leave partial cells, chunks and 16-byte
# alignment units (6,000 B; 200,704 B = 49 bf16 rows of 2048; 1,000,000 B; 3 MiB + 4 KiB;
# 12,345,676 B), each a multiple of 4 bytes so every dtype divides it.
SWEEP_BYTES = tuple(sorted({1 << k for k in range(12, 26)} | {6000, 12288, 200704, 1000000, (3 << 20) + 4096,
                                                              12345676}))
AR_SIZES = {"pins": AR_BYTES, "free": SWEEP_BYTES, "treefree": SWEEP_BYTES, "treech1": SWEEP_BYTES}
# Whole outputs of the sweep (to find chunk boundaries where a model misses): with nothing
# pinned bf16 (the most order-sensitive) up to 1 MiB and the others up to 64 KiB; for the
# tree configurations, whose model is proven already, everything up to 64 KiB.
SWEEP_FULL_MAX_BYTES = {"bfloat16": 1 << 20, "float16": 1 << 16, "float32": 1 << 16}


def saved_whole(config: str, name: str, nbytes: int) -> bool:
    if config == "pins":
        return nbytes <= AR_FULL_MAX_BYTES and name != "float16"
    if config == "free":
        return nbytes <= SWEEP_FULL_MAX_BYTES[name]
    return nbytes <= 1 << 16


def rs_input(dtype, world_size, rows, rank):
    from ep_harness.inputs import values
    return values((world_size * rows, HIDDEN), dtype, 0, "nccl-record-rs", world_size, rows, rank)


def ar_input(dtype, world_size, numel, rank):
    from ep_harness.inputs import values
    return values((numel,), dtype, 0, "nccl-record-ar", world_size, numel, rank)


def worker(out_dir: Path, config: str) -> None:
    import torch
    import torch.distributed as dist

    from ep_harness.inputs import dtype_of

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(emulation_env(os.environ.get("EP_RECORD_EMULATE", "hosts"), rank))
    if torch.cuda.is_available():
        from ep_harness.emulation import device_index
        device = torch.device("cuda", device_index(rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # a dry run of this script on a CPU (gloo): checks the script, records nothing useful
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    saved, hashes = {}, {}

    def keep(key, out, full=True):
        gathered = [torch.empty_like(out) for _ in range(world_size)]
        dist.all_gather(gathered, out)
        digests = [hashlib.sha256(g.cpu().view(torch.uint8).numpy().tobytes()).hexdigest() for g in gathered]
        hashes[key] = digests
        if full and rank == 0:
            saved[key] = torch.stack([g.cpu() for g in gathered]).view(torch.uint8).clone()

    for name in DTYPES:
        dtype = dtype_of(name)
        for rows in RS_ROWS:
            if config in ("treefree", "treech1") or (config == "free" and rows != RS_ROWS[0]):
                continue
            inp = rs_input(dtype, world_size, rows, rank).to(device)
            out = torch.empty(rows, HIDDEN, dtype=dtype, device=device)
            dist.reduce_scatter_tensor(out, inp)
            keep(f"rs/{name}/rows{rows}", out)
        if config == "rsring":
            continue
        for nbytes in AR_SIZES[config]:
            numel = nbytes // dtype.itemsize
            buf = ar_input(dtype, world_size, numel, rank).to(device)
            dist.all_reduce(buf)
            # Every rank gets the root's bits; keep rank 0's copy whole, the others as hashes.
            digest = hashlib.sha256(buf.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
            digests = [None] * world_size
            dist.all_gather_object(digests, digest)
            hashes[f"ar/{name}/{nbytes}"] = digests
            if rank == 0 and saved_whole(config, name, nbytes):
                saved[f"ar/{name}/{nbytes}"] = buf.cpu().view(torch.uint8).clone()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if rank == 0:
        torch.save(saved, out_dir / f"outputs-{config}-w{world_size}.pt")
        (out_dir / f"hashes-{config}-w{world_size}.json").write_text(json.dumps(hashes, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--world-sizes", type=int, nargs="+", help="default: CONFIG_WORLD_SIZES")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--worker", metavar="CONFIG")
    parser.add_argument("--emulate", choices=MODES, default="hosts", help="how the ranks share the GPU(s)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args.out, args.worker)
        return 0
    failed = 0
    for config in args.configs:
        for world_size in args.world_sizes or CONFIG_WORLD_SIZES[config]:
            logs = args.out / "logs" / f"{config}-w{world_size}"
            logs.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **CONFIGS[config], "NCCL_DEBUG": "INFO",
                   "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,TUNING,ENV", "NCCL_DEBUG_FILE": str(logs / "nccl.%p.log"),
                   "EP_RECORD_EMULATE": args.emulate,
                   "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(world_size), __file__, str(args.out), "--worker", config]
            start = time.monotonic()
            with open(logs / "torchrun.log", "w") as log:
                try:
                    code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=240).returncode
                except subprocess.TimeoutExpired:
                    code = "timeout"
            print(f"{config} w{world_size}: exit {code} ({time.monotonic() - start:.0f} s)", flush=True)
            failed += code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
