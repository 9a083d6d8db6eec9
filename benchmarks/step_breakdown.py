"""Benchmark: where a pipelined step's time goes beyond the schedule the simulator times.

Compiles a bundled model into 2 stages (one per rank under torchrun) and times steps, each
beside its measured trace: the step on the wall clock, the span of the schedule's actions,
the difference (the runtime's work outside the schedule: splitting the batch, starting the
stage workers, and under torchrun the per-step size broadcast and the loss and tied-weight
gradient exchanges), and the time a stage spends in its SEND actions (the simulator counts
none).

    python benchmarks/step_breakdown.py --model gpt
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \
        benchmarks/step_breakdown.py --model gpt
"""

from __future__ import annotations

import argparse
import statistics

from two_stages import add_model_arguments, two_stages

import fxpipe
from fxpipe.schedules import ActionKind

SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)
COMPUTE = (ActionKind.F, ActionKind.B)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt", schedule=True, steps=20)
    args = parser.parse_args()
    setup = two_stages(args, partitioner="balanced", schedule=args.schedule)
    setup.warm_up(3)
    pipe, x, y = setup.pipe, setup.x, setup.y
    walls, spans, sends, counts, busy = [], [], [], [], []
    for _ in range(args.steps):
        walls.append(setup.timed_step())
        events = pipe.full_trace("timing the step")  # every rank's, on one time axis
        spans.append(max(e.end for e in events) - min(e.start for e in events))
        mine = [e for e in events if e.action.kind in SENDS]
        sends.append(sum(e.end - e.start for e in mine) / max(len(mine), 1))
        counts.append(len(mine))
        busy.append(max(sum(e.end - e.start for e in events if e.stage == s
                            and e.action.kind in COMPUTE) for s in range(2)))
    predicted = pipe.predicted_timeline(fxpipe.retime(pipe, x, target=y))  # timed afresh
    overhead = pipe.measure_step_overhead(x) * 1e3
    if not setup.reporting():
        return
    wall, span = statistics.median(walls) * 1e3, statistics.median(spans) * 1e3
    print(f"{args.model}, {setup.where}, {args.schedule}, {args.micro_batches} micro-batches, "
          f"split {list(pipe.partition.sizes)}; medians of {args.steps} steps")
    predicted_busy = max(predicted.busy) * 1e3
    print(f"link between the stages     {pipe.link}")
    print(f"predicted schedule          {predicted.makespan * 1e3:8.2f} ms (units timed after "
          "the steps)")
    print(f"predicted outside it        {overhead:8.2f} ms (pipe.step_overhead)")
    print(f"step on the wall clock      {wall:8.2f} ms")
    print(f"span of the schedule        {span:8.2f} ms")
    print(f"outside the schedule        {wall - span:8.2f} ms ({(wall - span) / wall:.0%})")
    print(f"per SEND, the sender's time {statistics.median(sends) * 1e6:8.0f} us "
          f"({statistics.median(counts)} sends per step over both stages)")
    print(f"busier stage's F+B time     {statistics.median(busy) * 1e3:8.2f} ms measured, "
          f"{predicted_busy:.2f} ms predicted")


if __name__ == "__main__":
    main()
