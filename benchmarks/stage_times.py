"""Benchmark: each stage's forward and backward in the pipeline against the cost model's.

The step's prediction is a sum of stage times; this script checks those times one by one.
It compiles a bundled model into 2 stages (threads in one process, or one per rank under
torchrun), then alternates, round by round: re-time the units and the loss (`fxpipe.retime`
with the target), run two untimed steps, then a few timed ones, and record each stage's
measured forward and backward per micro-batch (the trace's F and B actions) against the
predicted ones. It prints the median measured/predicted per stage, for the backward also
against a stage that paid the fixed cost of a backward call once per unit, as the units' own
timings did before the profile took it out (stage backward + (units − 1) · backward_call, the
call's cost as compile measured it).

Each stage's backward / forward comes summed from the units' timings and in the pipeline
and, in one process, from the stage alone too: right after the units, its own module (as the
pipeline runs it) runs the first micro-batch, forward (with the loss on the last stage) and
backward, no other stage computing. The units are timed beside a busy neighbour and the stage
alone is not, so their times differ by that; their ratios of backward to forward show whether
the units add up to the stage as it runs.

    python benchmarks/stage_times.py --model vgg --batch 64
    python benchmarks/stage_times.py --model mlp --batch 32 --rounds 8
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \
        benchmarks/stage_times.py --model gpt
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from two_stages import add_model_arguments, at_least_one, two_stages

import fxpipe
from fxpipe.report import step_time
from fxpipe.runtime.microbatch import split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt")
    parser.add_argument("--rounds", type=at_least_one, default=6)
    parser.add_argument("--steps", type=at_least_one, default=4, help="timed steps per round")
    args = parser.parse_args()

    setup = two_stages(args)
    pipe, x, y = setup.pipe, setup.x, setup.y
    p = pipe.partition.micro_batches
    call = pipe.cost.call_at(p)  # as compile measured it
    ratios: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        fresh = fxpipe.retime(pipe, (x,), target=y)
        for s, stage in enumerate(fresh.stages):
            ratios.setdefault((s, "B/F units"), []).append(stage.b / stage.f)
        if not setup.distributed:  # every stage's module is in this process
            for s, (forward, backward) in enumerate(stages_alone(pipe, x, y)):
                ratios.setdefault((s, "B/F alone"), []).append(backward / forward)
        for _ in range(2):  # untimed: the first steps after a pause are slow
            pipe.step(x, y)
        measured = []
        for _ in range(args.steps):
            pipe.step(x, y)
            measured.append(step_time(pipe.full_trace(), pipe.plan.stages))
        for s, stage in enumerate(fresh.stages):
            forward = statistics.median(m.stages[s].forward for m in measured)
            backward = statistics.median(m.stages[s].backward for m in measured)
            units = stage.units[1] - stage.units[0]
            per_unit_calls = stage.b + (units - 1) * call
            ratios.setdefault((s, "F"), []).append(forward / stage.f)
            ratios.setdefault((s, "B"), []).append(backward / stage.b)
            ratios.setdefault((s, "B per-unit calls"), []).append(backward / per_unit_calls)
            ratios.setdefault((s, "B/F in the pipeline"), []).append(backward / forward)
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where}, 2 stages {list(pipe.partition.sizes)}, batch "
          f"{args.batch}, {p} micro-batches, gpipe; median measured / predicted over "
          f"{args.rounds} rounds")
    for (s, what), values in sorted(ratios.items()):
        print(f"stage {s}  {what:19s} {statistics.median(values):.2f}  "
              f"(rounds {min(values):.2f} .. {max(values):.2f})")


def stages_alone(pipe: fxpipe.CompiledPipeline, x: Any, y: Any, repeats: int = 20
                 ) -> list[tuple[float, float]]:
    """Each stage's (forward, backward) seconds on the first micro-batch, run by its own
    runner with no other stage computing (medians of `repeats`); the last stage's forward
    includes the loss, as in a step. Every stage must be in this process."""
    executor = pipe.executor
    p = pipe.partition.micro_batches
    inputs = split(pipe.traced.bind((x,), {}), p, executor.whole)[0]
    target = split([y], p)[0][0]
    values = dict(zip(executor.comm.graph_inputs, inputs))
    times = []
    for s, runner in sorted(executor.runners.items()):
        last = s == len(executor.runners) - 1
        forwards, backwards = [], []
        for rep in range(repeats + 2):  # the first two warm up
            key = ("alone", s, rep)
            start = time.perf_counter()
            outputs = runner.forward(key, {n: values[n] for n in runner.io.inputs})
            if last:
                runner.add_root(key, pipe.plan.loss_fn(executor.model_output(outputs), target))
            forwards.append(time.perf_counter() - start)
            grads = {} if last else {
                n: torch.ones_like(outputs[n]) for n in runner.io.outputs
                if isinstance(outputs[n], torch.Tensor) and outputs[n].requires_grad}
            start = time.perf_counter()
            runner.backward(key, grads)
            backwards.append(time.perf_counter() - start)
        values.update({n: v.detach() if isinstance(v, torch.Tensor) else v
                       for n, v in outputs.items()})  # the next stage's inputs
        pipe.zero_grad(set_to_none=True)  # the runs' gradients are no step's
        times.append((statistics.median(forwards[2:]), statistics.median(backwards[2:])))
    return times


if __name__ == "__main__":
    main()
