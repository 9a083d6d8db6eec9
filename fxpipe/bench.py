"""`fxpipe bench`: partitioners and schedules compared on one model, predicted against measured."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from fxpipe.compile import compile, retime, units_of
from fxpipe.compile.front import check_stage_count
from fxpipe.core_speed import core_times
from fxpipe.distributed import launched
from fxpipe.errors import FxpipeError
from fxpipe.inspect import format_bytes, format_sizes, format_table
from fxpipe.passes.analysis.capacity import ThreadCapacity
from fxpipe.passes.analysis.memory import PeakMemory
from fxpipe.plan import Plan
from fxpipe.report import LateMessages, late_messages, step_time
from fxpipe.schedules import ActionKind

if TYPE_CHECKING:
    from fxpipe.pipeline import CompiledPipeline

__all__ = [
    "FILLING_STEPS_MAX",
    "MEASURE_SECONDS",
    "OFF_BY",
    "PROFILE_SECONDS",
    "ROUNDS",
    "BenchRow",
    "StealMeter",
    "bench",
    "bench_plans",
    "bench_under_torchrun",
    "check_stage_count_of",
    "core_speed_line",
    "first_rank_error",
    "format_rows",
    "median_thread_capacity",
    "pyplot",
    "rows_to_json",
    "what_moved_lines",
    "write_csv",
    "write_png",
]

# seconds of timed steps per round at least: a round's two or so steps of a model whose steps
# take milliseconds move with every stall of the machine, and its median with them
MEASURE_SECONDS = 0.1
# seconds of timed repetitions of the units per micro-batch size in each round's re-timing (10x
# compile's MIN_TIMED): a stall of the machine as long as a short timing moves every unit in it,
# and the prediction with them, while the steps' median over the round moves less
# (benchmarks/timing_noise.py --min-time 0.05,0.5 and prediction_spread.py)
PROFILE_SECONDS = 0.5
# a row whose step is further than this from its prediction gets a line saying how far two of
# the prediction's inputs moved between its rounds (what_moved_lines)
OFF_BY = 0.15
# rounds per configuration, and timed steps at least (one a round at least): a machine that
# runs slow for a stretch moves a row of 5 rounds out of the 15% target now and then, and a row
# of 15 rounds less often (2 stages: 8 of 576 groups of 5 rounds missed it, and none of the 192
# rows of 15 rounds; benchmarks/ACCURACY.md, "with the bench's defaults of 15 rounds")
ROUNDS = 15


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One (partitioner, schedule) configuration, planned and run."""

    partitioner: str
    schedule: str
    sizes: tuple[int, ...]
    micro_batches: int
    predicted_ms: float  # the event simulator's schedule, plus the runtime's time per step
    measured_ms: float  # median of the timed steps (timed_steps of them)
    predicted_bubble: float
    measured_bubble: float
    memory: tuple[float, ...]  # per stage, bytes: the planner's estimate, or the measured peak
    memory_kind: str = "estimate"  # or "peak" (measured: each stage's device's, or rank's)
    # each round's prediction (predicted_ms: their median, the lower of an even count's two
    # middle ones) and median step (measured_ms: all timed steps' median), in the order the
    # rounds ran; empty where not known
    round_predicted_ms: tuple[float, ...] = ()
    round_measured_ms: tuple[float, ...] = ()
    # two of what each round's prediction was made from (with the link, measured each round
    # too), in the same order (empty where not known): the stages' compute of one micro-batch,
    # summed (their units' forwards and backwards, the loss, each stage's backward call: the
    # round's fresh timing), and fxpipe's own overhead in a step (its time per step outside
    # the schedule, once, plus each stage's time per forward and per backward action times
    # its actions)
    round_compute_ms: tuple[float, ...] = ()
    round_runtime_ms: tuple[float, ...] = ()
    # the machine's own speed, timed right after each round's steps (empty where not known):
    # the slowest core's time for a fixed piece of work (fxpipe.core_speed.core_times; every
    # rank's cores)
    round_core_ms: tuple[float, ...] = ()
    # the share of timed steps in which a message came late (fxpipe.report.late_messages)
    late_steps: float = float("nan")
    # per timed step on average, ms: the late messages' delays beyond the predicted ones, summed
    late_ms: float = float("nan")
    on_cpu: bool = True  # whether the stages computed on the CPU (else on GPUs)
    timed_steps: int = 0  # how many steps measured_ms is the median of (0: not known)
    # two or more stage threads (pipe.thread_capacity): how much of the units' work as many
    # threads as the cores (at most the stages), and as the stages, got through at once
    # against one (else nan)
    capacity_cores: float = float("nan")
    capacity_stages: float = float("nan")
    bound: bool = False  # whether compile bound the stage threads to cores (pipe.bound_cores)
    # how many threads ran the stages of one process, where fewer than the stages
    # (Plan(stage_threads); pipe.shared_threads); 0: a thread each
    threads: int = 0

    @property
    def ratio(self) -> float:
        return self.measured_ms / self.predicted_ms if self.predicted_ms > 0 else float("nan")

    @property
    def rounds(self) -> int:
        """How many predictions predicted_ms is the median of (0: not known)."""
        return len(self.round_predicted_ms)

    @property
    def predicted_low_ms(self) -> float:
        return min(self.round_predicted_ms, default=float("nan"))

    @property
    def predicted_high_ms(self) -> float:
        return max(self.round_predicted_ms, default=float("nan"))

    @property
    def measured_low_ms(self) -> float:
        return min(self.round_measured_ms, default=float("nan"))

    @property
    def measured_high_ms(self) -> float:
        return max(self.round_measured_ms, default=float("nan"))

    @property
    def predicted_spread(self) -> float:
        """How far the rounds' predictions spread (largest / smallest - 1). Each round times
        the units afresh, so this is how much the machine's speed moved during the row."""
        return _spread(self.round_predicted_ms)

    @property
    def measured_spread(self) -> float:
        """How far the rounds' median steps spread (largest / smallest - 1): the same plan
        run again, its steps moved by the machine's drift and by their own step-to-step noise
        (a round's median is of few steps)."""
        return _spread(self.round_measured_ms)

    @property
    def compute_spread(self) -> float:
        """How far the stages' compute that the rounds timed spread (largest / smallest - 1)."""
        return _spread(self.round_compute_ms)

    @property
    def runtime_spread(self) -> float:
        """How far fxpipe's own overhead per step that the rounds measured spread."""
        return _spread(self.round_runtime_ms)

    @property
    def core_spread(self) -> float:
        """How far the machine's own speed moved between the rounds: its slowest core's time
        for a fixed piece of work, timed outside the steps (largest / smallest - 1)."""
        return _spread(self.round_core_ms)


