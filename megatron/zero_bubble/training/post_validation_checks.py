"""What optimizer post-validation's speculative step and its rollback support; everything else is refused here."""
from __future__ import annotations

from .flags import StartupRefusal, given


def check_post_validation(args, options, flag: str, argv: list[str]) -> None:
    """What the speculative step and its rollback support; everything else is refused here."""
    if not options.through_runtime:
        raise StartupRefusal(
            f"--enable-optimizer-post-validation works with schedules run by the zero-bubble runtime, not with "
            f"megatron's own ({flag}); add --enable-zb-runtime or drop the flag")
    if given(argv, "--rerun-mode") and args.rerun_mode != "disabled":
        raise StartupRefusal(
            f"--rerun-mode {args.rerun_mode} all-reduces over every rank after each forward-backward, the barrier "
            f"--enable-optimizer-post-validation removes (without --rerun-mode it is switched off); use "
            f"--rerun-mode disabled or drop one of them")
    unsupported = {
        "log_num_zeros_in_grad": "counting zeros reduces over every stage in the step",
        "log_params_norm": "the parameter norm reduces over every stage and would read speculative weights",
        "use_precision_aware_optimizer": "its decoupled gradients and master weights are not rolled back",
        "optimizer_cpu_offload": "the offloaded optimizer's state is not rolled back",
        "mtp_num_layers": "multi-token prediction layers are clipped by their own norm, which is not chained",
        "moe_enable_routing_replay": "the routing it records or replays is not rewound when passes are replayed",
        "moe_routing_trace_path": "the router trace would record the passes a rollback replays twice",
        "save_tokens_per_expert_interval": "it would record the tokens of the passes a rollback replays twice",
        "save_params_interval": "it would save speculative parameters",
        "save_activations_interval": "its hooks would record the activations of the passes a rollback replays twice",
        "save_dgrads_interval": "its hooks would record the input gradients of the passes a rollback replays twice",
        "save_wgrads_interval": "it would save gradients a rollback re-steps with, and force an all-reduce in the "
                                "step's place",
        "qk_clip": "it changes weights after the step, which a rollback would not undo",
    }
    for name, why in unsupported.items():
        if getattr(args, name, False):
            raise StartupRefusal(
                f"--{name.replace('_', '-')} does not work with --enable-optimizer-post-validation ({why}); "
                f"drop one of them")
    if getattr(args, "num_distributed_optimizer_instances", 1) > 1:
        raise StartupRefusal("--num-distributed-optimizer-instances above 1 does not work with "
                             "--enable-optimizer-post-validation yet; drop one of them")
    if args.optimizer not in ("adam", "sgd"):
        raise StartupRefusal(
            f"--enable-optimizer-post-validation rolls back adam and sgd steps, not --optimizer {args.optimizer}; "
            f"use one of those or drop the flag")
    coupled_decay = args.optimizer == "adam" and not getattr(args, "decoupled_weight_decay", True)
    if coupled_decay and args.weight_decay and not args.zero_bubble_exact_rollback:
        raise StartupRefusal(
            "Adam with coupled weight decay cannot be inverted in place; add --zero-bubble-exact-rollback "
            "(or use decoupled weight decay)")
