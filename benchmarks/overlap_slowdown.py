"""Benchmark: how much longer compute actions take beside another stage's compute than alone.

The cost model times every unit one way: beside a busy stage for stage threads in one process
(each unit timed while a background thread runs the model), alone under torchrun (each rank
times its units while the others time theirs). In a pipeline some actions run beside another
stage's compute and some do not. This script compiles a bundled model into 2 stages, runs
steps, and pools their measured actions (`fxpipe.report.interference`, as `pipe.report()`
prints for one step): per kind, the median action beside another stage's compute against the
median one without, per stage, and their ratio.

    python benchmarks/overlap_slowdown.py --model mlp
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \
        benchmarks/overlap_slowdown.py --model mlp
"""

from __future__ import annotations

import argparse

import torch.distributed as dist
from two_stages import add_model_arguments, two_stages

from fxpipe.report import interference
from fxpipe.simulate import Event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp", schedule=True, steps=20)
    args = parser.parse_args()
    setup = two_stages(args, schedule=args.schedule)
    setup.warm_up(3)
    pipe, x, y = setup.pipe, setup.x, setup.y
    pooled: list[Event] = []
    for step in range(args.steps):
        if setup.distributed:
            dist.barrier()
        pipe.step(x, y)
        # the steps one after another on one axis, apart, so no action overlaps another step's
        offset = step * 1e3
        pooled += [Event(e.stage, e.action, e.start + offset, e.end + offset)
                   for e in pipe.full_trace("pooling the steps")]
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where}, {args.schedule}, {args.micro_batches} micro-batches, "
          f"split {list(pipe.partition.sizes)}; compute actions of {args.steps} steps")
    print("kind  beside / without (median per stage, geometric mean)  actions beside  without")
    for slowdown in interference(pooled):
        print(f"{slowdown.kind.name:4}  {slowdown.ratio:50.2f}  {slowdown.beside:14d}  "
              f"{slowdown.without:7d}")


if __name__ == "__main__":
    main()
