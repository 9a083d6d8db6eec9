"""Benchmark: a stage's computes back to back, profiled, in steps and as predicted.

The cost model takes each unit's forward and backward from the profile, which runs all the
model's units as training does, every forward, then every backward, so that a unit meets the
caches its neighbours leave. This script compiles a bundled model into 2 stages (one per rank
under torchrun, or 2 stage threads) and, in each of `--rounds` rounds, gives per stage, in
microseconds per micro-batch:

- back to back: the stage module's forward (or a forward, untimed, and its backward) again and
  again, every stage at once on its worker as in a step (`--repeats` of each, the median);
- profile: the stage's units as `fxpipe.retime` times them, added up (as compile does; under
  torchrun every rank times them, each stage's units as a run of their own since 546792e, and
  rank 0's table counts);
- in steps: the median of the stage's F and B actions over `--steps` training steps;
- predicted: the median of the F and B actions of the step predicted from that profile, which
  adds the runtime's own time per action and the link's terms (a compute after a wait, after
  a send, beside a receive).

On the last stage the F actions in steps, the profile and the prediction include the loss
(its forward, and its backward in B); back to back leaves it out. It prints each figure's
median over the rounds.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/compute_times.py --model gpt --schedule gpipe
    OMP_NUM_THREADS=1 python benchmarks/compute_times.py --model gpt --schedule gpipe
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections import defaultdict

import torch.distributed as dist
from two_stages import add_model_arguments, at_least_one, two_stages

from fxpipe.inspect import format_sizes
from fxpipe.runtime.executor import _stage_timers

KINDS = ("F", "B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt", schedule=True, steps=50)
    parser.add_argument("--partitioner", default="balanced")
    parser.add_argument("--rounds", type=at_least_one, default=3)
    parser.add_argument("--repeats", type=at_least_one, default=40,
                        help="back-to-back runs of each stage's forward and backward per round")
    args = parser.parse_args()
    setup = two_stages(args, partitioner=args.partitioner, schedule=args.schedule)
    pipe, executor = setup.pipe, setup.pipe.executor
    flat = pipe.traced.bind((setup.x,), {})

    def back_to_back(stage: int, inputs: dict) -> tuple[float, float]:
        timers = _stage_timers(executor.runners[stage], inputs[stage])
        return tuple(statistics.median(timer() for _ in range(args.repeats)) for timer in timers)

    figures: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        # as compile's own timings of the stages do: no gradient, buffer or trace left behind
        with executor.timing_the_stages(flat) as inputs:
            if setup.distributed:
                dist.barrier()  # every rank's stage at once, as in a step
            timed = executor.driver.on_stage_workers(functools.partial(back_to_back, inputs=inputs))
        run = setup.predicted_then_run(args.steps)
        for stage, seconds in timed.items():
            for kind, value in zip(KINDS, seconds):
                figures[stage, kind, "back to back"].append(value)
            cost = run.partition.stages[stage]
            figures[stage, "F", "profile"].append(cost.f)
            figures[stage, "B", "profile"].append(cost.b)
            for kind in KINDS:
                figures[stage, kind, "in steps"].append(statistics.median(
                    e.duration for events in run.traces for e in events
                    if e.stage == stage and e.action.kind.name == kind))
                figures[stage, kind, "predicted"].append(statistics.median(
                    e.duration for e in run.predicted.events
                    if e.stage == stage and e.action.kind.name == kind))
    lines = [f"stage {stage} {kind}: " + ", ".join(
        f"{name} {statistics.median(values) * 1e6:.0f}"
        for (s, k, name), values in figures.items() if (s, k) == (stage, kind))
        for stage in executor.runners for kind in KINDS]
    lines = setup.everyones(lines)
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where}, {args.partitioner} "
          f"{format_sizes(pipe.partition.sizes)}, {args.schedule}, "
          f"{args.micro_batches} micro-batches; us per micro-batch, medians of {args.rounds} "
          f"rounds")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
