"""Benchmark: stage threads' steps bound to cores round, in blocks, all on one, or unbound.

Stage threads of one process share Python's interpreter lock, and every operator of a forward
takes it again. Where a model's operators are short, as the bundled MLP's are, the lock passes
between the threads many times per action, and it passes faster between threads on one core
than between cores. Past the cores, the OS may also leave a woken stage waiting for a busy core
while another core idles. This script compiles a bundled model into `--stages` stage threads
and alternates, round by round, between four placements of them (the main thread stays where
it may run): stage s on core s mod the cores ("a core each", as compile binds stage threads
past the cores), the stages in consecutive blocks of a core each, all on the first core, and
unbound. Each round runs untimed steps for 0.2 s, then timed ones for `--seconds` (as `fxpipe
bench` runs a round). It prints each round's median step per placement, and per placement the
median and the spread (largest / smallest) of the rounds'.

    OMP_NUM_THREADS=1 python benchmarks/thread_placement.py --model mlp --schedule gpipe
    OMP_NUM_THREADS=1 python benchmarks/thread_placement.py --model vgg --batch 64 --stages 4 \
        --micro-batches 8 --schedule 1f1b
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from two_stages import add_model_arguments, at_least_one, median_step, print_rounds, two_stages

import fxpipe
from fxpipe.distributed import launched


def place(pipe: fxpipe.CompiledPipeline, cpus_of_stage: Callable[[int], set[int]]) -> None:
    """From the next step on, run each stage on `cpus_of_stage(s)`: the worker thread taking
    the stage binds itself to them (`Driver.bind`, as compile binds stage threads past the
    cores)."""
    pipe.executor.driver.bind({s: cpus_of_stage(s) for s in pipe.executor.runners})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp", schedule=True)
    parser.add_argument("--stages", type=at_least_one, default=2)
    parser.add_argument("--rounds", type=at_least_one, default=8, help="rounds per placement")
    parser.add_argument("--seconds", type=float, default=0.2, help="of timed steps per round")
    args = parser.parse_args()
    if not hasattr(os, "sched_setaffinity"):
        parser.error("binding threads to cores needs os.sched_setaffinity (Linux)")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        parser.error("this process may use one CPU: nothing to place apart")
    if launched():
        parser.error("stage threads of one process: run it with python, not torchrun")
    setup = two_stages(args, schedule=args.schedule, partitioner="even")
    placements = {"a core each": lambda s: {cpus[s % len(cpus)]},
                  "in blocks": lambda s: {cpus[s * len(cpus) // args.stages]},
                  "one core": lambda s: {cpus[0]},
                  "unbound": lambda s: set(cpus)}
    medians: dict[str, list[float]] = {name: [] for name in placements}
    names = list(placements)
    try:
        for index in range(args.rounds):
            turn = index % len(names)  # each placement first in turn
            for name in names[turn:] + names[:turn]:
                place(setup.pipe, placements[name])
                medians[name].append(median_step(setup.pipe, setup.x, setup.y, steps=3,
                                                 seconds=args.seconds) * 1e3)
    finally:
        place(setup.pipe, placements["unbound"])
    print_rounds(f"{args.model}, {setup.where}, even {setup.pipe.partition.bounds}, "
                 f"{args.schedule}, batch {args.batch}, {args.micro_batches} micro-batches: "
                 "median step ms per round", medians)


if __name__ == "__main__":
    main()
