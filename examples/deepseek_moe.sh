#!/bin/bash
# A DeepSeekMoE 16B-shaped model (fine-grained and shared experts, a dense first layer) with ZB-2p: zb-auto at twice
# 1F1B's activation memory (pipeline 4 x expert 2 on one node of 8 GPUs, bf16).
#
#   bash examples/deepseek_moe.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [TOKENIZER_MODEL [DATA_PATH]]]]
#   TINY=1 bash examples/deepseek_moe.sh         # the same flags at CPU size: PP 2 x EP 2 on 4 processes, gloo
#   DRY_RUN=1 bash examples/deepseek_moe.sh      # print the torchrun command only
#   MLA=1 bash examples/deepseek_moe.sh          # DeepSeek-V2-Lite's multi-latent attention instead of multi-head
#
# A path left out (or MOCK) means: no checkpoints, no tensorboard, NullTokenizer with DeepSeek's 102400 tokens, mock
# data. TOKENIZER_MODEL is a Hugging Face tokenizer (a directory, or deepseek-ai/deepseek-moe-16b-base); DATA_PATH
# the prefix of data preprocessed with it. Knobs (environment): TP, PP, EP, MLA, MICRO_BATCH, GLOBAL_BATCH,
# TRAIN_ITERS, NPROC_PER_NODE, NNODES, and those of examples/common.sh.
#
# The model: 28 layers of hidden 2048; every layer but the first routes each token to 6 of 64 small experts (FFN
# 1408) beside 2 always-active shared experts (one shared MLP of 2816); the first layer is a dense FFN of 10944.
# MLA=1: multi-latent attention as in DeepSeek-V2-Lite. It needs Transformer Engine's layers: megatron-core 0.19.2's
# local layers cannot build it, so pretrain_gpt.py refuses it with --transformer-impl local. It has not run on a GPU.
#
# Why ZB-2p: here memory is to spare. The experts dominate the weights (a rank holds 32 of each layer's 64, about
# 1.8B parameters: some 32 GB with gradients and Adam state), while a microbatch of a stage's 7 layers at sequence
# 4096 takes about 2 GB of activations; 2p = 8 microbatches in flight fit next to them, and with 2p the planner
# leaves almost no bubble (README, "Which schedule should I use"). The stages are uneven (the dense first layer and
# the embedding on the first, the LM head over 102400 tokens, about 2.5 layers' work, on the last, and routing that
# makes experts busier or idler), so the plan is remade from pass times measured in iterations 101-110.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
check_positional 4 "$@"

CHECKPOINT_PATH=${1:-}
TENSORBOARD_LOGS_PATH=${2:-}
TOKENIZER_MODEL=${3:-MOCK}
DATA_PATH=${4:-MOCK}
MLA=${MLA:-0}

if tiny; then  # the same model at CPU size: PP 2 x EP 2 on 4 processes, re-planned after iteration 4
  PP=${PP:-2} EP=${EP:-2}
  NUM_LAYERS=$((2 * PP)) HIDDEN=64 HEADS=4 HEAD_DIM=16 FFN=256 SEQ_LENGTH=64 VOCAB=128
  EXPERTS=16 TOPK=4 EXPERT_FFN=32 SHARED_FFN=64
  TRAIN_ITERS=${TRAIN_ITERS:-6} ILP_SECONDS=1 WARMUP=1 EVAL_INTERVAL=$TRAIN_ITERS EVAL_ITERS=1 TIMERS=(2 4)
  NPROC_PER_NODE=${NPROC_PER_NODE:-4} GLOBAL_BATCH=${GLOBAL_BATCH:-16}
else
  PP=${PP:-4} EP=${EP:-2}
  NUM_LAYERS=28 HIDDEN=2048 HEADS=16 HEAD_DIM=128 FFN=10944 SEQ_LENGTH=4096 VOCAB=102400
  EXPERTS=64 TOPK=6 EXPERT_FFN=1408 SHARED_FFN=2816
  TRAIN_ITERS=${TRAIN_ITERS:-500000} ILP_SECONDS=10 WARMUP=2000 EVAL_INTERVAL=1000 EVAL_ITERS=10 TIMERS=(100 110)
  NPROC_PER_NODE=${NPROC_PER_NODE:-8} GLOBAL_BATCH=${GLOBAL_BATCH:-256}
fi
TP=${TP:-1}
MICRO_BATCH=${MICRO_BATCH:-1}
WORLD=$((${NNODES:-1} * NPROC_PER_NODE))
[ $((WORLD % (TP * PP))) -eq 0 ] || die "TP $TP x PP $PP does not divide $WORLD processes (NNODES x NPROC_PER_NODE)"
[ $((WORLD / (TP * PP) % EP)) -eq 0 ] ||
  die "EP $EP does not divide the $((WORLD / (TP * PP))) data-parallel ranks of $WORLD processes (NNODES x NPROC_PER_NODE)"

GPT_MODEL_ARGS=(
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN"
  --num-attention-heads "$HEADS" --kv-channels "$HEAD_DIM"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --position-embedding-type rope --rotary-base 10000
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
  --untie-embeddings-and-output-weights --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.006
)

MOE_ARGS=(
  --num-experts "$EXPERTS" --moe-ffn-hidden-size "$EXPERT_FFN" --moe-router-topk "$TOPK"
  --moe-shared-expert-intermediate-size "$SHARED_FFN"
  --moe-layer-freq "[0]+[1]*$((NUM_LAYERS - 1))"  # layer 1 dense, the others MoE
  --moe-router-pre-softmax  # gates: a softmax over all experts, then the top k (not renormalised)
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --moe-token-dispatcher-type alltoall
  --moe-grouped-gemm  # Transformer Engine's grouped GEMM: a rank's experts in one kernel
)
if [ "$MLA" = 1 ]; then  # DeepSeek-V2-Lite's attention: keys and values through a rank-512 latent
  MOE_ARGS+=(--multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128)
fi

TRAINING_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
  --lr 4.2e-4 --min-lr 4.2e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --bf16
)

MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP"
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --pipeline-schedule zb-auto --zero-bubble-max-pending-backward "$((2 * PP))"
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

echo "deepseek_moe: DeepSeekMoE 16B-shaped ($NUM_LAYERS layers, $EXPERTS experts top-$TOPK + shared," \
  "$([ "$MLA" = 1 ] && echo multi-latent || echo multi-head) attention)$(tiny && echo ' at CPU size');" \
  "TP $TP x PP $PP x DP $((WORLD / (TP * PP))) (EP $EP) on $WORLD processes; schedule zb-auto, limit 2p"
launch "$NPROC_PER_NODE" "${GPT_MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${DEVICE_ARGS[@]}"
