"""Benchmark: what a forward and a backward action cost the runtime beyond their compute.

The cost model predicts a stage's F action from its units' (and, on the last stage, the
loss's) timed forwards, and its B action from their timed backwards, plus the runtime's own
time per forward and per backward that compile measures (`pipe.forward_overhead`,
`pipe.backward_overhead`): around the module's call the runtime also detaches the stage's
inputs, builds its value dicts and records the action; around the autograd call it gathers
the output gradients, fires the stage's hook and hands the input gradients back. This script
compiles a bundled model into 2 stage threads, times each stage module's call with forward
hooks and each autograd call of a backward (`StageRunner.backpropagate`), and prints per stage
and kind the median action (from the trace) against the median call, over the timed steps,
and their difference beside compile's figure. On the last stage the forward's difference also
holds the loss. Under torchrun each rank times its own stage.

    python benchmarks/action_overhead.py --model gpt
    python benchmarks/action_overhead.py --model mlp --schedule 1f1b
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/action_overhead.py --model mlp
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

from two_stages import add_model_arguments, two_stages

from fxpipe.schedules import ActionKind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt", micro_batches=False, schedule=True, steps=10)
    args = parser.parse_args()
    setup = two_stages(args, schedule=args.schedule)
    pipe, x, y = setup.pipe, setup.x, setup.y

    started: dict[int, float] = {}
    calls: dict[tuple[int, ActionKind], list[float]] = defaultdict(list)
    for s, runner in pipe.executor.runners.items():
        module = runner.stage.module
        module.register_forward_pre_hook(
            lambda m, a, s=s: started.__setitem__(s, time.perf_counter()))
        module.register_forward_hook(
            lambda m, a, o, s=s: calls[s, ActionKind.F].append(time.perf_counter() - started[s]))

        def timed(*call_args: Any, s=s, backpropagate=runner.backpropagate) -> None:
            start = time.perf_counter()
            backpropagate(*call_args)
            calls[s, ActionKind.B].append(time.perf_counter() - start)

        runner.backpropagate = timed
    for _ in range(3):
        pipe.step(x, y)
    calls.clear()
    actions: dict[tuple[int, ActionKind], list[float]] = defaultdict(list)
    for _ in range(args.steps):
        pipe.step(x, y)
        for e in pipe.last_trace():  # this process's stages: both, or under torchrun its own
            if e.action.kind in (ActionKind.F, ActionKind.B):
                actions[e.stage, e.action.kind].append(e.duration)
    lines = []
    for s in pipe.executor.runners:
        for kind, own in ((ActionKind.F, pipe.forward_overhead),
                          (ActionKind.B, pipe.backward_overhead)):
            action = statistics.median(actions[s, kind]) * 1e6
            call = statistics.median(calls[s, kind]) * 1e6
            note = "  (includes the loss)" if s == 1 and kind is ActionKind.F else ""
            lines.append(f"{s:5d}  {kind.value:4s}  {action:6.0f}  {call:11.0f}  "
                         f"{action - call:10.0f}  {own[s] * 1e6:13.0f}{note}")
    lines = setup.everyones(lines)
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where} {list(pipe.partition.sizes)}, batch {args.batch}, "
          f"4 micro-batches, {args.schedule}; medians over {args.steps} steps, in µs")
    print("stage  kind  action         call  difference  compile's own")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
