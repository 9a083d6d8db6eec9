"""Benchmark: would a simulator that paces each compute by what runs beside it predict closer?

For 2 stage threads of one process, compile times each unit's forward beside a thread running
backwards and its backward beside one running forwards ("crossed"), and the simulator runs
every compute at that pace, whatever the other stage does at the time. In a step a forward
also runs beside a forward, or beside nothing (`neighbour_kinds.py` shows how much those
differ). This script compiles a bundled model into 2 stage threads and, in each of `--rounds`
rounds, measures the link and the runtime's own time, times the units four ways (crossed;
alone; beside forwards; beside backwards: `fxpipe.retime` with the pipeline's timing told so),
then runs steps (0.2 s untimed, then `--seconds` timed, as `fxpipe bench` runs a round). It
predicts each round three ways:

- **crossed**: as fxpipe predicts;
- **by neighbour**: every compute from its time alone, slowed while the other stage computes
  by that kind's time beside it over its time alone;
- **same kind slowed**: every compute from its crossed time, slowed while the other stage
  computes the same kind by that kind's time beside it over the crossed time.

It prints each round's measured step and the three predictions, measured / predicted in
brackets, and how much slower each kind ran beside each kind than alone; then the median of each
way's measured / predicted and how far its predictions spread.

    OMP_NUM_THREADS=1 python benchmarks/neighbour_paces.py --model mlp --schedule 1f1b
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import statistics
from collections.abc import Iterator, Mapping
from typing import Any

from two_stages import add_model_arguments, at_least_one, median_step, two_stages

import fxpipe
import fxpipe.simulate as simulate
from fxpipe.affinity import usable_cores
from fxpipe.bench import PROFILE_SECONDS
from fxpipe.cost import Partition
from fxpipe.distributed import launched
from fxpipe.schedules import ActionKind, one_f_one_b
from fxpipe.simulate import _Run, _Work

F, B = ActionKind.F, ActionKind.B
Slowdowns = list[dict[ActionKind, dict[ActionKind, float]]]  # [stage][own kind][beside kind]


class NeighbourPaced(_Run):
    """The simulator's event loop with each compute's pace set by the compute beside it: the
    work of a stage computing kind k goes at 1 / slowdowns[s][k][j] of its pace while the other
    stage computes kind j, and at its own pace while it does not (2 stages, each a core)."""

    def __init__(self, *args: Any, slowdowns: Slowdowns) -> None:
        super().__init__(*args)
        self.slowdowns = slowdowns

    def run(self) -> None:
        paces: dict[int, tuple[_Work, float]] = {}  # each work, the pace its end is set at
        while True:
            self._settle()
            now = {s: self._pace_of(s) for s in self.work}
            for s, work in self.work.items():
                earlier, before = paces.get(s, (None, 1.0))
                if earlier is not work:  # begun since: its end was set at its own pace
                    before = 1.0
                if now[s] != before:
                    work.end = self.now + (work.end - self.now) * before / now[s]
            paces = {s: (work, now[s]) for s, work in self.work.items()}
            times = [w.end for w in self.work.values()] + [
                self.finished[m] for m in map(self._message, self.posted) if m in self.finished]
            if not times:
                return
            self.now = min(times)

    def _computing(self, s: int) -> ActionKind | None:
        kind = self.schedule.actions[s][self.pc[s]].kind if s in self.work else None
        return kind if kind in (F, B) else None

    def _pace_of(self, s: int) -> float:
        own = self._computing(s)
        beside = [k for o in self.work if o != s and (k := self._computing(o)) is not None]
        if own is None or not beside:
            return 1.0
        return 1.0 / max(self.slowdowns[s][own][k] for k in beside)


@contextlib.contextmanager
def paced(slowdowns: Slowdowns) -> Iterator[None]:
    """Within it, fxpipe.simulate.simulate runs its schedules with NeighbourPaced."""
    simulate._Run = functools.partial(NeighbourPaced, slowdowns=slowdowns)
    try:
        yield
    finally:
        simulate._Run = _Run


def check_event_loop() -> None:
    """Stop unless NeighbourPaced times a schedule as the simulator's own loop does where they
    agree: computes at half their pace beside any other compute, and one core shared by
    stages whose only work is their computes (no link, posting or slowdown terms)."""
    schedule = one_f_one_b(2, 4)
    forward, backward = [1.0, 1.5], [2.0, 2.5]
    shared = simulate.simulate(schedule, forward, backward, cores=1).makespan
    halved = [{k: {j: 2.0 for j in (F, B)} for k in (F, B)} for _ in range(2)]
    with paced(halved):
        halving = simulate.simulate(schedule, forward, backward).makespan
    if not math.isclose(halving, shared, rel_tol=1e-9):
        raise SystemExit(f"the paced event loop timed a step at {halving} where the simulator's "
                         f"own, on one shared core, timed it at {shared}: compare NeighbourPaced "
                         "with fxpipe.simulate._Run")


def paced_prediction(pipe: fxpipe.CompiledPipeline, base: Partition,
                     slowdowns: Slowdowns) -> float:
    """The step predicted from `base`'s stage costs, each compute paced by `slowdowns`."""
    with paced(slowdowns):
        return pipe.predicted_timeline(base).makespan + pipe.step_overhead


