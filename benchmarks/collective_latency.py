"""Benchmark: how long a small gloo collective takes, by what the ranks did just before it.

A pipelined step under torchrun starts with a collective (the micro-batch sizes), and over
gloo ends without one since the loss and tied gradients go point to point into receives
posted ahead (a weight three ranks hold is still all-reduced): a collective waits for ranks
that sat idle to wake up, which this script measures. fxpipe predicts the step's time outside
its schedule from a few steps timed at compile (`pipe.step_overhead`). It times one all-reduce of a
small tensor (by default the bundled GPT's tied embedding, 128 x 64 floats) right after each
rank has: done nothing, computed (matrix products), slept, or one rank computed while the
other waited in the collective. Medians, 90th percentiles and the share of calls over 1 ms.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/collective_latency.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fxpipe.distributed import shutdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=128 * 64)
    parser.add_argument("--busy-ms", type=float, default=5.0)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    a = torch.randn(256, 256)
    tensor = torch.zeros(args.numel)

    def compute() -> None:
        end = time.perf_counter() + args.busy_ms / 1e3
        while time.perf_counter() < end:
            a @ a

    cases: list[tuple[str, Callable[[], None]]] = [
        ("nothing", lambda: None),
        ("both computed", compute),
        ("both slept", lambda: time.sleep(args.busy_ms / 1e3)),
        ("rank 0 computed, 1 waited", lambda: compute() if rank == 0 else None),
    ]
    lines = []
    for label, before in cases:
        seconds = []
        for _ in range(args.calls):
            dist.barrier()
            before()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            seconds.append(time.perf_counter() - start)
        p90 = statistics.quantiles(seconds, n=10)[-1]
        slow = sum(s > 1e-3 for s in seconds) / len(seconds)
        lines.append(f"{label:27s} {statistics.median(seconds) * 1e3:7.2f} {p90 * 1e3:7.2f}"
                     f" {slow:8.0%}")
    shutdown()  # every rank is done communicating before any tears gloo down
    if rank == 0:
        print(f"all-reduce of {args.numel} floats over {args.calls} calls, after "
              f"{args.busy_ms:g} ms of: (rank 0's times, ms)")
        print(f"{'':27s} {'median':>7s} {'p90':>7s} {'> 1 ms':>8s}")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