# the CSV's columns after BenchRow's fields: what a row derives from them
_DERIVED = ("ratio", "rounds", "predicted_low_ms", "predicted_high_ms", "measured_low_ms",
            "measured_high_ms", "predicted_spread", "measured_spread", "compute_spread",
            "runtime_spread", "core_spread")


# the fields of one figure per round, written space-separated in the CSV
_PER_ROUND_FIELDS = ("round_predicted_ms", "round_measured_ms", "round_compute_ms",
                     "round_runtime_ms", "round_core_ms")


def _spread(values: Sequence[float]) -> float:
    """max / min - 1, or nan where there are fewer than two values to compare."""
    if len(values) < 2 or not min(values) > 0:
        return float("nan")
    return max(values) / min(values) - 1


def bench_plans(stages: int, micro_batches: int | str, partitioners: Sequence[str],
                schedules: Sequence[str], cpu_affinity: str = "auto",
                stage_threads: int | str = "auto") -> dict[tuple[str, str], Plan]:
    """The plan of every (partitioner, schedule) the benchmark runs, without the loss, each
    with `cpu_affinity` and `stage_threads` (Plan.cpu_affinity, Plan.stage_threads); made all
    at once, so a mistake in any of them is reported before any work."""
    if "async-1f1b" in schedules:
        raise FxpipeError("the benchmark times pipe.step, and async-1f1b trains only through "
                          "pipe.step_many with an attached optimizer: compare gpipe and 1f1b.")
    return {(p, s): Plan(stages=stages, partitioner=p, schedule=s, cpu_affinity=cpu_affinity,
                         stage_threads=stage_threads,
                         micro_batches="auto" if p == "csimd" else micro_batches)  # csimd
            for p in partitioners for s in schedules}  # chooses the micro-batch count itself


