"""The inputs of ci/nccl_record.py, generated once per test session, for the NCCL model tests
(tests/test_nccl_models.py, tests/test_nccl_single_node.py).

Regenerating every rank's input from the seed (`ep_harness.inputs.values`: float64 randn,
single-threaded) was most of those files' time, and with `pytest -n 3` every xdist worker
regenerated the same inputs. `recorder_inputs` makes each one once per session with the
recorder's own functions (ci/nccl_record.py ar_input / rs_input, unchanged), writes its bytes
to the directory the workers share (conftest.once_per_session: a file lock per input, so
workers make different inputs side by side), and every worker maps that file (torch.from_file, copy-on-write: a
model that wrote into its input would not change the file) and keeps it for the session. All-reduce inputs over
STORE_MAX_BYTES per rank (one test each) are generated afresh and not kept.

(The models run on one torch thread, as everything in the test processes: conftest's
one_torch_thread. They are elementwise folds, whose bits do not depend on the thread count.)
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, once_per_session

sys.path.insert(0, str(REPO / "ci"))
import nccl_record as recorder  # noqa: E402  (the recorder defines the inputs it used)

STORE_MAX_BYTES = 2 << 20  # per rank: every reduce-scatter input and the all-reduces up to 1 MiB


class RecorderInputs:
    """Every rank's input of one recorded collective, stacked: [world_size, ...]."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self._mapped: dict[tuple, torch.Tensor] = {}

    def ar(self, dtype: torch.dtype, world_size: int, n: int) -> torch.Tensor:
        """[world_size, n]: the recorder's all-reduce input of n elements on every rank."""
        return self._get("ar", dtype, world_size, n, (world_size, n), recorder.ar_input)

    def rs(self, dtype: torch.dtype, world_size: int, rows: int) -> torch.Tensor:
        """[world_size, world_size * rows, HIDDEN]: the recorder's reduce-scatter input."""
        return self._get("rs", dtype, world_size, rows, (world_size, world_size * rows, recorder.HIDDEN),
                         recorder.rs_input)

    def _get(self, kind: str, dtype: torch.dtype, world_size: int, n: int, shape: tuple, make) -> torch.Tensor:
        key = (kind, dtype, world_size, n)
        if key in self._mapped:
            return self._mapped[key]

        def generate() -> torch.Tensor:
            return torch.stack([make(dtype, world_size, n, rank) for rank in range(world_size)])

        numel = math.prod(shape)
        if numel // world_size * dtype.itemsize > STORE_MAX_BYTES:
            return generate()

        def write(folder: Path) -> str:  # once per session, under once_per_session's lock
            made = generate()
            assert made.shape == shape and made.is_contiguous()
            folder.mkdir(parents=True, exist_ok=True)
            made.view(torch.uint8).numpy().tofile(folder / "input.bin")
            return str(folder / "input.bin")

        name = f"nccl-input-{kind}-{str(dtype).removeprefix('torch.')}-w{world_size}-{n}"
        path = once_per_session(self.tmp_path_factory, name, write)
        # Every test reads the file, the worker that wrote it too (its pages stay in the page
        # cache, shared by the workers, rather than in each worker's own memory).
        made = torch.from_file(path, shared=False, size=numel, dtype=dtype).view(shape)
        self._mapped[key] = made
        return made


@pytest.fixture(scope="session")
def recorder_inputs(tmp_path_factory) -> RecorderInputs:
    return RecorderInputs(tmp_path_factory)
