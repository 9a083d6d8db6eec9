"""Benchmark: a 2-rank pipeline's steps with each rank bound to cores of its own, and unbound.

One pipeline, compiled with Plan(cpu_affinity="none"); its rounds alternate between binding
every thread of each rank to the rank's share of the CPUs (what cpu_affinity="auto" does) and
letting them use every CPU. Each round runs untimed steps, then times `--steps` steps; the
script prints each round's median and, per binding, the median and range of the rounds'
medians. Unbound, the scheduler now and then runs both ranks on one core.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/rank_affinity.py \
        --model mlp --schedule 1f1b
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch.distributed as dist
from two_stages import add_model_arguments, at_least_one, print_rounds, two_stages

from fxpipe.affinity import core_share, pin_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, "mlp", schedule=True, steps=100)
    parser.add_argument("--rounds", type=at_least_one, default=6, help="rounds per binding")
    args = parser.parse_args()
    setup = two_stages(args, schedule=args.schedule, partitioner="even", cpu_affinity="none")
    if not setup.distributed:
        raise SystemExit("run it under torchrun (see the docstring): binding is per rank")
    everything = sorted(os.sched_getaffinity(0))
    share = core_share(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]),
                       everything)
    if share is None:
        raise SystemExit(f"{os.environ['LOCAL_WORLD_SIZE']} ranks do not fit "
                         f"{len(everything)} CPUs: nothing to bind")
    medians: dict[str, list[float]] = {"bound": [], "unbound": []}
    for index in range(2 * args.rounds):
        binding = "bound" if index % 2 else "unbound"
        pin_process(share if binding == "bound" else everything)
        for _ in range(50):  # the threads settle where they now may run
            setup.pipe.step(setup.x, setup.y)
        times = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            setup.pipe.step(setup.x, setup.y)
            times.append(time.perf_counter() - start)
        medians[binding].append(statistics.median(times) * 1e3)
    if setup.reporting():
        print_rounds(f"{args.model}, {args.schedule}, {setup.where}: median step ms of each "
                     f"round of {args.steps} steps", medians)


if __name__ == "__main__":
    main()
