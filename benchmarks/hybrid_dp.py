"""Hybrid data + pipeline parallelism on 4 ranks: GroPipe's delayed all-reduce against the naive
order, 2 groups x 2 stages against 1 group x 4 stages, and against plain DDP, side by side.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/hybrid_dp.py

Every configuration trains the same model on the same global batch (SGD, one intra-op thread
per rank), alternated round by round in one job; rank 0 prints, per configuration, the median
(min-max) over rounds of each round's median step time and of its ratio to the delayed
all-reduce's in the same round. On a 2-core machine 4 ranks oversubscribe the cores two to
one: absolute times are those of a shared CPU, and only the ratios mean something.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import spread
from torch.nn.parallel import DistributedDataParallel

import fxpipe
from fxpipe.models import VGG, ResNet

MODELS = {"vgg": VGG, "resnet": ResNet}


def configs(world: int):
    yield "G=2 x k=2, delayed", dict(stages=world // 2, groups=2, dp_sync="delayed")
    yield "G=2 x k=2, naive", dict(stages=world // 2, groups=2, dp_sync="naive")
    yield f"G=1 x k={world}", dict(stages=world, groups=1)
    yield f"DDP x {world}", None


def build(name: str, batch: int):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return MODELS[name](), x, y


def step_fn(name: str, config, batch: int, micro_batches: int):
    model, x, y = build(name, batch)
    if config is None:  # plain data parallelism: each rank a quarter of the batch
        ddp = DistributedDataParallel(model)
        rank, world = dist.get_rank(), dist.get_world_size()
        xs, ys = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step():
            optimizer.zero_grad()
            F.cross_entropy(ddp(xs), ys).backward()
            optimizer.step()
        return step
    plan = fxpipe.Plan(micro_batches=micro_batches, loss_fn=F.cross_entropy, **config)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)

    def step():
        optimizer.zero_grad()
        pipe.step(x, y)
        optimizer.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg,resnet")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = {}
    for name in args.models.split(","):
        steps = {label: step_fn(name, config, args.batch, args.micro_batches)
                 for label, config in configs(world)}
        for fn in steps.values():
            fn()  # warm-up
        times: dict[str, list[float]] = {label: [] for label in steps}  # per round, medians
        for r in range(args.rounds):
            labels = list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]  # rotate
            for label in labels:
                took = []
                for _ in range(args.repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    steps[label]()
                    dist.barrier()
                    took.append(time.perf_counter() - start)
                times[label].append(statistics.median(took) * 1e3)
        results[name] = times
    if dist.get_rank() == 0:
        print(f"step time (ms) and its ratio to the delayed all-reduce's in the same round: "
              f"median (min-max) over {args.rounds} rounds of each round's median of "
              f"{args.repeats} steps; {world} ranks on gloo, global batch {args.batch}, "
              f"{args.micro_batches} micro-batches per pipeline; the machine has "
              f"{os.cpu_count()} cores, so {world} ranks may oversubscribe it")
        for name, times in results.items():
            delayed = times["G=2 x k=2, delayed"]
            print(f"\n{name}")
            for label, ms in times.items():
                print(f"  {label:<20}{spread(ms, '.1f'):>24} ms   "
                      f"{spread([a / b for a, b in zip(ms, delayed)], '.2f'):>20}x of delayed")
    fxpipe.shutdown()  # every rank is done communicating before any tears gloo down


if __name__ == "__main__":
    main()
