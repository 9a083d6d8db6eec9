"""Benchmark: the step predicted from units timed beside each kind of neighbour, against the
measured step.

Stage threads of one process slow each other, so compile times the units beside a busy
neighbour, and what that neighbour runs (profile_units' `load`) shapes the prediction. This
script compiles a bundled model into stage threads (`--stages`, 2 by default), then alternates,
round by round: for each load, re-time the units with it (`fxpipe.retime` for `--min-time`
seconds per micro-batch size, the target's loss too: compile counts it in the partition, as
the bench does) and predict the step as `fxpipe bench`
does (the schedule plus the runtime's time per step, per forward and per backward, measured
once per round); then run untimed steps for 0.2 s and `--steps` timed ones. The load that goes
first rotates from round to round. It prints, per load, the median measured step
over the median predicted one, and how far the rounds' predictions spread (max / min): ratios
measured side by side, against the same steps.

    python benchmarks/profile_loads.py --model mlp --schedule 1f1b
    python benchmarks/profile_loads.py --model gpt --schedule gpipe --rounds 6
    python benchmarks/profile_loads.py --model mlp --schedule gpipe --stages 4 \\
        --micro-batches 8 --min-time 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from two_stages import add_stage_thread_arguments, at_least_one, in_stage_threads, median_step

import fxpipe
from fxpipe.distributed import launched
from fxpipe.passes.analysis.profile import LOADS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stage_thread_arguments(parser, rounds=10)
    parser.set_defaults(stages=2, micro_batches=4, schedule="gpipe")
    parser.add_argument("--steps", type=at_least_one, default=3, help="timed steps per round")
    parser.add_argument("--loads", default="crossed,stage",
                        help=f"comma-separated, of {', '.join(LOADS)}")
    args = parser.parse_args()
    loads = args.loads.split(",")
    if not set(loads) <= set(LOADS):
        parser.error(f"--loads takes some of {', '.join(LOADS)}, not {args.loads!r}")
    if launched():
        parser.error("the units are timed beside a neighbour only in one process: run it "
                     "with python, not torchrun")
    pipe, x, y = in_stage_threads(args)
    if pipe.timing.concurrency < 2:
        parser.error("the units are timed beside no neighbour here (fewer than 2 stages on "
                     "the CPU), so every load times them alike")
    compiled = pipe.timing
    predicted: dict[str, list[float]] = {load: [] for load in loads}
    measured = []
    for _ in range(2):  # warm
        pipe.step(x, y)
    for r in range(args.rounds):
        pipe.measure_link(x)
        pipe.measure_runtime_overhead(x)  # per step, and per action (in the timeline)
        overhead = pipe.step_overhead
        for load in loads[r % len(loads):] + loads[:r % len(loads)]:
            pipe.timing = dataclasses.replace(compiled, load=load)
            fresh = fxpipe.retime(pipe, (x,), target=y, warmup=1, min_time=args.min_time)
            predicted[load].append(pipe.predicted_timeline(fresh).makespan + overhead)
        pipe.timing = compiled
        measured.append(median_step(pipe, x, y, args.steps))
    print(f"{args.model}, {args.stages} stage threads {list(pipe.partition.sizes)}, batch "
          f"{args.batch}, {args.micro_batches} micro-batches, {args.schedule}, {args.rounds} "
          f"rounds: measured step {statistics.median(measured) * 1e3:.2f} ms (median)")
    print("load      predicted ms  measured / predicted  spread of the predictions")
    for load, values in predicted.items():
        print(f"{load:9s} {statistics.median(values) * 1e3:12.2f}  "
              f"{statistics.median(measured) / statistics.median(values):20.2f}  "
              f"{max(values) / min(values):25.2f}")


if __name__ == "__main__":
    main()