def check_stage_count_of(build: Callable[[], tuple[torch.nn.Module, Any, Any, Callable]],
                         stages: int) -> None:
    """Raise PlanError when the model `build()` returns cuts into fewer units than `stages`
    (tracing it, no timing), so that the benchmark fails before any work."""
    model, x, _, _ = build()
    check_stage_count(model, Plan(stages=stages), units_of(model, (x,)))


def bench(build: Callable[[], tuple[torch.nn.Module, Any, Any, Callable]], stages: int,
          micro_batches: int | str, partitioners: Sequence[str], schedules: Sequence[str],
          repeats: int = ROUNDS, warmup: int = 2, progress: bool = True,
          rounds: int = ROUNDS, profile_repeats: int = 5, settle: float = 0.2,
          measure: float = MEASURE_SECONDS, profile_time: float = PROFILE_SECONDS,
          cpu_affinity: str = "auto", stage_threads: int | str = "auto") -> list[BenchRow]:
    """Compile and time each configuration in this process (or on every rank under torchrun:
    call it on every rank). `build()` returns (model, x, y, loss_fn), fresh each time. Every
    configuration is compiled before any is timed, and their rounds take turns (the first
    round of each, then the second, ...), so that the rows sample the machine alike.

    A shared machine's speed drifts over seconds, and a prediction is only as good as the
    timings it was made from. So the timed steps (at least `repeats`) come in `rounds`, each
    right after the link between the stages is measured again (`pipe.measure_link`), the
    units and the loss are timed afresh (`fxpipe.retime`, no disk cache) and the runtime's
    own time per step and per forward and backward action is measured
    (`pipe.measure_runtime_overhead`): the prediction (the simulated schedule plus that time)
    is the median of the rounds' predictions, the measurement the median of all timed steps,
    and both sample the machine over the same stretch of time.
    Each round's timed steps follow untimed ones: the larger of `warmup` and the number of the
    round's predicted steps that fills `settle` seconds; its timed steps are its share of
    `repeats`, or as many predicted steps as fill `measure` seconds where that is more (a
    filling is at most FILLING_STEPS_MAX steps; under torchrun the most any rank asks for).
    After anything else ran (a pause, re-timing the units) the cores of a virtual machine take
    tens of milliseconds to settle, and the steps meanwhile run at another speed than a
    training loop's back to back ones: slower for some models, faster for others
    (benchmarks/after_pause.py). `profile_repeats`: timed runs of each unit per round, more
    until they took `profile_time` seconds at each micro-batch size (at most MOST_REPEATS).
    `cpu_affinity`: every plan's (`Plan.cpu_affinity`); "none" compares the steps of unbound
    stage threads, or ranks, with the default's. `stage_threads`: every plan's
    (`Plan.stage_threads`); "stage" compares a thread per stage with the default's."""
    plans = bench_plans(stages, micro_batches, partitioners, schedules, cpu_affinity,
                        stage_threads)
    check_stage_count_of(build, stages)
    rounds = max(1, min(rounds, repeats))
    # every configuration is compiled first, then their rounds take turns: a stretch of the
    # machine running slow falls on the rows alike, not on the one whose rounds ran then,
    # and the rows are compared with each other (the best automatic partition against even);
    # every configuration's pipeline stays alive meanwhile, its weights and gradients too
    total = len(plans) * (rounds + 1)
    configurations = []
    for index, ((partitioner, schedule), plan) in enumerate(plans.items(), 1):
        if progress:
            _progress(index, total, f"compiling {partitioner}/{schedule}")
        model, x, y, loss_fn = build()
        plan = dataclasses.replace(plan, loss_fn=loss_fn)
        # the partitioners see the loss on the last stage, as the steps compute it
        pipe = compile(model, plan, example_inputs=(x,), example_target=y, cache=False)
        configurations.append(_Configuration(partitioner, schedule, pipe, x, y))
    done = len(plans)  # the compiles
    for number, steps in enumerate(_split(repeats, rounds), 1):
        for configuration in configurations:
            done += 1
            if progress:
                _progress(done, total, f"round {number}/{rounds} {configuration.name}")
            configuration.run_round(steps, warmup, settle, measure, profile_repeats,
                                    profile_time)
    rows = [configuration.row(stages) for configuration in configurations]
    if progress:
        _progress(total + 1, total, "done")
        if not launched():  # a bar of its own line ends with it
            print(file=sys.stderr)
    return rows


