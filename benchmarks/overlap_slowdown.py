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

import torch
import torch.distributed as dist

import fxpipe
from fxpipe.distributed import launched
from fxpipe.models import bundled
from fxpipe.report import interference
from fxpipe.simulate import Event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    distributed = launched()  # compile joins the process group torchrun describes
    torch.set_num_threads(1)
    model = bundled(args.model)
    torch.manual_seed(0)
    x, y = model.batch(args.batch, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=2, micro_batches=args.micro_batches, schedule=args.schedule,
                       loss_fn=model.loss_fn)
    pipe = fxpipe.compile(model.build(), plan, example_inputs=(x,), cache=False)
    for _ in range(3):
        pipe.step(x, y)
    pooled: list[Event] = []
    for step in range(args.steps):
        if distributed:
            dist.barrier()
        pipe.step(x, y)
        # the steps one after another on one axis, apart, so no action overlaps another step's
        offset = step * 1e3
        pooled += [Event(e.stage, e.action, e.start + offset, e.end + offset)
                   for e in pipe.full_trace("pooling the steps")]
    if distributed:
        dist.barrier()  # every rank is done communicating before any tears gloo down
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return
    where = "2 ranks under torchrun" if distributed else "2 stage threads in one process"
    print(f"{args.model}, {where}, {args.schedule}, {args.micro_batches} micro-batches, split "
          f"{list(pipe.partition.sizes)}; compute actions of {args.steps} steps")
    print("kind  beside / without (median per stage, geometric mean)  actions beside  without")
    for slowdown in interference(pooled):
        print(f"{slowdown.kind.name:4}  {slowdown.ratio:50.2f}  {slowdown.beside:14d}  "
              f"{slowdown.without:7d}")


if __name__ == "__main__":
    main()
