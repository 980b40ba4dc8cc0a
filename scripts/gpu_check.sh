#!/usr/bin/env bash
# One command for a GPU node: the versions found, (a) the B/W split against megatron's fused backward on local and
# Transformer Engine layers, (b) megatron's 1F1B against zb-h1, zb-auto (one and two chunks per rank) and zb-v (the
# same loss at every iteration, PP = every GPU), (c) the split's overhead on the paper's layer shapes, (d) the
# executor's time per pass, (e) peak memory per rank against the planner's, (f) whether a kernel that cannot start
# holds back launches on other streams with CUDA_DEVICE_MAX_CONNECTIONS=1 and 32 (reported, not judged). Prints a
# table to paste into a bug report; exit status 0 only when (a) and (b) hold. Without CUDA it says so in one line and
# exits 2.  Options: --gpus N, --iterations N (20), --reps N (5), --schedules, --out DIR (logs), --cpu (every part on
# CPU at tiny sizes: tests the tool).  PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m megatron.zero_bubble.tools.gpu_check "$@"
