"""What the diagnostic scripts share: a bundled model's arguments and its compiled pipeline.

Imported by the scripts beside it (`python benchmarks/step_breakdown.py` puts this folder on
the import path, under torchrun too); not a benchmark of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

import fxpipe
from fxpipe.cli import at_least_one, stage_threads  # the benchmarks' argparse types, as the CLI's
from fxpipe.distributed import launched
from fxpipe.models import BundledModel, bundled
from fxpipe.passes.analysis.profile import MIN_TIMED
from fxpipe.simulate import Event, Timeline


def add_model_arguments(parser: argparse.ArgumentParser, model: str,
                        micro_batches: bool = True, schedule: bool = False,
                        steps: int | None = None) -> None:
    """--model (default `model`), --batch, --stage-threads and, unless told not to,
    --micro-batches; when asked, --schedule (default gpipe) and --steps (default `steps`)."""
    parser.add_argument("--model", default=model)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--stage-threads", type=stage_threads, default="stage",
                        help="Plan.stage_threads in one process: stage (a thread each, which "
                             "these scripts study), auto (compile's default) or a number")
    if micro_batches:
        parser.add_argument("--micro-batches", type=int, default=4)
    if schedule:
        parser.add_argument("--schedule", default="gpipe")
    if steps is not None:
        parser.add_argument("--steps", type=at_least_one, default=steps, help="timed steps")


def median_step(pipe: fxpipe.CompiledPipeline, x: Any, y: Any, steps: int = 1,
                seconds: float = 0.0, settle: float = 0.2) -> float:
    """The median of timed training steps' seconds, `steps` of them or as many as fill
    `seconds` where that is more, after untimed steps for `settle` seconds, as `fxpipe bench`
    runs a round (after a pause, steps run at another speed for a while:
    benchmarks/after_pause.py). In one process only: under torchrun, ranks timing their own
    seconds would run different numbers of steps, and wait for each other forever."""
    if launched():
        raise SystemExit("median_step times steps in one process: run this script with python, "
                         "not torchrun")
    settled = time.perf_counter() + settle
    while time.perf_counter() < settled:
        pipe.step(x, y)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < steps or time.perf_counter() < end:
        start = time.perf_counter()
        pipe.step(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_rounds(title: str, rounds: Mapping[str, Sequence[float]]) -> None:
    """Print `title`, then a line per setting of `rounds` (setting -> each round's figure):
    every round's figure, their median and range, and the spread (largest / smallest)."""
    print(title)
    width = max(map(len, rounds), default=0)
    for label, values in rounds.items():
        print(f"  {label:{width}s} {' '.join(f'{v:.2f}' for v in values)}   median "
              f"{statistics.median(values):.2f}, range {min(values):.2f}-{max(values):.2f}, "
              f"spread {max(values) / min(values):.2f}")


def time_per_kind(events: list[Event]) -> dict[tuple[int, str], float]:
    """Seconds per (stage, kind of action) over one step's events."""
    total: dict[tuple[int, str], float] = {}
    for e in events:
        key = (e.stage, e.action.kind.name)
        total[key] = total.get(key, 0.0) + e.end - e.start
    return total


@dataclasses.dataclass
class PredictedRun:
    """A step predicted from timings taken afresh, and the steps run after it."""

    partition: fxpipe.Partition  # the compiled partition's costs from those timings
    predicted: Timeline
    seconds: list[float]  # each timed step's
    traces: list[list[Event]]  # each timed step's actions, on every rank


@dataclasses.dataclass
class TwoStages:
    """A bundled model compiled into 2 stages (more where a script asks), with one mini-batch
    of it."""

    pipe: fxpipe.CompiledPipeline
    model: BundledModel
    x: Any
    y: Any
    distributed: bool  # one stage per rank under torchrun, else stage threads

    @property
    def where(self) -> str:
        stages = self.pipe.plan.stages
        if self.distributed:
            return f"{stages} ranks under torchrun"
        threads = len(self.pipe.executor.driver.workers)
        return (f"{stages} stage threads" if threads >= stages else
                f"{stages} stages on {threads} thread{'s' if threads > 1 else ''}")

    def warm_up(self, steps: int) -> None:
        """Run `steps` training steps untimed, so the ones timed after find everything warm."""
        for _ in range(steps):
            self.pipe.step(self.x, self.y)

    def timed_step(self) -> float:
        """One training step's seconds, the ranks started together under torchrun."""
        if self.distributed:
            dist.barrier()
        start = time.perf_counter()
        self.pipe.step(self.x, self.y)
        return time.perf_counter() - start

    def settled_step(self, steps: int) -> float:
        """median_step of `steps` steps (in stage threads of one process)."""
        return median_step(self.pipe, self.x, self.y, steps)

    def predicted_then_run(self, steps: int) -> PredictedRun:
        """Time the units and the runtime's own work per action afresh and predict a step
        from them; then, once the cores settled (benchmarks/after_pause.py), run `steps` timed
        steps."""
        fresh = fxpipe.retime(self.pipe, (self.x,), target=self.y, warmup=1, repeats=5)
        self.pipe.measure_action_overhead(self.x)  # which the predicted timeline adds
        predicted = self.pipe.predicted_timeline(fresh)
        self.warm_up(50)
        walls, kept = [], []
        for _ in range(steps):
            walls.append(self.timed_step())
            kept.append((self.pipe.executor.last_trace(), self.pipe.executor.trace_origin))
        # gathered after the steps, as gathering communicates
        return PredictedRun(fresh, predicted, walls, self.pipe.executor.full_traces(kept))

    def everyones(self, lines: list[str]) -> list[str]:
        """Every rank's `lines`, in rank order (under torchrun every rank must call it)."""
        if not self.distributed:
            return lines
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, lines)
        return [line for share in everyone for line in share]

    def reporting(self) -> bool:
        """Under torchrun, wait for every rank to finish communicating and tear the process
        group down; whether this process prints (rank 0, or the only process)."""
        if not self.distributed:
            return True
        rank = dist.get_rank()
        fxpipe.shutdown()  # every rank is done communicating before any tears gloo down
        return rank == 0