@dataclasses.dataclass
class _Configuration:
    """One (partitioner, schedule) of the benchmark, compiled, and what its rounds measured."""

    partitioner: str
    schedule: str
    pipe: CompiledPipeline
    x: Any
    y: Any
    # per round: the prediction (the simulated timeline, and the runtime's time per step
    # outside it), what it was made from (the stages' compute, fxpipe's own overhead per
    # step), the timed steps' seconds, and the slowest core's time for the fixed work after
    # the steps
    predictions: list[tuple[Any, float]] = dataclasses.field(default_factory=list)
    made_of: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    round_times: list[list[float]] = dataclasses.field(default_factory=list)
    slowest_core: list[float] = dataclasses.field(default_factory=list)
    late: list[LateMessages] = dataclasses.field(default_factory=list)  # per timed step

    @property
    def name(self) -> str:
        return f"{self.partitioner}/{self.schedule}"

    def run_round(self, steps: int, warmup: int, settle: float, measure: float,
                  profile_repeats: int, profile_time: float) -> None:
        """Predict a step from measurements made afresh, then time steps (see bench)."""
        pipe, x, y = self.pipe, self.x, self.y
        pipe.measure_link(x)  # what sending costs, for retime and the prediction
        fresh = retime(pipe, (x,), target=y, warmup=1, repeats=profile_repeats,
                       min_time=profile_time)
        pipe.measure_runtime_overhead(x)  # per step, and per action (in the timeline)
        overhead = pipe.step_overhead
        timeline = pipe.predicted_timeline(fresh)
        self.predictions.append((timeline, overhead))
        self.made_of.append((sum(s.f + s.b for s in fresh.stages),
                             _own_overhead_per_step(pipe)))
        predicted_step = timeline.makespan + overhead  # seconds
        settling, timing = _most_of_any_rank(_steps_filling(settle, predicted_step, warmup),
                                              _steps_filling(measure, predicted_step, steps))
        for _ in range(settling):
            pipe.step(x, y)
        timed, kept = [], []
        for _ in range(timing):
            # the ranks start together; a step ends on every rank once the loss is shared,
            # so no barrier is timed after it (a round trip no training loop pays)
            _barrier()
            start = time.perf_counter()
            pipe.step(x, y)
            timed.append(time.perf_counter() - start)
            kept.append((pipe.executor.last_trace(), pipe.executor.trace_origin))
        # in the state the steps left the cores in (a core that idled can run slower for a
        # while: benchmarks/core_speeds.py --after-idle)
        self.slowest_core.append(_slowest_core_time())
        # gathered after the round, so that only the barrier comes between its steps
        self.late += [late_messages(events, timeline.events)
                      for events in pipe.executor.full_traces(kept)]
        self.round_times.append(timed)

    def row(self, stages: int) -> BenchRow:
        """The configuration's row, from its rounds (and its memory, see _memory)."""
        pipe = self.pipe
        totals = [timeline.makespan + overhead for timeline, overhead in self.predictions]
        predicted, overhead = self.predictions[_lower_median_index(totals)]
        measured = step_time(pipe.full_trace("timing the bubble"), stages)  # every rank's
        memory, kind = _memory(pipe, self.x, self.y, stages)
        every_step = [t for timed in self.round_times for t in timed]
        return BenchRow(
            partitioner=self.partitioner, schedule=self.schedule,
            sizes=tuple(pipe.partition.sizes), micro_batches=pipe.partition.micro_batches,
            predicted_ms=(predicted.makespan + overhead) * 1e3,
            measured_ms=statistics.median(every_step) * 1e3, predicted_bubble=predicted.bubble,
            measured_bubble=measured.bubble, memory=memory, memory_kind=kind,
            round_predicted_ms=tuple(t * 1e3 for t in totals),
            round_measured_ms=tuple(statistics.median(timed) * 1e3 for timed in self.round_times),
            round_compute_ms=tuple(compute * 1e3 for compute, _ in self.made_of),
            round_runtime_ms=tuple(runtime * 1e3 for _, runtime in self.made_of),
            round_core_ms=() if any(map(math.isnan, self.slowest_core)) else tuple(
                t * 1e3 for t in self.slowest_core),
            late_steps=statistics.fmean(found.late > 0 for found in self.late),
            late_ms=statistics.fmean(found.excess for found in self.late) * 1e3,
            # this process's stages (under torchrun, this rank's)
            on_cpu=all(r.device.type == "cpu" for r in pipe.executor.runners.values()),
            timed_steps=len(every_step), bound=pipe.bound_cores() is not None,
            threads=len(pipe.executor.driver.workers) if pipe.shared_threads() else 0,
            **_capacities(pipe))


