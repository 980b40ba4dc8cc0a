"""A stand-in for pretrain_gpt.py that checks the launcher's plumbing without Megatron.

Every rank joins the gloo group torchrun set up, the first rank sends a tensor down the "pipeline" to the
last one each iteration, and the last rank prints a Megatron-style loss line naming every rank's host.
Unknown arguments (the Megatron flags the launcher passes) are accepted and ignored.
"""
import argparse
import socket

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-iters", type=int, default=3)
    args, _ = parser.parse_known_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    for iteration in range(1, args.train_iters + 1):
        activation = torch.full((4,), float(iteration))
        if rank == 0:
            dist.send(activation, dst=world - 1)
        elif rank == world - 1:
            dist.recv(activation, src=0)
            print(f" iteration {iteration}/{args.train_iters} | lm loss: {activation.sum().item():.6E} "
                  f"| hosts: {','.join(hosts)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
