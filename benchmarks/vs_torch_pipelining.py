"""fxpipe against PyTorch's own pipelining, 2 ranks on gloo, the same stages and schedules.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/vs_torch_pipelining.py

For each model and schedule of SCHEDULES (GPipe, 1F1B, ZB-H1, and with two stages per rank
interleaved 1F1B, looped BFS, ZB-V and DualPipeV), both runtimes run the same stages (the model
is an nn.Sequential cut at the same children, Plan(unit_depth=1)), the same micro-batch count
and the same loss, alternated round by round in one job (each rank sets one intra-op thread); a
model's schedules take turns within each round as well, so that the machine's drift falls on every
schedule alike. For ZB-H1 PyTorch runs ScheduleInterleavedZeroBubble with one stage per rank,
whose action order is fxpipe's zb-h1 action for action (checked before timing: a PyTorch
schedule whose order differs from fxpipe's is refused). PyTorch's DualPipeV pairs a forward
and a backward of its two stages in one OVERLAP_F_B action, which its runtime runs as the F,
then the B, as fxpipe's dualpipev lists them.

Rank 0 prints a table, each cell the median (min-max) over rounds of that round's value: the
step times (each round's median), fxpipe / torch, fxpipe's simulated step (`fxpipe.calibrate`
at the start of every round, then the simulator's makespan of the schedule with those costs,
`pipe.predicted_timeline(cal).makespan`, plus the calibrated time outside the actions,
`cal.step`) and measured / simulated, and the bubble: the idle share of the devices' time
(1 - compute / (devices x span)) in fxpipe's own measured timelines of the timed steps (each
round's median) next to the simulated timeline's. Models: 8 x [Linear(1024, 1024) + ReLU] at
batch 64 with 8 micro-batches, and the bundled ResNet-style CNN at batch 32 with 4.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import sequential_resnet, spread
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

import fxpipe
from fxpipe.ir import Event
from fxpipe.schedules import ActionKind, Schedule
from fxpipe.schedules.csv_form import from_pytorch

# fxpipe's schedule name: (PyTorch's schedule class, extra fxpipe.Plan arguments). The PyTorch
# side takes its stages from fxpipe's compiled schedule (its stage count and `placement`).
VIRTUAL = {"stages_per_device": 2}  # two stages per rank; Pair sets stages = 2 x ranks
SCHEDULES: dict[str, tuple[type, dict]] = {
    "gpipe": (ScheduleGPipe, {}),
    "1f1b": (Schedule1F1B, {}),
    "zb-h1": (ScheduleInterleavedZeroBubble, {}),  # one stage per rank: ZB-H1, as fxpipe's
    "interleaved-1f1b": (ScheduleInterleaved1F1B, VIRTUAL),
    "looped-bfs": (ScheduleLoopedBFS, VIRTUAL),
    "zbv": (ScheduleZBVZeroBubble, VIRTUAL),
    "dualpipev": (ScheduleDualPipeV, VIRTUAL),
}
_COMPUTE = (ActionKind.F, ActionKind.B, ActionKind.W)


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


CASES = {"mlp": mlp_case, "resnet": resnet_case}


def timed(fn: Callable[[], object], repeats: int, after: Callable[[], None] = lambda: None
          ) -> float:
    """The median seconds of `repeats` calls of `fn`, the ranks started together each time;
    `after` runs after each call, outside the timing."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
        after()
    return statistics.median(times)


def bubble(events: Sequence[Event], devices: int) -> float:
    """The idle share of the devices' time over the span of `events`: 1 - compute / (devices x
    span), the simulator's definition (Timeline.bubble)."""
    span = max(e.end for e in events) - min(e.start for e in events)
    compute = sum(e.duration for e in events if e.action.kind in _COMPUTE)
    return 1.0 - compute / (devices * span)


def torch_schedule(kind: type, schedule: Schedule, sizes: Sequence[int], model: nn.Sequential,
                   rank: int, chunks: int, loss_fn: Callable) -> tuple[object, tuple[int, ...]]:
    """PyTorch's schedule `kind` on this rank's stages of `schedule` (fxpipe's compiled one),
    each stage the same children of `model` as fxpipe's; refused unless it runs this rank's
    compute actions in fxpipe's order. Returns it and the stages it holds."""
    children, mine = list(model.children()), schedule.stages_on(rank)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    stages = [PipelineStage(nn.Sequential(*children[starts[s]:starts[s] + sizes[s]]), s,
                            schedule.stages, torch.device("cpu")) for s in mine]
    if issubclass(kind, PipelineScheduleSingle):  # GPipe, 1F1B: one stage, order not exposed
        return kind(stages[0], n_microbatches=chunks, loss_fn=loss_fn), mine
    theirs = kind(stages, n_microbatches=chunks, loss_fn=loss_fn)
    # pipeline_order holds each rank's compute actions (None: a bubble); PyTorch's I is
    # fxpipe's B where a W follows; an OVERLAP_F_B (DualPipeV) runs its F, then its B
    order = [from_pytorch(str(leaf)) for a in theirs.pipeline_order[rank] if a is not None
             for leaf in (a.sub_actions or (a,))]
    ours = [a for a in schedule.device_programs[rank] if a.kind in _COMPUTE]
    if [a for a in order if a.kind in _COMPUTE] != ours:
        raise SystemExit(f"{kind.__name__} on rank {rank} runs {' '.join(map(str, order))}, "
                         f"fxpipe's {schedule.name} {' '.join(map(str, ours))}: not the same "
                         "schedule, so not a comparison")
    return theirs, mine


