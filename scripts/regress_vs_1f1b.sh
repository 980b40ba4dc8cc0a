#!/usr/bin/env bash
# Loss-curve regression: megatron's own 1F1B against the zero-bubble schedules, same seed, exact by default.
#
#   bash scripts/regress_vs_1f1b.sh                        # PP=4, 4 processes, 20 iterations; CPU without a GPU
#   PP=2 TP=2 ITERS=30 bash scripts/regress_vs_1f1b.sh     # 4 processes: TP=2 x PP=2
#   COMPARE_ARGS="--rtol 1e-6" EXTRA_ARGS="--bf16" bash scripts/regress_vs_1f1b.sh   # on GPU, with a tolerance
#
# Two comparisons, each on lm loss and grad norm (scripts/compare_loss_curves.py):
# - zb-h1, zb-h2, zb-auto against megatron's 1F1B, everything at megatron's defaults (its initialisation,
#   dropout on): same layout and the same RNG use per rank, so the curves must be identical.
# - zb-v against 1F1B with --init-weights-by-global-name, no dropout and a clipping bound never reached: the V
#   layout places layers on other ranks, so megatron's per-rank initialisation and dropout streams differ,
#   and the gradient norm sums per-rank partial norms in another order (a last-bit difference that
#   clipping would spread into every weight). Initialising every weight by its global name
#   (pretrain_gpt.py), switching dropout off and never clipping make both runs compute the same thing.
# zb-auto runs with a short timer window, so it is re-planned from measured costs mid-run and must stay exact.
#
# Knobs (environment): PP (4), TP (1), NPROC (PP x TP; more gives data parallelism), ITERS (20),
# SCHEDULES ("zb-h1 zb-h2 zb-auto zb-v"), MODEL_ARGS (a tiny GPT, below), EXTRA_ARGS (to every run),
# ZB_ARGS (to zero-bubble runs only), ILP_ARGS (to zb-auto only), COMPARE_ARGS (tolerances, default exact), OUT_DIR (out/regress),
# DEVICE=cpu (hide GPUs: run on CPU with gloo even where CUDA exists), PYTHON.
# Exit status: 0 when every schedule matches its reference, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PP=${PP:-4}
TP=${TP:-1}
NPROC=${NPROC:-$((PP * TP))}
ITERS=${ITERS:-20}
SCHEDULES=${SCHEDULES:-zb-h1 zb-h2 zb-auto zb-v}
OUT=${OUT_DIR:-out/regress}
MODEL_ARGS=${MODEL_ARGS:---num-layers $((2 * PP)) --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 --vocab-size 128 \
--tokenizer-type NullTokenizer --mock-data --num-workers 0 --transformer-impl local --no-gradient-accumulation-fusion}
ZB_ARGS=${ZB_ARGS:---zero-bubble-pipeline-timers-start-iter 3 --zero-bubble-pipeline-timers-end-iter 6}
ILP_ARGS=${ILP_ARGS:---zero-bubble-ilp-time-limit 5}  # zb-auto only: the other schedules have no ILP and refuse it
V_REFERENCE_ARGS="--init-weights-by-global-name --hidden-dropout 0 --attention-dropout 0 --clip-grad 1e9"
device_args=""
if [ "${DEVICE:-}" = cpu ] || ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  device_args=--zero-bubble-cpu  # pretrain_gpt.py trains on the CPU only when asked to
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1  # megatron asks for it with tensor parallelism on GPU
mkdir -p "$OUT"
device=$([ -n "$device_args" ] && echo "CPU (gloo)" || echo GPU)
echo "== regression vs 1F1B: PP=$PP TP=$TP, $NPROC processes, $ITERS iterations, $device; logs in $OUT/ =="

trained=()
failures=()
summary=()

