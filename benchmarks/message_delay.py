"""Benchmark: how late each pipeline message arrives beyond its send, step by step.
The simulator has a message arrive a latency plus its bytes over the bandwidth after its SEND
is posted. This script compiles a bundled model into 2 stages (one per rank under torchrun,
or 2 stage threads), runs steps back to back, and for every message of every step takes the
delay: the end of its RECV less the later of the RECV's start and the end of its SEND (both
ranks' traces on one clock). Per message of the schedule it prints the median delay, the
90th percentile, the largest, and how many steps waited over 1 ms and over 4 ms for it.
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/message_delay.py --model gpt --schedule gpipe
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from two_stages import add_model_arguments, two_stages

from fxpipe.report import receive_waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt", schedule=True, steps=100)
    args = parser.parse_args()
    setup = two_stages(args, partitioner="balanced", schedule=args.schedule)
    setup.warm_up(20)
    pipe, x, y = setup.pipe, setup.x, setup.y
    delays: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.steps):
        pipe.step(x, y)
        for (receive, _), delay in receive_waits(pipe.full_trace()).items():
            delays[f"{receive.kind.name[-1]}{receive.mb}"].append(delay)  # RECV_F / RECV_B
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where}, {args.schedule}, {args.micro_batches} micro-batches; "
          f"delay of each message beyond its send, over {args.steps} steps (ms)")
    print(f"{'message':>8} {'median':>7} {'p90':>7} {'max':>7} {'>1 ms':>6} {'>4 ms':>6}")
    for name, values in sorted(delays.items()):
        values.sort()
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        print(f"{name:>8} {statistics.median(values) * 1e3:7.2f} {p90 * 1e3:7.2f} "
              f"{values[-1] * 1e3:7.2f} {sum(v > 1e-3 for v in values):6d} "
              f"{sum(v > 4e-3 for v in values):6d}")


if __name__ == "__main__":
    main()
