# shellcheck shell=bash disable=SC2178  # (SC2178: the namerefs below name arrays)
# What every example script shares; sourced by examples/*.sh, not run on its own.
#
#   tiny                      true when TINY=1: the same model shrunk to CPU sizes (gloo, the same layers)
#   is_mock VALUE             true for an empty value or MOCK (a positional argument left out)
#   tokenizer_args A TOK V    appends to array A: NullTokenizer of V tokens for MOCK, else the Hugging Face tokenizer TOK
#   data_args A DATA          appends mock data for MOCK, else megatron's indexed dataset with the prefix DATA
#   output_args A CKPT TB N   appends --save/--load every N iterations and --tensorboard-dir, for the paths given
#   launch NPROC ARG...       the command for pretrain_gpt.py with ARG... (then EXTRA_ARGS): written to ARGS_FILE,
#                             printed (DRY_RUN=1), or run with torchrun on NPROC processes per node
#
# Launch knobs (environment): NNODES (default 1), NODE_RANK (0), MASTER_ADDR (localhost), MASTER_PORT (29500),
# TORCHRUN (torchrun), EXTRA_ARGS (flags for pretrain_gpt.py, given last, so they win), DRY_RUN, ARGS_FILE.

EXAMPLES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$EXAMPLES_DIR/.." && pwd)

die() { echo "$(basename "$0"): $*" >&2; exit 1; }

tiny() { [ "${TINY:-0}" = 1 ]; }

is_mock() { [ -z "$1" ] || [ "$1" = MOCK ]; }

# The CPU mode's device flags: --zero-bubble-cpu hides the GPUs and trains with gloo, without apex's fused norm and
# softmax. The layers stay megatron's default, Transformer Engine's: on the CPU its own Python over this package's
# labelled CPU kernels (scripts/install.sh installs it; without it, megatron's local layers), with megatron's
# gradient-accumulation fusion as on a GPU.
# shellcheck disable=SC2034  # used by the scripts that source this file
CPU_ARGS=(--zero-bubble-cpu --distributed-backend gloo --no-persist-layer-norm --no-masked-softmax-fusion
          --num-workers 0)

tokenizer_args() {  # tokenizer_args ARRAY TOKENIZER_MODEL VOCAB_SIZE_FOR_MOCK: appends to the array named ARRAY
  local -n into=$1
  if is_mock "$2"; then into+=(--tokenizer-type NullTokenizer --vocab-size "$3")
  else into+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$2"); fi
}

data_args() {  # data_args ARRAY DATA_PATH
  local -n into=$1
  if is_mock "$2"; then into+=(--mock-data); else into+=(--data-path "$2" --split "99,1,0"); fi
}

output_args() {  # output_args ARRAY CHECKPOINT_PATH TENSORBOARD_LOGS_PATH SAVE_INTERVAL
  local -n into=$1
  is_mock "$2" || into+=(--save "$2" --load "$2" --save-interval "$4")
  is_mock "$3" || into+=(--tensorboard-dir "$3")
}

check_positional() {  # check_positional MAX "$@": megatron's examples take their paths as positional arguments
  local max=$1; shift
  [ $# -le "$max" ] || die "takes at most $max arguments (see its header); flags for pretrain_gpt.py go in EXTRA_ARGS"
}

launch() {  # launch NPROC_PER_NODE ARG...
  local nproc=$1; shift
  local args=("$@")
  # shellcheck disable=SC2206  # EXTRA_ARGS holds several flags on purpose
  args+=(${EXTRA_ARGS:-})
  if [ -n "${ARGS_FILE:-}" ]; then  # for scripts/slurm/pretrain_gpt.sbatch: one argument per line
    local arg
    for arg in "${args[@]}"; do
      [[ $arg != *$'\n'* ]] || die "an argument holds a line break, which ARGS_FILE cannot keep: $arg"
    done
    printf '%s\n' "${args[@]}" >"$ARGS_FILE"
    echo "arguments for pretrain_gpt.py written to $ARGS_FILE (${#args[@]} words)"
    return 0
  fi
  # shellcheck disable=SC2206  # TORCHRUN may be a command with arguments (python -m torch.distributed.run)
  local command=(${TORCHRUN:-torchrun}
    --nproc-per-node "$nproc" --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}"
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-29500}"
    "$REPO_DIR/pretrain_gpt.py" "${args[@]}")
  echo "torchrun command: $(printf '%q ' "${command[@]}")"
  [ "${DRY_RUN:-0}" = 1 ] && return 0
  # Megatron orders tensor-parallel communication and compute on one CUDA stream only when this is 1.
  export CUDA_DEVICE_MAX_CONNECTIONS=1
  # Tiny: several ranks share a laptop's cores; one thread each keeps them from fighting over them.
  tiny && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  exec "${command[@]}"
}