# train NAME ARGS...: one pretrain_gpt.py run, its output in $OUT/NAME.log; prints how long it took.
train() {
  local name=$1 start=$SECONDS
  shift
  # shellcheck disable=SC2086  # the *_ARGS knobs are word lists
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --pipeline-model-parallel-size "$PP" --tensor-model-parallel-size "$TP" $MODEL_ARGS \
    --train-iters "$ITERS" --lr 1e-3 --eval-iters 0 --eval-interval "$ITERS" --log-interval 1 --seed 1234 \
    $device_args "$@" ${EXTRA_ARGS:-} >"$OUT/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "$name: pretrain_gpt.py failed (exit $rc) after $((SECONDS - start)) s; see $OUT/$name.log:"
    # The cause: a start-up refusal or the first rank's exception, not torchrun's report that follows it.
    grep -m 1 -E 'pretrain_gpt.py: error:|^\[rank[0-9]+\]: [A-Za-z_.]*(Error|Exception)\b' "$OUT/$name.log" \
      | sed 's/^/    /' || grep -v '^\s*$' "$OUT/$name.log" | tail -n 8 | sed 's/^/    /'
    failures+=("$name (training failed)")
    return 1
  fi
  trained+=("$name")
  echo "$name: trained in $((SECONDS - start)) s"
}

# compare REFERENCE RUN...: lm loss and grad norm of the runs that trained, against REFERENCE.
compare() {
  local reference=$1 runs=() metric
  shift
  for run in "$@"; do [[ " ${trained[*]} " == *" $run "* ]] && runs+=("$run"); done
  [ ${#runs[@]} -gt 0 ] || return 0
  for metric in "lm loss" "grad norm"; do
    local logs=() labels picture="$OUT/${reference}-${metric// /-}.png"
    for run in "$reference" "${runs[@]}"; do logs+=("$OUT/$run.log"); done
    labels=$(IFS=,; echo "$reference,${runs[*]}")
    echo
    # shellcheck disable=SC2086
    "$PY" scripts/compare_loss_curves.py "${logs[@]}" --labels "$labels" --metric "$metric" -o "$picture" \
      ${COMPARE_ARGS:-} 2>&1 | tee "$OUT/compare.txt"
    local rc=${PIPESTATUS[0]}
    summary+=("$metric: $(tail -n 1 "$OUT/compare.txt")")
    [ "$rc" -eq 0 ] || failures+=("$metric of ${runs[*]} vs $reference (compare_loss_curves exit $rc)")
  done
  rm -f "$OUT/compare.txt"
}

same_layout=()
for schedule in $SCHEDULES; do [ "$schedule" != zb-v ] && same_layout+=("$schedule"); done
if [ ${#same_layout[@]} -gt 0 ] && train 1f1b; then
  for schedule in "${same_layout[@]}"; do
    # shellcheck disable=SC2086
    ilp=""
    [ "$schedule" = zb-auto ] && ilp=$ILP_ARGS
    train "$schedule" --pipeline-schedule "$schedule" $ZB_ARGS $ilp
  done
  compare 1f1b "${same_layout[@]}"
elif [ ${#same_layout[@]} -gt 0 ]; then
  echo "skipping ${same_layout[*]}: their reference did not train"
fi
if [[ " $SCHEDULES " == *" zb-v "* ]]; then
  # shellcheck disable=SC2086
  if train 1f1b-v-reference $V_REFERENCE_ARGS; then
    # shellcheck disable=SC2086
    train zb-v --pipeline-schedule zb-v $V_REFERENCE_ARGS $ZB_ARGS && compare 1f1b-v-reference zb-v
  else
    echo "skipping zb-v: its reference did not train"
  fi
fi

echo
echo "== summary: PP=$PP TP=$TP, $NPROC processes, $ITERS iterations, $device =="
for line in "${summary[@]}"; do echo "$line"; done
if [ ${#failures[@]} -gt 0 ]; then
  for failure in "${failures[@]}"; do echo "MISMATCH: $failure"; done
  exit 1
fi
echo "all schedules match megatron's 1F1B (${COMPARE_ARGS:-exact})"
