"""Benchmark: how often a torchrun job aborts as it exits, with and without fxpipe.shutdown().

gloo's worker threads free a collective's tensors after the call that waited for it has
returned, which takes the interpreter lock; one that does so after the interpreter has begun
to shut down aborts its process ("terminate called without an active exception"). Each job
here builds an optimizer, as a training script does (which imports torch._dynamo, after which
torch keeps the default group, and its threads, alive to the end), runs collectives on
tensors, each followed by a barrier, as a script ending with a gathered trace does, then ends
one of two ways: a barrier and destroy_process_group, or fxpipe.shutdown(). The script
launches `--jobs` 2-rank jobs of each, alternating, and counts those that aborted.

    python benchmarks/exit_race.py --jobs 30
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ENDINGS = ("destroy_process_group", "fxpipe.shutdown")


def job(ending: str) -> None:
    """One rank: an optimizer, gathers and barriers, then the given ending."""
    import torch
    import torch.distributed as dist

    import fxpipe

    dist.init_process_group("gloo")
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    for _ in range(20):
        gathered = [torch.empty(1000) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.ones(1000), async_op=True).wait()
        del gathered
        done = dist.barrier(async_op=True)
    done.wait()
    del done
    if ending == "fxpipe.shutdown":
        fxpipe.shutdown()
    else:
        dist.barrier()
        dist.destroy_process_group()


def aborted(ending: str) -> bool:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, "--job", ending]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    if result.returncode != 0 and "terminate called" not in result.stderr:
        raise RuntimeError(f"a job failed otherwise than by aborting:\n{result.stderr[-3000:]}")
    return result.returncode != 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=30, help="jobs of each ending")
    parser.add_argument("--job", choices=ENDINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.job)
        return
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    counts = dict.fromkeys(ENDINGS, 0)
    for _ in range(args.jobs):
        for ending in ENDINGS:
            counts[ending] += aborted(ending)
    for ending, count in counts.items():
        print(f"{ending:22s} {count}/{args.jobs} jobs aborted as they exited")


if __name__ == "__main__":
    main()
