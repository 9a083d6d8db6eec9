"""Benchmark: what the profile measures for a model, alone and beside a busy neighbour.

Times a bundled model's units as compile does (micro-batch size batch / micro-batches), with
the plan's loss on a target: with no other work (concurrency 1), and beside a background
worker (concurrency 2) that runs the units as a second stage does, runs only their forwards,
only their backwards (through one retained graph), or the other kind of work than the timed one
(what the local runtime's 2 stage threads are timed with: forwards beside backwards, backwards
beside forwards); `--rounds` times each, alternating. It prints the sums of the units' forward
and backward times, the fixed cost of one backward call the profile takes out of them, and the
loss's forward and backward: how much each kind of neighbour slows each part (for a small
model, mostly through Python's global interpreter lock, which a forward holds between its
operators and a backward, run by autograd's engine in C++, mostly does not).

    python benchmarks/profile_parts.py --model mlp
    python benchmarks/profile_parts.py --model gpt
"""

from __future__ import annotations

import argparse

from two_stages import add_model_arguments, at_least_one, two_stages

from fxpipe.passes.analysis.profile import profile_units
from fxpipe.passes.rewrite.stages import split_stages

# what runs beside the timed units: (label, concurrency, the background worker's load)
NEIGHBOURS = [("nothing", 1, "stage"), ("a stage", 2, "stage"), ("forwards", 2, "forwards"),
              ("backwards", 2, "backwards"), ("other kind", 2, "crossed")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp")
    parser.add_argument("--rounds", type=at_least_one, default=2)
    args = parser.parse_args()
    setup = two_stages(args)
    pipe, model, x, y = setup.pipe, setup.model, setup.x, setup.y
    k = len(pipe.units)
    graph, table = split_stages(pipe.traced.gm, pipe.units, range(1, k + 1), ["cpu"] * k)
    size = -(-args.batch // args.micro_batches)

    def loss(outputs, size):
        return model.loss_fn(pipe.executor.model_output(outputs), y[:size])

    print(f"{args.model}: {k} units, micro-batch {size}; sums over the units, in µs")
    print("beside      forward  backward  backward call  loss forward  loss backward")
    for _ in range(args.rounds):
        for beside, concurrency, load in NEIGHBOURS:
            prof = profile_units(graph, table, [x], [size], concurrency=concurrency, loss=loss,
                                 load=load)
            us = [v * 1e6 for v in (prof.forward.sum(), prof.backward.sum(),
                                    prof.backward_call[0], prof.loss_forward[0],
                                    prof.loss_backward[0])]
            print(f"{beside:10s}  {us[0]:7.0f}  {us[1]:8.0f}  {us[2]:13.0f}  "
                  f"{us[3]:12.0f}  {us[4]:13.0f}")


if __name__ == "__main__":
    main()
