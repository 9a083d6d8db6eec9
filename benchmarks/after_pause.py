"""Benchmark: how fast the pipelined steps after a pause run, against steps back to back.

On a virtual machine the cores take tens of milliseconds to settle after a pause (a sleep
here; in bench, re-timing the units), and the steps meanwhile run at another speed than a
training loop's: here slower for the GPT and faster for the MLP. Pinned to one core
(`taskset -c 0`), the MLP's steps ran at that fast speed throughout, so its fast phase looks
like its two stage threads sharing a core, where (bound by the interpreter lock) they lose
less to each other. This is why `fxpipe bench` runs untimed steps for a while before the
timed ones of each round. The script prints each step's median over the rounds, and about
when it ends: the sum of the medians so far.

    python benchmarks/after_pause.py --model gpt
    python benchmarks/after_pause.py --model mlp --steps 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from two_stages import at_least_one

import fxpipe
from fxpipe.models import bundled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--pause", type=float, default=0.2, help="seconds")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=at_least_one, default=20, help="steps after each pause")
    args = parser.parse_args()
    model = bundled(args.model)
    torch.manual_seed(0)
    x, y = model.batch(args.batch, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=2, micro_batches=4, schedule="1f1b", loss_fn=model.loss_fn)
    pipe = fxpipe.compile(model.build(), plan, example_inputs=(x,), cache=False)
    rows = []
    for _ in range(args.rounds):
        time.sleep(args.pause)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            pipe.step(x, y)
            times.append(time.perf_counter() - start)
        rows.append(times)
    steps = [statistics.median(column) for column in zip(*rows)]
    print(f"{args.model}, 2 stage threads, 1f1b; step i after a {args.pause:g} s pause, median "
          f"of {args.rounds} rounds")
    elapsed = 0.0
    for i, step in enumerate(steps):
        elapsed += step
        print(f"step {i:3d}  {step * 1e3:7.2f} ms  (ends about {elapsed * 1e3:6.1f} ms after "
              "the pause)")


if __name__ == "__main__":
    main()
