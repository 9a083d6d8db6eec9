"""Benchmark: a stage's computes as the profile times them, as steps run them, as predicted.

The cost model takes each unit's forward and backward from the profile, which runs all the
model's units as training does, every forward, then every backward, so that a unit meets the
caches its neighbours leave. This script compiles a bundled model into 2 stages (one per rank
under torchrun, or 2 stage threads) and, in each of `--rounds` rounds, times per stage held
here, in this process, in microseconds per micro-batch:

- back to back: the stage module's forward (or a forward, untimed, and its backward) again and
  again, with every other rank waiting (in one process, the other stage thread idle);
- profile, stage as one unit: the profile run on the compiled partition's stages as units,
  every rank at once, as compile times;
- profile (compile's): the stage's units as compile times them, added up (`fxpipe.retime`);
- in steps: the stage's F and B actions over `--steps` training steps (their medians);
- predicted: the F and B actions of the step predicted from those timings, which add the
  runtime's own time per action and the link's terms (a compute after a wait, after a send).

It prints each figure's median over the rounds.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/compute_times.py --model gpt --schedule gpipe --partitioner balanced
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch.distributed as dist
from two_stages import add_model_arguments, at_least_one, two_stages

from fxpipe.inspect import format_sizes
from fxpipe.passes.analysis.profile import profile_units
from fxpipe.passes.rewrite.stages import split_stages
from fxpipe.runtime.executor import _stage_timers

KINDS = ("F", "B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt", schedule=True, steps=50)
    parser.add_argument("--partitioner", default="balanced")
    parser.add_argument("--rounds", type=at_least_one, default=3)
    parser.add_argument("--repeats", type=at_least_one, default=40,
                        help="back-to-back runs of each stage per round")
    args = parser.parse_args()
    setup = two_stages(args, partitioner=args.partitioner, schedule=args.schedule)
    pipe, executor = setup.pipe, setup.pipe.executor
    flat = pipe.traced.bind((setup.x,), {})
    inputs = executor._stage_inputs(flat)  # each held stage's first micro-batch's inputs
    bounds = tuple(pipe.partition.bounds)
    as_units = split_stages(pipe.traced.gm, pipe.units, bounds, ["cpu"] * len(bounds))
    size = [args.batch // args.micro_batches]
    figures: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        for stage, runner in executor.runners.items():
            timers = dict(zip(KINDS, _stage_timers(runner, inputs[stage])))
            for turn in range(dist.get_world_size() if setup.distributed else 1):
                if setup.distributed:
                    dist.barrier()
                if not setup.distributed or dist.get_rank() == turn:
                    for kind, timer in timers.items():
                        figures[stage, kind, "back to back"].append(
                            statistics.median(timer() for _ in range(args.repeats)))
                if setup.distributed:
                    dist.barrier()
        profiled = profile_units(*as_units, flat, size, min_time=0.05)
        run = setup.predicted_then_run(args.steps)
        for stage in executor.runners:
            for kind, times in zip(KINDS, (profiled.forward, profiled.backward)):
                figures[stage, kind, "profile, stage as one unit"].append(float(times[0][stage]))
            cost = run.partition.stages[stage]
            figures[stage, "F", "profile (compile's)"].append(cost.f)
            figures[stage, "B", "profile (compile's)"].append(cost.b)
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
    sizes = format_sizes([end - start for start, end in zip((0, *bounds[:-1]), bounds)])
    print(f"{args.model}, {setup.where}, {args.partitioner} {sizes}, "
          f"{args.schedule}, micro-batch {size[0]}; us per micro-batch, medians of "
          f"{args.rounds} rounds")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