def _own_overhead_per_step(pipe) -> float:
    """fxpipe's own overhead in a step of `pipe`, in seconds, as its prediction counts it: the
    runtime's time per step outside the schedule, once, plus each stage's time per forward and
    per backward action times its forwards and backwards in the last run's schedule."""
    schedule = pipe.executor.latest_schedule
    total = pipe.step_overhead
    for actions, forward, backward in zip(schedule.actions, pipe.forward_overhead,
                                          pipe.backward_overhead):
        total += sum({ActionKind.F: forward, ActionKind.B: backward}.get(a.kind, 0.0)
                     for a in actions)
    return total


def _slowest_core_time() -> float:
    """The slowest of the cores' times for a fixed piece of work (core_times), under torchrun
    of every rank's cores, the ranks in turn (the others wait in a barrier); nan where no core
    could be timed."""
    if _world_size() == 1:
        mine = core_times()
    else:
        mine = {}
        for rank in range(_world_size()):
            _barrier()
            if rank == torch.distributed.get_rank():
                mine = core_times()
    everyone = _from_every_rank(mine)
    return max((t for times in everyone for t in times.values()), default=float("nan"))


def _lower_median_index(values: Sequence[float]) -> int:
    """The index of the values' median, the lower middle one of an even count (a round's
    prediction, whose timeline the row then shows, rather than a mean of two)."""
    return sorted(range(len(values)), key=values.__getitem__)[(len(values) - 1) // 2]


def _capacities(pipe) -> dict[str, float]:
    """The row's capacity_cores and capacity_stages, from the pipeline's thread_capacity."""
    capacity = pipe.thread_capacity
    if capacity is None:
        return {}
    return {"capacity_cores": capacity.at_cores, "capacity_stages": capacity.at_stages}


def median_thread_capacity(rows: Sequence[BenchRow], cores: int, stages: int
                           ) -> ThreadCapacity | None:
    """The rows' thread capacity, with as many threads as `cores` and as `stages` (the median
    over the rows that measured it; None when none did), as shared_cores_lines takes it."""
    measured = [r for r in rows if not math.isnan(r.capacity_stages)]
    if not measured:
        return None
    return ThreadCapacity(cores, stages, statistics.median(r.capacity_cores for r in measured),
                          statistics.median(r.capacity_stages for r in measured))


def core_speed_line(rows: Sequence[BenchRow]) -> str | None:
    """How far the machine's own speed moved over the rows' rounds (round_core_ms), in a line
    to print beside the table; None where no round timed it."""
    times = [t for r in rows for t in r.round_core_ms]
    if len(times) < 2:
        return None
    return (f"core speed during the run: a fixed piece of work took {_low_high(times, 3)} ms "
            f"on the slowest core after each round's steps, {_percent(_spread(times))} apart, "
            "over every row (a virtual machine's core can run far slower for a stretch with "
            "no steal to show for it; the CSV has each row's rounds)")


class StealMeter:
    """The share of this machine's CPU time its hypervisor took while the block ran ("steal"
    in /proc/stat; None where there is no /proc/stat). On a virtual machine it is what makes
    timings drift: a few percent already spreads them."""

    def __enter__(self) -> StealMeter:
        self.start, self.share = _cpu_times(), None
        return self

    def __exit__(self, *exc) -> None:
        end = _cpu_times()
        if self.start is not None and end is not None:
            spent = [b - a for a, b in zip(self.start, end)]
            total = sum(spent[:8])  # guest time (fields 9-10) is counted in user time already
            self.share = spent[7] / total if total > 0 and len(spent) > 7 else None


def _cpu_times() -> list[int] | None:
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    return [int(v) for v in fields[1:]] if fields and fields[0] == "cpu" else None


FILLING_STEPS_MAX = 500  # a prediction far too small must not run steps for minutes


def _steps_filling(seconds: float, predicted: float, least: int) -> int:
    """Steps of `predicted` seconds enough to fill `seconds` (at most FILLING_STEPS_MAX), and
    never fewer than `least`."""
    if seconds <= 0:
        return least
    filling = seconds / predicted if predicted > 0 else math.inf  # may overflow to inf
    return max(least, math.ceil(min(filling, FILLING_STEPS_MAX)))


def _split(total: int, parts: int) -> list[int]:
    """`total` as `parts` near-equal positive counts."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def bench_under_torchrun(nproc: int, args: Sequence[str]) -> list[BenchRow]:
    """Run `fxpipe bench ARGS` with --nproc ranks under torchrun and read rank 0's results."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc), "-m", "fxpipe", "bench", *args,
                   "--rows-json", out]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        job = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        errors = _relay_progress(job.stderr)
        if job.wait() != 0:
            ours = first_rank_error(errors, nproc)
            if ours:
                raise FxpipeError(f"under torchrun: {ours}")
            # the launcher's own report of a failed rank alone takes about 2000 characters:
            # keep enough before it for the rank's message
            raise FxpipeError(f"the torchrun benchmark failed:\n{errors[-8000:]}")
        return rows_from_json(out)


