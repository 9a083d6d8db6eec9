"""fxpipe against PyTorch's own pipelining, 2 ranks on gloo, the same stages and schedules.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/vs_torch_pipelining.py

For each model and schedule (GPipe, 1F1B), both runtimes run the same two stages (the model is
an nn.Sequential cut at the same child, Plan(unit_depth=1)), the same micro-batch count and
the same loss, alternated round by round in one job (each rank sets one intra-op thread).
Rank 0 prints, as the median (min-max) over rounds of each round's medians: the step times,
the ratio fxpipe / torch, and fxpipe's calibrated prediction (`fxpipe.calibrate` at the start
of every round, then `pipe.predicted_timeline(cal).makespan + cal.step`) with measured /
predicted. Models: 8 x [Linear(1024, 1024) + ReLU] at batch 64 with 8 micro-batches, and the
bundled ResNet-style CNN at batch 32 with 4 micro-batches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import sequential_resnet, spread
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import fxpipe


def mlp_case():
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    model = nn.Sequential(*layers)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1024, generator=gen), torch.randn(64, 1024, generator=gen)
    return "mlp 8x1024", model, x, y, F.mse_loss, 8


def resnet_case():
    torch.manual_seed(0)
    model = sequential_resnet()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    return "resnet", model, x, y, F.cross_entropy, 4


def timed(fn, repeats: int) -> float:
    """The median seconds of `repeats` calls of `fn`, the ranks started together each time."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per runtime and round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the runtimes alternated")
    parser.add_argument("--models", default="mlp,resnet")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = {"mlp": mlp_case, "resnet": resnet_case}
    rows = []
    for case in (cases[name] for name in args.models.split(",")):
        for schedule in ("gpipe", "1f1b"):
            name, model, x, y, loss_fn, chunks = case()
            plan = fxpipe.Plan(stages=world, schedule=schedule, micro_batches=chunks,
                               unit_depth=1, loss_fn=loss_fn)
            pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y)
            sizes = list(pipe.partition.sizes)

            # torch.distributed.pipelining on the same children of the same Sequential
            _, twin, _, _, _, _ = case()
            start = sum(sizes[:rank])
            part = nn.Sequential(*list(twin.children())[start:start + sizes[rank]])
            stage = PipelineStage(part, rank, world, torch.device("cpu"))
            kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            theirs = kind(stage, n_microbatches=chunks, loss_fn=loss_fn)

            def torch_step(theirs=theirs, x=x, y=y):
                if rank == 0:
                    theirs.step(x)
                elif rank == world - 1:
                    theirs.step(target=y, losses=[])
                else:
                    theirs.step()

            def fxpipe_step(pipe=pipe, x=x, y=y):
                pipe.step(x, y)

            torch_step(), fxpipe_step()  # warm-up
            rounds = []  # per round: torch s, fxpipe s, calibrated prediction s
            for r in range(args.rounds):
                cal = fxpipe.calibrate(pipe, x, target=y, steps=5, warmup=1)
                predicted = pipe.predicted_timeline(cal).makespan + cal.step
                steps = [("torch", torch_step), ("fxpipe", fxpipe_step)]
                order = steps if r % 2 == 0 else steps[::-1]  # alternate which goes first
                measured = {k: timed(fn, args.repeats) for k, fn in order}
                rounds.append((measured["torch"], measured["fxpipe"], predicted))
            rows.append((name, schedule, sizes, chunks, rounds))

    if rank == 0:
        print(f"2 ranks on gloo, one intra-op thread each; median (min-max) over {args.rounds} "
              f"rounds of each round's median of {args.repeats} steps; predicted: fxpipe's "
              "calibrated prediction (fxpipe.calibrate, 5 steps, at the start of every round)")
        for name, schedule, sizes, chunks, rounds in rows:
            ours, theirs, predicted = ([r[i] * 1e3 for r in rounds] for i in (1, 0, 2))
            print(f"{name} {schedule} split {sizes} p={chunks}: torch {spread(theirs, '.1f')} ms, "
                  f"fxpipe {spread(ours, '.1f')} ms, predicted {spread(predicted, '.1f')} ms")
            print(f"    fxpipe / torch {spread([a / b for a, b in zip(ours, theirs)], '.2f')}, "
                  f"fxpipe / predicted {spread([a / b for a, b in zip(ours, predicted)], '.2f')}")
    fxpipe.shutdown()  # every rank is done communicating before any tears gloo down


if __name__ == "__main__":
    main()
