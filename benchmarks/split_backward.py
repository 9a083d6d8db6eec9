"""The zero-bubble split backward (B, then W) against the unsplit backward, on one stage.

    python benchmarks/split_backward.py

For each stack, a forward then either the unsplit backward (torch.autograd.backward) or the
runtime's split (runtime/split_backward.py: input_backward, then weight_backward), the stack's
input requiring a gradient as a later stage's does. The two alternate step by step in one
process with one intra-op thread; it prints the median (min-max) over rounds of each round's
median, and split / unsplit.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import median_ms, spread
from torch import nn

from fxpipe.runtime.split_backward import input_backward, weight_backward

STACKS = {  # name: (layers, width, batch)
    "4 x Linear(1024), batch 8": (4, 1024, 8),
    "24 x Linear(16), batch 8": (24, 16, 8),
}


def stack(layers: int, width: int) -> nn.Sequential:
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width),
                                                                nn.ReLU())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per round and way")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| stack | unsplit ms | B + W ms | split / unsplit |\n| --- | --- | --- | --- |")
    for name, (layers, width, batch) in STACKS.items():
        torch.manual_seed(0)
        rounds = measure(stack(layers, width), torch.randn(batch, width, requires_grad=True),
                         args.rounds, args.repeats)
        ratio = [s / u for u, s in rounds]
        print(f"| {name} | {spread([r[0] for r in rounds])} | {spread([r[1] for r in rounds])} "
              f"| {spread(ratio)} |")


def measure(model: nn.Module, x: torch.Tensor, rounds: int, repeats: int
            ) -> list[tuple[float, float]]:
    """Per round, the median ms of the unsplit and of the split backward (with the forward)."""
    def unsplit() -> None:
        torch.autograd.backward([model(x).square().sum()])

    def split() -> None:
        _, work = input_backward([model(x).square().sum()], [None], [x])
        weight_backward(work)

    medians = []
    for _ in range(rounds):
        unsplit(), split()  # warm-up
        taken: dict[str, list[float]] = {"unsplit": [], "split": []}
        for _ in range(repeats):  # alternating, so drift falls on both alike
            taken["unsplit"].append(median_ms(unsplit, 1))
            taken["split"].append(median_ms(split, 1))
        medians.append((statistics.median(taken["unsplit"]), statistics.median(taken["split"])))
    return medians

if __name__ == "__main__":
    main()