def first_rank_error(stderr: str, ranks: int) -> str | None:
    """The first message a rank printed for an FxpipeError, when each of the `ranks` printed
    one (the launcher's own traceback follows them); else None: a rank failed otherwise,
    and its traceback says more."""
    found = _ERROR.findall(stderr)
    return found[0].strip() if len(found) >= ranks else None


def format_rows(rows: Sequence[BenchRow]) -> str:
    kinds = {r.memory_kind for r in rows}
    memory = {frozenset({"peak"}): "peak memory per stage",
              frozenset({"estimate"}): "memory per stage (estimate)"}.get(
        frozenset(kinds), "memory per stage (peak or estimate)")
    header = ["partitioner", "schedule", "units per stage", "p", "predicted ms", "measured ms",
              "meas/pred", "pred spread", "meas spread", "late steps", "late ms", "bubble pred",
              "bubble meas", memory]
    table = [[r.partitioner, r.schedule, format_sizes(r.sizes), r.micro_batches,
              f"{r.predicted_ms:.1f}", f"{r.measured_ms:.1f}", f"{r.ratio:.2f}",
              _percent(r.predicted_spread), _percent(r.measured_spread), f"{r.late_steps:.0%}",
              f"{r.late_ms:.1f}", f"{r.predicted_bubble:.0%}", f"{r.measured_bubble:.0%}",
              " / ".join(format_bytes(m) for m in r.memory)] for r in rows]
    return format_table(header, table)


def what_moved_lines(rows: Sequence[BenchRow], off_by: float = OFF_BY) -> list[str]:
    """A line for each row whose step was further than `off_by` from its prediction, that ran
    several rounds: how far two of the predictions' inputs moved between its rounds (the
    stages' compute, fxpipe's own overhead), beside the predictions and the median steps, and
    how far the machine's own speed did (round_core_ms), where the rounds timed it."""
    lines = []
    for r in rows:
        known = r.rounds >= 2 and r.round_compute_ms and r.round_runtime_ms
        if not (known and abs(r.ratio - 1) > off_by):
            continue
        lines.append(
            f"{r.partitioner}/{r.schedule}: measured {r.ratio:.2f}x its prediction. Between "
            f"its {r.rounds} rounds the predictions moved {_percent(r.predicted_spread)} "
            f"({_low_high(r.round_predicted_ms)} ms), the median steps "
            f"{_percent(r.measured_spread)} ({_low_high(r.round_measured_ms)} ms), and of what "
            f"the predictions were made from, the stages' compute "
            f"{_percent(r.compute_spread)} ({_low_high(r.round_compute_ms)} ms per "
            f"micro-batch, summed) and fxpipe's own overhead {_percent(r.runtime_spread)} "
            f"({_low_high(r.round_runtime_ms)} ms per step)"
            + (f"; the machine's own speed moved {_percent(r.core_spread)} (a fixed piece of "
               f"work on its slowest core, {_low_high(r.round_core_ms, 3)} ms)"
               if r.round_core_ms else "")
            + "; the CSV has every round's figures")
    return lines


