"""Benchmark: gloo point-to-point over one two-way process group against two one-way groups.

Two ranks each post a receive, compute for a while, send a small tensor and wait for the
peer's, as adjacent pipeline stages do. With one group both directions share a connection;
with two (fxpipe's runtime) each carries data one way. Prints the time per iteration and the
CPU share of gloo's event threads, alternating the two set-ups over several rounds.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/gloo_links.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from fxpipe.distributed import shutdown


def loop_cpu_seconds() -> float:
    """CPU time so far of this process's gloo event threads."""
    ticks = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            if not comm.read().startswith("gloo_tcp_loop"):
                continue
        with open(f"/proc/self/task/{task}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def run(out_group, in_group, peer: int, iterations: int, compute: float) -> tuple[float, float]:
    """Seconds per iteration, and the event threads' share of one core meanwhile."""
    a, w = torch.randn(64, 256), torch.randn(256, 256)
    cpu, start = loop_cpu_seconds(), time.perf_counter()
    for tag in range(iterations):
        incoming = torch.empty(8, 256)
        received = dist.irecv(incoming, peer, in_group, tag)
        began = time.perf_counter()
        while time.perf_counter() - began < compute:
            a @ w
        sent = dist.isend(torch.ones(8, 256), peer, out_group, tag)
        received.wait()
        sent.wait()
    seconds = time.perf_counter() - start
    return seconds / iterations, (loop_cpu_seconds() - cpu) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--compute-ms", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("run it on 2 ranks: torchrun --nproc-per-node 2 ...")
    peer = 1 - rank
    to_one, to_zero = dist.new_group([0, 1]), dist.new_group([0, 1])
    setups = {"one two-way group": (None, None),
              "two one-way groups": (to_one, to_zero) if rank == 0 else (to_zero, to_one)}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, (out_group, in_group) in setups.items():
            dist.barrier()
            results[name].append(run(out_group, in_group, peer, args.iterations,
                                     args.compute_ms / 1e3))
    if rank == 0:
        print(f"{args.compute_ms} ms of compute and one exchange of 8 KiB each way per "
              f"iteration; medians of {args.rounds} rounds of {args.iterations}")
        for name, rows in results.items():
            per_iteration = statistics.median(r[0] for r in rows) * 1e3
            share = statistics.median(r[1] for r in rows)
            print(f"{name:20s} {per_iteration:6.2f} ms per iteration, gloo event threads "
                  f"{share:4.0%} of a core")
    shutdown()  # every rank is done communicating before any tears gloo down


if __name__ == "__main__":
    main()
