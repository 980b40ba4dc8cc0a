"""Read a pretrain_gpt.py command line into a `Run`, with megatron's own argument parser.

The parser is megatron-core's (`megatron.training.arguments.add_megatron_arguments`) plus the zero-bubble flags,
built as pretrain_gpt.py builds it, so every flag spelling and default is megatron's; with --zero-bubble-cpu the
CPU defaults pretrain_gpt.py uses there (local layers, no fusions). Parsing reads nothing but the given words (not
sys.argv, not the environment) and starts nothing. What megatron's validation derives afterwards (the FFN size,
the query groups, the data-parallel size, the padded vocabulary, ...) is derived here by the same rules, written
next to each value; megatron's `validate_args` itself is not run (it prints, reads the environment and the GPU).

Importing megatron's parser imports megatron-core and torch (seconds); nothing else in advise/ does.
"""
from __future__ import annotations

import argparse
import math
import warnings

from ..training.checks import _virtual_stages
from ..training.flags import ON_CPU, StartupRefusal, add_zero_bubble_flags, cpu_defaults, refuse_argparse_error
from .run import Kernels, LayerPlacement, ModelShape, Moe, Numerics, ParallelLayout, Recompute, Run

GPT2_VOCAB = 50257  # GPT2BPETokenizer's vocabulary (its vocab.json), what megatron pads for that tokenizer
# Not modelled: refused with the reason rather than advised on a wrong count.
_NOT_MODELLED = {
    "multi_latent_attention": "multi-latent attention (MLA) is not in advise's memory model",
    "mtp_num_layers": "multi-token prediction layers are not in advise's memory model",
    "hybrid_layer_pattern": "hybrid (Mamba) models are not in advise's memory model",
    "heterogeneous_layers_config_path": "heterogeneous layers are not in advise's memory model",
    "use_megatron_fsdp": "megatron FSDP shards weights and gradients differently from megatron DDP",
    "use_torch_fsdp2": "torch FSDP2 shards weights and gradients differently from megatron DDP",
    "yaml_cfg": "advise reads the command line's flags, not a YAML configuration",
    "fp4": "FP4 training is not in advise's memory model",
    "use_checkpoint_args": "the model's shape would come from a checkpoint",
}


class AdviseError(Exception):
    """Bad input to advise: one line naming the flag and the fix."""


def megatron_parser(on_cpu: bool) -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser: megatron's flags and ours (see the module docstring)."""
    from ..patches import imports

    imports.install()  # what `import megatron.training` needs without triton and on Python 3.11
    try:
        with warnings.catch_warnings():  # megatron warns at import that Transformer Engine or Apex is missing
            warnings.simplefilter("ignore")
            from megatron.training.arguments import add_megatron_arguments
    except ImportError as error:
        raise AdviseError(f"advise reads the command line with megatron's parser, which does not import here "
                          f"({error}); install megatron-core 0.19") from None
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False, add_help=False)
    add_megatron_arguments(parser)
    add_zero_bubble_flags(parser)
    parser.error = refuse_argparse_error
    if on_cpu:
        parser.set_defaults(**cpu_defaults())  # the layers pretrain_gpt.py trains on this machine
    return parser


