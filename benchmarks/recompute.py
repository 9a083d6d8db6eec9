"""Activation recomputation: stage 0's peak activation memory with and without it, 2 gloo ranks.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/recompute.py

The bundled GPT in 2 stages under 1F1B, compiled twice on each rank: Plan(recompute=False)
and Plan(recompute=True), the same split. Each round runs one pipe.step of each, in turns.
Rank 0 (stage 0, alone in its process) records the step under torch.profiler with
profile_memory=True; the running sum of its [memory] events (every allocation and free in
the process) gives the step's peak above what was allocated when it started: the
activations the stage holds, its transient workspace and the messages it receives
(weights and gradients are allocated before, by a warm-up step). Rank 0 prints each
variant's peak, median (min-max) over rounds, and the drop, 1 - with / without, per round.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
from common import spread
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import fxpipe
from fxpipe.inspect import format_bytes
from fxpipe.models import bundled


def step_peak(pipe: fxpipe.CompiledPipeline, x: torch.Tensor, y: torch.Tensor,
              measure: bool) -> float:
    """One pipe.step; with `measure`, its peak allocation above the level at its start."""
    if not measure:
        pipe.step(x, y)
        return float("nan")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pipe.step(x, y)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    level = np.cumsum([n for _, n in events], dtype=np.float64)
    return float(max(level.max(), 0.0)) if len(level) else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--schedule", default="1f1b", help="1f1b (the target), gpipe, zb-h1, ...")
    args = parser.parse_args()
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # a script, not the library: quiet kineto
    torch.set_num_threads(1)
    spec = bundled("gpt")
    x, y = spec.batch(args.batch, torch.Generator().manual_seed(0))
    pipes = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        plan = fxpipe.Plan(stages=2, schedule=args.schedule, micro_batches=args.micro_batches,
                           partitioner="params", costs="none", loss_fn=spec.loss_fn,
                           recompute=recompute)
        pipes[recompute] = fxpipe.compile(spec.build(), plan, example_inputs=(x,))
    rank = dist.get_rank()
    for pipe in pipes.values():  # warm-up: gradients allocated, first-call costs paid
        pipe.step(x, y)
    peaks: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        for recompute in order:
            peaks[recompute].append(step_peak(pipes[recompute], x, y, rank == 0))
    if rank != 0:
        return
    print(pipes[True])
    drops = [1 - on / off for on, off in zip(peaks[True], peaks[False])]
    print(f"\nbundled GPT, 2 stages, {args.schedule}, batch {args.batch}, {args.micro_batches} "
          f"micro-batches, {args.rounds} rounds; stage 0's peak above the step's start "
          "(median (min-max) over rounds):")
    for recompute in (False, True):
        mib = [p / 2**20 for p in peaks[recompute]]
        print(f"  recompute={recompute!s:5}  {spread(mib, '.3f')} MiB"
              f"  (median {format_bytes(float(np.median(peaks[recompute])))})")
    print(f"  drop (1 - with / without, per round): {spread([d * 100 for d in drops], '.1f')} %")


if __name__ == "__main__":
    main()
