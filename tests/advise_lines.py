"""pretrain_gpt.py command lines shaped like Megatron-LM's examples/, for `zb-schedule advise` (docs/advise.md).

FULL: the examples at full size (examples/llama/train_llama3_8b_h100_fp8.sh,
examples/gpt3/train_gpt3_175b_distributed.sh, examples/mixtral/train_mixtral_8x7b_distributed.sh), and a
DeepSeek-like MoE (DeepSeek-V2-Lite's experts: 64 of them, 6 routed per token, shared experts, a dense first layer;
grouped-query attention instead of multi-latent attention, which advise does not model) with expert parallelism.
Each with the advise options that give its world size (and the vocabulary of a tokenizer advise does not load).

TINY: the same shapes small enough to train on two CPU cores (benchmarks/advise_memory.py measures them),
with the number of processes. Rotary embeddings do not run on the CPU here: the tiny lines use learned absolute
positions (--position-embedding-type learned_absolute) where the examples use rope.
"""
from __future__ import annotations

FULL = {
    "llama3-8b": ("--world-size 8", """
        --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
        --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
        --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
        --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
        --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1
        --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748 --lr-warmup-samples 3906252
        --lr 0.00015 --min-lr 0.00001 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9
        --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss
        --manual-gc --empty-unused-memory-level 1 --fp8-format hybrid --fp8-amax-history-len 1024
        --fp8-amax-compute-algo max --fp8-param-gather --tensor-model-parallel-size 1 --context-parallel-size 1
        --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --mock-data
        --tokenizer-type NullTokenizer --vocab-size 128256 --no-create-attention-mask-in-dataloader"""),
    "gpt3-175b": ("--nodes 128 --gpus-per-node 8", """
        --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
        --attention-backend auto --micro-batch-size 1 --global-batch-size 1536 --train-iters 500000 --weight-decay 0.1
        --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5
        --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --data-path my-gpt3_00_text_document
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --tokenizer-type GPT2BPETokenizer
        --split 949,50,1"""),
    "mixtral-8x7b": ("--nodes 8 --tokenizer-vocab 32000", """
        --use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
        --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
        --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
        --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
        --no-position-embedding --rotary-base 1000000 --num-experts 8 --moe-router-topk 2
        --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm
        --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
        --tokenizer-type Llama2Tokenizer
        --tokenizer-model tokenizer.model --data-path my-mixtral_text_document --split 99990,8,2 --micro-batch-size 1
        --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine
        --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16 --tensor-model-parallel-size 1
        --pipeline-model-parallel-size 4 --expert-model-parallel-size 8 --use-distributed-optimizer
        --sequence-parallel"""),
    "deepseek-moe": ("--nodes 8 --tokenizer-vocab 102400", """
        --num-layers 28 --hidden-size 2048 --ffn-hidden-size 10944 --num-attention-heads 16 --kv-channels 128
        --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope --swiglu --normalization RMSNorm
        --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
        --num-experts 64 --moe-layer-freq ([0]+[1]*27) --moe-ffn-hidden-size 1408 --moe-router-topk 6
        --moe-shared-expert-intermediate-size 2816 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
        --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 --moe-grouped-gemm
        --moe-token-dispatcher-type alltoall --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
        --expert-model-parallel-size 8 --use-distributed-optimizer --bf16 --micro-batch-size 1 --global-batch-size 1024
        --recompute-granularity selective --recompute-modules moe_act --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model deepseek-ai/DeepSeek-V2-Lite --data-path my-deepseek_text_document --split 99,1,0"""),
}

# megatron's local layers: what the advisor's figures were measured on (its reading of Transformer Engine's layers is
# not yet within the goal against TE's own Python on the CPU: docs/advise.md)
_TINY_COMMON = """--zero-bubble-cpu --transformer-impl local --tokenizer-type NullTokenizer --mock-data --num-workers 0 --seq-length 256
    --max-position-embeddings 256 --vocab-size 4096 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 --eval-iters 0 --eval-interval 1000
    --log-interval 1"""
_DENSE_WINDOW = "--train-iters 4 --zero-bubble-pipeline-timers-start-iter 1 --zero-bubble-pipeline-timers-end-iter 3"
# MoE runs on the CPU hold more of the allocator in their first iterations than their tensors need (variable expert
# shapes); measured after a dozen iterations
_MOE_WINDOW = "--train-iters 17 --zero-bubble-pipeline-timers-start-iter 14 --zero-bubble-pipeline-timers-end-iter 16"

TINY = {
    "llama3-8b": (2, "zb-v", """
        --num-layers 4 --hidden-size 256 --ffn-hidden-size 896 --num-attention-heads 8 --group-query-attention
        --num-query-groups 2 --kv-channels 32 --position-embedding-type learned_absolute --swiglu
        --normalization RMSNorm
        --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0 --hidden-dropout 0 --bf16
        --grad-reduce-in-bf16 --use-distributed-optimizer --micro-batch-size 2 --global-batch-size 16
        --no-create-attention-mask-in-dataloader --pipeline-model-parallel-size 2 --pipeline-schedule zb-v"""
        + " " + _DENSE_WINDOW),
    "gpt3-175b": (4, "1f1b", """
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --fp16 --initial-loss-scale 1024
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 16
        --enable-zb-runtime""" + " " + _DENSE_WINDOW),
    "mixtral-8x7b": (2, "zb-h1", """
        --num-layers 4 --hidden-size 256 --ffn-hidden-size 896 --num-attention-heads 8 --group-query-attention
        --num-query-groups 2 --position-embedding-type learned_absolute --swiglu --normalization RMSNorm
        --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0 --hidden-dropout 0 --bf16
        --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
        --moe-token-dispatcher-type alltoall --use-distributed-optimizer --micro-batch-size 2 --global-batch-size 16
        --pipeline-model-parallel-size 2 --pipeline-schedule zb-h1""" + " " + _MOE_WINDOW),
    "deepseek-moe": (4, "zb-h2", """
        --num-layers 4 --hidden-size 256 --ffn-hidden-size 768 --num-attention-heads 8 --kv-channels 32
        --position-embedding-type learned_absolute --swiglu --normalization RMSNorm
        --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0 --hidden-dropout 0 --bf16
        --num-experts 8 --moe-router-topk 2
        --moe-ffn-hidden-size 192 --moe-shared-expert-intermediate-size 384 --moe-layer-freq ([0]+[1]*3)
        --moe-router-score-function sigmoid --moe-router-enable-expert-bias
        --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall
        --expert-model-parallel-size 2
        --use-distributed-optimizer --micro-batch-size 2 --global-batch-size 16 --pipeline-model-parallel-size 2
        --pipeline-schedule zb-h2""" + " " + _MOE_WINDOW),
}


def full_line(name: str) -> tuple[list[str], list[str]]:
    """(advise's options, pretrain_gpt.py's arguments) of a full-size line."""
    options, words = FULL[name]
    return options.split(), words.split()


def tiny_line(name: str) -> tuple[int, str, list[str]]:
    """(processes, the schedule it runs as advise labels it, pretrain_gpt.py's arguments) of a tiny line."""
    processes, schedule, words = TINY[name]
    return processes, schedule, (_TINY_COMMON + " " + words).split()
