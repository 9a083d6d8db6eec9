"""Benchmark: which measurement moves a step's prediction from one timing to the next.

`fxpipe bench` predicts each round from the units timed afresh (`fxpipe.retime`) and the
runtime's own time measured afresh (`pipe.measure_runtime_overhead`), with the link measured
again (`pipe.measure_link`), and its `pred spread` says how far those predictions moved. This
script compiles a bundled model into `--stages` stage threads of one process, takes all three
measurements in each of `--rounds` rounds (the units timed for `--min-time` seconds per
micro-batch size: compile's, by default; the bench's rounds time them for its PROFILE_SECONDS
since 37c6fc7), times `--steps` steps after each (after 0.2 s of untimed ones, as the bench runs
a round), and then predicts every round four ways: as measured; with the runtime's own times
(per step and per action) replaced by their medians over the rounds; with the units replaced by
those of the middle round by their sum (of an even count, the upper of the two); and with both,
so that only the link's per-message terms move (the time a message takes on the link is scored
with the units). What a way holds steady, the spread it loses had come from.

    OMP_NUM_THREADS=1 python benchmarks/prediction_spread.py --model mlp --stages 4
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from two_stages import add_stage_thread_arguments, at_least_one, in_stage_threads, median_step

import fxpipe
from fxpipe.cost import Link, Partition


@dataclasses.dataclass(frozen=True)
class Round:
    """One round's measurements, and the median of the steps run after them."""

    units: Partition
    forward_overhead: tuple[float, ...]
    backward_overhead: tuple[float, ...]
    step_overhead: float
    link: Link
    measured: float


def predicted(pipe: fxpipe.CompiledPipeline, units: Partition, forward: tuple[float, ...],
              backward: tuple[float, ...], step: float, link: Link) -> float:
    """The step `fxpipe bench` predicts from these measurements, in seconds; leaves `pipe`'s
    runtime's own times per action and its link set to them."""
    vars(pipe).update(forward_overhead=tuple(forward), backward_overhead=tuple(backward),
                      link=link)
    return pipe.predicted_timeline(units).makespan + step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stage_thread_arguments(parser, rounds=10)
    parser.add_argument("--steps", type=at_least_one, default=50, help="timed steps per round")
    args = parser.parse_args()
    pipe, x, y = in_stage_threads(args)
    rounds = []
    for _ in range(args.rounds):
        pipe.measure_link(x)
        units = fxpipe.retime(pipe, (x,), target=y, warmup=1, min_time=args.min_time)
        pipe.measure_runtime_overhead(x)
        rounds.append(Round(units, pipe.forward_overhead, pipe.backward_overhead,
                            pipe.step_overhead, pipe.link, median_step(pipe, x, y, args.steps)))
    totals = [sum(s.f + s.b for s in r.units.stages) for r in rounds]
    middle = rounds[int(np.argsort(totals)[len(totals) // 2])].units
    forward = tuple(np.median([r.forward_overhead for r in rounds], axis=0))
    backward = tuple(np.median([r.backward_overhead for r in rounds], axis=0))
    step = float(np.median([r.step_overhead for r in rounds]))
    ways = {
        "as measured": [predicted(pipe, r.units, r.forward_overhead, r.backward_overhead,
                                  r.step_overhead, r.link) for r in rounds],
        "runtime's own times: medians": [predicted(pipe, r.units, forward, backward, step,
                                                   r.link) for r in rounds],
        "units: the middle round's": [predicted(pipe, middle, r.forward_overhead,
                                                r.backward_overhead, r.step_overhead, r.link)
                                      for r in rounds],
        "both: the link's terms move": [predicted(pipe, middle, forward, backward, step, r.link)
                                      for r in rounds],
    }
    measured = [r.measured for r in rounds]
    print(f"{args.model}, {args.stages} stage threads, {args.partitioner} "
          f"{'+'.join(map(str, pipe.partition.sizes))}, {args.schedule}, "
          f"{args.micro_batches} micro-batches; per round, ms; spread = largest / smallest - 1")
    for name, values in [("measured", measured), *ways.items()]:
        ms = " ".join(f"{v * 1e3:6.2f}" for v in values)
        print(f"{name:30s} {ms}  spread {max(values) / min(values) - 1:.0%}")


if __name__ == "__main__":
    main()