def two_stages(args: argparse.Namespace, **plan: Any) -> TwoStages:
    """Compile `args.model` into 2 stages, or `args.stages` where the script has that argument
    (one intra-op thread per stage; under torchrun, one stage per rank; in one process,
    `args.stage_threads`, by default a thread per stage, which these scripts study, even where
    compile's default would run them on one), with a mini-batch of `args.batch`,
    `args.micro_batches` (4 without the argument) and the model's loss; `plan`: more Plan
    fields."""
    plan.setdefault("stage_threads", getattr(args, "stage_threads", "stage"))
    distributed = launched()  # compile joins the process group torchrun describes
    torch.set_num_threads(1)
    model = bundled(args.model)
    torch.manual_seed(0)
    x, y = model.batch(args.batch, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=getattr(args, "stages", 2),
                       micro_batches=getattr(args, "micro_batches", 4),
                       loss_fn=model.loss_fn, **plan)
    pipe = fxpipe.compile(model.build(), plan, example_inputs=(x,), cache=False)
    return TwoStages(pipe, model, x, y, distributed)


def add_stage_thread_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """For scripts that re-time a model in stage threads in rounds: --model (mlp), --batch,
    --stages (4), --micro-batches (8), --partitioner (even), --schedule (1f1b), --rounds
    (default `rounds`) and --min-time (the units' timing per micro-batch size, compile's)."""
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--partitioner", default="even")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--rounds", type=at_least_one, default=rounds)
    parser.add_argument("--min-time", type=float, default=MIN_TIMED,
                        help="seconds of the units' timed repetitions per micro-batch size")


def in_stage_threads(args: argparse.Namespace) -> tuple[fxpipe.CompiledPipeline, Any, Any]:
    """`args.model` compiled into `args.stages` stage threads of this process (one intra-op
    thread each), as add_stage_thread_arguments' arguments say, its loss timed with the units;
    with a mini-batch of `args.batch` and its target."""
    torch.set_num_threads(1)
    model = bundled(args.model)
    torch.manual_seed(0)
    x, y = model.batch(args.batch, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=args.stages, micro_batches=args.micro_batches,
                       partitioner=args.partitioner, schedule=args.schedule,
                       loss_fn=model.loss_fn)
    pipe = fxpipe.compile(model.build(), plan, example_inputs=(x,), example_target=y,
                          cache=False)
    return pipe, x, y