def parse(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(words)
    except StartupRefusal as refusal:
        raise AdviseError(f"the pretrain_gpt.py arguments: {refusal}") from None


def world_size(args, world: int | None) -> tuple[int, int, str | None]:
    """(world size, data-parallel size, a note when advise assumed the world size)."""
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    note = None
    if world is None:
        world = model_parallel
        note = (f"world size {world} assumed (one data-parallel replica); give --world-size or --nodes with "
                f"--gpus-per-node for the data-parallel size")
    if world % model_parallel:
        raise AdviseError(f"--world-size {world} is not a multiple of TP x PP x CP = {model_parallel}")
    return world, world // model_parallel, note


def vocabulary(args, tokenizer_vocab: int | None) -> tuple[int, str | None]:
    """The padded vocabulary (megatron's calculate_padded_vocab_size) and a note on where the size came from."""
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    kind = args.tokenizer_type
    note = None
    if tokenizer_vocab is not None:
        size, note = tokenizer_vocab, f"vocabulary {tokenizer_vocab} (--tokenizer-vocab)"
    elif kind == "GPT2BPETokenizer":
        size = GPT2_VOCAB
    elif args.vocab_size is not None:
        size = args.vocab_size
        if kind != "NullTokenizer":
            note = f"vocabulary {size} from --vocab-size (the {kind} files are not read)"
    else:
        raise AdviseError(f"advise does not load the {kind or 'default'} tokenizer to learn its vocabulary size; give "
                          f"it to advise as --tokenizer-vocab N (128256 for Llama 3, 32000 for Llama 2 / Mixtral)")
    padded = calculate_padded_vocab_size(size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size,
                                         logging_enabled=False)
    return padded, note


def _moe(args, layers: int, ffn: int) -> Moe | None:
    if not args.num_experts:
        return None
    freq = args.moe_layer_freq
    pattern = [i % freq == 0 for i in range(layers)] if isinstance(freq, int) else [bool(x) for x in freq]
    if len(pattern) != layers:
        raise AdviseError(f"--moe-layer-freq names {len(pattern)} layers, --num-layers is {layers}")
    if args.num_experts % args.expert_model_parallel_size:
        raise AdviseError(f"--num-experts {args.num_experts} is not a multiple of --expert-model-parallel-size "
                          f"{args.expert_model_parallel_size}")
    return Moe(experts=args.num_experts, topk=args.moe_router_topk, ffn_hidden=args.moe_ffn_hidden_size or ffn,
               shared_ffn_hidden=args.moe_shared_expert_intermediate_size or 0, layers=tuple(pattern),
               grouped_gemm=bool(args.moe_grouped_gemm), shared_expert_gate=bool(args.moe_shared_expert_gate))


def model_shape(args, vocab: int) -> ModelShape:
    h, heads = args.hidden_size, args.num_attention_heads
    for flag, value in (("--num-layers", args.num_layers), ("--hidden-size", h), ("--num-attention-heads", heads),
                        ("--seq-length", args.seq_length), ("--micro-batch-size", args.micro_batch_size)):
        if value is None:
            raise AdviseError(f"the pretrain_gpt.py arguments lack {flag}, which megatron requires")
    if args.ffn_hidden_size is not None:
        ffn = args.ffn_hidden_size
    else:  # megatron's default: 4h, or for SwiGLU two thirds of it rounded down to a multiple of 64
        ffn = int((4 * h * 2 / 3) / 64) * 64 if args.swiglu else 4 * h
    return ModelShape(
        layers=args.num_layers, hidden=h, ffn_hidden=ffn, heads=heads,
        query_groups=args.num_query_groups if args.group_query_attention else heads,
        kv_channels=args.kv_channels or h // heads, seq_length=args.seq_length, vocab=vocab,
        max_position_embeddings=args.max_position_embeddings or args.seq_length, swiglu=bool(args.swiglu),
        normalization=args.normalization, linear_bias=bool(args.add_bias_linear),
        qkv_bias=bool(args.add_bias_linear or args.add_qkv_bias), qk_layernorm=bool(args.qk_layernorm),
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        position_embedding=args.position_embedding_type, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, moe=_moe(args, args.num_layers, ffn))


def parallel_layout(args, dp: int) -> ParallelLayout:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    micro = args.micro_batch_size
    global_batch = args.global_batch_size or micro * dp  # megatron's default: one microbatch per replica
    if global_batch % (micro * dp):
        raise AdviseError(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro} x "
                          f"data-parallel size {dp}")
    placement = LayerPlacement(
        num_layers=args.num_layers, pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=bool(args.account_for_embedding_in_pipeline_split),
        account_for_loss_in_pipeline_split=bool(args.account_for_loss_in_pipeline_split),
        allow_padding_num_layers=bool(args.allow_padding_num_layers))
    return ParallelLayout(
        tp=tp, pp=pp, dp=dp, cp=args.context_parallel_size, ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size or tp, chunks=_virtual_stages(args) or 1,
        sequence_parallel=bool(args.sequence_parallel) and tp > 1,  # megatron turns it off at TP 1
        micro_batch=micro, global_batch=global_batch, placement=placement)


