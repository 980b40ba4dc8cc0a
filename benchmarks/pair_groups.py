"""What the runtime's pair groups cost on CPU (gloo): the time to make them and the threads they hold.

    python benchmarks/pair_groups.py [--stages 2,4,8] [--reps 5]

p local processes, one pipeline of p ranks; each repetition makes the pair groups (runtime/links.py:
PipelineLinks.make, collective over every rank) and destroys them. Printed: seconds to make them on the slowest rank
(min / median / max over the repetitions) and the threads a rank holds with them, against without (from
/proc/self/task, gloo's own threads included). NCCL's cost (a communicator per pair) cannot be measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megatron.zero_bubble.tools.local_ranks import run_ranks  # noqa: E402


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rank(rank: int, world: int, directory: str, reps: int) -> None:
    from megatron.zero_bubble.runtime.links import PipelineLinks
    from megatron.zero_bubble.tools.local_ranks import init_group

    init_group("gloo", rank, world, directory)
    seconds, extra = [], []
    for _ in range(reps):
        dist.barrier()
        before = _threads()
        start = time.perf_counter()
        links = PipelineLinks.make(dist.group.WORLD)
        seconds.append(time.perf_counter() - start)
        extra.append(_threads() - before)
        links.close()
    Path(directory, f"r.{rank}").write_text(json.dumps({"seconds": seconds, "threads": extra}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="2,4,8")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"{'p':>3}{'seconds to make (slowest rank) min / median / max':>52}{'threads per rank':>18}")
    for p in (int(x) for x in args.stages.split(",")):
        directory = tempfile.mkdtemp()
        run_ranks(_rank, p, directory, (args.reps,), 600, "spawn", "the pair groups' benchmark")
        ranks = [json.loads(Path(directory, f"r.{r}").read_text()) for r in range(p)]
        slowest = [max(r["seconds"][i] for r in ranks) for i in range(args.reps)]
        threads = statistics.median(t for r in ranks for t in r["threads"])
        print(f"{p:>3}{min(slowest):>30.3f} / {statistics.median(slowest):.3f} / {max(slowest):.3f}{threads:>18.0f}")


if __name__ == "__main__":
    main()
