"""Benchmark: how often a gloo message between two ranks takes milliseconds to arrive.

The simulator has a message arrive a latency plus its bytes over the bandwidth after it is
sent, as the link's ping-pong measured them (their medians). On some virtual machines a message
now and then arrives milliseconds late, and a pipeline of short steps sends many: one late
message in a step is enough to move the step's median. This script sends with torch.distributed
alone, no pipeline in the way. Rank 1 waits in a blocking receive; rank 0 first computes (or
not) for `--before` microseconds, then sends one message (`--numel` floats, over a process
group of its own, one way, as fxpipe's links are) and then either blocks in a receive of its
own or computes for a millisecond, as a pipeline stage does after a send. The delay is the
receive's end less the send's start, both on the machine's monotonic clock, which the two
processes share. Per case: the median, the 90th percentile, the largest, and the share of
messages over 1 ms.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/gloo_stalls.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fxpipe.cli import at_least_one
from fxpipe.distributed import shutdown


def busy(seconds: float) -> None:
    """Compute, not sleep, for `seconds`."""
    a = torch.ones(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=at_least_one, default=8 * 256,
                        help="floats per message (default: a micro-batch of 8 rows of 256)")
    parser.add_argument("--before", default="0,100,1000",
                        help="microseconds rank 0 computes before each send, comma-separated")
    parser.add_argument("--messages", type=at_least_one, default=300, help="per case")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("run it with 2 ranks: torchrun --nproc-per-node 2")
    one_way, back = dist.new_group([0, 1]), dist.new_group([0, 1])
    message, note = torch.zeros(args.numel), torch.zeros(1)
    lines = []
    for before in [float(v) * 1e-6 for v in args.before.split(",")]:
        for after in ("waits", "computes"):
            delays = []
            for _ in range(args.messages):
                dist.barrier()
                if rank == 0:
                    busy(before)
                    sent = time.perf_counter()
                    work = dist.isend(message, 1, one_way)
                    if after == "waits":  # the answer comes once rank 1 has the message
                        dist.recv(note, 1, back)
                    else:
                        busy(1e-3)
                    work.wait()
                    stamp = torch.tensor([sent], dtype=torch.float64)
                else:
                    dist.recv(message, 0, one_way)
                    stamp = torch.tensor([time.perf_counter()], dtype=torch.float64)
                    if after == "waits":
                        dist.send(note, 0, back)
                stamps = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
                dist.all_gather(stamps, stamp)
                delays.append(float(stamps[1] - stamps[0]))
            p90 = statistics.quantiles(delays, n=10)[-1] if len(delays) > 1 else delays[0]
            late = sum(d > 1e-3 for d in delays) / len(delays)
            median = statistics.median(delays)
            lines.append(f"{before * 1e6:12.0f} us  {after:8s} {median * 1e6:8.0f}"
                         f" {p90 * 1e6:8.0f} {max(delays) * 1e6:8.0f} {late:8.1%}")
    shutdown()
    if rank == 0:
        print(f"one message of {args.numel} floats from rank 0 to rank 1, waiting in a receive; "
              f"{args.messages} per case; delay from the send's start to the receive's end, us")
        print(f"{'computed before':>15s}  {'then':8s} {'median':>8s} {'p90':>8s} {'largest':>8s}"
              f" {'> 1 ms':>8s}")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
