"""Benchmark: a send that wakes only its receiving stage thread, against one that wakes them all.

The local transport hands a message over under one lock. With one condition variable for every
stage, each send woke every stage thread blocked in a receive; all but one found nothing and
went back to sleep, having taken the interpreter lock and a core from the stages computing.
Now each stage waits on a condition of its own. This script compiles a bundled model into
`--stages` stage threads and alternates, round by round, between the transport as it is and
one whose sends wake every stage (the old behaviour): 0.2 s of untimed steps, then the median
of 10 timed ones. It prints the median step of each and their ratio, measured side by side.

    OMP_NUM_THREADS=1 python benchmarks/receiver_wakeups.py --model mlp --stages 4
    OMP_NUM_THREADS=1 python benchmarks/receiver_wakeups.py --model gpt --stages 2
"""

from __future__ import annotations

import argparse
import statistics
import types

import torch
from two_stages import add_model_arguments, at_least_one, median_step

import fxpipe
from fxpipe.models import bundled
from fxpipe.runtime.transport import LocalTransport


def wake_every_stage(self: LocalTransport, src: int, dst: int, direction: str, mb,
                     values) -> None:
    """LocalTransport.send as it was: every waiting stage is woken, not only `dst`."""
    payload, event = self._to_device(values, self.devices[dst])
    with self._lock:
        self._messages[(src, dst, direction, mb)] = (payload, event)
        for ready in self._ready:
            ready.notify_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp", schedule=True)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--rounds", type=at_least_one, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = bundled(args.model)
    x, y = model.batch(args.batch, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=args.stages, micro_batches=args.micro_batches,
                       schedule=args.schedule, loss_fn=model.loss_fn)
    pipe = fxpipe.compile(model.build(), plan, example_inputs=(x,), cache=False)
    transport = pipe.executor.driver.transport
    if not isinstance(transport, LocalTransport):
        parser.error("stage threads hand messages over only in one process: run it with "
                     "python, not torchrun")
    steps: dict[str, list[float]] = {"its receiver": [], "every stage": []}
    for r in range(args.rounds):
        for woken in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            if woken == "every stage":
                transport.send = types.MethodType(wake_every_stage, transport)
            else:
                vars(transport).pop("send", None)  # the class's send again
            steps[woken].append(median_step(pipe, x, y, 10))
    own, every = (statistics.median(v) for v in steps.values())
    print(f"{args.model}, {args.stages} stage threads, {args.schedule}, batch {args.batch}, "
          f"{args.micro_batches} micro-batches, {args.rounds} rounds (medians):")
    print(f"a send wakes its receiver: {own * 1e3:.2f} ms per step; every stage: "
          f"{every * 1e3:.2f} ms; every / receiver {every / own:.3f}")


if __name__ == "__main__":
    main()
