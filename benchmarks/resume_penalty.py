"""Benchmark: how much slower a rank computes right after it blocked waiting, than back to back.
The cost model times the units back to back; in a pipeline under torchrun a stage often
blocks in a receive first, and a process woken from a wait runs slower for a while. Compile
measures this penalty on each stage's own forward and backward (`Link.resume`, one figure per
stage), which the simulator adds to a stage's first compute after a wait. This script
measures it in more settings, on a whole bundled model: each rank times one forward and
backward of the model on a micro-batch, back
to back, after a sleep, after spinning (busy, not blocked) for as long, and right after a
blocking receive from the other rank, which meanwhile computed (the ranks take turns, as
adjacent stages do; in the other kinds both ranks compute at once, as every rank times the
units at compile), and right after a receive whose message landed while the rank spun, so
that nothing blocked. Kinds alternate round by round; rank 0 prints each rank's medians and
their differences from back to back.
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/resume_penalty.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from two_stages import add_model_arguments, at_least_one

from fxpipe.distributed import shutdown
from fxpipe.models import bundled

KINDS = ("back to back", "after a sleep", "after spinning", "after a receive",
         "after a receive already there")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp", micro_batches=False)
    parser.add_argument("--wait", type=float, default=300e-6, help="seconds of sleep or spin")
    parser.add_argument("--rounds", type=at_least_one, default=10)
    parser.add_argument("--steps", type=at_least_one, default=30, help="timings per kind and round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("run this with 2 ranks: torchrun --nproc-per-node 2 ...")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    spec = bundled(args.model)
    model = spec.build()
    x, y = spec.batch(args.batch, torch.Generator().manual_seed(0))

    def compute() -> float:
        start = time.perf_counter()
        spec.loss_fn(model(x), y).backward()
        return time.perf_counter() - start

    def spin(seconds: float) -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass

    token, landing = torch.zeros(1), torch.zeros(1)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for _ in range(args.steps):
            times["back to back"].append(compute())
        for _ in range(args.steps):
            time.sleep(args.wait)
            times["after a sleep"].append(compute())
        for _ in range(args.steps):
            spin(args.wait)
            times["after spinning"].append(compute())
        for _ in range(args.steps):  # rank 0 starts; each computes while the other waits
            if rank == 0:
                dist.send(token, peer)
                dist.recv(token, peer)
                times["after a receive"].append(compute())
            else:
                dist.recv(token, peer)
                times["after a receive"].append(compute())
                dist.send(token, peer)
        for _ in range(args.steps):  # both at once; the message lands while the rank spins
            arriving = dist.irecv(landing, peer)
            dist.isend(token, peer).wait()
            spin(args.wait)
            arriving.wait()  # there already: nothing blocks
            times["after a receive already there"].append(compute())
    base = statistics.median(times["back to back"])
    line = f"rank {rank}: " + ", ".join(
        f"{kind} {statistics.median(times[kind]) * 1e6:.0f} us"
        + ("" if kind == KINDS[0] else f" ({(statistics.median(times[kind]) - base) * 1e6:+.0f})")
        for kind in KINDS)
    everyone: list = [None, None]
    dist.all_gather_object(everyone, line)
    if rank == 0:
        print(f"{args.model}, batch {args.batch}, one forward and backward; waits of "
              f"{args.wait * 1e6:.0f} us; medians of {args.rounds * args.steps}")
        print("\n".join(everyone))
    shutdown()  # every rank is done communicating before any tears gloo down


if __name__ == "__main__":
    main()
