#!/bin/bash
# Llama-3 8B pre-training with the ZB-V schedule (pipeline 4 x data 2 on one node of 8 GPUs, bf16).
#
#   bash examples/llama3_8b.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [TOKENIZER_MODEL [DATA_PATH]]]]
#   TINY=1 bash examples/llama3_8b.sh            # the same flags at CPU size: 4 processes, gloo, about a minute
#   DRY_RUN=1 bash examples/llama3_8b.sh         # print the torchrun command only
#
# A path left out (or MOCK) means: no checkpoints, no tensorboard, NullTokenizer, mock data. TOKENIZER_MODEL is a
# Hugging Face tokenizer (a local directory, or a name such as meta-llama/Meta-Llama-3-8B); DATA_PATH the prefix of
# data preprocessed with it (..._text_document). Knobs (environment): TP, PP, MICRO_BATCH, GLOBAL_BATCH,
# TRAIN_ITERS, NPROC_PER_NODE, NNODES, and those of examples/common.sh (EXTRA_ARGS, DRY_RUN, ARGS_FILE, ...).
#
# Why ZB-V: at sequence length 8192 activations, not weights, fill the GPU (about 1 GiB per layer and microbatch
# in bf16 without recomputation, so a stage of 8 layers holds some 9 GiB per microbatch in flight). A schedule that
# keeps more microbatches in flight than 1F1B (ZB-2p: 2p of them) does not fit; ZB-V keeps 1F1B's peak (p
# microbatches' worth per rank) and still has the lowest bubble of the schedules at that memory. It cuts the 32
# layers into 2p = 8 chunks of 4 and places them as a V (rank 0 holds the first and the last chunk, so the embedding
# and the LM head sit on the same rank); the runtime re-plans the V from the pass times it measures.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
check_positional 4 "$@"

CHECKPOINT_PATH=${1:-}
TENSORBOARD_LOGS_PATH=${2:-}
TOKENIZER_MODEL=${3:-MOCK}
DATA_PATH=${4:-MOCK}

if tiny; then  # the same model at CPU size: PP 2 x DP 2 on 4 processes, a few iterations
  PP=${PP:-2}
  NUM_LAYERS=$((2 * PP)) HIDDEN=64 FFN=224 HEADS=4 QUERY_GROUPS=2 HEAD_DIM=16 SEQ_LENGTH=64 VOCAB=128
  TRAIN_ITERS=${TRAIN_ITERS:-6} WARMUP=1 EVAL_INTERVAL=$TRAIN_ITERS EVAL_ITERS=1
  NPROC_PER_NODE=${NPROC_PER_NODE:-4} GLOBAL_BATCH=${GLOBAL_BATCH:-16}
else
  PP=${PP:-4}
  NUM_LAYERS=32 HIDDEN=4096 FFN=14336 HEADS=32 QUERY_GROUPS=8 HEAD_DIM=128 SEQ_LENGTH=8192 VOCAB=128256
  TRAIN_ITERS=${TRAIN_ITERS:-250000} WARMUP=2000 EVAL_INTERVAL=1000 EVAL_ITERS=10
  NPROC_PER_NODE=${NPROC_PER_NODE:-8} GLOBAL_BATCH=${GLOBAL_BATCH:-128}
fi
TP=${TP:-1}
MICRO_BATCH=${MICRO_BATCH:-1}
WORLD=$((${NNODES:-1} * NPROC_PER_NODE))
[ $((WORLD % (TP * PP))) -eq 0 ] || die "TP $TP x PP $PP does not divide $WORLD processes (NNODES x NPROC_PER_NODE)"

GPT_MODEL_ARGS=(
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN"
  --num-attention-heads "$HEADS" --group-query-attention --num-query-groups "$QUERY_GROUPS" --kv-channels "$HEAD_DIM"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --untie-embeddings-and-output-weights --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)

TRAINING_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --bf16
)

MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --pipeline-schedule zb-v
  # the data-parallel replicas shard the optimizer state; their gradient reduction overlaps the W passes
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
[ "$TP" -gt 1 ] && MODEL_PARALLEL_ARGS+=(--sequence-parallel)

DATA_ARGS=()
tokenizer_args DATA_ARGS "$TOKENIZER_MODEL" "$VOCAB"
data_args DATA_ARGS "$DATA_PATH"

EVAL_AND_LOGGING_ARGS=(--log-interval 1 --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS")
output_args EVAL_AND_LOGGING_ARGS "$CHECKPOINT_PATH" "$TENSORBOARD_LOGS_PATH" "$EVAL_INTERVAL"

DEVICE_ARGS=()
tiny && DEVICE_ARGS=("${CPU_ARGS[@]}")

echo "llama3_8b: Llama-3 8B ($NUM_LAYERS layers, hidden $HIDDEN, sequence $SEQ_LENGTH)$(tiny && echo ' at CPU size');" \
  "TP $TP x PP $PP x DP $((WORLD / (TP * PP))) on $WORLD processes; schedule zb-v"
launch "$NPROC_PER_NODE" "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${DEVICE_ARGS[@]}"
