"""Benchmark: each stage's forward and backward in the pipeline against the cost model's.

The step's prediction is a sum of stage times; this script checks those times one by one.
It compiles a bundled model into 2 stages (threads in one process, or one per rank under
torchrun), then alternates, round by round: re-time the units and the loss (`fxpipe.retime`
with the target), run two untimed steps, then a few timed ones, and record each stage's
measured forward and backward per micro-batch (the trace's F and B actions) against the
predicted ones. It prints the median measured/predicted per stage, for the backward also
against a stage that paid the fixed cost of a backward call once per unit, as the units' own
timings did before the profile took it out (stage backward + (units − 1) · backward_call, the
call's cost as compile measured it).

    python benchmarks/stage_times.py --model vgg --batch 64
    python benchmarks/stage_times.py --model mlp --batch 32 --rounds 8
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \
        benchmarks/stage_times.py --model gpt
"""

from __future__ import annotations

import argparse
import statistics

from two_stages import add_model_arguments, at_least_one, two_stages

import fxpipe
from fxpipe.report import step_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt")
    parser.add_argument("--rounds", type=at_least_one, default=6)
    parser.add_argument("--steps", type=at_least_one, default=4, help="timed steps per round")
    args = parser.parse_args()

    setup = two_stages(args)
    pipe, x, y = setup.pipe, setup.x, setup.y
    p = pipe.partition.micro_batches
    call = pipe.cost.call_at(p)  # as compile measured it
    ratios: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        fresh = fxpipe.retime(pipe, (x,), target=y)
        for _ in range(2):  # untimed: the first steps after a pause are slow
            pipe.step(x, y)
        measured = []
        for _ in range(args.steps):
            pipe.step(x, y)
            measured.append(step_time(pipe.full_trace(), pipe.plan.stages))
        for s, stage in enumerate(fresh.stages):
            forward = statistics.median(m.stages[s].forward for m in measured)
            backward = statistics.median(m.stages[s].backward for m in measured)
            units = stage.units[1] - stage.units[0]
            per_unit_calls = stage.b + (units - 1) * call
            ratios.setdefault((s, "F"), []).append(forward / stage.f)
            ratios.setdefault((s, "B"), []).append(backward / stage.b)
            ratios.setdefault((s, "B per-unit calls"), []).append(backward / per_unit_calls)
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where}, 2 stages {list(pipe.partition.sizes)}, batch "
          f"{args.batch}, {p} micro-batches, gpipe; median measured / predicted over "
          f"{args.rounds} rounds")
    for (s, what), values in sorted(ratios.items()):
        print(f"stage {s}  {what:17s} {statistics.median(values):.2f}  "
              f"(rounds {min(values):.2f} .. {max(values):.2f})")


if __name__ == "__main__":
    main()
