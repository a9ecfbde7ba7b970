"""`ep-harness explore`: search for an invariance violation of a subject, and shrink it.

One torchrun launch (its ranks: harness/run/explore_rank.py): rank 0 runs a Hypothesis search
(`hypothesis.find`) over shapes, routing, batch composition and seeds; every example it draws
is broadcast to all ranks, which run the check exactly as `verify` would. The smallest
failing example is printed as a case-file snippet with its rerun command, and appended to a
store that later explorations replay first.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ep_harness import console
from ep_harness.check import Check, single_check
from ep_harness.errors import HarnessError
from ep_harness.records import append_line, numbered_jsonl, write_json

STORE = Path("reports/out/counterexamples.jsonl")


def searchable(family: str) -> list[str]:
    """The family's properties a search may draw (Property.searchable), those compared across
    ranks first: a counterexample within one call is the smallest, and Hypothesis shrinks
    toward the first choice."""
    from ep_harness import families, properties

    found = [p for p in families.get(family).properties if properties.get(p).searchable]
    return sorted(found, key=lambda p: properties.get(p).compares != "destination")


def strategy(family: str):
    """Hypothesis strategy of (property, params) for a family; shrinks toward small cases."""
    from hypothesis import strategies as st

    from ep_harness import families

    space = families.get(family).search_space  # the parameters a search varies (Family.search_space)
    if space is None:
        explorable = [name for name, f in families.FAMILIES.items() if f.search_space is not None]
        raise HarnessError(f"explore has no search space for {family} subjects; families: "
                           f"{', '.join(explorable)}")
    return st.fixed_dictionaries({"property": st.sampled_from(searchable(family)),
                                  "params": st.fixed_dictionaries(space(st))})


def as_check(subject, example: dict, world_size: int, backend: str) -> Check:
    return single_check(subject, example["property"], {**example["params"], "world_size": world_size}, backend,
                        f"explore/{subject.name}/{example['property']}")


STORE_FIX = "remove that line (or the store) and explore again"


def known_counterexamples(store: Path, subject, world_size: int, backend: str) -> list[dict]:
    """The store's counterexamples of `subject`, each checked as the ranks will replay it: a
    line that is not one (an edited or damaged store) is one HarnessError naming it."""
    known = []
    for lineno, record in numbered_jsonl(Path(store), STORE_FIX):
        if not isinstance(record.get("subject"), str):
            raise HarnessError(f"{store}:{lineno}: a counterexample without its subject; {STORE_FIX}")
        if record["subject"] != subject.name:
            continue
        example = record.get("example")
        if not (isinstance(example, dict) and example.get("property") in searchable(subject.family)
                and isinstance(example.get("params"), dict)):
            raise HarnessError(f"{store}:{lineno}: not a counterexample of {subject.name} (an object with a "
                               f"searchable property and its params); {STORE_FIX}")
        try:
            as_check(subject, example, world_size, backend)
        except HarnessError as exc:
            raise HarnessError(f"{store}:{lineno}: {exc}; {STORE_FIX}") from None
        known.append(record)
    return known


def snippet(subject_name: str, example: dict, n: int, world_size: int) -> str:
    lines = ["[[case]]", f'name = "counterexample-{n}"', f'subject = "{subject_name}"',
             f'properties = ["{example["property"]}"]', 'expect = "holds"', "[case.params]"]
    for key, value in sorted({**example["params"], "world_size": world_size}.items()):
        if key != "backend":
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def explore(subject_name: str, world_size: int, budget_s: float, max_examples: int, plugins: list[str],
            store: Path = STORE, gpus: int | None = None, out: Path | None = None) -> int:
    """Search `subject_name` for an invariance violation; the launch's files go under `out`
    (default: beside the store, in its folder's explore/), never elsewhere."""
    from ep_harness import subject as registry
    from ep_harness.environment import detect, pinned_env
    from ep_harness.launch.nodes import Nodes
    from ep_harness.launch.processes import Interrupted, agent_command, import_paths, interruptible, kill_launch, spawn

    registry.load_all(plugins)
    subject = registry.get(subject_name)
    strategy(subject.family)  # fail early on a family without a search space
    platform = detect(gpus)
    if world_size > platform.ranks:
        raise HarnessError(f"--world-size {world_size} exceeds this run's {platform.ranks} ranks")
    from ep_harness.run.verify import new_run_id

    known = known_counterexamples(store, subject, world_size, platform.backend)
    job_dir = (out if out is not None else Path(store).parent / "explore") / f"{subject_name}-{new_run_id()}"
    job_dir.mkdir(parents=True, exist_ok=True)
    write_json(job_dir / "job.json", {"subject": subject_name, "plugins": plugins, "backend": platform.backend,
                                      "world_size": world_size, "budget_s": budget_s, "max_examples": max_examples,
                                      "known": [k["example"] for k in known]})
    env = {**os.environ, **pinned_env(platform, {}), **import_paths()}
    proc = spawn(agent_command(Nodes(), world_size, job_dir.name, None, job_dir, module="ep_harness.run.explore_rank",
                               args=(str(job_dir),)), env, job_dir / "torchrun.log")
    try:
        with interruptible():
            proc.wait(timeout=budget_s + 600)
    except Interrupted as exc:  # the whole launch ends with it (below); nothing was found
        console.current().line(f"# exploration interrupted by {exc}")
        return 128 + exc.signum
    except subprocess.TimeoutExpired:
        raise HarnessError(f"the exploration launch outlived its budget + 600 s; log {job_dir}/torchrun.log") from None
    finally:
        kill_launch(proc, _rank_groups(job_dir))
    result_path = job_dir / "result.json"
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join((job_dir / "torchrun.log").read_text().splitlines()[-15:])
        raise HarnessError(f"the exploration launch failed (exit {proc.returncode}); log {job_dir}/torchrun.log:\n{tail}")
    result = json.loads(result_path.read_text())
    out = console.current()
    out.line(f"# explored {subject_name} on {world_size} {platform.backend} ranks: {result['examples']} examples "
             f"in {result['seconds']:.0f} s ({len(known)} known counterexample(s) replayed first)")
    if not result["found"]:
        out.line("# no violation found within the budget")
        return 0
    example = result["example"]
    n = len(known) + 1
    suite = job_dir / "counterexample.toml"
    suite.write_text(f'[suite]\nname = "counterexample"\nplugins = {json.dumps(plugins)}\n\n'
                     + snippet(subject_name, example, n, world_size))
    if not result.get("replayed"):
        append_line(store, {"subject": subject_name, "example": example, "found": result["summary"]})
    out.line(f"# violation: {result['summary']}")
    out.line(snippet(subject_name, example, n, world_size))
    check = f"counterexample-{n}/{example['property']}"
    out.line(f"# rerun: ep-harness verify --suite {suite} --check '{check}'"
             + "".join(f" --plugin {p}" for p in plugins))
    return 1


def _rank_groups(job_dir: Path) -> set[int]:
    """The process groups of this node's exploring ranks (each wrote its pid)."""
    from ep_harness.launch.processes import process_groups

    pids = []
    for pid_file in job_dir.glob("pid-rank*"):
        try:
            pids.append(int(pid_file.read_text()))
        except (OSError, ValueError):
            pass
    return process_groups(pids)
