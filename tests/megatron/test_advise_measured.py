"""`zb-schedule advise` against what training measures: a tiny CPU version of the Llama 3 8B example command line
(tests/advise_lines.py) trains with pretrain_gpt.py under torchrun; its memory report (runtime/memory_report.py)
gives each pipeline rank's model state (the tensors alive as a forward-backward call starts) and its peak with the
activations (the allocator after each pass, the largest over data-parallel replicas). `zb-schedule advise --json` on the same command line must
predict every pipeline rank's peak within 10%. benchmarks/advise_memory.py measures all four example lines (GPT-3
175B with TP, Mixtral 8x7B, a DeepSeek-like MoE with EP as well): a memory goal is a benchmark that prints figures; this
one line keeps the suite watching the model.

The Llama-like line uses learned absolute positions (--position-embedding-type learned_absolute): rotary embeddings
do not run on the CPU here.
"""
from __future__ import annotations

import pytest

from tests.megatron.advise_measure import MIB, TOLERANCE, measure

pytestmark = pytest.mark.slow


def test_predicted_peak_per_gpu_is_within_ten_percent_of_the_measured():
    """The Llama-like line: RMSNorm, SwiGLU, GQA, untied, no bias, bf16 with the distributed optimizer, ZB-V at PP=2."""
    result = measure("llama3-8b")
    print(f"\nllama3-8b ({result.schedule}): measured peak {[round(v / MIB, 1) for v in result.peak]} MiB, predicted "
          f"{[round(v / MIB, 1) for v in result.predicted_peak]} MiB")
    assert len(result.predicted_peak) == len(result.peak)
    for rank, (got, expected) in enumerate(zip(result.peak, result.predicted_peak)):
        assert abs(expected - got) <= TOLERANCE * got, (rank, got, expected)
