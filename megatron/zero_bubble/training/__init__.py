"""Megatron's own training loop (`megatron.training.pretrain`) with zero-bubble pipeline schedules.

- `arguments.py`: the command-line flags (`--enable-zero-bubble`, `--pipeline-schedule`, ...) added through
  megatron's extra-args hook, and the start-up checks that refuse combinations which cannot work with one
  line naming the flag and the fix (`ZeroBubbleOptions`, `StartupRefusal`).
- `setup.py`: turns those options into installed patches and a planning, profiling `PipelineExecutor`
  (`prepare_process()` at the top of the entry script; `zero_bubble_session(options)` around `pretrain`).
- `init_weights.py`: initialisation by global parameter name, so that models split into different
  pipeline layouts start from the same weights (for layout-independent comparisons).
- `language_model.py`: what the entry scripts share (data, batch, loss, forward step, main); `hybrid_checks.py` and
  `hybrid_pattern.py`: --hybrid-layer-pattern's checks and layout.

The entry scripts are `pretrain_gpt.py` and `pretrain_hybrid.py` at the repository root; nothing here runs on import.
"""
