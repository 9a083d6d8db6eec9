"""Benchmark: every action of a step, predicted against measured, one line each.

action_kinds.py sums each kind of action over a step; this script shows them one by one, so a
term of the prediction that is off shows where it is added: a send's posting, the compute
after it, the compute after a wait. It compiles a bundled model into 2 stages (one per rank
under torchrun, or 2 stage threads), times the units and the runtime's own work afresh,
predicts the step, runs `--steps` steps, and prints for each action of the predicted timeline
its start, its predicted duration and the medians of its measured start and duration, and of
the gap before it (the runtime's work between a stage's actions, which the simulator charges
to the actions: the receive the driver posts before a compute shows there). The link's line
above gives the terms the prediction adds.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/action_times.py --model mlp --schedule gpipe
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from two_stages import add_model_arguments, two_stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp", schedule=True, steps=100)
    parser.add_argument("--partitioner", default="even")
    args = parser.parse_args()
    setup = two_stages(args, partitioner=args.partitioner, schedule=args.schedule)
    pipe = setup.pipe
    run = setup.predicted_then_run(args.steps)
    # (start, duration, gap: the time since the stage's action before ended, or since the
    # step's first action began; the driver's work between actions, such as posting a receive)
    spans: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for events in run.traces:
        origin = min(e.start for e in events)
        ended: dict[int, float] = {}
        for e in sorted(events, key=lambda e: (e.stage, e.start)):
            spans[str(e.action)].append((e.start - origin, e.duration,
                                         e.start - ended.get(e.stage, origin)))
            ended[e.stage] = e.end
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where}, {args.partitioner}, {args.schedule}, "
          f"{args.micro_batches} micro-batches; per action: start and duration in us, "
          f"predicted and measured, and the measured gap since the stage's action before "
          f"(medians of {args.steps} steps)")
    print(f"link: {pipe.link}")
    print("stage costs (units' + the runtime's own, per forward / backward): " + ", ".join(
        f"{(s.f + f) * 1e6:.0f} / {(s.b + b) * 1e6:.0f}" for s, f, b in
        zip(run.partition.stages, pipe.forward_overhead, pipe.backward_overhead)))
    for e in sorted(run.predicted.events, key=lambda e: (e.stage, e.start)):
        measured = spans.get(str(e.action))
        shown = ("  ".join(f"{statistics.median(column) * 1e6:{width}.0f}"
                           for column, width in zip(zip(*measured), (7, 6, 5)))
                 if measured else "      -       -      -")
        print(f"{e.action!s:10s} predicted {e.start * 1e6:7.0f}  {e.duration * 1e6:6.0f}"
              f"   measured {shown}")


if __name__ == "__main__":
    main()
