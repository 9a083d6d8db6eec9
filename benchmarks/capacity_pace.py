"""Benchmark: stage threads past the cores paced by their measured thread capacity, not by cores.

Where stage threads outnumber the cores, fxpipe times the units beside every other stage thread
busy (less the waits for a core) and the simulator gives the k stages computing at once
min(1, cores / k) of that pace each. The units' times then hold the slowdown of every thread
busy (the interpreter lock, shared caches) even where the schedule leaves some idle. This
script tries two predictions that take that slowdown from the measured thread capacity c(k)
instead (`thread_capacity`: the share of one thread's work that k threads get through at once,
running all the units as a stage does), so that it follows how many stages compute:

- "busy, by capacity": the units timed as fxpipe times them, taken to run at
  busy = c(K) / K / min(1, cores / K) of one thread alone (K: the stage threads); each of k
  computing stages goes at c(k) / k of one thread alone, so at (c(k) / k) / busy of its timed
  pace.
- "alone, by capacity": the units timed with no other stage thread busy, and k computing
  stages at c(k) / k of that pace each.

It compiles a bundled model into `--stages` stage threads and, in each of `--rounds` rounds,
measures the thread capacity at every k up to the stages, the link and the runtime's own time,
re-times the units both ways, in turns which first, for `--min-time` seconds per micro-batch
size (the bench's PROFILE_SECONDS by default) and predicts the step the three ways, then runs
untimed steps for 0.2 s and timed ones for `--seconds`. It prints each round's figures, and
per prediction the median measured step over its median prediction and how far the rounds'
predictions spread.

    OMP_NUM_THREADS=1 python benchmarks/capacity_pace.py --model mlp --schedule gpipe
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable
from unittest import mock

from two_stages import add_stage_thread_arguments, in_stage_threads, median_step

import fxpipe
from fxpipe import simulate
from fxpipe.affinity import usable_cores
from fxpipe.batching import input_dims
from fxpipe.bench import PROFILE_SECONDS
from fxpipe.compile.front import split_into_units
from fxpipe.passes.analysis.capacity import thread_capacity

PREDICTIONS = ("fxpipe", "busy, by capacity", "alone, by capacity")
Pace = Callable[[simulate._Run], float]


def paced_by(capacity: dict[int, float], timed_pace: float) -> Pace:
    """A replacement for the simulator's pace: k computing stages at c(k) / k of one thread
    alone each, over `timed_pace`, the pace the units' times stand for."""
    def pace(run: simulate._Run) -> float:
        working = sum(run._shares(s, w.cpu_bound) for s, w in run.work.items())
        return capacity[working] / working / timed_pace if working else 1.0
    return pace


def predicted_ms(pipe: fxpipe.CompiledPipeline, costs: fxpipe.Partition,
                 pace: Pace | None = None) -> float:
    """The bench's prediction from `costs`, with the simulator's pace replaced by `pace`."""
    if pace is None:
        return (pipe.predicted_timeline(costs).makespan + pipe.step_overhead) * 1e3
    with mock.patch.object(simulate._Run, "_pace", pace):
        return (pipe.predicted_timeline(costs).makespan + pipe.step_overhead) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stage_thread_arguments(parser, rounds=6)
    parser.set_defaults(min_time=PROFILE_SECONDS)
    parser.add_argument("--seconds", type=float, default=0.3, help="of timed steps per round")
    args = parser.parse_args()
    cores = usable_cores()
    if args.stages <= cores:
        parser.error(f"--stages {args.stages}: give more stage threads than this machine's "
                     f"{cores} cores, where fxpipe shares the cores out among them")
    pipe, x, y = in_stage_threads(args)
    stages = args.stages
    unit_graph, unit_table = split_into_units(pipe.traced.gm, pipe.units, "cpu")
    flat = pipe.traced.bind((x,), {})
    size = -(-input_dims(flat, pipe.executor.whole).batch // pipe.partition.micro_batches)
    busy = pipe.timing
    alone = dataclasses.replace(busy, concurrency=1)
    figures: dict[str, list[float]] = {name: [] for name in PREDICTIONS}
    measured: list[float] = []
    print(f"{args.model}, {stages} stage threads on {cores} cores, {args.partitioner} "
          f"{'+'.join(map(str, pipe.partition.sizes))}, {args.schedule}, "
          f"{args.micro_batches} micro-batches; ms")
    for index in range(args.rounds):
        capacity = thread_capacity(unit_graph, unit_table, flat, size,
                                   range(1, stages + 1), threads=busy.threads,
                                   whole=pipe.executor.whole)
        pipe.measure_link(x)
        pipe.measure_runtime_overhead(x)
        ways = {"busy": busy, "alone": alone}
        timings = {}
        for way in ways if index % 2 == 0 else reversed(ways):
            pipe.timing = ways[way]
            try:
                timings[way] = fxpipe.retime(pipe, (x,), target=y, warmup=1,
                                             min_time=args.min_time)
            finally:
                pipe.timing = busy
        timed, timed_alone = timings["busy"], timings["alone"]
        busy_pace = capacity[stages] / stages / min(1.0, cores / stages)
        round_figures = {
            "fxpipe": predicted_ms(pipe, timed),
            "busy, by capacity": predicted_ms(pipe, timed, paced_by(capacity, busy_pace)),
            "alone, by capacity": predicted_ms(pipe, timed_alone, paced_by(capacity, 1.0)),
        }
        measured.append(median_step(pipe, x, y, steps=3, seconds=args.seconds) * 1e3)
        for name, value in round_figures.items():
            figures[name].append(value)
        print(f"round {index}: capacity "
              + " ".join(f"{k}:{c:.2f}" for k, c in capacity.items())
              + f"; measured {measured[-1]:.2f}; predicted "
              + ", ".join(f"{name} {value:.2f}" for name, value in round_figures.items()))
    step = statistics.median(measured)
    for name, values in figures.items():
        print(f"{name}: measured / predicted {step / statistics.median(values):.3f}, "
              f"predictions spread {max(values) / min(values) - 1:.0%}")


if __name__ == "__main__":
    main()
