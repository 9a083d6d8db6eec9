"""Benchmark: what a forward action costs the runtime beyond its stage module's call.

The cost model predicts a stage's F action from its units' (and, on the last stage, the
loss's) timed forwards, plus the runtime's own time per forward that compile measures
(`pipe.forward_overhead`): the runtime also detaches the stage's inputs, builds its value
dicts and records the action. This script compiles a bundled model into 2 stage threads,
times each stage module's call with forward hooks, and prints per stage the median F action
(from the trace) against the median module call, over the timed steps, and their difference
beside compile's figure. On the last stage the difference also holds the loss. Under torchrun
each rank times its own stage.

    python benchmarks/action_overhead.py --model gpt
    python benchmarks/action_overhead.py --model mlp
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/action_overhead.py --model mlp
"""

from __future__ import annotations

import argparse
import statistics
import time

from two_stages import add_model_arguments, two_stages

from fxpipe.schedules import ActionKind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt", micro_batches=False, schedule=True, steps=10)
    args = parser.parse_args()
    setup = two_stages(args, schedule=args.schedule)
    pipe, x, y = setup.pipe, setup.x, setup.y

    started: dict[int, float] = {}
    calls: dict[int, list[float]] = {0: [], 1: []}
    for s, runner in pipe.executor.runners.items():
        module = runner.stage.module
        module.register_forward_pre_hook(
            lambda m, a, s=s: started.__setitem__(s, time.perf_counter()))
        module.register_forward_hook(
            lambda m, a, o, s=s: calls[s].append(time.perf_counter() - started[s]))
    for _ in range(3):
        pipe.step(x, y)
    for timed in calls.values():
        timed.clear()
    actions: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(args.steps):
        pipe.step(x, y)
        for e in pipe.last_trace():  # this process's stages: both, or under torchrun its own
            if e.action.kind is ActionKind.F:
                actions[e.stage].append(e.duration)
    lines = []
    for s in pipe.executor.runners:
        action, call = statistics.median(actions[s]) * 1e6, statistics.median(calls[s]) * 1e6
        note = "  (includes the loss)" if s == 1 else ""
        lines.append(f"{s:5d}  {action:8.0f}  {call:11.0f}  {action - call:10.0f}  "
                     f"{pipe.forward_overhead[s] * 1e6:13.0f}{note}")
    lines = setup.everyones(lines)
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where} {list(pipe.partition.sizes)}, batch {args.batch}, "
          f"4 micro-batches, {args.schedule}; medians over {args.steps} steps, in µs")
    print("stage  F action  module call  difference  compile's own")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
