"""Benchmark: how long compile takes, and each measurement it makes.

compile traces the model, times its units, plans, and measures the link between the stages and
the runtime's own time per step and per action. Each of those can be asked for again on a
compiled pipeline, and `fxpipe bench` does so in every round. This script compiles a bundled
model into 2 stages (one per rank under torchrun, or 2 stage threads) and prints compile's
seconds, then the median of `--repeats` runs of each measurement: the link
(`pipe.measure_link`, under torchrun with the sending and receiving terms measured on the
stages' own compute), the units (`fxpipe.retime`), the runtime's own time per step and per
forward and backward action, and one training step for scale; in one process also what
compile spends on the thread capacity where stage threads outnumber the cores, as for
`--threads` stage threads on this machine's cores (`measure_thread_capacity`; nothing where
they do not outnumber them).

    python benchmarks/compile_time.py --model vgg --batch 64
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/compile_time.py --model vgg --batch 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from two_stages import add_model_arguments, at_least_one, two_stages

import fxpipe
from fxpipe.compile.front import measure_thread_capacity


def seconds(work: Callable[[], Any], distributed: bool) -> float:
    """`work`'s seconds, the ranks started together under torchrun."""
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "vgg", schedule=True)
    parser.add_argument("--repeats", type=at_least_one, default=3)
    parser.add_argument("--threads", type=at_least_one, default=4,
                        help="stage threads whose thread capacity is timed (one process)")
    args = parser.parse_args()
    start = time.perf_counter()
    setup = two_stages(args, schedule=args.schedule)  # builds the model and compiles it
    compiled = time.perf_counter() - start
    pipe, x, y = setup.pipe, setup.x, setup.y
    measurements = {
        "pipe.measure_link(x)": lambda: pipe.measure_link(x),
        "fxpipe.retime(pipe, x, target=y)": lambda: fxpipe.retime(pipe, x, target=y),
        "pipe.measure_step_overhead(x)": lambda: pipe.measure_step_overhead(x),
        "pipe.measure_action_overhead(x)": lambda: pipe.measure_action_overhead(x),
        "pipe.step(x, y)": lambda: pipe.step(x, y),
    }
    if not setup.distributed:  # as compile measures it for --threads stage threads
        flat = pipe.traced.bind((x,), {})
        measurements[f"thread capacity, {args.threads} threads"] = (
            lambda: measure_thread_capacity(pipe.traced.gm, pipe.units, flat, pipe.partition,
                                            ["cpu"] * args.threads, 1, pipe.executor.whole))
    medians = {name: statistics.median(seconds(work, setup.distributed)
                                       for _ in range(args.repeats))
               for name, work in measurements.items()}
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where}, {args.schedule}, batch {args.batch}, "
          f"{args.micro_batches} micro-batches; seconds (medians of {args.repeats} runs)")
    print(f"{'compile (with building the model)':>36}  {compiled:7.2f}")
    for name, median in medians.items():
        print(f"{name:>36}  {median:7.3f}")


if __name__ == "__main__":
    main()
