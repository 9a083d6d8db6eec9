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
median and the spread (largest / smallest) of the rounds'. With `--predict`, each round first
measures the link and the runtime's own time and re-times the units (with the loss, for the
bench's PROFILE_SECONDS per micro-batch size, as a bench round does), and predicts the step of
each placement from them: bound (the first three) each core shared among its stages, unbound
the cores split evenly. It then prints the predictions too, and per placement the median
measured step over the median prediction.

    OMP_NUM_THREADS=1 python benchmarks/thread_placement.py --model mlp --schedule gpipe
    OMP_NUM_THREADS=1 python benchmarks/thread_placement.py --model vgg --batch 64 --stages 4 \
        --micro-batches 8 --schedule 1f1b
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

from two_stages import add_model_arguments, at_least_one, median_step, print_rounds, two_stages

import fxpipe
from fxpipe.bench import PROFILE_SECONDS
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
    parser.add_argument("--predict", action="store_true",
                        help="re-time the units each round and predict every placement")
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
    pipe, x, y = setup.pipe, setup.x, setup.y
    compiled = dict(pipe.executor.driver.cores_of)  # compile's binding, if it bound them
    medians: dict[str, list[float]] = {name: [] for name in placements}
    predicted: dict[str, list[float]] = {name: [] for name in placements}
    names = list(placements)
    try:
        for index in range(args.rounds):
            if args.predict:
                pipe.executor.driver.bind(compiled or {s: cpus for s in pipe.executor.runners})
                pipe.measure_link(x)
                pipe.measure_runtime_overhead(x)
                timed = fxpipe.retime(pipe, (x,), target=y, warmup=1, min_time=PROFILE_SECONDS)
            turn = index % len(names)  # each placement first in turn
            for name in names[turn:] + names[:turn]:
                place(pipe, placements[name])
                if args.predict:
                    predicted[name].append((pipe.predicted_timeline(timed).makespan
                                            + pipe.step_overhead) * 1e3)
                medians[name].append(median_step(pipe, x, y, steps=3, seconds=args.seconds)
                                     * 1e3)
    finally:
        place(pipe, placements["unbound"])
    title = (f"{args.model}, {setup.where}, even {pipe.partition.bounds}, {args.schedule}, "
             f"batch {args.batch}, {args.micro_batches} micro-batches")
    print_rounds(f"{title}: median step ms per round", medians)
    if args.predict:
        print_rounds(f"{title}: predicted step ms per round", predicted)
        for name in names:
            ratio = statistics.median(medians[name]) / statistics.median(predicted[name])
            print(f"  {name}: measured / predicted {ratio:.3f}")


if __name__ == "__main__":
    main()
