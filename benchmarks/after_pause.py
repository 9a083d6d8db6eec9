"""Benchmark: how long the first pipelined steps after a pause take, against steps back to back.

On a virtual machine whose idle cores are slow to come back, the steps right after any pause
(a sleep here; in bench, re-timing the units) run slower than a training loop's steps, which
is why `fxpipe bench` runs untimed steps before the timed ones of each round.

    python benchmarks/after_pause.py --model gpt
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
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--pause", type=float, default=0.2, help="seconds")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    model = bundled(args.model)
    torch.manual_seed(0)
    x, y = model.batch(args.batch, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=2, micro_batches=4, schedule="1f1b", loss_fn=model.loss_fn)
    pipe = fxpipe.compile(model.build(), plan, example_inputs=(x,), cache=False)
    after, steady = [], []
    for _ in range(args.rounds):
        time.sleep(args.pause)
        times = []
        for _ in range(6):
            start = time.perf_counter()
            pipe.step(x, y)
            times.append(time.perf_counter() - start)
        after += times[:2]
        steady += times[3:]
    first, rest = statistics.median(after) * 1e3, statistics.median(steady) * 1e3
    print(f"{args.model}, 2 stage threads, medians of {args.rounds} rounds: the 2 steps after a "
          f"{args.pause:g} s pause {first:.1f} ms, steps 4-6 back to back {rest:.1f} ms "
          f"(x{first / rest:.2f})")


if __name__ == "__main__":
    main()