def _low_high(values: Sequence[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f} to {max(values):.{digits}f}"


def _percent(share: float) -> str:
    """A share as the table shows it: '-' where there is none (nan)."""
    return "-" if math.isnan(share) else f"{share:.0%}"


def write_csv(path: str, rows: Sequence[BenchRow]) -> None:
    """One line per row: its fields (a tuple's values space-separated, ms per round in the
    order the rounds ran), then the figures the row derives from them (_DERIVED)."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([f.name for f in dataclasses.fields(BenchRow)] + list(_DERIVED))
        for r in rows:
            cells = {**dataclasses.asdict(r), "sizes": format_sizes(r.sizes),  # as the table
                     "memory": " ".join(f"{m:.0f}" for m in r.memory),  # bytes per stage
                     **{name: " ".join(map(repr, getattr(r, name)))
                        for name in _PER_ROUND_FIELDS}}
            writer.writerow([*cells.values(), *(getattr(r, name) for name in _DERIVED)])


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files; FxpipeError without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise FxpipeError("--png needs matplotlib: pip install 'fxpipe[plot]'") from e
    return plt


def write_png(path: str, rows: Sequence[BenchRow], title: str) -> None:
    plt = pyplot()
    labels = [f"{r.partitioner}\n{r.schedule}" for r in rows]
    positions = range(len(rows))
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4))
    # the whiskers span the rounds' predictions (how far the machine's speed moved meanwhile)
    # and their median steps (that, and the steps' own noise)
    axis.bar([i - 0.2 for i in positions], [r.predicted_ms for r in rows], 0.4,
             yerr=_whiskers(rows, "predicted"), capsize=3, ecolor="#636363",
             label="predicted (median; whisker: the rounds' predictions)", color="#9ecae1")
    axis.bar([i + 0.2 for i in positions], [r.measured_ms for r in rows], 0.4,
             yerr=_whiskers(rows, "measured"), capsize=3, ecolor="#636363",
             label="measured (median; whisker: the rounds' median steps)", color="#3182bd")
    axis.set_xticks(list(positions), labels, fontsize=8)
    axis.set_ylabel("step time (ms)")
    axis.set_title(title, fontsize=10)
    tallest = max((v for r in rows for v in (r.predicted_high_ms, r.predicted_ms,
                                             r.measured_high_ms, r.measured_ms)
                   if math.isfinite(v)), default=1.0)
    axis.set_ylim(0, 1.45 * tallest)  # room above the bars for the legend
    axis.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _whiskers(rows: Sequence[BenchRow], kind: Literal["predicted", "measured"]
              ) -> list[list[float]]:
    """How far below and above each row's `kind` ("predicted" or "measured") ms its rounds'
    lowest and highest went (nan, drawn as nothing, where not known)."""
    values = [(getattr(r, f"{kind}_low_ms"), getattr(r, f"{kind}_ms"),
               getattr(r, f"{kind}_high_ms")) for r in rows]
    return [[max(mid - low, 0.0) for low, mid, _ in values],
            [max(high - mid, 0.0) for _, mid, high in values]]


def rows_to_json(path: str, rows: Sequence[BenchRow]) -> None:
    with open(path, "w") as handle:
        json.dump([dataclasses.asdict(r) for r in rows], handle)


def rows_from_json(path: str) -> list[BenchRow]:
    """The rows rows_to_json wrote."""
    with open(path) as handle:
        return [BenchRow(**{name: tuple(value) if isinstance(value, list) else value
                            for name, value in row.items()})  # JSON's arrays: the tuples
                for row in json.load(handle)]


def _memory(pipe: CompiledPipeline, x: Any, y: Any, stages: int) -> tuple[tuple[float, ...], str]:
    """Per stage, the memory a row shows and its kind: with one stage per process (under
    torchrun), every rank's peak in one more step, gathered (every rank takes this path); on
    GPUs in one process, each stage's device's peak in one more step; else the planner's
    estimate (stages in one process share the CPU's memory, which no peak tells apart)."""
    runners = [pipe.executor.runners[s] for s in sorted(pipe.executor.runners)]
    devices = [_indexed(r.device) for r in runners]  # this process's stages', in order
    if 1 < _world_size() == stages:  # a process's memory is its stage's
        [mine] = _step_peaks(pipe, x, y, devices[:1])
        return tuple(_from_every_rank(mine)), "peak"
    if _world_size() == 1 and any(d.type == "cuda" for d in devices):
        peaks = dict(zip(unique := list(dict.fromkeys(devices)),
                         _step_peaks(pipe, x, y, unique)))
        return tuple(peaks[d] for d in devices), "peak"
    return tuple(s.memory for s in pipe.partition.stages), "estimate"


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index ("cuda" is the current CUDA device), as tensors name theirs."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _step_peaks(pipe: torch.nn.Module, x: Any, y: Any, devices: Sequence[torch.device]
                ) -> tuple[float, ...]:
    """Per device of `devices`, the pipeline's peak memory there: what it holds on it between
    steps (parameters, buffers, gradients) plus the most one more step allocates above what
    the device held before it (the allocator's peak on a GPU; on the CPU, which keeps none,
    torch.profiler's allocation log). Other pipelines alive beside it do not count."""
    held = dict.fromkeys(devices, 0)
    tensors = [t for t in pipe.state_dict().values() if isinstance(t, torch.Tensor)]
    tensors += [p.grad for p in pipe.parameters() if p.grad is not None]
    for tensor in tensors:
        if (device := _indexed(tensor.device)) in held:
            held[device] += tensor.nbytes
    with contextlib.ExitStack() as measuring:
        peaks = [measuring.enter_context(PeakMemory(d)) for d in devices]
        for peak in peaks:  # the spans end first, then the CPU's profiler
            measuring.enter_context(peak.span("step"))
        pipe.step(x, y)
    return tuple(float(held[d] + peak.result["step"]) for d, peak in zip(devices, peaks))


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _most_of_any_rank(*counts: int) -> tuple[int, ...]:
    """For each of `counts`, the largest any rank gives, gathered in one collective (this
    process's own counts when it is the only one)."""
    if _world_size() == 1:
        return counts
    return tuple(map(max, zip(*_from_every_rank(counts))))


def _from_every_rank(mine: Any) -> list[Any]:
    """Every rank's `mine`, in rank order, gathered in one collective (on any backend, NCCL
    too); this process's alone when it is the only one."""
    if _world_size() == 1:
        return [mine]
    everyone: list[Any] = [None] * _world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _relay_progress(stream) -> str:
    """Show rank 0's progress bar from the torchrun job's stderr as it arrives; return the
    rest (warnings, a traceback) for the error message, should the job fail."""
    rest, pending, shown = [], "", False
    while chunk := stream.read(1):
        pending += chunk
        if chunk not in "\r\n":
            continue
        line, pending = pending, ""
        if _PROGRESS.fullmatch(line.strip()):  # padded, to cover a longer label before it
            print("\r" + line.strip("\r\n"), end="", file=sys.stderr, flush=True)
            shown = True
        elif line.strip():
            rest.append(line)
    if shown:
        print(file=sys.stderr)
    return "".join(rest) + pending


_PROGRESS = re.compile(r"\[[#.]+\] \d+/\d+ .*")
# what `fxpipe` prints for an FxpipeError, up to the end of its line or another rank's message
_ERROR = re.compile(r"fxpipe: error: (.+?)(?=fxpipe: error: |\n|$)")


def _progress(index: int, total: int, label: str) -> None:
    """The bar as piece `index` of the run's `total` starts (a configuration's compile, or
    one of its rounds; `total + 1`: all are done)."""
    width = 24
    done = int(width * (index - 1) / total)
    # under torchrun each update is a line of its own, for the parent to relay at once
    print(f"\r[{'#' * done}{'.' * (width - done)}] {min(index, total)}/{total} {label:<32}",
          end="\n" if launched() else "", file=sys.stderr, flush=True)