def action_time(pipe: fxpipe.CompiledPipeline, partition: Partition, s: int,
                kind: ActionKind) -> float:
    """Stage s's forward or backward as the simulator takes it: the stage's cost in
    `partition`, and the runtime's own time per action."""
    stage = partition.stages[s]
    if kind is F:
        return stage.f + pipe.forward_overhead[s]
    return stage.b + pipe.backward_overhead[s]


def by_neighbour(pipe: fxpipe.CompiledPipeline, alone: Partition,
                 beside: Mapping[ActionKind, Partition]) -> Slowdowns:
    """Per stage, each kind's action beside each kind (timed as in `beside`) over alone."""
    return [{k: {j: action_time(pipe, beside[j], s, k) / action_time(pipe, alone, s, k)
                 for j in (F, B)} for k in (F, B)} for s in range(len(alone.stages))]


def same_kind(pipe: fxpipe.CompiledPipeline, crossed: Partition,
              beside: Mapping[ActionKind, Partition]) -> Slowdowns:
    """Per stage, each kind's action beside the same kind over its crossed time (beside the
    other kind, as crossed timed it: 1)."""
    return [{k: {j: action_time(pipe, beside[k], s, k) / action_time(pipe, crossed, s, k)
                 if j is k else 1.0 for j in (F, B)} for k in (F, B)}
            for s in range(len(crossed.stages))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "mlp", schedule=True)
    parser.add_argument("--partitioner", default="even")
    parser.add_argument("--rounds", type=at_least_one, default=6)
    parser.add_argument("--seconds", type=float, default=0.1, help="of timed steps per round")
    parser.add_argument("--min-time", type=float, default=PROFILE_SECONDS,
                        help="seconds of the units' timed repetitions per micro-batch size "
                             "(the bench's, by default)")
    args = parser.parse_args()
    if launched():
        parser.error("the stages pace each other as threads of one process: run it with "
                     "python, not torchrun")
    if usable_cores() < 2:
        parser.error("2 stage threads need a core each for this comparison")
    check_event_loop()
    setup = two_stages(args, partitioner=args.partitioner, schedule=args.schedule)
    pipe, x, y = setup.pipe, setup.x, setup.y
    compiled = pipe.timing
    timings = {"crossed": compiled, "alone": dataclasses.replace(compiled, concurrency=1),
               "forwards": dataclasses.replace(compiled, load="forwards"),
               "backwards": dataclasses.replace(compiled, load="backwards")}
    ways = ("crossed", "by neighbour", "same kind slowed")
    print(f"{args.model}, {setup.where}, {args.partitioner} {pipe.partition.bounds}, "
          f"{args.schedule}; measured and predicted step in ms, measured / predicted in "
          f"brackets; then per stage each kind's time beside a forward (|F) or a backward (|B) "
          f"over alone")
    measured, predicted = [], {way: [] for way in ways}
    for index in range(args.rounds):
        pipe.measure_link(x)
        pipe.measure_runtime_overhead(x)
        timed = {}
        try:
            for name, timing in timings.items():
                pipe.timing = timing
                timed[name] = fxpipe.retime(pipe, (x,), target=y, warmup=1,
                                            min_time=args.min_time)
        finally:
            pipe.timing = compiled
        beside = {F: timed["forwards"], B: timed["backwards"]}
        neighbour_slowdowns = by_neighbour(pipe, timed["alone"], beside)
        round_predictions = {
            "crossed": pipe.predicted_timeline(timed["crossed"]).makespan + pipe.step_overhead,
            "by neighbour": paced_prediction(pipe, timed["alone"], neighbour_slowdowns),
            "same kind slowed": paced_prediction(pipe, timed["crossed"],
                                                 same_kind(pipe, timed["crossed"], beside)),
        }
        unpaced = [{k: {j: 1.0 for j in (F, B)} for k in (F, B)} for _ in neighbour_slowdowns]
        if not math.isclose(paced_prediction(pipe, timed["crossed"], unpaced),
                            round_predictions["crossed"], rel_tol=1e-9):
            raise SystemExit("the paced event loop no longer times a step as the simulator "
                             "does with every pace at 1: compare it with fxpipe.simulate._Run")
        measured.append(median_step(pipe, x, y, steps=3, seconds=args.seconds))
        cells = []
        for way in ways:
            predicted[way].append(round_predictions[way])
            cells.append(f"{way} {round_predictions[way] * 1e3:.2f} "
                         f"({measured[-1] / round_predictions[way]:.2f})")
        paces = "  ".join(f"s{s} " + " ".join(f"{k.name}|{j.name} {stage[k][j]:.2f}"
                                              for k in (F, B) for j in (F, B))
                          for s, stage in enumerate(neighbour_slowdowns))
        print(f"round {index}: measured {measured[-1] * 1e3:.2f}; " + "; ".join(cells)
              + f" | {paces}", flush=True)
    for way in ways:
        ratios = [m / p for m, p in zip(measured, predicted[way])]
        print(f"{way}: measured / predicted median {statistics.median(ratios):.3f}, "
              f"{min(ratios):.2f} to {max(ratios):.2f}; predictions spread "
              f"{max(predicted[way]) / min(predicted[way]) - 1:.0%}")
    print(f"measured steps spread {max(measured) / min(measured) - 1:.0%}")


if __name__ == "__main__":
    main()
