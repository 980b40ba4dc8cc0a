"""One GPT transformer layer, megatron's fused backward against B then W: the time (T_B + T_W) / T_BW and the gradients.

    python benchmarks/split_layer.py [--device cpu|cuda] [--impl local,transformer_engine] [--shapes paper|tiny|H:A:MB]
                                     [--seq 1024] [--dtype bf16] [--reps 5] [--json FILE]

One process, TP = 1: megatron's TransformerLayer from its GPT layer spec (local layers, or Transformer Engine's),
gradients accumulated as megatron DDP accumulates them (into main_grad; TE's layers with gradient-accumulation
fusion). Each round runs the fused backward (the store attached, not active: megatron's own path) and then B and W
of the split, on the same input and output gradient; rounds alternate after one warm-up round. Printed per case:
min / median / max of T_BW and of T_B + T_W (ms), the ratio of the medians ("noisy" where a spread (max - min) /
median exceeds 10%), and whether every gradient of the split equals the fused one bit for bit (first round).
Shapes: the paper's GPT layers (1.5B: h 2304, 24 heads, micro batch 6; 6.2B: 4096, 32, 3; 14.6B: 5120, 40, 1; 28.3B:
6144, 48, 1; sequence 1024), `tiny` (h 64, 4 heads, micro batch 2, sequence 32: CPU tests) or H:A:MB.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PAPER = {"1.5b": (2304, 24, 6), "6.2b": (4096, 32, 3), "14.6b": (5120, 40, 1), "28.3b": (6144, 48, 1)}
NOISY = 0.10
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _set_up(device: str) -> None:
    from megatron.zero_bubble.patches import imports

    imports.install()
    if device == "cpu":
        from megatron.zero_bubble.patches import cpu_backend

        cpu_backend.install()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method="tcp://127.0.0.1:0", rank=0,
                               world_size=1)
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def build_layer(impl: str, hidden: int, heads: int, dtype: torch.dtype, device: str):
    """megatron's TransformerLayer of the GPT spec; parameters with main_grad as megatron DDP gives them."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    te = impl == "transformer_engine"
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        gradient_accumulation_fusion=te, persist_layer_norm=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, use_cpu_initialization=device == "cpu")
    spec = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec() if te
            else gpt_layer_specs.get_gpt_layer_local_spec())
    # In dtype as a whole, as megatron's Float16Module makes the model: torch's LayerNorm (the local spec's norm
    # without apex) creates fp32 weights, which CUDA's layer_norm refuses beside bf16 input (CPU's accepts them).
    layer = build_module(spec, config=config, layer_number=1).to(device=device, dtype=dtype)
    return with_megatron_ddp_main_grads(layer, device)


def with_megatron_ddp_main_grads(module, device):
    """Each parameter of `module` as megatron DDP sets it up on one rank (no reduction): an fp32 main_grad, the
    grad_added_to_main_grad flag that gradient-accumulation fusion sets, and the hook that adds what autograd
    accumulated into main_grad. Returns `module`."""
    for param in module.parameters():
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=device)
        param.grad_added_to_main_grad = False
        param.register_post_accumulate_grad_hook(_ddp_hook)
    return module


def _ddp_hook(param) -> None:
    if param.grad is not None and not param.grad_added_to_main_grad:
        param.main_grad.add_(param.grad.data)
    param.grad = None


def _zero(layer) -> None:
    for param in layer.parameters():
        param.main_grad.zero_()
        param.grad, param.grad_added_to_main_grad = None, False


