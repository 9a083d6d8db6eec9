"""fxpipe against PyTorch's own pipelining, 2 ranks on gloo, the same stages and schedules.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/vs_torch_pipelining.py

For each model and schedule (GPipe, 1F1B), both runtimes run the same two stages (the model is
an nn.Sequential cut at the same child, Plan(unit_depth=1)), the same micro-batch count and
the same loss, alternated A B A B in one job; rank 0 prints the median step times, the ratio
fxpipe / torch, and the simulator's ideal for the per-micro-batch compute fxpipe measured (the
units are re-timed at the start of every round and the median prediction counts, since the
machine's speed drifts over the run).
Models: 8 x [Linear(1024, 1024) + ReLU] at batch 64 with 8 micro-batches (the case from the
issue), and the bundled ResNet-style CNN at batch 32 with 4 micro-batches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import fxpipe
from fxpipe.models import ResNet


class PoolFlatten(nn.Module):
    def forward(self, x):
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


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
    net = ResNet()
    model = nn.Sequential(net.stem, *net.layers, PoolFlatten(), net.fc)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    return "resnet", model, x, y, F.cross_entropy, 4


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4, help="A B rounds, alternated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for case in (mlp_case, resnet_case):
        for schedule in ("gpipe", "1f1b"):
            name, model, x, y, loss_fn, chunks = case()
            plan = fxpipe.Plan(stages=world, schedule=schedule, micro_batches=chunks,
                               unit_depth=1, loss_fn=loss_fn)
            pipe = fxpipe.compile(model, plan, example_inputs=(x,))
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
            times, ideals = {"torch": [], "fxpipe": []}, []
            for _ in range(args.rounds):  # each round re-times the units for the ideal
                ideals.append(pipe.predicted_timeline(fxpipe.retime(pipe, (x,))).makespan)
                times["torch"] += timed(torch_step, args.repeats)
                times["fxpipe"] += timed(fxpipe_step, args.repeats)
            medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            ideal = statistics.median(ideals) * 1e3
            rows.append((name, schedule, sizes, chunks, medians, ideal))

    if rank == 0:
        print("median step time, 2 ranks (gloo, one core and one intra-op thread each)")
        print(f"{'model':<12}{'schedule':<9}{'split':<10}{'p':>3}{'torch ms':>10}"
              f"{'fxpipe ms':>11}{'fx/torch':>10}{'ideal ms':>10}{'fx/ideal':>10}")
        for name, schedule, sizes, chunks, medians, ideal in rows:
            print(f"{name:<12}{schedule:<9}{sizes!s:<10}{chunks:>3}{medians['torch']:>10.1f}"
                  f"{medians['fxpipe']:>11.1f}{medians['fxpipe'] / medians['torch']:>10.2f}"
                  f"{ideal:>10.1f}{medians['fxpipe'] / ideal:>10.2f}")
    fxpipe.shutdown()  # every rank is done communicating before any tears gloo down


if __name__ == "__main__":
    main()
