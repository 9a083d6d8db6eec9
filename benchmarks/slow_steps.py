"""Benchmark: in the steps that run well above the median, where does the extra time go?

A small model's step on a shared machine now and then runs much slower than its neighbours,
and `fxpipe bench` shows it as a large `meas spread`. This script compiles a bundled model
into 2 stages, runs many steps, and sets the slow ones (over `--slow` times the median) beside
the others: each stage's time per kind of action (forwards, backwards, sends and receives with
their waits), averaged over each group, and how the slow steps come, alone or in runs of
consecutive steps. Computes that take longer in the slow steps mean the machine ran slower
then (no prediction from timings taken at another moment follows that); longer receives
alone mean waiting for the other stage or for the transport.

    python benchmarks/slow_steps.py --model mlp --schedule 1f1b
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \
        benchmarks/slow_steps.py --model mlp --schedule 1f1b
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Sequence

from two_stages import add_model_arguments, two_stages

from fxpipe.simulate import Event


def time_per_kind(events: Sequence[Event]) -> dict[tuple[int, str], float]:
    """Seconds each stage spent in each kind of action."""
    seconds: dict[tuple[int, str], float] = {}
    for event in events:
        key = (event.stage, event.action.kind.name)
        seconds[key] = seconds.get(key, 0.0) + event.end - event.start
    return seconds


def runs_of(indices: Sequence[int]) -> list[int]:
    """The lengths of the runs of consecutive numbers in sorted `indices`."""
    return [len(list(run)) for _, run in itertools.groupby(
        enumerate(indices), key=lambda pair: pair[1] - pair[0])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp", schedule=True, steps=2000)
    parser.add_argument("--slow", type=float, default=1.3,
                        help="a step this many times the median or more counts as slow")
    args = parser.parse_args()
    setup = two_stages(args, schedule=args.schedule)
    setup.warm_up(50)
    steps = []
    for _ in range(args.steps):
        seconds = setup.timed_step()
        steps.append((seconds, time_per_kind(setup.pipe.full_trace("timing slow steps"))))
    if not setup.reporting():
        return
    median = statistics.median(seconds for seconds, _ in steps)
    slow = [i for i, (seconds, _) in enumerate(steps) if seconds >= args.slow * median]
    lengths = runs_of(slow)
    print(f"{args.model}, {setup.where}, {args.schedule}, {args.micro_batches} micro-batches: "
          f"{args.steps} steps, median {median * 1e3:.2f} ms; {len(slow)} slow "
          f"(>= {args.slow}x the median) in {len(lengths)} runs of consecutive steps"
          + (f", the longest {max(lengths)}" if lengths else ""))
    if not slow:
        return
    slow_ones = set(slow)
    groups = [[step for i, step in enumerate(steps) if i not in slow_ones],
              [steps[i] for i in slow]]
    print(f"{'ms per step':20}{'other':>8}{'slow':>8}")
    print(f"{'step':20}" + "".join(f"{statistics.mean(s for s, _ in g) * 1e3:8.3f}"
                                   for g in groups))
    for key in sorted({key for _, kinds in steps for key in kinds}):
        means = [statistics.mean(kinds.get(key, 0.0) for _, kinds in g) for g in groups]
        print(f"{f'stage {key[0]} {key[1]}':20}" + "".join(f"{m * 1e3:8.3f}" for m in means))


if __name__ == "__main__":
    main()
