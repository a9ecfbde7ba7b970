"""Which injection each property must catch: the table `ep-harness selftest` holds checks to.

A property must catch an injection when the defect changes what the property compares:

* `reference` compares every element with a float64 (or exact) reference within a bound.
  It must catch NaN and +Inf and a stale value (a value from another problem is far
  outside any bound), but not 1 ULP: one unit in the last place is inside a summation
  bound. Where the comparison is exact (`comparison: bitwise`, FP8 quantization, BF16
  dispatch), it must catch 1 ULP as well.
* `run-to-run` repeats one call: it must catch a 1-ULP change on the first call (`ulp`)
  and another order on the k-th call (`kth-call`). Not `stale`: every call has the same
  inputs, so a buffer kept from the previous call holds the right values (the selftest
  plants the next row's, another token's, which run-to-run may still show).
* `batch-invariance`, `position-invariance`, `size-invariance`, `others-invariance` compare
  calls with different inputs: they must catch a change on one call (`ulp`, `kth-call`);
  batch- and size-invariance also a change above a batch or message size.
* `prefill-decode-invariance` compares the probe in a decode-sized message with copies
  in several rows of larger ones: as size-invariance, and a stale value (the probe moves).
* A stale value is kept per position: only a property that moves the probe to another row
  between calls (`position-invariance`, `prefill-decode-invariance`) or compares every
  element (`reference`) must see it. Batch-, size- and others-invariance may keep the probe in the same row of every call
  (the GEMM's probe is always its expert's first row), where a buffer kept from the previous
  call holds the probe's own, right value.
* `thread-invariance` repeats one call on other thread counts: as run-to-run, and a change
  on more threads than the launch pinned (`more-threads`), which no other property runs.
* `rank-invariance` compares the probe on different ranks within one call: `one-rank`.
* `graph-invariance` compares eager and CUDA-graph runs: `in-graph`, and `ulp` (the eager
  call differs). Not `kth-call`: the k-th call is a warm-up whose output the replay overwrites.
* Every collective property must catch a write outside the output (`out-of-slice`): the
  collective contract forbids writing the input outside the output's alias, and the family
  checks the input after every call. The other families hand their subjects fresh inputs
  (issue 23 item 6 decides what they guarantee), so no property of theirs is held to it.

An injection a property need not catch is never a miss. A control (`expect` other than
`holds`) already shows a difference, so an injected one cannot change its verdict: its
cells are not applicable. A plugin that adds a property declares its row with `declare`.
"""
from __future__ import annotations

from ep_harness import families, properties

EXACT_REFERENCE = frozenset({"ulp"})  # added where a reference property compares bit for bit
# (family, property) pairs that compare something no injection touches, and why (none today:
# the layout-size properties' reduce_shards / forward_shards are wrapped as the other calls are).
NOT_TARGETED: dict[tuple[str, str], str] = {}


def must_catch() -> dict[str, frozenset[str]]:
    """The table: every registered property with a row (its Property.must_catch)."""
    return {name: p.must_catch for name, p in properties.PROPERTIES.items() if p.must_catch is not None}


def family_must_catch() -> dict[str, frozenset[str]]:
    """The injections each family requires of all its properties beyond each property's own
    row (its Family.must_catch), for the families that declare any."""
    return {name: f.must_catch for name, f in families.FAMILIES.items() if f.must_catch}


def required(record: dict, injection: str) -> tuple[bool | None, str]:
    """Whether the check of a baseline `record` must catch `injection`: (True, why),
    (False, why) or (None, why not applicable)."""
    prop, family = record["property"], record["family"]
    if record.get("status") != "ok":
        return None, f"baseline {record.get('status')}: only a check that is ok without injection can be tested"
    if record.get("expect") != "holds":
        return None, f"a control (expect = {record.get('expect')}): an injected difference cannot change its verdict"
    declared = families.FAMILIES.get(family)
    if declared is None or declared.selftest_wrapper is None:
        return None, f"no injection wrapper for the {family} family (harness/selftest/wrap.py)"
    if (family, prop) in NOT_TARGETED:
        return None, NOT_TARGETED[(family, prop)]
    kind = properties.PROPERTIES.get(prop)
    if kind is None or kind.must_catch is None:
        return None, f"no row for property {prop!r} (its must_catch in harness/properties.py, or the plugin's Property)"
    must = kind.must_catch | declared.must_catch
    if kind.needs_reference and record.get("comparison") == "bitwise":
        must |= EXACT_REFERENCE
    if injection in must:
        return True, f"{prop} must catch {injection}"
    return False, f"{prop} need not catch {injection}"
