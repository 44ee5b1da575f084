#!/usr/bin/env bash
# The encryption figures of BENCHMARKS.md: each `kvtier bench … --encrypt` command N times
# (default 5), then the median of every ratio and throughput field and the encrypt_ratio of each run.
# Usage: scripts/bench_encrypt.sh [N]   (after `make install`)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-5}
KVTIER=${KVTIER:-.venv/bin/kvtier}
PYTHON=${PYTHON:-.venv/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
while read -r cmd; do
  file="$out/$(echo "$cmd" | tr ' -' '__').jsonl"
  for _ in $(seq "$N"); do $KVTIER bench $cmd --json; done > "$file"
  echo "== kvtier bench $cmd --json  ($N runs, load $(cut -d' ' -f1 /proc/loadavg))"
  "$PYTHON" - "$file" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
fields = [k for k, v in rows[0].items()
          if isinstance(v, float) and ("ratio" in k or "gbps" in k) and all(r.get(k) is not None for r in rows)]
print({k: round(statistics.median(r[k] for r in rows), 3) for k in fields})
print("encrypt_ratio per run:", [r["encrypt_ratio"] for r in rows])
PY
done <<'CMDS'
storage --tier disk --encrypt --block-mib 8
storage --tier disk --encrypt --block-mib 32
remote --encrypt --block-mib 8
remote --encrypt --block-mib 32
remote --encrypt --unix --block-mib 8
CMDS