def measure(impl: str, hidden: int, heads: int, micro_batch: int, seq: int, dtype, reps: int, device: str) -> dict:
    from megatron.zero_bubble.patches.megatron_adapter import MegatronAdapter
    from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore

    layer = build_layer(impl, hidden, heads, dtype, device)
    store = WeightGradStore("layer")
    store.attach(layer, MegatronAdapter())
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(seq, micro_batch, hidden, generator=generator).to(device, dtype)
    dy = torch.randn(seq, micro_batch, hidden, generator=generator).to(device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    names = [name for name, _ in layer.named_parameters()]
    deferred = len(store.weights)
    times = {"fused": [], "b": [], "w": []}
    grads = {}
    try:
        for round_ in range(reps + 1):
            for split in (False, True):
                _zero(layer)
                out, _ = layer(x.clone().requires_grad_())
                sync()
                start = time.perf_counter()
                with store.split_backward() if split else store.fused_backward(last=False):
                    out.backward(dy)
                if split:
                    store.close_microbatch(0)
                sync()
                middle = time.perf_counter()
                if split:
                    store.run_next(0)
                    sync()
                end = time.perf_counter()
                if round_:
                    times["b" if split else "fused"].append(middle - start)
                    if split:
                        times["w"].append(end - middle)
                else:
                    grads[split] = [p.main_grad.clone() for p in layer.parameters()]
    finally:
        store.detach()
    different = [n for n, a, b in zip(names, grads[False], grads[True]) if not torch.equal(a, b)]
    split_times = [b + w for b, w in zip(times["b"], times["w"])]
    return {"impl": impl, "hidden": hidden, "heads": heads, "micro_batch": micro_batch, "seq": seq,
            "fused_ms": [t * 1e3 for t in times["fused"]], "split_ms": [t * 1e3 for t in split_times],
            "b_ms": [t * 1e3 for t in times["b"]], "w_ms": [t * 1e3 for t in times["w"]],
            "ratio": statistics.median(split_times) / statistics.median(times["fused"]),
            "deferred": deferred, "bit_identical": not different, "first_difference": different[:1]}


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def _shapes(text: str) -> list[tuple[str, tuple[int, int, int], int]]:
    if text == "paper":
        return [(name, shape, 1024) for name, shape in PAPER.items()]
    if text == "tiny":
        return [("tiny", (64, 4, 2), 32)]
    hidden, heads, mb = (int(v) for v in text.split(":"))
    return [(text, (hidden, heads, mb), 1024)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--impl", default="local", help="local and/or transformer_engine (default %(default)s)")
    parser.add_argument("--shapes", default="paper", help="paper, tiny or H:A:MB (default %(default)s)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: 1024; tiny: 32)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--reps", type=int, default=5, help="rounds after the warm-up (default %(default)s)")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    _set_up(args.device)
    print(f"(T_B + T_W) / T_BW of one GPT layer, TP=1, {args.device}, {dtype}, ms; {args.reps} rounds, fused and "
          f"split alternated")
    print(f"{'impl':<20}{'shape':<8}{'T_BW min/med/max':>26}{'T_B+T_W min/med/max':>26}{'T_B':>8}{'T_W':>8}"
          f"{'ratio':>8}  gradients")
    results = []
    for impl in args.impl.split(","):
        for name, (hidden, heads, mb), seq in _shapes(args.shapes):
            r = measure(impl, hidden, heads, mb, args.seq or seq, dtype, args.reps, args.device)
            r["shape"] = name
            results.append(r)
            noisy = " noisy" if max(_spread(r["fused_ms"]), _spread(r["split_ms"])) > NOISY else ""
            ms = lambda v: f"{min(v):.2f}/{statistics.median(v):.2f}/{max(v):.2f}"  # noqa: E731
            same = "bit-identical" if r["bit_identical"] else f"DIFFER ({r['first_difference'][0]})"
            print(f"{impl:<20}{name:<8}{ms(r['fused_ms']):>26}{ms(r['split_ms']):>26}"
                  f"{statistics.median(r['b_ms']):>8.2f}{statistics.median(r['w_ms']):>8.2f}{r['ratio']:>8.3f}{noisy}"
                  f"  {same}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    dist.destroy_process_group()
    return 0 if all(r["bit_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
