"""The measured timelines of zb-h1 and 1f1b, one above the other, on 2 gloo ranks (the MLP).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/timeline_zb_h1.py docs/zb_h1_vs_1f1b.png

The 8 x [Linear(1024, 1024) + ReLU] MLP of vs_torch_pipelining.py (batch 64, 8 micro-batches,
the same two stages; --model resnet: its ResNet) compiled once per schedule; after warm-up
steps the two pipelines take turns for --steps steps each, and the figure shows each
schedule's step of median length,
every stage's actions on one time axis (fxpipe's own measured trace, `pipe.full_trace()`),
drawn by fxpipe.plot.save_timeline. With --simulated, the simulator's timelines with
calibrated costs (`fxpipe.calibrate`) are drawn below them. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from vs_torch_pipelining import CASES, bubble

import fxpipe
from fxpipe.plot import save_timeline

SCHEDULES = ("1f1b", "zb-h1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default="docs/zb_h1_vs_1f1b.png")
    parser.add_argument("--model", default="mlp", choices=sorted(CASES))
    parser.add_argument("--steps", type=int, default=9, help="timed steps per schedule")
    parser.add_argument("--simulated", action="store_true",
                        help="draw the calibrated simulator's timelines too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pipes = {}
    for name in SCHEDULES:
        label, model, x, y, loss_fn, chunks = CASES[args.model]()
        plan = fxpipe.Plan(stages=world, schedule=name, micro_batches=chunks, unit_depth=1,
                           loss_fn=loss_fn)
        pipes[name] = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y)
    kept = {name: [] for name in SCHEDULES}
    for i in range(2 + args.steps):  # the schedules take turns, step by step
        for name, pipe in pipes.items():
            dist.barrier()
            pipe.step(x, y)
            if i >= 2:
                kept[name].append((pipe.executor.last_trace(), pipe.executor.trace_origin))
    panels, lines = {}, []
    for name, pipe in pipes.items():
        runs = pipe.executor.full_traces(kept[name])  # every rank's events, one time axis
        spans = [max(e.end for e in r) - min(e.start for e in r) for r in runs]
        median = runs[spans.index(sorted(spans)[len(spans) // 2])]
        panels[f"{name}, measured (median of {len(runs)} steps)"] = median
        lines.append(f"{name}: step {statistics.median(spans) * 1e3:.1f} ms "
                     f"({min(spans) * 1e3:.1f}-{max(spans) * 1e3:.1f}), bubble "
                     f"{bubble(median, world):.0%} in the step drawn")
    if args.simulated:
        for name, pipe in pipes.items():
            cal = fxpipe.calibrate(pipe, x, target=y, steps=5, warmup=1)
            panels[f"{name}, simulated (calibrated)"] = pipe.predicted_timeline(cal).events
    if dist.get_rank() == 0:
        save_timeline(args.path, panels, world,
                      f"{label}: {world} ranks on gloo, {chunks} micro-batches, split "
                      f"{list(pipes['1f1b'].partition.sizes)}")
        print("\n".join(lines) + f"\nwrote {args.path}")
    fxpipe.shutdown()


if __name__ == "__main__":
    main()
