#!/bin/bash
# Mixtral 8x7B pre-training with zb-auto under an automatic memory limit (pipeline 4 x expert 8: 4 nodes of 8 GPUs,
# bf16).
#
#   bash examples/mixtral_8x7b.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [TOKENIZER_MODEL [DATA_PATH]]]]
#   TINY=1 bash examples/mixtral_8x7b.sh         # the same flags at CPU size: PP 2 x EP 2 on 4 processes, gloo
#   DRY_RUN=1 bash examples/mixtral_8x7b.sh      # print the torchrun command only
#
# A path left out (or MOCK) means: no checkpoints, no tensorboard, NullTokenizer with Mistral's 32000 tokens, mock
# data. TOKENIZER_MODEL is a Hugging Face tokenizer (a directory, or mistralai/Mixtral-8x7B-v0.1); DATA_PATH the
# prefix of data preprocessed with it. Without SLURM, run it on every node with NODE_RANK and MASTER_ADDR set; with
# SLURM: EXAMPLE=mixtral_8x7b sbatch --nodes=4 scripts/slurm/pretrain_gpt.sbatch. Knobs (environment): TP, PP, EP,
# MICRO_BATCH, GLOBAL_BATCH, TRAIN_ITERS, NPROC_PER_NODE, NNODES, and those of examples/common.sh.
#
# Why zb-auto with --zero-bubble-max-pending-backward auto: memory is tight but not as tight as 1F1B's. Each GPU holds
# 8 layers with one expert each (about 1.9B parameters: some 30 GB with gradients and the optimizer state, which the
# distributed optimizer can shard only for the dense part, as each expert lives on one rank of its expert group), and
# at sequence 4096 a stage's activations take several GB per microbatch (two experts per token). 1F1B's p = 4
# microbatches in flight fit; ZB-2p's 8 may not. With the limit `auto` the planner takes as many microbatches as the
# free GPU memory holds, between ZB-1p and ZB-2p, and it re-plans from pass times measured in iterations 101-110:
# MoE layers cost what their routing makes them cost (the all-to-all, uneven experts), which a plan from the model's
# shape cannot know. Expert gradients are split into B and W like any other linear layer's.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
check_positional 4 "$@"

CHECKPOINT_PATH=${1:-}
TENSORBOARD_LOGS_PATH=${2:-}
TOKENIZER_MODEL=${3:-MOCK}
DATA_PATH=${4:-MOCK}

if tiny; then  # the same model at CPU size: PP 2 x EP 2 on 4 processes, re-planned after iteration 4
  PP=${PP:-2} EP=${EP:-2}
  NUM_LAYERS=$((2 * PP)) HIDDEN=64 FFN=224 HEADS=4 QUERY_GROUPS=2 HEAD_DIM=16 SEQ_LENGTH=64 VOCAB=128
  TRAIN_ITERS=${TRAIN_ITERS:-6} ILP_SECONDS=1 WARMUP=1 EVAL_INTERVAL=$TRAIN_ITERS EVAL_ITERS=1 TIMERS=(2 4)
  NPROC_PER_NODE=${NPROC_PER_NODE:-4} GLOBAL_BATCH=${GLOBAL_BATCH:-16}
else
  PP=${PP:-4} EP=${EP:-8}
  NUM_LAYERS=32 HIDDEN=4096 FFN=14336 HEADS=32 QUERY_GROUPS=8 HEAD_DIM=128 SEQ_LENGTH=4096 VOCAB=32000
  TRAIN_ITERS=${TRAIN_ITERS:-500000} ILP_SECONDS=10 WARMUP=500 EVAL_INTERVAL=1000 EVAL_ITERS=10 TIMERS=(100 110)
  NPROC_PER_NODE=${NPROC_PER_NODE:-8} GLOBAL_BATCH=${GLOBAL_BATCH:-256}
  NNODES=${NNODES:-4}
fi
TP=${TP:-1}
MICRO_BATCH=${MICRO_BATCH:-1}
WORLD=$((${NNODES:-1} * NPROC_PER_NODE))
[ $((WORLD % (TP * PP))) -eq 0 ] || die "TP $TP x PP $PP does not divide $WORLD processes (NNODES x NPROC_PER_NODE)"
[ $((WORLD / (TP * PP) % EP)) -eq 0 ] ||
  die "EP $EP does not divide the $((WORLD / (TP * PP))) data-parallel ranks of $WORLD processes (NNODES x NPROC_PER_NODE)"

GPT_MODEL_ARGS=(
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN"
  --num-attention-heads "$HEADS" --group-query-attention --num-query-groups "$QUERY_GROUPS" --kv-channels "$HEAD_DIM"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --position-embedding-type rope --rotary-base 1000000
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --untie-embeddings-and-output-weights --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.01
)

MOE_ARGS=(  # 8 SwiGLU experts per layer (each of the dense FFN's size), top-2 routing, megatron's auxiliary loss
  --num-experts 8 --moe-router-topk 2
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --moe-token-dispatcher-type alltoall
  --moe-grouped-gemm  # Transformer Engine's grouped GEMM: a rank's experts in one kernel
)

TRAINING_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --bf16
)

MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP"
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --pipeline-schedule zb-auto --zero-bubble-max-pending-backward auto
  --zero-bubble-pipeline-timers-start-iter "${TIMERS[0]}" --zero-bubble-pipeline-timers-end-iter "${TIMERS[1]}"
  --zero-bubble-ilp-time-limit "$ILP_SECONDS"  # seconds for the ILP that refines each plan
)
[ "$TP" -gt 1 ] && MODEL_PARALLEL_ARGS+=(--sequence-parallel)

DATA_ARGS=()
tokenizer_args DATA_ARGS "$TOKENIZER_MODEL" "$VOCAB"
data_args DATA_ARGS "$DATA_PATH"

EVAL_AND_LOGGING_ARGS=(--log-interval 1 --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS")
output_args EVAL_AND_LOGGING_ARGS "$CHECKPOINT_PATH" "$TENSORBOARD_LOGS_PATH" "$EVAL_INTERVAL"

DEVICE_ARGS=()
tiny && DEVICE_ARGS=("${CPU_ARGS[@]}")

echo "mixtral_8x7b: Mixtral 8x7B ($NUM_LAYERS layers, 8 experts top-2, sequence $SEQ_LENGTH)$(tiny && echo ' at CPU size');" \
  "TP $TP x PP $PP x DP $((WORLD / (TP * PP))) (EP $EP) on $WORLD processes; schedule zb-auto, memory limit auto"
launch "$NPROC_PER_NODE" "${GPT_MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${DEVICE_ARGS[@]}"
