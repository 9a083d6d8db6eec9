"""Benchmark: how differently fast the ranks of a torchrun job time the same units.

Under torchrun every rank times every unit at once, and rank 0's table is the one compile and
`fxpipe.retime` use, for the stages of every rank. That holds only if the ranks' CPUs run
equally fast. This script compiles a bundled model into 2 stages (one per rank), then, in
each of `--rounds` rounds, has every rank time the units as retime does and prints, per rank,
each stage's forward and backward per micro-batch, and rank 1's sums over rank 0's.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/rank_speeds.py --model gpt --rounds 6
"""

from __future__ import annotations

import argparse
from typing import Any

import torch.distributed as dist
from two_stages import add_model_arguments, at_least_one, two_stages

from fxpipe.compile.front import measure_costs
from fxpipe.cost import Partition


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt")
    parser.add_argument("--partitioner", default="even")
    parser.add_argument("--rounds", type=at_least_one, default=6)
    args = parser.parse_args()
    setup = two_stages(args, partitioner=args.partitioner)
    if not setup.distributed:
        parser.error("run it under torchrun with 2 ranks (see the docstring)")
    pipe = setup.pipe
    flat, timing, part = pipe.traced.bind((setup.x,), {}), pipe.timing, pipe.partition
    lines = []
    for _ in range(args.rounds):
        cost = measure_costs(pipe.traced.gm, pipe.units, flat, pipe.plan, [timing.device],
                             pipe.link, None, timing.threads, timing.concurrency,
                             pipe.executor.whole, 1, 5, held=timing.held)
        stages = Partition.evaluate(cost, part.bounds, part.micro_batches).stages
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [(s.f, s.b) for s in stages])
        cells = [f"rank {rank}: " + "  ".join(f"F{s} {f * 1e3:.2f} B{s} {b * 1e3:.2f}"
                                             for s, (f, b) in enumerate(times))
                 for rank, times in enumerate(everyone)]
        total = [sum(f + b for f, b in times) for times in everyone]
        lines.append(" | ".join(cells) + f" | rank 1 / rank 0: {total[1] / total[0]:.2f}")
    if setup.reporting():
        print(f"{args.model}, 2 stages {list(part.sizes)}, micro-batch of "
              f"{args.batch // part.micro_batches}: ms per micro-batch, each rank timing "
              "every unit at once")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
