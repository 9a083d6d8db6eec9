"""Benchmark: how much slower a small compute runs while a gloo message lands on its rank.

A pipeline stage under torchrun posts its next receive before it computes, so the message often
lands during the compute, and gloo's I/O thread takes it in meanwhile. Rank 1 here runs a small
model's forward (with its loss) and backward again and again, as a last stage does, and times
each. Rank 0 meanwhile sleeps ("alone"), computes ("other computes"), sends rank 1 one message
per forward and backward, whose receive rank 1 posts right before the forward ("messages land"),
or computes between those sends ("both"). Every thread of each rank is bound to a core of its
own, as fxpipe bound ranks before 940db6f (`fxpipe.affinity.pin_process`); with `--free-gloo`,
gloo's I/O threads (named `gloo_tcp_loop`) may run on any of the two cores, as fxpipe leaves
them since. Prints per case the medians of
the forward and of the backward, the share of rank 1's waits for a message after them that
blocked, and the medians over the forwards and backwards right after a wait that did not: a
compute right after a blocking wait runs slower whether or not a message lands in it.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/landing_cost.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/landing_cost.py \\
        --free-gloo
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.affinity import bind_io_threads, pin_process
from fxpipe.cli import at_least_one
from fxpipe.distributed import shutdown

CASES = ("alone", "other computes", "messages land", "both")
WAITED = 20e-6  # a wait for a message that arrived during the compute returns sooner


def busy(seconds: float) -> None:
    """Compute small operators, not sleep, for `seconds`."""
    a, w = torch.randn(8, 64), torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        (a @ w).relu().sum()


def last_stage(iterations: int, message: torch.Tensor | None, group
               ) -> tuple[list, list, list]:
    """Rank 1: forward with loss, then backward, `iterations` times, each iteration's receive
    posted before its forward (None: no message); the seconds of each forward and backward,
    and of each wait for the message after them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(8, 64, requires_grad=True), torch.randint(0, 10, (8,))
    forwards, backwards, waits = [], [], []
    for _ in range(iterations):
        work = dist.irecv(message, 0, group) if message is not None else None
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        forwards.append(middle - start)
        backwards.append(end - middle)
        if work is not None:
            work.wait()
        waits.append(time.perf_counter() - end)
    return forwards, backwards, waits


def after_no_wait(times: list[float], waits: list[float]) -> list[float]:
    """`times` of the iterations whose last one's wait did not block (under WAITED): a
    compute right after a wait runs slower for other reasons (ACCURACY.md, "resume")."""
    return [t for t, before in zip(times[1:], waits) if before < WAITED]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=at_least_one, default=2000, help="per case")
    parser.add_argument("--numel", type=at_least_one, default=8 * 64, help="floats per message")
    parser.add_argument("--gap", type=float, default=40.0,
                        help="microseconds rank 0 sleeps or computes before each send")
    parser.add_argument("--free-gloo", action="store_true",
                        help="let gloo's I/O threads run on either core")
    args = parser.parse_args()
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("this script binds each rank to a core of its own: Linux, 2 cores")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("run it with 2 ranks: torchrun --nproc-per-node 2")
    rank = dist.get_rank()
    to_last = dist.new_group([0, 1])
    cpus = sorted(os.sched_getaffinity(0))[:2]
    pin_process([cpus[rank]])
    freed = bind_io_threads(set(cpus)) if args.free_gloo else 0
    message = torch.zeros(args.numel)
    alone = torch.zeros(1, dtype=torch.float64)  # seconds rank 1's "alone" case took
    lines = []
    for case in CASES:
        dist.barrier()
        landing = case in ("messages land", "both")
        if rank == 1:
            start = time.perf_counter()
            forwards, backwards, waits = last_stage(args.iterations,
                                                    message if landing else None, to_last)
            if case == "alone":
                alone[0] = time.perf_counter() - start
            steady = [after_no_wait(t, waits) for t in (forwards, backwards)]
            blocked = sum(w >= WAITED for w in waits) / len(waits)
            lines.append(f"{case:15s} {statistics.median(forwards) * 1e6:9.1f}"
                         f" {statistics.median(backwards) * 1e6:9.1f} {blocked:7.0%}"
                         + "".join(f" {statistics.median(t) * 1e6 if t else math.nan:9.1f}"
                                   for t in steady))
        elif landing:  # one message per forward and backward of rank 1's, as it posts them
            for _ in range(args.iterations):
                if case == "both":
                    busy(args.gap * 1e-6)
                else:
                    time.sleep(args.gap * 1e-6)
                dist.send(message, 1, to_last)
        elif case == "other computes":  # long enough to cover rank 1's run
            busy(1.5 * float(alone[0]) + 0.1)
        if case == "alone":
            dist.broadcast(alone, 1)
    shutdown()
    if rank == 1:
        print(f"rank 1's forward (with its loss) and backward, medians of {args.iterations} in "
              f"us; every rank bound to a core of its own"
              + (f", gloo's {freed} I/O threads free to use either" if args.free_gloo else ""))
        print(f"{'rank 0':15s} {'forward':>9s} {'backward':>9s} {'waited':>7s}"
              f" {'forward':>9s} {'backward':>9s}  (the last two: after no wait)")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