class Pair:
    """One model under one schedule in both runtimes, and what each round measured."""

    def __init__(self, case: Callable, name: str, rank: int, world: int) -> None:
        self.label, model, self.x, self.y, loss_fn, self.chunks = case()
        kind, extra = SCHEDULES[name]
        stages = world * extra.get("stages_per_device", 1)
        plan = fxpipe.Plan(**{"stages": stages, "schedule": name, "micro_batches": self.chunks,
                              "unit_depth": 1, "loss_fn": loss_fn, **extra})
        self.pipe = fxpipe.compile(model, plan, example_inputs=(self.x,), example_target=self.y)
        self.name, self.schedule = name, self.pipe.executor.latest_schedule
        self.sizes = list(self.pipe.partition.sizes)
        self.theirs, mine = torch_schedule(kind, self.schedule, self.sizes, case()[1], rank,
                                           self.chunks, loss_fn)
        self.args = (self.x,) if 0 in mine else ()
        self.last = self.schedule.stages - 1 in mine  # the last stage takes the target
        self.kept: list = []  # this round's timed fxpipe steps' traces
        self.rounds: list[tuple[float, ...]] = []
        self.torch_step(), self.fxpipe_step()  # warm-up

    def torch_step(self) -> None:
        self.theirs.step(*self.args, **({"target": self.y, "losses": []} if self.last else {}))

    def fxpipe_step(self) -> None:
        self.pipe.step(self.x, self.y)

    def keep(self) -> None:
        self.kept.append((self.pipe.executor.last_trace(), self.pipe.executor.trace_origin))

    def round(self, r: int, repeats: int) -> None:
        """Calibrate fxpipe, then time both runtimes (which goes first alternates with `r`):
        torch's and fxpipe's median step, fxpipe's simulated step, and fxpipe's measured and
        simulated bubble."""
        pipe = self.pipe
        cal = fxpipe.calibrate(pipe, self.x, target=self.y, steps=5, warmup=1)
        simulated = pipe.predicted_timeline(cal)
        self.kept.clear()
        steps = [("torch", self.torch_step, lambda: None), ("fxpipe", self.fxpipe_step, self.keep)]
        order = steps if r % 2 == 0 else steps[::-1]
        took = {k: timed(fn, repeats, after) for k, fn, after in order}
        traces = pipe.executor.full_traces(self.kept)  # every rank calls it, as many runs each
        self.rounds.append((took["torch"], took["fxpipe"], simulated.makespan + cal.step,
                            statistics.median(bubble(t, self.schedule.devices) for t in traces),
                            simulated.bubble))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per runtime and round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, the runtimes alternated")
    parser.add_argument("--models", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"of {', '.join(SCHEDULES)}")
    args = parser.parse_args()
    models, schedules = args.models.split(","), args.schedules.split(",")
    for what, names, known in (("model", models, CASES), ("schedule", schedules, SCHEDULES)):
        if set(names) - set(known):
            parser.error(f"unknown {what} {sorted(set(names) - set(known))}; take "
                         f"{', '.join(known)}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for model in models:
        pairs = [Pair(CASES[model], name, rank, world) for name in schedules]
        for r in range(args.rounds):
            # the schedules take turns too, each round starting one later, so that the machine's
            # drift falls on them alike
            for pair in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
                pair.round(r, args.repeats)
        rows += pairs

    if rank == 0:
        print(f"{world} ranks on gloo, one intra-op thread each; median (min-max) over "
              f"{args.rounds} rounds of each round's value (step times: the median of "
              f"{args.repeats} steps); simulated: fxpipe's simulator with the costs of "
              "fxpipe.calibrate (5 steps, at the start of every round); bubble: idle share of "
              "the devices' time, measured in fxpipe's timeline / simulated\n")
        print("| model | schedule | split, p | torch ms | fxpipe ms | fxpipe / torch "
              "| simulated ms | fxpipe / simulated | bubble measured | bubble simulated |")
        print("|" + " --- |" * 10)
        for pair in rows:
            theirs, ours, simulated, measured_bubble, simulated_bubble = (
                [r[i] for r in pair.rounds] for i in range(5))
            print(f"| {pair.label} | {pair.name} | {pair.sizes}, {pair.chunks} "
                  f"| {spread([t * 1e3 for t in theirs], '.1f')} "
                  f"| {spread([t * 1e3 for t in ours], '.1f')} "
                  f"| {spread([a / b for a, b in zip(ours, theirs)], '.2f')} "
                  f"| {spread([t * 1e3 for t in simulated], '.1f')} "
                  f"| {spread([a / b for a, b in zip(ours, simulated)], '.2f')} "
                  f"| {spread([b * 100 for b in measured_bubble], '.0f')} % "
                  f"| {spread([b * 100 for b in simulated_bubble], '.0f')} % |")
    fxpipe.shutdown()  # every rank is done communicating before any tears gloo down


if __name__ == "__main__":
    main()
