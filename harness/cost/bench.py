"""`make bench`: timings that belong in BENCHMARKS.md, never in tests.

    python -m ep_harness.cost.bench suite   # CPU default suite: one launch per world size vs one per check
    python -m ep_harness.cost.bench startup # a one-test pytest run with the plugin vs `-p no:ep_harness`
    python -m ep_harness.cost.bench ep-suite  # `pytest --ep-suite` vs `ep-harness verify` on one suite
    python -m ep_harness.cost.bench report  # render a 2,000-record run: seconds and bytes
    python -m ep_harness.cost.bench compare # GPU: fused bitwise comparison vs device-to-device copy
    python -m ep_harness.cost.bench collectives  # native reduce-scatter vs the deterministic paths

Medians over repeats, measured side by side in one process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ep_harness import console
from ep_harness.records import read_jsonl, write_json, write_jsonl


def bench_suite(repeats: int, suite: str, modes=("one", "per-world-size", "per-check")) -> dict:
    """The suite's wall time under each way of grouping checks into torchrun launches (the
    per-check mode once: it is by far the slowest)."""
    from ep_harness.run.verify import RunOptions, verify

    timings: dict[str, list[float]] = {m: [] for m in modes}
    checks = None
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            for _ in range(1 if mode == "per-check" else repeats):
                began = time.perf_counter()
                with console.using(console.Console(quiet=True)):  # timed, not watched
                    code, run_dir = verify(RunOptions(suite, gpus=0, out_root=Path(tmp), render=False, launches=mode))
                timings[mode].append(time.perf_counter() - began)
                checks = sum(r["status"] != "skipped" for r in read_jsonl(run_dir / "results.jsonl"))
                if code:
                    raise SystemExit(f"the {mode} run failed; fix the suite before timing it")
    medians = {m: round(statistics.median(t), 2) for m, t in timings.items()}
    base = medians.get("per-world-size")
    return {"suite": suite, "checks_run": checks, "seconds": timings, "median_s": medians,
            "speedup_vs_per_world_size": {m: round(base / v, 2) for m, v in medians.items()} if base else {}}


def _median_wall(cmd: list[str], repeats: int, cwd: Path) -> float:
    import subprocess

    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        times.append(time.perf_counter() - began)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-1000:]}")
    return statistics.median(times)


def bench_startup(repeats: int) -> dict:
    """What the installed plugin costs a pytest session that does not use it: one trivial
    test, run with the plugin loaded and with `-p no:ep_harness`, alternately."""
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
        base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_one.py"]
        _median_wall(base, 1, Path(tmp))  # warm the file cache
        with_plugin = _median_wall(base, repeats, Path(tmp))
        without = _median_wall([*base, "-p", "no:ep_harness"], repeats, Path(tmp))
    return {"repeats": repeats, "with_plugin_s": round(with_plugin, 3), "without_plugin_s": round(without, 3),
            "plugin_cost_s": round(with_plugin - without, 3)}


def bench_ep_suite(repeats: int, suite: str) -> dict:
    """`pytest --ep-suite SUITE` (one item per check, one verify run behind them) against
    `ep-harness verify --suite SUITE`, on the CPU, alternately."""
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        pytest_s = _median_wall([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--ep-suite", suite,
                                 "--ep-gpus", "0", "."], repeats, Path(tmp))
        verify_s = _median_wall([sys.executable, "-m", "ep_harness", "verify", "--suite", suite, "--gpus", "0",
                                 "--no-report", "--out", str(Path(tmp) / "out")], repeats, Path(tmp))
    return {"suite": suite, "repeats": repeats, "pytest_ep_suite_s": round(pytest_s, 2), "verify_s": round(verify_s, 2),
            "ratio": round(pytest_s / verify_s, 2)}


def synthetic_run(base: list[dict], n: int, out: Path) -> Path:
    """`n` records cloned from a real run's, with distinct ids and a share of failures."""
    records = []
    for i in range(n):
        r = json.loads(json.dumps(base[i % len(base)]))
        r["check"] = f"{r['check']}/copy={i // len(base)}"
        r["params"] = {**r["params"], "copy": i // len(base)}
        if i % 50 == 7 and r.get("mismatched") is not None and r["expect"] == "holds":
            r["status"], r["reason"] = "unexpected", "planted for the benchmark"
        records.append(r)
    write_jsonl(out / "results.jsonl", records)
    write_json(out / "environment.json", {"command": "synthetic", "suite": "bench"})
    return out


def bench_report(n: int, repeats: int, source: Path) -> dict:
    from ep_harness.reports.render import render_run

    base = read_jsonl(source / "results.jsonl")
    if not base:
        raise SystemExit(f"no records in {source}; run `make verify` first")
    times, size = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = synthetic_run(base, n, Path(tmp))
        for _ in range(repeats):
            began = time.perf_counter()
            render_run(run_dir, quiet=True)
            times.append(time.perf_counter() - began)
            size = (run_dir / "report.html").stat().st_size
    return {"records": n, "render_s": [round(t, 3) for t in times], "render_median_s": round(statistics.median(times), 3),
            "html_bytes": size}


def _cuda_median(fn, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _compare_one(n: int, dtype, repeats: int) -> dict:
    import torch

    from ep_harness.kernels.bitcompare import bitwise_stats

    a = torch.randn(n, device="cuda", dtype=torch.float32).to(dtype)
    b = a.clone()
    b[n // 3] = b[n // 3] * 2 + 1  # two planted differences, the first at n // 3
    b[-1] = -b[-1] + 1
    dst = torch.empty_like(a)
    copy_s = _cuda_median(lambda: dst.copy_(a), repeats)
    fused_s = _cuda_median(lambda: bitwise_stats(a, b), repeats)
    torch_s = _cuda_median(lambda: bitwise_stats(a, b, use_triton=False), max(3, repeats // 4))
    fused, vectorized = bitwise_stats(a, b), bitwise_stats(a, b, use_triton=False)
    nbytes = a.numel() * a.element_size()
    return {
        "dtype": str(dtype).replace("torch.", ""), "bytes_per_tensor": nbytes,
        "copy_GBps": round(2 * nbytes / copy_s / 1e9, 1),
        "fused_GBps": round(2 * nbytes / fused_s / 1e9, 1),
        "torch_GBps": round(2 * nbytes / torch_s / 1e9, 1),
        "fused_vs_copy": round(copy_s / fused_s, 3),
        "fused_stats": list(fused), "torch_stats": list(vectorized), "agree": fused == vectorized,
    }


def bench_compare(gib_sizes: list[float], repeats: int) -> list[dict]:
    """Fused comparison (reads both tensors once) against a device-to-device copy of one."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the comparison benchmark needs a CUDA GPU")
    rows = []
    for gib in gib_sizes:
        for dtype in (torch.bfloat16, torch.float32):
            n = int(gib * 2**30) // torch.empty(0, dtype=dtype).element_size()
            rows.append(_compare_one(n, dtype, repeats))
            torch.cuda.empty_cache()
    return rows


def bench_collectives(world_size: int, min_kib: int, max_mib: int, repeats: int) -> dict:
    import os
    import subprocess
    import sys

    from ep_harness.launch.processes import REPO_ROOT

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collectives.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size),
               "-m", "ep_harness.cost.bench_collectives", str(out), str(min_kib), str(max_mib), str(repeats)]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "NCCL_NVLS_ENABLE": "0",
               "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the collectives benchmark failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return json.loads(out.read_text())


BENCHES = ("suite", "startup", "ep-suite", "report", "compare", "collectives")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ep_harness.cost.bench")
    parser.add_argument("what", nargs="*", metavar="WHAT",
                        help=f"any of {', '.join(BENCHES)} (default: suite startup ep-suite report)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--min-kib", type=int, default=64)
    parser.add_argument("--max-mib", type=int, default=16)
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--suite", default="smoke")
    parser.add_argument("--modes", nargs="+", default=["one", "per-world-size", "per-check"],
                        help="launch groupings to time for `suite`")
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--source", type=Path, default=Path("reports/out/latest"))
    args = parser.parse_args(argv)
    args.what = args.what or ["suite", "startup", "ep-suite", "report"]  # argparse rejects a list default with choices
    unknown = [w for w in args.what if w not in BENCHES]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}")
    out = console.current()
    results = {}
    if "suite" in args.what:
        results["suite"] = bench_suite(args.repeats, args.suite, args.modes)
        s = results["suite"]
        for mode, median in s["median_s"].items():
            out.line(f"suite {s['suite']} ({s['checks_run']} checks), {mode} launches: {median} s "
                     f"(median of {len(s['seconds'][mode])}), {s['speedup_vs_per_world_size'].get(mode, '-')}x the "
                     f"per-world-size time")
    if "startup" in args.what:
        results["startup"] = u = bench_startup(max(args.repeats, 9))
        out.line(f"one-test pytest run: {u['with_plugin_s']} s with the plugin, {u['without_plugin_s']} s with "
                 f"-p no:ep_harness (medians of {u['repeats']}): the plugin costs {u['plugin_cost_s']} s")
    if "ep-suite" in args.what:
        results["ep-suite"] = e = bench_ep_suite(args.repeats, args.suite)
        out.line(f"pytest --ep-suite {e['suite']}: {e['pytest_ep_suite_s']} s, ep-harness verify: {e['verify_s']} s "
                 f"(medians of {e['repeats']}): {e['ratio']}x")
    if "report" in args.what:
        results["report"] = bench_report(args.records, args.repeats, args.source)
        r = results["report"]
        out.line(f"report of {r['records']} records: {r['render_median_s']} s (median of {len(r['render_s'])}), "
                 f"{r['html_bytes'] / 1e6:.2f} MB")
    if "compare" in args.what:
        results["compare"] = bench_compare(args.gib, max(args.repeats, 10))
        for r in results["compare"]:
            out.line(f"compare {r['dtype']} {r['bytes_per_tensor'] / 2**30:.0f} GiB: fused {r['fused_GBps']} GB/s, "
                     f"torch {r['torch_GBps']} GB/s, copy {r['copy_GBps']} GB/s -> fused/copy {r['fused_vs_copy']}"
                     f" (stats agree: {r['agree']})")
    if "collectives" in args.what:
        results["collectives"] = c = bench_collectives(args.world_size, args.min_kib, args.max_mib,
                                                       max(args.repeats, 5))
        out.line(f"collectives on {c['world_size']} {c['backend']} ranks, median of {c['repeats']}:")
        for r in c["rows"]:
            out.line(f"  {r['bytes'] / 2**20:9.3f} MiB  {r['subject']:22s} {r['median_s'] * 1e3:9.3f} ms  "
                     f"{r['vs_native']:.2f}x native")
    out.line(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
