"""Hybrid data + pipeline parallelism on 4 ranks: GroPipe's delayed all-reduce against the naive
order, 2 groups x 2 stages against 1 group x 4 stages, and against plain DDP, side by side.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/hybrid_dp.py

Every configuration trains the same model on the same global batch (SGD, one intra-op thread
per rank). The configurations take turns step by step, the order rotating every turn, so that
each sees the same load on a shared machine; rank 0 prints per configuration the median
(quartiles) of its step time and of its ratio to the delayed all-reduce's step of the same
turn. On a 2-core machine 4 ranks oversubscribe the cores two to one: absolute times are those
of a shared CPU, only the ratios mean something, and the delayed all-reduce cannot gain here,
since the cores its work would overlap are busy with the first stages' backward.

Where it gains, the event simulator shows ("simulated" columns): 2 x 2 with every rank on a
core of its own and every all-reduce on a link of its own. Its inputs are each stage's median
forward and backward in 5 naive steps measured after the others, and each stage's all-reduce
timed alone on its data-parallel group (printed); links between stages are free. Delayed: a
stage's all-reduce starts after its last backward (an ALLREDUCE action closing its list), so a
later stage's overlaps the earlier stages' remaining backward; naive: after the whole pipeline,
which adds the longest all-reduce to the pipeline's step. `--ar-scale` replays the all-reduces
that many times longer (a slower network): the gain grows with them until they outlast the
earlier stages' remaining backward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import fxpipe
from fxpipe.models import VGG, ResNet
from fxpipe.schedules import ActionKind, add_step
from fxpipe.simulate import simulate

MODELS = {"vgg": VGG, "resnet": ResNet}
DELAYED, NAIVE = "G=2 x k=2, delayed", "G=2 x k=2, naive"


def configs(world: int):
    yield DELAYED, dict(stages=world // 2, groups=2, dp_sync="delayed")
    yield NAIVE, dict(stages=world // 2, groups=2, dp_sync="naive")
    yield f"G=1 x k={world}", dict(stages=world, groups=1)
    yield f"DDP x {world}", None


def build(name: str, batch: int):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return MODELS[name](), x, y


def step_fn(name: str, config, batch: int, micro_batches: int):
    """(one training step, the compiled pipeline or None for DDP)."""
    model, x, y = build(name, batch)
    if config is None:  # plain data parallelism: each rank a quarter of the batch
        ddp = DistributedDataParallel(model)
        rank, world = dist.get_rank(), dist.get_world_size()
        xs, ys = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step():
            optimizer.zero_grad()
            F.cross_entropy(ddp(xs), ys).backward()
            optimizer.step()
        return step, None
    plan = fxpipe.Plan(micro_batches=micro_batches, loss_fn=F.cross_entropy, **config)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)

    def step():
        optimizer.zero_grad()
        pipe.step(x, y)
        optimizer.step()
    return step, pipe


def turns(steps: dict, count: int) -> dict[str, list[float]]:
    """Step times (ms) of each configuration, taking turns one step each, the order rotating."""
    labels = list(steps)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for turn in range(count):
        for label in labels[turn % len(labels):] + labels[:turn % len(labels)]:
            dist.barrier()
            start = time.perf_counter()
            steps[label]()
            dist.barrier()
            times[label].append((time.perf_counter() - start) * 1e3)
    return times


def allreduce_ms(pipe, repeats: int) -> list[float]:
    """Each stage's gradient all-reduce timed alone on its data-parallel group (median ms),
    while the other ranks wait; every rank gets every stage's."""
    sync = pipe.executor.coordinator.sync  # the stage's GradientSync: its group and parameters
    flat = torch.zeros(sum(p.numel() for p in sync.params))
    mine = 0.0
    for stage in range(pipe.plan.stages):
        dist.barrier()
        if sync.stage == stage:
            took = []
            for _ in range(repeats):
                start = time.perf_counter()
                dist.all_reduce(flat, group=sync.group)
                took.append((time.perf_counter() - start) * 1e3)
            mine = statistics.median(took)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sync.stage, mine))
    return [max(ms for s, ms in everyone if s == stage) for stage in range(pipe.plan.stages)]


