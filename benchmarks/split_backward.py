"""T_B + T_W of the split backward against megatron's fused backward, on megatron's own linear layers.

    python benchmarks/split_backward.py [--hidden 1024,4096] [--micro-batch 1,2,4] [--dtype fp32,bf16] [--reps 5]

One process, TP=1 (a one-rank gloo group), sequence 1024: ColumnParallelLinear h -> 4h (fc1) and
RowParallelLinear 4h -> h (fc2), as in a GPT MLP. Each round times megatron's fused backward (our patch
installed, no store active: megatron's own code path) and then B and W of the split (store active), on the
same input and output gradient; the rounds repeat `--reps` times after one warm-up round, so fused and
split alternate. Printed per case: min / median / max of T_BW and of T_B + T_W, and the ratio of the
medians; "noisy" where a spread (max - min) / median exceeds 10%. Goal: ratio <= 1.03.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.zero_bubble.patches import imports  # noqa: E402

imports.install()

from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.tensor_parallel import layers  # noqa: E402

from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter  # noqa: E402
from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore  # noqa: E402

SEQ = 1024
GOAL = 1.03
NOISY = 0.10
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_layer(kind: str, hidden: int, dtype: torch.dtype, group):
    config = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype)
    if kind == "column":
        layer = layers.ColumnParallelLinear(hidden, 4 * hidden, config=config, init_method=torch.nn.init.zeros_,
                                            bias=True, tp_group=group)
    else:
        layer = layers.RowParallelLinear(4 * hidden, hidden, config=config, init_method=torch.nn.init.zeros_,
                                         bias=True, input_is_parallel=True, skip_bias_add=False, tp_group=group)
    with torch.no_grad():
        layer.weight.normal_(std=0.02)
        layer.bias.zero_()
    layer.gradient_accumulation_fusion = False
    return layer


def measure(kind: str, hidden: int, micro_batch: int, dtype: torch.dtype, reps: int, group, seq: int = SEQ) -> dict:
    """Per round (after a warm-up one): seconds of the fused backward, of B and of W. Lists of `reps`."""
    layer = make_layer(kind, hidden, dtype, group)
    size_in, size_out = (hidden, 4 * hidden) if kind == "column" else (4 * hidden, hidden)
    x = torch.randn(seq, micro_batch, size_in, dtype=dtype)
    grad_y = torch.randn(seq, micro_batch, size_out, dtype=dtype)
    store = WeightGradStore("bench")
    store.attach(layer, MegatronAdapter())
    fused, split_b, split_w = [], [], []
    try:
        for _ in range(reps + 1):
            y, _ = layer(x.clone().requires_grad_(True))
            start = time.perf_counter()
            y.backward(grad_y)
            fused.append(time.perf_counter() - start)
            layer.weight.grad = layer.bias.grad = None
            y, _ = layer(x.clone().requires_grad_(True))
            start = time.perf_counter()
            with store.split_backward():
                y.backward(grad_y)
            store.close_microbatch(0)
            split_b.append(time.perf_counter() - start)
            start = time.perf_counter()
            store.run_next(0)
            split_w.append(time.perf_counter() - start)
            layer.weight.grad = layer.bias.grad = None
    finally:
        store.detach()
    return {"fused": fused[1:], "b": split_b[1:], "w": split_w[1:]}


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", default="1024,4096", help="hidden sizes (default %(default)s)")
    parser.add_argument("--micro-batch", default="1,2,4", help="micro batch sizes (default %(default)s)")
    parser.add_argument("--dtype", default="fp32,bf16", help="fp32 and/or bf16 (default %(default)s)")
    parser.add_argument("--layer", default="column,row", help="column and/or row (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5, help="rounds after the warm-up (default %(default)s)")
    parser.add_argument("--max-tokens-x-hidden", type=float, default=4096 * 1024,
                        help="skip cases with seq x micro batch x hidden above this (CPU time; default 4096x1024)")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")
    print(f"T_B + T_W vs megatron's fused T_BW, seq {SEQ}, TP=1, {torch.get_num_threads()} threads, ms; "
          f"{args.reps} rounds, fused and split alternated")
    print(f"{'layer':<8}{'h':>6}{'mb':>4}{'dtype':>6}{'T_BW min/med/max':>24}{'T_B+T_W min/med/max':>26}"
          f"{'T_B med':>9}{'T_W med':>9}{'ratio':>8}")
    worst = 0.0
    for kind in args.layer.split(","):
        for dtype_name in args.dtype.split(","):
            for hidden in (int(h) for h in args.hidden.split(",")):
                for mb in (int(b) for b in args.micro_batch.split(",")):
                    if SEQ * mb * hidden > args.max_tokens_x_hidden:
                        continue
                    r = measure(kind, hidden, mb, DTYPES[dtype_name], args.reps, group)
                    split = [b + w for b, w in zip(r["b"], r["w"])]
                    ratio = statistics.median(split) / statistics.median(r["fused"])
                    worst = max(worst, ratio)
                    noisy = " noisy" if max(spread(r["fused"]), spread(split)) > NOISY else ""
                    ms = lambda v: f"{min(v) * 1e3:.1f}/{statistics.median(v) * 1e3:.1f}/{max(v) * 1e3:.1f}"  # noqa: E731
                    print(f"{kind:<8}{hidden:>6}{mb:>4}{dtype_name:>6}{ms(r['fused']):>24}{ms(split):>26}"
                          f"{statistics.median(r['b']) * 1e3:>9.1f}{statistics.median(r['w']) * 1e3:>9.1f}"
                          f"{ratio:>8.3f}{noisy}", flush=True)
    print(f"worst ratio {worst:.3f} (goal <= {GOAL})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
