"""Benchmark: how repeatable a stage's predicted and measured times are on this machine.

A prediction is only as good as the unit timings it was made from. This script compiles a
bundled model into 2 stages once, then alternates, round by round: re-time the units
(`fxpipe.retime`, as compile times them) and record the predicted step (the schedule plus the
runtime's time per step, as `fxpipe bench` predicts it); run two untimed steps, then a few
timed ones, and record the measured step. It prints both per round and their spread
(max / min), so a user can see how far apart two identical timings land here before reading a
measured/predicted ratio.

    python benchmarks/timing_noise.py --model vgg --rounds 8
    python benchmarks/timing_noise.py --model mlp --batch 32 --rounds 8 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fxpipe
from fxpipe.models import bundled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--profile-repeats", type=int, default=5,
                        help="timed runs of each unit per re-timing (the median counts)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")

    model = bundled(args.model)
    torch.manual_seed(0)
    net = model.build()
    x, y = model.batch(args.batch, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=2, partitioner="balanced", micro_batches=args.micro_batches,
                       loss_fn=model.loss_fn)
    pipe = fxpipe.compile(net, plan, example_inputs=(x,), cache=False)
    for _ in range(2):
        pipe.step(x, y)
    predicted, measured = [], []
    print(f"{args.model}, 2 stages {list(pipe.partition.sizes)}, batch {args.batch}, "
          f"{args.micro_batches} micro-batches, gpipe")
    print("round  predicted ms  measured ms  meas/pred")
    for r in range(args.rounds):
        # predicted as fxpipe bench predicts: the schedule plus the runtime's time per step
        timeline = pipe.predicted_timeline(fxpipe.retime(pipe, (x,), target=y,
                                                          repeats=args.profile_repeats))
        predicted.append((timeline.makespan + pipe.measure_step_overhead(x)) * 1e3)
        for _ in range(2):  # untimed, as in fxpipe bench: the first steps after a pause are slow
            pipe.step(x, y)
        steps = []
        for _ in range(args.steps):
            start = time.perf_counter()
            pipe.step(x, y)
            steps.append((time.perf_counter() - start) * 1e3)
        measured.append(statistics.median(steps))
        print(f"{r:5d}  {predicted[-1]:12.1f}  {measured[-1]:11.1f}  "
              f"{measured[-1] / predicted[-1]:9.2f}")
    for name, values in (("predicted", predicted), ("measured", measured)):
        print(f"{name}: median {statistics.median(values):.1f} ms, spread (max / min) "
              f"{max(values) / min(values):.2f}")
    print(f"median measured / median predicted: "
          f"{statistics.median(measured) / statistics.median(predicted):.2f}")


if __name__ == "__main__":
    main()
