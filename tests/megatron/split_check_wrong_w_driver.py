"""Test driver (tests/megatron/test_split_check_pretrain.py): pretrain_gpt.py with a deliberately wrong W.

On global rank 1 every weight gradient a B pass defers for an MLP's first linear layer comes out 1e-3 too large
when its W runs (the fused backward is untouched), so the split check must stop the run naming that layer.
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import pretrain_gpt  # noqa: E402  (sets up the process: import shims, the CPU backend)

from megatron.zero_bubble.runtime.wgrad_store import WeightGradStore  # noqa: E402

_defer = WeightGradStore.defer


class _TooLarge:
    def __init__(self, work):
        self.work, self.nbytes, self.weight = work, work.nbytes, work.weight

    def __call__(self):
        self.work()
        target = self.weight
        (target.main_grad if getattr(target, "main_grad", None) is not None else target.grad).add_(1e-3)


def _wrong_defer(store, work):
    fc1 = tuple(work.weight.shape) == (4 * work.weight.shape[1], work.weight.shape[1])
    _defer(store, _TooLarge(work) if fc1 and os.environ.get("RANK") == "1" else work)


WeightGradStore.defer = _wrong_defer
if __name__ == "__main__":
    sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
    pretrain_gpt.main()
