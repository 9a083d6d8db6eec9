"""Benchmark: computes right after a wait for a message against the others, in steps and predicted.

Under torchrun the cost model has a stage's first compute after it blocked in a receive take
the link's `resume` longer (one figure per stage, measured by the ranks taking turns, each
woken from a receive while the other computed a whole forward and backward). This script asks
whether the steps show that much. It compiles a bundled model into 2 stages (one per rank
under torchrun, or 2 stage threads), times the units and the runtime's own work afresh,
predicts the step, runs `--steps` steps, and sorts every forward and backward, measured and
predicted, by whether the action before it on its stage was a receive that took over
`--waited` seconds (a wait: the driver posts a receive before the compute ahead of it, so a
receive's action is mostly its wait). Per stage and kind it prints the median of each group,
measured beside predicted, with the compute's figure in the cost table and the link's
`resume`.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/after_wait.py --model resnet --schedule 1f1b
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Iterable

import numpy as np
from two_stages import add_model_arguments, two_stages

from fxpipe.inspect import format_sizes
from fxpipe.simulate import Event

KINDS = ("F", "B")
GROUPS = ("after a wait", "without")


def computes_by_wait(events: Iterable[Event], waited: float
                     ) -> dict[tuple[int, str, str], list[float]]:
    """Seconds of each F and B of `events` (one step's, any stages), keyed by (stage, kind,
    group): "after a wait" where the stage's action before it was a receive that took over
    `waited` seconds, else "without"."""
    by_stage: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_stage[e.stage].append(e)
    groups: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    for stage, actions in by_stage.items():
        before = None
        for e in sorted(actions, key=lambda e: e.start):
            kind = e.action.kind.name
            if kind in KINDS:
                after_wait = (before is not None and before.action.kind.is_recv
                              and before.duration > waited)
                groups[stage, kind, GROUPS[0] if after_wait else GROUPS[1]].append(e.duration)
            before = e
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "resnet", schedule=True, steps=40)
    parser.add_argument("--partitioner", default="balanced")
    parser.add_argument("--waited", type=float, default=3e-4,
                        help="seconds a receive takes, over which it counts as a wait")
    args = parser.parse_args()
    setup = two_stages(args, partitioner=args.partitioner, schedule=args.schedule)
    run = setup.predicted_then_run(args.steps)
    measured: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    for trace in run.traces:
        for key, seconds in computes_by_wait(trace, args.waited).items():
            measured[key] += seconds
    predicted = computes_by_wait(run.predicted.events, args.waited)
    if not setup.reporting():
        return
    pipe = setup.pipe
    resume = "/".join(f"{r * 1e6:.0f}" for r in np.atleast_1d(pipe.link.resume))
    print(f"{args.model}, {setup.where}, {args.partitioner} "
          f"{format_sizes(pipe.partition.sizes)}, {args.schedule}, {args.micro_batches} "
          f"micro-batches; resume {resume} us; medians in us (count), measured / predicted, "
          f"of {args.steps} steps")
    for stage, cost in enumerate(run.partition.stages):
        for kind, figure in zip(KINDS, (cost.f, cost.b)):
            cells = []
            for group in GROUPS:
                key = (stage, kind, group)
                mine, theirs = measured.get(key), predicted.get(key)
                cells.append(f"{group} " + " / ".join(
                    f"{statistics.median(v) * 1e6:.0f} ({len(v)})" if v else "-"
                    for v in (mine, theirs)))
            print(f"stage {stage} {kind}: cost table {figure * 1e6:.0f}; " + "; ".join(cells))


if __name__ == "__main__":
    main()
