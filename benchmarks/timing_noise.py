"""Benchmark: how repeatable a stage's predicted and measured times are on this machine.

A prediction is only as good as the unit timings it was made from. This script compiles a
bundled model into 2 stages once, then alternates, round by round: re-time the units
(`fxpipe.retime`, as compile times them) and record the predicted step (the schedule plus the
runtime's time per step, as `fxpipe bench` predicts it); run untimed steps for 0.2 s (as
`fxpipe bench` does by default), then a few timed ones, and record the measured step. It prints
both per round and their spread (max / min), so a user can see how far apart two identical
timings land here before reading a measured/predicted ratio. `--min-time` takes several values,
comma-separated, to compare how long the units' timed repetitions run
(`fxpipe.retime(min_time=...)`): each round then predicts once with each, against the same
measured steps.

    python benchmarks/timing_noise.py --model vgg --rounds 8
    python benchmarks/timing_noise.py --model mlp --batch 32 --rounds 8 --steps 10
    python benchmarks/timing_noise.py --model mlp --batch 32 --rounds 15 --steps 10 \
        --partitioner even --min-time 0,0.05
    python benchmarks/timing_noise.py --model mlp --batch 32 --rounds 10 --steps 50 \
        --partitioner balanced --schedule 1f1b --min-time 0.05,0.5
"""

from __future__ import annotations

import argparse
import statistics

import torch
from two_stages import TwoStages

import fxpipe
from fxpipe.models import bundled
from fxpipe.passes.analysis.profile import MIN_TIMED


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--profile-repeats", type=int, default=5,
                        help="timed runs of each unit per re-timing (the median counts)")
    parser.add_argument("--min-time", type=_seconds, default=[MIN_TIMED],
                        help="seconds the timed runs of the units take at least, per "
                             "re-timing; several, comma-separated, to compare them")
    parser.add_argument("--partitioner", default="balanced")
    parser.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"])
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")

    model = bundled(args.model)
    torch.manual_seed(0)
    net = model.build()
    x, y = model.batch(args.batch, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=2, partitioner=args.partitioner, micro_batches=args.micro_batches,
                       schedule=args.schedule, loss_fn=model.loss_fn)
    pipe = fxpipe.compile(net, plan, example_inputs=(x,), cache=False)
    setup = TwoStages(pipe, model, x, y, distributed=False)
    setup.warm_up(2)
    predicted: dict[float, list[float]] = {t: [] for t in args.min_time}
    measured = []
    print(f"{args.model}, 2 stages {list(pipe.partition.sizes)}, batch {args.batch}, "
          f"{args.micro_batches} micro-batches, {args.schedule}")
    labels = [f"predicted ms ({t:g} s)" for t in args.min_time]
    print("round  " + "  ".join(labels) + "  measured ms")
    for r in range(args.rounds):
        # each as fxpipe bench predicts: the schedule plus the runtime's time per step
        for min_time in args.min_time if r % 2 == 0 else args.min_time[::-1]:
            fresh = fxpipe.retime(pipe, (x,), target=y, repeats=args.profile_repeats,
                                  min_time=min_time)
            predicted[min_time].append((pipe.predicted_timeline(fresh).makespan
                                        + pipe.measure_step_overhead(x)) * 1e3)
        measured.append(setup.settled_step(args.steps) * 1e3)
        print(f"{r:5d}  " + "  ".join(f"{predicted[t][-1]:{len(label)}.1f}"
                                      for t, label in zip(args.min_time, labels))
              + f"  {measured[-1]:11.1f}")
    rows = [(f"predicted ({t:g} s)", values) for t, values in predicted.items()]
    for name, values in [*rows, ("measured", measured)]:
        print(f"{name}: median {statistics.median(values):.1f} ms, spread (max / min) "
              f"{max(values) / min(values):.2f}")
    for t, values in predicted.items():
        ratios = [m / p for m, p in zip(measured, values)]
        print(f"min_time {t:g} s: median measured / median predicted "
              f"{statistics.median(measured) / statistics.median(values):.2f}; rounds' "
              f"measured / predicted {min(ratios):.2f} .. {max(ratios):.2f}")


def _seconds(text: str) -> list[float]:
    """An argparse type: comma-separated non-negative seconds."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"give non-negative seconds, comma-separated, not "
                                         f"{text!r}")
    return values


if __name__ == "__main__":
    main()
