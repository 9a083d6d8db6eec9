"""Benchmark: in the steps that run well above the median, where does the extra time go?

A small model's step on a shared machine now and then runs much slower than its neighbours,
and `fxpipe bench` shows it as a large `meas spread`. This script compiles a bundled model
into 2 stages, runs many steps, and sets the slow ones (`--slow` times the median or more, by
rank 0's clock under torchrun) beside the others: each stage's time per kind of action
(forwards, backwards, and sends and receives, a receive's wait for its message included),
averaged over each group, and how the slow steps come, alone or in runs of consecutive steps.
Computes that take longer in the slow steps mean the machine ran slower then, which no
prediction from timings taken at another moment follows; longer sends mean the transport
held up the sender; longer receives alone, a stage waiting for the other's compute or for
the transport. The steps' traces are gathered after the last step, as gathering
communicates.

    python benchmarks/slow_steps.py --model mlp --schedule 1f1b
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \
        benchmarks/slow_steps.py --model mlp --schedule 1f1b
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Sequence

from two_stages import add_model_arguments, time_per_kind, two_stages


def above_one(text: str) -> float:
    """argparse type: a factor above 1."""
    value = float(text)
    if not value > 1:
        raise argparse.ArgumentTypeError(f"{text}: give a factor above 1, e.g. 1.3")
    return value


def runs_of(indices: Sequence[int]) -> list[int]:
    """The lengths of the runs of consecutive numbers in increasing `indices`."""
    return [len(list(run)) for _, run in itertools.groupby(
        enumerate(indices), key=lambda pair: pair[1] - pair[0])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp", schedule=True, steps=2000)
    parser.add_argument("--slow", type=above_one, default=1.3,
                        help="a step this many times the median or more counts as slow")
    args = parser.parse_args()
    setup = two_stages(args, schedule=args.schedule)
    setup.warm_up(50)
    executor = setup.pipe.executor
    walls, kept = [], []
    for _ in range(args.steps):
        walls.append(setup.timed_step())
        kept.append((executor.last_trace(), executor.trace_origin))
    kinds = [time_per_kind(events) for events in executor.full_traces(kept)]
    if not setup.reporting():
        return
    median = statistics.median(walls)
    slow = [i for i, seconds in enumerate(walls) if seconds >= args.slow * median]
    lengths = runs_of(slow)
    print(f"{args.model}, {setup.where}, {args.schedule}, {args.micro_batches} micro-batches: "
          f"{args.steps} steps, median {median * 1e3:.2f} ms; {len(slow)} slow "
          f"({args.slow}x the median or more) in {len(lengths)} runs of consecutive steps"
          + (f", the longest {max(lengths)}" if lengths else ""))
    if not slow:
        return
    slow_ones = set(slow)
    groups = [[i for i in range(args.steps) if i not in slow_ones], slow]
    print(f"{'ms per step':20}{'other':>8}{'slow':>8}")
    print(f"{'step':20}" + "".join(f"{statistics.mean(walls[i] for i in g) * 1e3:8.3f}"
                                   for g in groups))
    for key in sorted({key for step in kinds for key in step}):
        means = [statistics.mean(kinds[i].get(key, 0.0) for i in g) for g in groups]
        print(f"{f'stage {key[0]} {key[1]}':20}" + "".join(f"{m * 1e3:8.3f}" for m in means))


if __name__ == "__main__":
    main()
