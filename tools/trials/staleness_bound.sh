#!/usr/bin/env bash
# ASP at equal epochs, unbounded staleness against --max-staleness K, over 3 seeds (issue 23, part 3).
# Run alone on the machine (other jobs stall the workers and change staleness):
#   bash tools/trials/staleness_bound.sh [K] [EPOCHS]
# Prints one line per run and the summary fields compared; the run directories stay in $OUT.
set -euo pipefail
K=${1:-6}
EPOCHS=${2:-20}
OUT=${OUT:-/tmp/staleness-bound}
rm -rf "$OUT" && mkdir -p "$OUT"
for seed in 1 2 3; do
  for arm in unbounded bounded; do
    flags=()
    [ "$arm" = bounded ] && flags=(--max-staleness "$K")
    omnilearn train --mode asp --epochs "$EPOCHS" --seed "$seed" --no-plots \
      --out "$OUT/$arm-$seed" "${flags[@]}" > "$OUT/$arm-$seed.log" 2>&1
    python - "$OUT/$arm-$seed/summary.json" "$arm" "$seed" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
w = s["workers"]
print(f"{sys.argv[2]:9} seed {sys.argv[3]}  accuracy {s['test_accuracy']:.4f}  train_s {s['train_s']:.1f}  "
      f"staleness mean {s['mean_staleness']:.2f} p50 {s['p50_staleness']} p99 {s['p99_staleness']} "
      f"max {s['max_staleness']}  refused {s['refused']} of {s['updates']}  "
      f"per-worker p99 {[x['p99_staleness'] for x in w]} max {[x['max_staleness'] for x in w]}")
PY
  done
done
