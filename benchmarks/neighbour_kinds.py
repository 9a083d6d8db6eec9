"""Benchmark: how much longer a stage's backward and forward take beside each kind of neighbour.

Stage threads of one process share Python's interpreter lock. A backward is mostly C++ work,
which runs without the lock, but the call still takes the lock at times. This script
compiles a bundled model into 2 stages and keeps each stage module's inputs from one step.
On this thread it then times stage 0's backward (one autograd call on its outputs, as a stage
runs it) and stage 1's forward (its module's call), the median of `--repeats` each. Each is
timed while a second thread runs one of these:

- nothing;
- a pure Python loop, which holds the lock until the interpreter's switch interval makes it
  let go;
- matrix products over and over, which release the lock;
- the other stage's forwards;
- the other stage's backwards, through one retained graph.

Under 1F1B a stage's backward runs beside the other stage's forward, and a forward beside a
backward. Under GPipe forwards mostly run beside forwards, and backwards beside backwards.
Beside the other stage, the figures for a model of short actions such as the MLP move a lot
from one run to the next: where the OS puts the two threads, and how the lock passes between
them. Run it a few times before reading much into one run.

    python benchmarks/neighbour_kinds.py --model mlp
    python benchmarks/neighbour_kinds.py --model gpt --repeats 100
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from two_stages import add_model_arguments, at_least_one, two_stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp")
    parser.add_argument("--repeats", type=at_least_one, default=200)
    parser.add_argument("--partitioner", default="even")
    args = parser.parse_args()
    setup = two_stages(args, partitioner=args.partitioner)
    if setup.distributed:
        parser.error("stage threads share a process only without torchrun: run it with python")
    pipe = setup.pipe
    first, second = (pipe.executor.runners[s].stage.module for s in (0, 1))
    inputs = _stage_inputs(pipe, [first, second], setup.x, setup.y)

    def backward_of(module: torch.nn.Module, args: list[Any]) -> Callable[[], float]:
        def timed() -> float:
            outputs = _grad_outputs(module(*args))
            ones = [torch.ones_like(o) for o in outputs]
            start = time.perf_counter()
            torch.autograd.backward(outputs, ones)
            return time.perf_counter() - start
        return timed

    def forward_of(module: torch.nn.Module, args: list[Any]) -> Callable[[], float]:
        def timed() -> float:
            start = time.perf_counter()
            module(*args)
            return time.perf_counter() - start
        return timed

    timed = {"stage 0 backward": (backward_of(first, inputs[0]), second, inputs[1]),
             "stage 1 forward": (forward_of(second, inputs[1]), first, inputs[0])}
    print(f"{args.model}, 2 stages {list(pipe.partition.sizes)}, micro-batch "
          f"{-(-args.batch // args.micro_batches)}; medians of {args.repeats}, in µs")
    print(f"{'beside':32s}" + "".join(f"{name:>18s}" for name in timed))
    for beside in NEIGHBOURS:
        row = []
        for work, other, other_args in timed.values():
            with _Neighbour(beside, other, other_args):
                row.append(statistics.median(work() for _ in range(args.repeats)) * 1e6)
        print(f"{beside:32s}" + "".join(f"{us:18.0f}" for us in row))


NEIGHBOURS = ("nothing", "a Python loop", "matrix products", "the other stage's forwards",
              "the other stage's backwards")


class _Neighbour:
    """A thread running one of NEIGHBOURS until the block ends."""

    def __init__(self, kind: str, module: torch.nn.Module, args: list[Any]) -> None:
        self.kind, self.module, self.args = kind, module, args
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        torch.set_num_threads(1)
        if self.kind == "a Python loop":
            while not self.stop.is_set():
                for _ in range(1000):
                    pass
        elif self.kind == "matrix products":
            a = torch.randn(256, 256)
            while not self.stop.is_set():
                a @ a
        elif self.kind == "the other stage's forwards":
            while not self.stop.is_set():
                self.module(*self.args)
        elif self.kind == "the other stage's backwards":
            outputs = _grad_outputs(self.module(*self.args))
            ones = [torch.ones_like(o) for o in outputs]
            while not self.stop.is_set():
                torch.autograd.backward(outputs, ones, retain_graph=True)

    def __enter__(self) -> _Neighbour:
        if self.kind != "nothing":
            self.thread.start()
            time.sleep(0.02)  # under way before the timing starts
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def _stage_inputs(pipe: Any, modules: list[torch.nn.Module], x: Any, y: Any
                  ) -> list[list[Any]]:
    """Each stage module's inputs from one training step, detached, a floating one needing
    a gradient as the stage's input leaf does."""
    seen: dict[int, list[Any]] = {}

    def keep(stage: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, args: tuple) -> None:  # None: the args stay
            seen.setdefault(stage, list(args))
        return hook

    hooks = [module.register_forward_pre_hook(keep(s)) for s, module in enumerate(modules)]
    try:
        pipe.step(x, y)
    finally:
        for hook in hooks:
            hook.remove()
    return [[a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor)
             else a for a in seen[s]] for s in range(len(modules))]


def _grad_outputs(outputs: Any) -> list[torch.Tensor]:
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    return [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]


if __name__ == "__main__":
    main()
