#!/usr/bin/env bash
# The demo: installs what it needs, then plans, compares and draws schedules on the paper's 1.5B model costs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-out/demo}
mkdir -p "$OUT"
COSTS="--stages 8 --microbatches 24 --t-f 18.5 --t-b 18.1 --t-w 9.3 --t-comm 0.7"
echo "== Schedules for the paper's 1.5B model (p=8, m=24, profiled times in ms) =="
"$PY" -m megatron.zero_bubble.schedules.cli compare --schedules 1f1b,zb-h1,zb-h2,zb-auto,zb-v $COSTS --memory-limit 16 --ilp-time-limit 5
for s in 1f1b zb-h1 zb-h2 zb-auto zb-v; do
  "$PY" -m megatron.zero_bubble.schedules.cli draw --schedule "$s" $COSTS --memory-limit 16 --ilp-time-limit 5 -o "$OUT/$s.png"
done
echo "pictures in $OUT/"