def numerics(args) -> Numerics:
    params = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if params == "bf16":  # megatron accumulates and reduces bf16 gradients in fp32 unless told otherwise
        grad = "bf16" if args.grad_reduce_in_bf16 else "fp32"
    elif params == "fp16":
        grad = "fp32" if args.accumulate_allreduce_grads_in_fp32 else "fp16"
    else:
        grad = "fp32"
    aware = bool(args.use_precision_aware_optimizer)
    if args.optimizer not in ("adam", "sgd"):
        raise AdviseError(f"--optimizer {args.optimizer}: advise models adam and sgd")
    return Numerics(
        params=params, fp8=args.fp8, fp8_param_gather=bool(args.fp8 and args.fp8_param_gather), grad=grad,
        optimizer=args.optimizer, sgd_momentum=args.sgd_momentum > 0,
        distributed_optimizer=bool(args.use_distributed_optimizer),
        main_params=None if params == "fp32" else (args.main_params_dtype if aware else "fp32"),
        exp_avg=args.exp_avg_dtype if aware else "fp32", exp_avg_sq=args.exp_avg_sq_dtype if aware else "fp32",
        softmax_in_fp32=bool(args.attention_softmax_in_fp32 or args.apply_query_key_layer_scaling))


def kernels(args, on_cpu: bool) -> Kernels:
    impl = args.transformer_impl
    backend = getattr(args.attention_backend, "name", str(args.attention_backend))
    return Kernels(device="cpu" if on_cpu else "cuda", transformer_impl=impl,
                   flash_attention=impl == "transformer_engine" and backend != "unfused",
                   fused_activation=bool(args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion))


def recompute(args) -> Recompute:
    granularity = args.recompute_granularity or ("selective" if args.recompute_activations else None)
    modules = tuple(args.recompute_modules or (("core_attn",) if granularity == "selective" else ()))
    return Recompute(granularity=granularity, method=args.recompute_method, num_layers=args.recompute_num_layers,
                     modules=modules, distribute_saved=bool(args.distribute_saved_activations))


def read_run(parser: argparse.ArgumentParser, words: list[str], world: int | None = None,
             tokenizer_vocab: int | None = None) -> tuple[Run, argparse.Namespace]:
    """The run a pretrain_gpt.py command line describes, and megatron's parsed arguments."""
    args = parse(parser, words)
    for name, why in _NOT_MODELLED.items():
        if getattr(args, name, None):
            raise AdviseError(f"--{name.replace('_', '-')}: {why}")
    world, dp, world_note = world_size(args, world)
    vocab, vocab_note = vocabulary(args, tokenizer_vocab)
    notes = [note for note in (world_note, vocab_note) if note]
    if args.step_batch_size_schedule or args.rampup_batch_size:
        notes.append("batch-size ramp-up: advised for the final --global-batch-size")
    run = Run(model=model_shape(args, vocab), layout=parallel_layout(args, dp), numerics=numerics(args),
              kernels=kernels(args, ON_CPU in words), recompute=recompute(args),
              attention_mask_in_batch=bool(args.create_attention_mask_in_dataloader), notes=tuple(notes),
              argv=tuple(words))
    _check_sizes(run)
    return run, args


def _check_sizes(run: Run) -> None:
    m, layout = run.model, run.layout
    if m.heads % layout.tp or m.query_groups % layout.tp:
        raise AdviseError(f"--num-attention-heads {m.heads} and the query groups ({m.query_groups}) must be multiples "
                          f"of --tensor-model-parallel-size {layout.tp}")
    if layout.microbatches < 1:
        raise AdviseError("the global batch holds no microbatch per data-parallel replica")
    if m.moe is not None and (layout.tp * layout.cp * layout.dp) % (layout.ep * layout.etp):
        raise AdviseError(f"expert parallelism {layout.ep} x expert tensor parallelism {layout.etp} does not divide "
                          f"the {layout.tp * layout.cp * layout.dp} GPUs of a pipeline stage")
    if math.gcd(m.seq_length, layout.cp) != layout.cp:
        raise AdviseError(f"--seq-length {m.seq_length} is not a multiple of --context-parallel-size {layout.cp}")
