"""Benchmark: how a term of the measured link changes the prediction's error, in one run.

Compiles a bundled model into 2 stages (one per rank under torchrun), and in each of
`--rounds` rounds times the units afresh, times the runtime's own work per step, runs
`--steps` steps and predicts the step twice from the same timings: with the link as measured,
and with `--term` (a Link field, e.g. after_receive or after_send) set to 0. It prints
measured/predicted per round for both, so the two predictions meet the same steps.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/link_terms.py --model gpt --schedule 1f1b --term after_receive
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from two_stages import add_model_arguments, at_least_one, two_stages

import fxpipe
from fxpipe.cost import Link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt", schedule=True, steps=30)
    parser.add_argument("--partitioner", default="even")
    parser.add_argument("--term", default="after_receive",
                        choices=[f.name for f in dataclasses.fields(Link)
                                 if f.type in ("float", "float | None")
                                 and f.name not in ("latency", "bandwidth")])
    parser.add_argument("--rounds", type=at_least_one, default=3)
    args = parser.parse_args()
    setup = two_stages(args, partitioner=args.partitioner, schedule=args.schedule)
    pipe, x, y = setup.pipe, setup.x, setup.y
    measured_link = pipe.link
    without_term = dataclasses.replace(measured_link, **{args.term: 0.0})
    ratios: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        fresh = fxpipe.retime(pipe, (x,), target=y, warmup=1, repeats=5)
        overhead = pipe.measure_step_overhead(x)
        setup.warm_up(20)  # the cores settle after the timing (benchmarks/after_pause.py)
        walls = [setup.timed_step() for _ in range(args.steps)]
        predicted = []
        for link in (measured_link, without_term):
            vars(pipe)["link"] = link
            predicted.append(pipe.predicted_timeline(fresh).makespan + overhead)
        vars(pipe)["link"] = measured_link
        measured = statistics.median(walls)
        ratios.append((measured / predicted[0], measured / predicted[1]))
    if not setup.reporting():
        return
    value = getattr(measured_link, args.term)
    print(f"{args.model}, {setup.where}, {args.partitioner}, {args.schedule}, "
          f"{args.micro_batches} micro-batches; {args.term} = "
          f"{'None' if value is None else f'{value * 1e6:.0f} us'}; medians of {args.steps} "
          "steps per round")
    print("meas/pred with it:   " + "  ".join(f"{a:.3f}" for a, _ in ratios))
    print("meas/pred without:   " + "  ".join(f"{b:.3f}" for _, b in ratios))


if __name__ == "__main__":
    main()
