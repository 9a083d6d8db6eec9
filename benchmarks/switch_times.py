"""Benchmark: a stage's forward and backward after each kind of compute, of its own and the other's.

The units are timed each kind back to back (forwards after forwards), while a 1F1B step
switches between forwards and backwards at almost every compute. This script compiles a
bundled model into 2 stages and, on one thread with the other stage idle, times stage 0's
forward (its runner's whole forward) right after each of: its own forward, its own backward,
stage 1's forward, stage 1's backward; and stage 1's backward after the same four. It prints
the medians of `--repeats` of each, taken in turns, and the switch figures compile measured
(`pipe.forward_switch`, `pipe.backward_switch`), which the prediction adds to a compute that
follows the other kind on its thread whichever stage that was of.

    OMP_NUM_THREADS=1 python benchmarks/switch_times.py --model mlp
    OMP_NUM_THREADS=1 python benchmarks/switch_times.py --model gpt --repeats 40
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

from two_stages import add_model_arguments, at_least_one, two_stages

from fxpipe.runtime.executor import _ones_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp")
    parser.add_argument("--repeats", type=at_least_one, default=100)
    args = parser.parse_args()
    setup = two_stages(args)
    if setup.distributed:
        parser.error("both stages run on this process's thread: run it with python")
    pipe = setup.pipe
    executor = pipe.executor
    keys = itertools.count()
    runners = executor.runners

    def forward(s: int) -> tuple[float, Any]:
        key = ("switch_times", next(keys))
        start = time.perf_counter()
        outputs = runners[s].forward(key, inputs[s])
        return time.perf_counter() - start, (key, outputs)

    def backward(s: int, ran: Any) -> float:
        key, outputs = ran
        grads = _ones_for(runners[s], outputs)
        start = time.perf_counter()
        runners[s].backward(key, grads)
        return time.perf_counter() - start

    def forward_after(s: int, kind: str) -> Callable[[], float]:
        """Stage 0's forward right after stage s's compute of `kind`."""
        def timed() -> float:
            before = forward(s)[1]
            if kind == "B":
                backward(s, before)
            seconds, ran = forward(0)
            if kind == "F":
                backward(s, before)
            backward(0, ran)
            return seconds
        return timed

    def backward_after(s: int, kind: str) -> Callable[[], float]:
        """Stage 1's backward right after stage s's compute of `kind`."""
        def timed() -> float:
            ran = forward(1)[1]
            before = forward(s)[1] if (s, kind) != (1, "F") else None
            if kind == "B":
                backward(s, before)
            seconds = backward(1, ran)
            if kind == "F" and before is not None:
                backward(s, before)
            return seconds
        return timed

    cases = {f"stage 0's forward after stage {s}'s {kind}": forward_after(s, kind)
             for s in (0, 1) for kind in "FB"}
    cases |= {f"stage 1's backward after stage {s}'s {kind}": backward_after(s, kind)
              for s in (1, 0) for kind in "BF"}
    times: dict[str, list[float]] = {name: [] for name in cases}
    with executor.timing_the_stages(pipe.traced.bind((setup.x,), {})) as inputs:
        for _ in range(args.repeats):
            for name, timed in cases.items():
                times[name].append(timed())
        for runner in runners.values():
            runner.discard("switch_times")
    print(f"{args.model}, 2 stages ({' + '.join(map(str, pipe.partition.sizes))} units), one "
          f"thread; medians of {args.repeats}, us:")
    for name, seconds in times.items():
        print(f"  {name}: {statistics.median(seconds) * 1e6:.0f}")
    print(f"compile's switch figures, us per stage: a forward after a backward "
          f"{[round(t * 1e6) for t in pipe.forward_switch]}, a backward after a forward "
          f"{[round(t * 1e6) for t in pipe.backward_switch]}")


if __name__ == "__main__":
    main()
