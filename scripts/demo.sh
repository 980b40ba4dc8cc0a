#!/usr/bin/env bash
# The demo: installs what it needs, then
# 1. trains a tiny GPT on CPU (gloo) with PP=4 under megatron's own 1F1B, ZB-H1, the automatic schedule
#    (--enable-zero-bubble) and ZB-V (--zero-bubble-v-schedule), prints their loss curves side by side (identical)
#    and each schedule's planned bubble on the pass times it measured, and writes the schedule pictures;
# 2. measures megatron's 1F1B against ZB-H1, zb-auto and ZB-V at PP=2, each rank on a core (scripts/demo_speed.py:
#    runs alternated, min / median / max);
# 3. plans the paper's 1.5B model. About six minutes on 2 cores.  Knobs: OUT_DIR (out/demo), ITERS (30),
#    SPEED_REPS (5), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-out/demo}
ITERS=${ITERS:-30}
SCHEDULES="$OUT/schedules"
rm -rf "$SCHEDULES"  # dumps of an earlier demo would mix with this one's
mkdir -p "$OUT" "$SCHEDULES"
export CUDA_VISIBLE_DEVICES=""  # the CPU demo, also on a machine with GPUs

# ZB-V places layers on other ranks than 1F1B. Weights initialised by global name, no dropout and a gradient
# clipping bound never reached (the norm's summation order depends on the layout) make every layout
# compute the same model, so all four loss columns must be identical.
MODEL="--zero-bubble-cpu --pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32
  --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 --vocab-size 128
  --tokenizer-type NullTokenizer --mock-data --num-workers 0 --train-iters $ITERS --lr 1e-3 --eval-iters 0
  --eval-interval $ITERS --log-interval 1 --seed 1234 --init-weights-by-global-name --hidden-dropout 0
  --attention-dropout 0 --clip-grad 1e9"
# Zero-bubble runs measure pass times in iterations 4-7 and re-plan from them at iteration 8.
ZB="--zero-bubble-pipeline-timers-start-iter 4 --zero-bubble-pipeline-timers-end-iter 8
  --zero-bubble-dump-schedule $SCHEDULES"

echo "== Training a tiny GPT ($ITERS iterations, PP=4, m=8 microbatches, 4 processes on $(nproc) CPU cores) =="
# Only zb-auto's planner has an ILP; the other schedules refuse --zero-bubble-ilp-time-limit.
for run in "1f1b:" "zb-h1:--pipeline-schedule zb-h1" "zb-auto:--enable-zero-bubble --zero-bubble-ilp-time-limit 5" \
    "zb-v:--zero-bubble-v-schedule"; do
  name=${run%%:*} flags=${run#*:} start=$SECONDS
  [ -n "$flags" ] && flags="$flags $ZB"
  # shellcheck disable=SC2086  # MODEL, ZB and flags are word lists
  if ! "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_gpt.py $MODEL $flags \
      >"$OUT/$name.log" 2>&1; then
    echo "$name: training failed; see $OUT/$name.log:"
    grep -m 1 -E 'pretrain_gpt.py: error:|^\[rank[0-9]+\]: [A-Za-z_.]*(Error|Exception)\b' "$OUT/$name.log" ||
      tail -n 15 "$OUT/$name.log"
    exit 1
  fi
  # the zero-bubble lines (plan, split check, memory, re-plan) stay in the log: the summary below has their figures
  lines=$(grep -c '^zero-bubble: ' "$OUT/$name.log" || true)
  echo "$name: trained in $((SECONDS - start)) s ($lines zero-bubble lines in $OUT/$name.log)"
done

echo
status=0
# The whole table goes to a file; on screen, the verdicts without the time per iteration (4 processes on 2 cores take
# turns, so those times say nothing about the schedules: the PP=2 part below measures that)
"$PY" scripts/compare_loss_curves.py "$OUT"/{1f1b,zb-h1,zb-auto,zb-v}.log --labels 1f1b,zb-h1,zb-auto,zb-v \
  -o "$OUT/loss-curves.png" >"$OUT/loss-curves.txt" 2>&1 || status=$?
grep -E '^(OK|FAIL|(1f1b|zb-h1|zb-auto|zb-v): )' "$OUT/loss-curves.txt" |
  sed -E 's/[;,] median [0-9.]+ ms\/iteration.*$//' || cat "$OUT/loss-curves.txt"
echo "(the lm loss of every iteration, side by side: $OUT/loss-curves.txt)"

echo
echo "== Planned bubble rate, simulated on the pass times each run measured =="
"$PY" - "$OUT" <<'PYTHON'
import glob, os, re, sys
from megatron.zero_bubble.schedules import Costs, Schedule, validate
from megatron.zero_bubble.schedules.draw import draw
from megatron.zero_bubble.schedules.planners import PlanRequest, plan

out = sys.argv[1]

def replanned_at(path):
    match = re.search(r"-iter(\d+)\.json$", path)
    return int(match.group(1)) if match else -1  # -1: the initial plan


def latest_dump(name):
    """The schedule a run ended with: its last re-planned dump (NAME-mM-iterN.json), else the initial one."""
    dumps = [p for p in glob.glob(os.path.join(out, "schedules", f"{name}-m*-*.json")) if not p.endswith(".trace.json")]
    return Schedule.from_json(open(max(dumps, key=replanned_at)).read()) if dumps else None


planned = {}
for name in ("zb-h1", "zb-auto", "zb-v"):
    schedule = latest_dump(name)
    planned[name] = schedule.info["predicted"]["bubble_rate"] if schedule else None
# Megatron's own 1F1B dumps nothing: plan it on the costs the zb-h1 run measured (same layout), and draw it.
h1 = latest_dump("zb-h1")
if h1 is not None:
    costs = Costs.from_dict(h1.info["costs"])
    timeline = validate(plan("1f1b", PlanRequest(h1.stages, h1.microbatches, costs=costs)), costs)
    planned["1f1b"] = timeline.bubble_rate
    draw(timeline, os.path.join(out, "schedules", f"1f1b-m{h1.microbatches}.png"), time_unit="s")
for name in ("1f1b", "zb-h1", "zb-auto", "zb-v"):
    rate = f"{planned[name]:.1%}" if planned.get(name) is not None else "-"
    print(f"{name:<9} {rate:>8}")
PYTHON
echo "(4 processes on $(nproc) cores take turns, so their wall times say nothing about the bubble: the next part"
echo " measures at PP=2, one core per rank.)"

echo
echo "== Measured: megatron's 1F1B against ZB-H1, zb-auto and ZB-V at PP=2, one core per rank =="
"$PY" scripts/demo_speed.py --reps "${SPEED_REPS:-5}" --out "$OUT"

echo
echo "== Planning only: the paper's 1.5B model (p=8, m=24, profiled T_F/T_B/T_W in ms) =="
"$PY" -m megatron.zero_bubble.cli compare --schedules 1f1b,zb-h1,zb-h2,zb-auto,zb-v --stages 8 \
  --microbatches 24 --t-f 18.5 --t-b 18.1 --t-w 9.3 --t-comm 0.7 --memory-limit 16 --ilp-time-limit 5 \
  -o "$OUT/paper-1.5b.png"

echo
echo "pictures: $SCHEDULES/ (each schedule as planned at start and after re-planning, 1F1B on measured costs),"
echo "          $OUT/loss-curves.png (loss curves and their difference to 1F1B), $OUT/paper-1.5b.png"
echo "logs:     $OUT/{1f1b,zb-h1,zb-auto,zb-v}.log"
exit $status
