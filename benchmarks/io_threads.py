"""Benchmark: training steps with gloo's I/O threads bound to the rank's core and free, in turns.

Compile binds every thread of a rank on the CPU to the rank's own CPUs but gloo's I/O threads
(`gloo_tcp_loop`, one per process group), which stay free to run on every CPU the rank had
(`fxpipe.affinity.release_io_threads`). This script compiles a bundled model into 2 stages, one
per rank under torchrun, and in each of `--rounds` rounds runs `--steps` timed steps with those
threads bound to the rank's CPUs like the rest, and as many with them free, in turns (which goes
first alternates from round to round), settling a few untimed steps after each change. It prints
each round's two medians and their ratio, free / bound, and the median of the ratios. Taken side
by side in one run, the two settings meet the same drift of the machine's speed, which sweeps run
one after another do not (benchmarks/ACCURACY.md).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/io_threads.py \\
        --model gpt --schedule 1f1b
"""

from __future__ import annotations

import argparse
import os
import statistics

from two_stages import add_model_arguments, at_least_one, two_stages

from fxpipe.affinity import bind_io_threads, io_threads
from fxpipe.distributed import launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp", schedule=True, steps=50)
    parser.add_argument("--partitioner", default="even")
    parser.add_argument("--rounds", type=at_least_one, default=6)
    args = parser.parse_args()
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        parser.error("this script sets threads' CPU affinity: run it on Linux")
    if not launched():
        parser.error("gloo's threads run only under torchrun: run it with torchrun "
                     "--nproc-per-node 2")
    setup = two_stages(args, partitioner=args.partitioner, schedule=args.schedule)
    threads = io_threads()
    own = os.sched_getaffinity(0)  # the rank's share, where compile bound it
    free = set().union(*(os.sched_getaffinity(t) for t in threads)) if threads else own
    settings = {"bound": own, "free": free}
    medians: list[dict[str, float]] = []
    for index in range(args.rounds):
        order = list(settings) if index % 2 == 0 else list(reversed(settings))
        medians.append({})
        for setting in order:
            bind_io_threads(settings[setting])
            setup.warm_up(10)
            medians[-1][setting] = statistics.median(setup.timed_step()
                                                     for _ in range(args.steps))
    bind_io_threads(free)
    if not setup.reporting():
        return
    print(f"{args.model}, {setup.where}, {args.partitioner}, {args.schedule}, "
          f"{args.micro_batches} micro-batches; {len(threads)} I/O threads on rank 0, bound to "
          f"CPUs {sorted(own)} or free on {sorted(free)}; medians of {args.steps} steps, ms")
    ratios = []
    for index, m in enumerate(medians):
        ratios.append(m["free"] / m["bound"])
        print(f"round {index}: bound {m['bound'] * 1e3:.2f}  free {m['free'] * 1e3:.2f}  "
              f"free/bound {ratios[-1]:.3f}")
    print(f"free/bound: median {statistics.median(ratios):.3f}, "
          f"{min(ratios):.3f} to {max(ratios):.3f}")


if __name__ == "__main__":
    main()
