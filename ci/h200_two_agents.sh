#!/usr/bin/env bash
# Two torchrun agents on the one lent H200 as two "nodes" of 2 NCCL ranks each (emulated
# hosts: one NCCL_HOSTID per rank, NET/Socket), against one agent of 4 ranks, on the smoke
# suite's world-size-4 collectives (smaller NCCL world sizes on subgroups of one emulated-hosts
# launch hung in 2026-11-29's first try: results/h200-two-agents-2026-11-29). Not a
# multi-GPU or multi-host result: every rank shares the one GPU.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
{ date -u; nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"; } \
  > "$OUT/machine.txt" 2>&1
SEL=(--check 'rs-native/*/world_size=4' --check 'ar-slice/*/world_size=4' --check 'ag-fold/*/world_size=4'
     --check 'a2a-fold/*/world_size=4')
COMMON=(--suite smoke --gpus 4 --emulate-hosts --no-report "${SEL[@]}")
start=$(date +%s)
python3 -m ep_harness verify "${COMMON[@]}" --launches one --out /tmp/one > "$OUT/one-agent.log" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s" >> "$OUT/one-agent.log"
start=$(date +%s)
mkdir -p /tmp/node0 /tmp/node1
(cd /tmp/node0 && python3 -m ep_harness verify "${COMMON[@]}" --nnodes 2 --nproc-per-node 2 \
   --rdzv-endpoint 127.0.0.1:29400 --node-rank 0 --out /tmp/two > "$OUT/two-agents-head.log" 2>&1; \
 echo "exit $? after $(( $(date +%s) - start )) s" >> "$OUT/two-agents-head.log") &
(cd /tmp/node1 && python3 -m ep_harness verify --gpus 4 --emulate-hosts --nnodes 2 --nproc-per-node 2 \
   --rdzv-endpoint 127.0.0.1:29400 --node-rank 1 --out /tmp/node1/out > "$OUT/two-agents-node1.log" 2>&1; \
 echo "exit $?" >> "$OUT/two-agents-node1.log") &
wait
for d in one two; do mkdir -p "$OUT/$d"; cp /tmp/$d/latest/results.jsonl /tmp/$d/latest/environment.json "$OUT/$d/" 2>/dev/null; done
python3 - "$OUT" > "$OUT/compare.txt" 2>&1 <<'PY'
import json, sys
out = sys.argv[1]
def counts(d):
    return {r["check"]: (r["status"], r["mismatched"], r.get("predicted_mismatched"), r["total"])
            for r in map(json.loads, open(f"{out}/{d}/results.jsonl"))}
one, two = counts("one"), counts("two")
same = [c for c in one if one[c] == two.get(c)]
print(f"{len(one)} checks in the one-agent run, {len(two)} in the two-agent run, {len(same)} identical "
      f"(status, mismatched, predicted, total)")
for c in one:
    if one[c] != two.get(c):
        print("DIFFERENT", c, one[c], two.get(c))
PY
(cd /tmp/node1/out && tar czf "$OUT/node1-logs.tgz" . 2>/dev/null)
