"""Benchmark: each kind of action's time per step and stage, predicted against measured.

A step's prediction can come out right while its parts are wrong and make up for each other
(sends predicted too long, backwards too short). This script compiles a bundled model into
`--stages` stages (2 by default; one per rank under torchrun, else stage threads) and, in each
of `--rounds` rounds, times the units and the runtime's own work per step afresh, predicts the
step, runs `--steps` steps, and sums each stage's actions of one kind (F, B, SEND_F, RECV_B,
...) over the schedule: the predicted timeline's sum beside the median of the measured steps'
sums. It prints per round a line with the measured step and the predicted one (schedule plus the
runtime's own time), then one per stage with each kind's "predicted / measured" milliseconds.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/action_kinds.py --model mlp --schedule 1f1b
    OMP_NUM_THREADS=1 python benchmarks/action_kinds.py --model resnet --stages 4 \\
        --micro-batches 8

Under torchrun, `--late-receives` posts each receive only when its RECV action comes, instead of
before the compute ahead of it, so no message lands during a compute of its receiver (gloo
holds a message whose receive is not posted; the steps run far slower, but the computes can be
set beside the default's).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from two_stages import add_model_arguments, at_least_one, time_per_kind, two_stages

from fxpipe.distributed import launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp", schedule=True, steps=100)
    parser.add_argument("--stages", type=at_least_one, default=2)
    parser.add_argument("--partitioner", default="even")
    parser.add_argument("--rounds", type=at_least_one, default=3)
    parser.add_argument("--late-receives", action="store_true",
                        help="under torchrun, post each receive at its RECV action")
    args = parser.parse_args()
    if args.late_receives and not launched():
        parser.error("--late-receives changes the ranks' transport: run it under torchrun")
    setup = two_stages(args, partitioner=args.partitioner, schedule=args.schedule)
    pipe, x = setup.pipe, setup.x
    if args.late_receives:
        post_receives_late(pipe.executor.transport)
    lines = []
    for _ in range(args.rounds):
        overhead = pipe.measure_step_overhead(x)
        run = setup.predicted_then_run(args.steps)
        measured = [time_per_kind(events) for events in run.traces]
        expected = time_per_kind(run.predicted.events)
        lines.append(f"step {statistics.median(run.seconds) * 1e3:.2f} measured, "
                     f"{(run.predicted.makespan + overhead) * 1e3:.2f} predicted")
        for stage in range(args.stages):
            lines.append(f"  stage {stage}: " + "  ".join(
                f"{kind} {seconds * 1e3:.2f}/"
                f"{statistics.median(m.get((s, kind), 0.0) for m in measured) * 1e3:.2f}"
                for (s, kind), seconds in sorted(expected.items()) if s == stage))
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where}, {args.partitioner}, {args.schedule}, "
          f"{args.micro_batches} micro-batches; per round: ms per step, then per stage and "
          f"kind of action predicted/measured ms per step (medians of {args.steps} steps)")
    print(f"link: {pipe.link}")
    print("\n".join(lines))


def post_receives_late(transport) -> None:
    """Have `transport` (a DistTransport) post each receive when it is waited for: the driver's
    early posting does nothing."""
    posting = type(transport).prefetch

    def receive(src: int, dst: int, direction: str, mb: Any) -> dict[str, Any]:
        posting(transport, src, dst, direction, mb)
        return type(transport).recv(transport, src, dst, direction, mb)

    transport.prefetch = lambda *_: None
    transport.recv = receive


if __name__ == "__main__":
    main()
