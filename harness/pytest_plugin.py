"""pytest integration (entry point `pytest11: ep_harness`).

* `@pytest.mark.gpus(n)`: skipped with the reason where fewer than n GPUs are visible.
* `ep_world`: a factory fixture; `ep_world(4).run(fn, *args)` runs `fn(rank, world_size,
  *args)` on 4 ranks with an initialized process group (gloo on CPU, NCCL on GPUs) and
  returns every rank's result; an exception on any rank is raised here, unchanged.
* `assert_bitwise_equal` / `assert_invariant`: the harness's comparison and mismatch text.
* `pytest --ep-suite smoke`: one pytest item per check of a suite; with pytest-xdist each
  worker is pinned to its own GPU where there are several.
"""
from __future__ import annotations

import os
import socket
import tempfile
import traceback
from pathlib import Path

import pytest

# --- assertions ---------------------------------------------------------------------


def assert_bitwise_equal(actual, expected, labels=None, what: str = "rank-invariance") -> dict:
    """Raise AssertionError with the harness's mismatch text unless every bit matches."""
    from harness.compare import compare_bitwise
    from reports.text import mismatch_text

    m = compare_bitwise(actual, expected, labels)
    record = {"property": what, "rerun": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], **m.to_dict()}
    record["detail"] = {"max_abs_index": m.max_abs_index, "max_ulp_index": m.max_ulp_index}
    if m.mismatched:
        raise AssertionError(mismatch_text(record))
    return record


def assert_invariant(copies, labels=None, what: str = "rank-invariance") -> dict:
    """Every copy of a result (one per placement) must equal the first, bit for bit."""
    import torch

    stacked = torch.stack(list(copies)) if not isinstance(copies, torch.Tensor) else copies
    return assert_bitwise_equal(stacked, stacked[0], labels, what)


# --- multi-rank world ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, backend, fn, args, result_dir):
    import pickle

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # carried back to the test process and raised there
        outcome = ("raised", exc, traceback.format_exc())
    finally:
        dist.destroy_process_group()
    with open(Path(result_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(outcome, f)


class World:
    def __init__(self, world_size: int):
        import torch

        self.world_size = world_size
        self.backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"

    def run(self, fn, *args) -> list:
        """fn(rank, world_size, *args) on every rank; fn must be importable (module level)."""
        import pickle

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            ctx = mp.start_processes(_rank_main, args=(self.world_size, _free_port(), self.backend, fn, args, tmp),
                                     nprocs=self.world_size, join=False, start_method="spawn")
            while not ctx.join(timeout=120):
                pass
            outcomes = [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(self.world_size)]
        for rank, outcome in enumerate(outcomes):
            if outcome[0] == "raised":
                raise outcome[1]
        return [o[1] for o in outcomes]


@pytest.fixture
def ep_world():
    return World


# --- markers and suite items --------------------------------------------------------


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def pytest_addoption(parser):
    group = parser.getgroup("ep-harness")
    group.addoption("--ep-suite", default=None, help="run a suite's checks as pytest items (e.g. smoke)")
    group.addoption("--ep-gpus", type=int, default=None, help="GPUS for --ep-suite (default: all visible)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs n GPUs; skipped with the reason when fewer are visible")
    if not config.getoption("--ep-suite"):
        return  # a session that uses none of the plugin's options imports nothing and changes nothing
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    gpus = _gpu_count()
    if worker and gpus > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(worker.removeprefix("gw")) % gpus)  # one GPU per worker


def pytest_runtest_setup(item):
    for mark in item.iter_markers(name="gpus"):
        needed = mark.args[0] if mark.args else mark.kwargs.get("n", 1)
        found = _gpu_count()
        if found < needed:
            pytest.skip(f"needs {needed} GPU{'s' if needed != 1 else ''}, found {found}")


class CheckItem(pytest.Item):
    def __init__(self, *, check: dict, suite: str, gpus, **kwargs):
        super().__init__(**kwargs)
        self.check, self.suite, self.gpus = check, suite, gpus

    def runtest(self):
        from harness.records import read_jsonl
        from harness.verify import verify

        if self.check.skip_reason:
            pytest.skip(self.check.skip_reason)
        with tempfile.TemporaryDirectory() as tmp:
            _, run_dir = verify(self.suite, gpus=self.gpus, selection=[self.check.id], out_root=Path(tmp),
                                render=False, quiet=True)
            record = read_jsonl(run_dir / "results.jsonl")[0]
        if record["status"] == "vacuous":
            pytest.skip(f"vacuous (not a pass): {record['reason']}")
        if record["status"] in ("unexpected", "error"):
            from reports.text import mismatch_text

            raise AssertionError(f"{record['status']}: {record['reason']}\n\n{mismatch_text(record)}")

    def reportinfo(self):
        return self.suite, None, self.check.id

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, AssertionError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)


def pytest_collection_modifyitems(session, config, items):
    suite = config.getoption("--ep-suite")
    if not suite:
        return
    from harness import subject as registry
    from harness.cases import load_suite, resolve_suite_path
    from harness.environment import detect
    from harness.plan import expand

    path = resolve_suite_path(suite)
    loaded = load_suite(path)
    registry.load_all(loaded.plugins)
    gpus = config.getoption("--ep-gpus")
    for check in expand(loaded, detect(gpus)):
        items.append(CheckItem.from_parent(session, name=check.id, check=check, suite=str(path), gpus=gpus))