def simulated(pipe, step, runs: int, reduce_ms: list[float], scales: list[float]) -> dict:
    """The event simulator's step (ms) of `pipe`'s schedule, delayed and naive, with the
    stages' median F and B over `runs` measured runs of `step` and the all-reduces `scales`
    times `reduce_ms`; a core per rank, a link per all-reduce, free links between stages."""
    events = []
    for _ in range(runs):
        step()
        events += pipe.full_trace()  # every rank of the pipeline takes part
    stages = pipe.plan.stages
    forward, backward = ([statistics.median(e.duration for e in events
                                            if e.stage == s and e.action.kind is kind)
                          for s in range(stages)] for kind in (ActionKind.F, ActionKind.B))
    schedule = pipe.executor.schedule
    pipeline = simulate(schedule, forward, backward).makespan * 1e3
    rows = {"forward": [f * 1e3 for f in forward], "backward": [b * 1e3 for b in backward]}
    for scale in scales:
        reduce = [scale * ms / 1e3 for ms in reduce_ms]
        delayed = simulate(add_step(schedule, allreduce=True), forward, backward,
                           allreduce=reduce).makespan * 1e3
        rows[scale] = {DELAYED: delayed, NAIVE: pipeline + max(reduce) * 1e3}
    return rows


def quartiles(values: list[float], fmt: str = ".2f") -> str:
    """The median of `values` and their quartiles: "1.00 (0.95-1.10)"."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"{median:{fmt}} ({q1:{fmt}}-{q3:{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg,resnet")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--turns", type=int, default=24, help="steps per configuration")
    parser.add_argument("--ar-scale", default="1,4",
                        help="simulate the all-reduces these many times longer")
    parser.add_argument("--save", help="also write every step time (ms) to this JSON file, "
                        "by model and configuration, to pool several runs")
    args = parser.parse_args()
    scales = [float(s) for s in args.ar_scale.split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = {}
    for name in args.models.split(","):
        built = {label: step_fn(name, config, args.batch, args.micro_batches)
                 for label, config in configs(world)}
        steps = {label: step for label, (step, _) in built.items()}
        for step in steps.values():
            step()  # warm-up
        times = turns(steps, args.turns)
        reduce_ms = allreduce_ms(built[NAIVE][1], 5)
        # replayed from naive steps, where no all-reduce overlaps a stage's compute
        results[name] = times, reduce_ms, simulated(built[NAIVE][1], steps[NAIVE], 5,
                                                    reduce_ms, scales)
    if dist.get_rank() == 0:
        print(f"step time (ms) and its ratio to the delayed all-reduce's step of the same turn: "
              f"median (quartiles) of {args.turns} turns; {world} ranks on gloo, global batch "
              f"{args.batch}, {args.micro_batches} micro-batches per pipeline; the machine has "
              f"{os.cpu_count()} cores, so {world} ranks may oversubscribe it")
        for name, (times, reduce_ms, sim) in results.items():
            delayed = times[DELAYED]
            print(f"\n{name}{'measured':>37}{'/ delayed':>20}"
                  + "".join(f"{f'simulated x{s:g} AR':>22}{'/ delayed':>11}" for s in scales))
            for label, ms in times.items():
                ratio = quartiles([a / b for a, b in zip(ms, delayed)])
                line = f"  {label:<20}{quartiles(ms, '.1f'):>24} ms{ratio:>20}"
                for s in scales:
                    if label in sim[s]:
                        line += (f"{sim[s][label]:>19.1f} ms"
                                 f"{sim[s][label] / sim[s][DELAYED]:>11.2f}")
                print(line)
            print("  simulated from: per micro-batch forward "
                  + "/".join(f"{v:.2f}" for v in sim["forward"]) + " ms, backward "
                  + "/".join(f"{v:.2f}" for v in sim["backward"]) + " ms (stage 0/1/...); "
                  + "all-reduce alone " + "/".join(f"{v:.2f}" for v in reduce_ms) + " ms")
        if args.save:
            with open(args.save, "w") as file:
                json.dump({name: times for name, (times, _, _) in results.items()}, file)
    fxpipe.shutdown()  # every rank is done communicating before any tears gloo down


if __name__ == "__main__":
    main()
