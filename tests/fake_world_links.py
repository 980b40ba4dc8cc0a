"""A child process for tests/test_links_at_scale.py: one rank of a 4096-rank job (TP8 x PP16 x DP32) on torch's fake
process-group backend, with megatron's parallel state; it counts the collective calls the runtime makes to build its
pipeline links and warm them up, and, as a control that the counting sees them, the ones megatron makes for its
groups. Prints one line: RESULT {json}."""
from __future__ import annotations

import collections
import json
import sys

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron.zero_bubble.patches import imports

COLLECTIVES = ("new_group", "split_group", "new_subgroups", "new_subgroups_by_enumeration", "all_gather",
               "all_gather_object", "all_gather_into_tensor", "all_reduce", "broadcast", "broadcast_object_list",
               "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier")


def counting(counts: collections.Counter) -> None:
    """Count every call of torch.distributed's collectives and group makers (this process only)."""
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    batch = dist.batch_isend_irecv

    def counted_batch(ops):
        counts["batch_isend_irecv"] += 1
        return batch(ops)

    dist.batch_isend_irecv = counted_batch


def main(rank: int) -> None:
    imports.install()
    from megatron.core import parallel_state

    from megatron.zero_bubble.runtime.messaging import Messaging

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4096)
    counts = collections.Counter()
    counting(counts)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=8, pipeline_model_parallel_size=16,
                                             create_gloo_process_groups=False)
    pp = parallel_state.get_pipeline_model_parallel_group()
    megatron_made = dict(counts)
    messaging = Messaging()  # what the executor makes, then its first call: the links and their warm-up
    links = messaging.links(pp)
    links.warm_up([(links.rank - 1) % pp.size(), (links.rank + 1) % pp.size()], messaging.ops)
    ours = {name: count - megatron_made.get(name, 0) for name, count in counts.items()}
    print("RESULT " + json.dumps({"megatron": megatron_made, "links": {k: v for k, v in ours.items() if v},
                                  "pp_size": pp.size(), "pp_rank": links.rank, "warm": sorted(links.warm)}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
