#!/bin/bash
# GPT-3 175B pre-training with zb-auto over two model chunks per rank (tensor 8 x pipeline 16: 16 nodes of 8 GPUs, fp16).
#
#   bash examples/gpt3_175b.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [VOCAB_FILE MERGE_FILE [DATA_PATH]]]]
#   TINY=1 bash examples/gpt3_175b.sh            # the same flags at CPU size: TP 2 x PP 2 on 4 processes, gloo
#   DRY_RUN=1 bash examples/gpt3_175b.sh         # print the torchrun command only
#
# A path left out (or MOCK) means: no checkpoints, no tensorboard, NullTokenizer with GPT-2's 50257 tokens, mock
# data. VOCAB_FILE and MERGE_FILE are GPT-2's BPE files (gpt2-vocab.json, gpt2-merges.txt), DATA_PATH the prefix of
# data preprocessed with them. Without SLURM, run it on every node with NODE_RANK and MASTER_ADDR set; with SLURM:
# EXAMPLE=gpt3_175b sbatch --nodes=16 scripts/slurm/pretrain_gpt.sbatch. Knobs (environment): TP, PP, VPP,
# MICRO_BATCH, GLOBAL_BATCH, TRAIN_ITERS, NPROC_PER_NODE, NNODES, and those of examples/common.sh.
#
# Why zb-auto over two chunks per rank: a model this deep is usually pipelined with megatron's interleaved 1F1B (here
# each rank would hold 2 chunks of 3 layers). zb-auto plans that same placement with every backward split into B and W, under interleaved 1F1B's own
# peak activation memory as its default limit (p + (p-1)/2 microbatches' worth of a rank's layers: 23.5 at p = 16,
# against 1F1B's 16): no more memory than megatron's schedule, a fraction of its bubble (README, "Interleaved
# layouts"). The limit is --zero-bubble-max-pending-backward (default auto: at most what the free GPU memory holds).
# The batch's 1536 sequences are m = 1536 / DP microbatches per pipeline: the bubble matters most where m is small
# against p, i.e. on more nodes. The plan is made at start-up from the model's shape, and again from measured pass
# times after iteration 110.
#
# fp16 with dynamic loss scaling as megatron's example has it, except that the scale starts at 2^16: from megatron's
# default, 2^32, the first dozen or so steps overflow and are skipped while the scale comes down.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
check_positional 5 "$@"

CHECKPOINT_PATH=${1:-}
TENSORBOARD_LOGS_PATH=${2:-}
VOCAB_FILE=${3:-MOCK}
MERGE_FILE=${4:-MOCK}
DATA_PATH=${5:-MOCK}

if tiny; then  # the same model at CPU size: TP 2 x PP 2, two chunks per rank
  TP=${TP:-2} PP=${PP:-2} VPP=${VPP:-2}
  NUM_LAYERS=$((2 * PP * VPP)) HIDDEN=64 HEADS=4 SEQ_LENGTH=64
  TRAIN_ITERS=${TRAIN_ITERS:-6} ILP_SECONDS=1 WARMUP=1 DECAY_ITERS=$TRAIN_ITERS EVAL_INTERVAL=$TRAIN_ITERS EVAL_ITERS=1
  NPROC_PER_NODE=${NPROC_PER_NODE:-4} GLOBAL_BATCH=${GLOBAL_BATCH:-16}
else
  TP=${TP:-8} PP=${PP:-16} VPP=${VPP:-2}
  NUM_LAYERS=96 HIDDEN=12288 HEADS=96 SEQ_LENGTH=2048
  # GPT-3: 300B tokens at 1536 x 2048 tokens a step; warm-up over 375M tokens; cosine to 10% over 260B tokens
  TRAIN_ITERS=${TRAIN_ITERS:-95367} ILP_SECONDS=10 WARMUP=120 DECAY_ITERS=82657 EVAL_INTERVAL=1000 EVAL_ITERS=10
  NPROC_PER_NODE=${NPROC_PER_NODE:-8} GLOBAL_BATCH=${GLOBAL_BATCH:-1536}
  NNODES=${NNODES:-16}
fi
MICRO_BATCH=${MICRO_BATCH:-1}
WORLD=$((${NNODES:-1} * NPROC_PER_NODE))
[ $((WORLD % (TP * PP))) -eq 0 ] || die "TP $TP x PP $PP does not divide $WORLD processes (NNODES x NPROC_PER_NODE)"

GPT_MODEL_ARGS=(  # GPT-3's architecture is megatron's default GPT: learned positions, LayerNorm, GeLU, tied embeddings
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --init-method-std 0.006
)

TRAINING_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
  --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --lr-decay-iters "$DECAY_ITERS"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --fp16 --initial-loss-scale 65536
)

MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --num-virtual-stages-per-pipeline-rank "$VPP" --pipeline-schedule zb-auto
  --zero-bubble-ilp-time-limit "$ILP_SECONDS"  # seconds for the ILP that refines each plan
)
[ "$TP" -gt 1 ] && MODEL_PARALLEL_ARGS+=(--sequence-parallel)

DATA_ARGS=()
if is_mock "$VOCAB_FILE" && is_mock "$MERGE_FILE"; then
  DATA_ARGS+=(--tokenizer-type NullTokenizer --vocab-size "$(tiny && echo 128 || echo 50257)")
elif is_mock "$VOCAB_FILE" || is_mock "$MERGE_FILE"; then
  die "give both VOCAB_FILE and MERGE_FILE (GPT-2's BPE), or neither"
else
  DATA_ARGS+=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
fi
data_args DATA_ARGS "$DATA_PATH"

EVAL_AND_LOGGING_ARGS=(--log-interval 1 --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS")
output_args EVAL_AND_LOGGING_ARGS "$CHECKPOINT_PATH" "$TENSORBOARD_LOGS_PATH" "$EVAL_INTERVAL"

DEVICE_ARGS=()
tiny && DEVICE_ARGS=("${CPU_ARGS[@]}")

echo "gpt3_175b: GPT-3 175B ($NUM_LAYERS layers, hidden $HIDDEN, sequence $SEQ_LENGTH)$(tiny && echo ' at CPU size');" \
  "TP $TP x PP $PP x DP $((WORLD / (TP * PP))) on $WORLD processes; schedule zb-auto over $VPP chunks per rank"
launch "$NPROC_PER_NODE" "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${DEVICE_ARGS[@]}"
