"""Benchmark: each thread of a pipelined step, its time on a core and its wait for one.

The cost model times the stages' compute; the cores also run the runtime's other threads
(under torchrun gloo's event loops and its collective workers, which move every message and
the per-step broadcasts). This script compiles a bundled model into 2 stages (threads in one
process, or one per rank under torchrun), runs steps back to back, and prints per thread,
from Linux's /proc/self/task/*/schedstat: its CPU time per step and the time it was ready to
run but waited for a core. Threads of one kind are summed (the count in brackets). Beside
them: the step on the wall clock and the compute the cost model predicts for the stage(s).

    python benchmarks/thread_time.py --model gpt
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/thread_time.py --model mlp
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections import defaultdict

from two_stages import add_model_arguments, two_stages

import fxpipe


def thread_times() -> dict[str, tuple[str, float, float]]:
    """Per thread of this process, by its id: (name, seconds on a core so far, seconds it was
    ready to run but waited for one)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    times = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                ran, waited = (int(v) / 1e9 for v in stat.read().split()[:2])
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = names.get(int(task)) or comm.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        times[task] = (name, ran, waited)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt", schedule=True, steps=50)
    args = parser.parse_args()
    if not os.path.exists("/proc/self/task"):
        sys.exit("thread_time.py reads Linux's /proc/self/task/*/schedstat; run it on Linux")
    setup = two_stages(args, partitioner="balanced", schedule=args.schedule)
    pipe, x, y = setup.pipe, setup.x, setup.y
    predicted = fxpipe.retime(pipe, (x,), target=y)
    setup.warm_up(30)  # the cores settle after the timing (benchmarks/after_pause.py)
    before, start = thread_times(), time.perf_counter()
    for _ in range(args.steps):
        pipe.step(x, y)
    wall, after = (time.perf_counter() - start) / args.steps, thread_times()
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for task, (name, ran, waited) in after.items():
        _, ran0, waited0 = before.get(task, (name, 0.0, 0.0))
        kind = kinds[name.split("_")[0] if name.startswith("fxpipe-stage") else name]
        kind[0] += (ran - ran0) / args.steps
        kind[1] += (waited - waited0) / args.steps
        kind[2] += 1
    held = list(pipe.executor.runners)
    compute = sum(predicted.stages[s].f + predicted.stages[s].b for s in held) \
        * predicted.micro_batches
    lines = [f"{'stage ' + ' and '.join(map(str, held)):>16}: step {wall * 1e3:.2f} ms on the "
             f"wall clock, predicted compute (F+B) {compute * 1e3:.2f} ms",
             f"{'thread':>24}  {'CPU ms/step':>11}  {'waited for a core':>17}"]
    for name, (ran, waited, count) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        if ran * 1e3 >= 0.005:
            lines.append(f"{f'{name} ({count})':>24}  {ran * 1e3:11.3f}  {waited * 1e3:17.3f}")
    lines = setup.everyones(lines)
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where}, {args.schedule}, split {list(pipe.partition.sizes)}; "
          f"means over {args.steps} steps back to back")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
