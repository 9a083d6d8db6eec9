"""`fxpipe bench`: partitioners and schedules compared on one model, predicted against measured."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxpipe.calibrate import calibrate
from fxpipe.compiler import compile, units_of
from fxpipe.compiler.inputs import check_stage_count
from fxpipe.distributed import launched
from fxpipe.errors import FxpipeError
from fxpipe.inspect import format_bytes, format_sizes, format_table
from fxpipe.peak_memory import measure_memory
from fxpipe.plan import Plan
from fxpipe.preserve import gradients_set_aside, preserved_state
from fxpipe.report import step_time

__all__ = ["BenchRow", "against_even", "bench", "bench_plans", "bench_under_torchrun",
           "check_stage_count_of", "first_rank_error", "format_rows", "rows_from_json",
           "rows_to_json", "write_csv"]

Build = Callable[[], tuple[torch.nn.Module, Any, Any, Callable]]  # -> model, x, y, loss_fn


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One (partitioner, schedule) configuration, planned, calibrated and run."""

    partitioner: str
    schedule: str
    sizes: tuple[int, ...]  # units per stage
    micro_batches: int
    predicted_ms: float  # the calibrated simulated step
    measured_ms: float  # median of the timed steps
    measured_low_ms: float  # the lowest of the rounds' median steps
    measured_high_ms: float  # and the highest
    predicted_bubble: float
    measured_bubble: float  # of the last timed step
    memory: tuple[float, ...]  # per stage, bytes: the planner's estimate
    timed_steps: int
    rounds: int
    # per stage, bytes: the measured peak (fxpipe.measure_memory, Adam's state); () where this
    # run cannot tell stages apart (several CPU stages in one process: use --nproc)
    measured_memory: tuple[float, ...] = ()

    @property
    def ratio(self) -> float:
        return self.measured_ms / self.predicted_ms if self.predicted_ms > 0 else float("nan")


def bench_plans(stages: int, micro_batches: int | str, partitioners: Sequence[str],
                schedules: Sequence[str]) -> dict[tuple[str, str], Plan]:
    """The plan of every (partitioner, schedule) the benchmark runs, without the loss; made
    all at once, so a mistake in any of them is reported before any work."""
    if "async-1f1b" in schedules:
        raise FxpipeError("the benchmark times pipe.step, and async-1f1b trains only through "
                          "pipe.step_many with an attached optimizer: compare gpipe and 1f1b.")
    return {(p, s): Plan(stages=stages, partitioner=p, schedule=s,
                         micro_batches="auto" if p == "csimd" else micro_batches)  # csimd
            for p in partitioners for s in schedules}  # chooses the micro-batch count itself


def check_stage_count_of(build: Build, stages: int) -> None:
    """Raise PlanError when the model `build()` returns cuts into fewer units than `stages`
    (tracing it, no timing), so that the benchmark fails before any work."""
    model, x, _, _ = build()
    check_stage_count(model, Plan(stages=stages), units_of(model, (x,)))


def bench(build: Build, stages: int, micro_batches: int | str, partitioners: Sequence[str],
          schedules: Sequence[str], rounds: int = 5, steps: int = 5, warmup: int = 2,
          calibration_steps: int = 10, progress: bool = True,
          clock: Callable[[], float] = time.perf_counter) -> list[BenchRow]:
    """Compile and calibrate every configuration, then time `rounds` rounds of `warmup`
    untimed and `steps` timed steps of each, the configurations taking turns (in this process,
    or on every rank under torchrun: call it on every rank). `build()` returns (model, x, y,
    loss_fn), fresh each time."""
    plans = bench_plans(stages, micro_batches, partitioners, schedules)
    check_stage_count_of(build, stages)
    total, done, started, estimate = len(plans) * (rounds + 1), 0, clock(), ""
    configurations = []
    for (partitioner, schedule), plan in plans.items():
        done += 1
        if progress:
            _progress(done, total, f"compiling {partitioner}/{schedule}{estimate}")
        model, x, y, loss_fn = build()
        plan = dataclasses.replace(plan, loss_fn=loss_fn)
        pipe = compile(model, plan, example_inputs=(x,), example_target=y, cache=False)
        calibration = calibrate(pipe, x, target=y, steps=calibration_steps)
        memory = _measured_memory(pipe, x, y)
        configurations.append(_Configuration(partitioner, schedule, pipe, x, y, calibration,
                                             memory))
        if len(configurations) == 1:  # the first configuration's times stand for each one's
            step = pipe.predicted_timeline(calibration).makespan + calibration.step
            estimate = _estimate(clock() - started, step, len(plans), rounds * (warmup + steps))
    for number in range(1, rounds + 1):
        for configuration in configurations:
            done += 1
            if progress:
                _progress(done, total, f"round {number}/{rounds} {configuration.name}{estimate}")
            configuration.run_round(steps, warmup, clock)
    if progress:
        _progress(total + 1, total, "done")
        if not launched():  # a bar of its own line ends with it
            print(file=sys.stderr)
    return [configuration.row(stages) for configuration in configurations]


def _estimate(first: float, step: float, configurations: int, steps: int) -> str:
    """The benchmark's whole time, for the progress bar, from the first configuration's:
    `first` seconds to compile and calibrate, then `steps` steps of `step` seconds."""
    seconds = configurations * (first + steps * step)
    return f" (all: about {f'{seconds / 60:.0f} min' if seconds >= 90 else f'{seconds:.0f} s'})"


@dataclasses.dataclass
class _Configuration:
    """One (partitioner, schedule) of the benchmark, compiled, and what its rounds measured."""

    partitioner: str
    schedule: str
    pipe: Any
    x: Any
    y: Any
    calibration: Any
    memory: tuple[float, ...]
    rounds: list[list[float]] = dataclasses.field(default_factory=list)  # seconds per step

    @property
    def name(self) -> str:
        return f"{self.partitioner}/{self.schedule}"

    def run_round(self, steps: int, warmup: int, clock: Callable[[], float]) -> None:
        """`warmup` untimed steps (the cores settle after the other rows' steps), then `steps`
        timed ones, each from a barrier under torchrun; gradients are zeroed, not stepped."""
        times = []
        for i in range(warmup + steps):
            _barrier()
            start = clock()
            self.pipe.step(self.x, self.y)
            if i >= warmup:
                times.append(clock() - start)
            self.pipe.zero_grad(set_to_none=True)
        self.rounds.append(times)

    def row(self, stages: int) -> BenchRow:
        pipe, calibration = self.pipe, self.calibration
        predicted = pipe.predicted_timeline(calibration)
        measured = step_time(pipe.full_trace(), stages,  # the last timed step's
                             pipe.executor.latest_schedule.placement)
        every = [t for times in self.rounds for t in times]
        medians = [statistics.median(times) for times in self.rounds]
        return BenchRow(
            self.partitioner, self.schedule, tuple(pipe.partition.sizes),
            pipe.partition.micro_batches, (predicted.makespan + calibration.step) * 1e3,
            statistics.median(every) * 1e3, min(medians) * 1e3, max(medians) * 1e3,
            predicted.bubble, measured.bubble,
            tuple(s.memory for s in pipe.partition.stages), len(every), len(self.rounds),
            self.memory)


def format_rows(rows: Sequence[BenchRow]) -> str:
    header = ["partitioner", "schedule", "units per stage", "p", "predicted ms", "measured ms",
              "rounds' range ms", "meas/pred", "bubble pred", "bubble meas",
              "memory per stage pred (meas)"]
    table = [[r.partitioner, r.schedule, format_sizes(r.sizes), r.micro_batches,
              f"{r.predicted_ms:.1f}", f"{r.measured_ms:.1f}",
              f"{r.measured_low_ms:.1f}-{r.measured_high_ms:.1f}", f"{r.ratio:.2f}",
              f"{r.predicted_bubble:.0%}", f"{r.measured_bubble:.0%}",
              _memory_cells(r)] for r in rows]
    note = ("" if all(r.measured_memory for r in rows) else
            "\nmemory per stage: predicted; measured (in parentheses) where each stage runs in "
            "a process of its own (--nproc) or on a CUDA device of its own")
    return format_table(header, table) + note


def _memory_cells(row: BenchRow) -> str:
    """Per stage, the predicted peak and, where measured, the measured one in parentheses."""
    measured = row.measured_memory or (None,) * len(row.memory)
    return " / ".join(format_bytes(p) + (f" ({format_bytes(m)})" if m is not None else "")
                      for p, m in zip(row.memory, measured))


def _measured_memory(pipe: Any, x: Any, y: Any) -> tuple[float, ...]:
    """Each stage's measured peak in a step, with Adam's state (which the prediction counts)
    made by a step of learning rate 0, which leaves the weights as they are; () where this
    process runs several stages on CPU threads, whose peaks cannot be told apart."""
    runners = pipe.executor.runners.values()
    if len(runners) > 1 and any(r.device.type != "cuda" for r in runners):
        return ()
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.0)
    with preserved_state(pipe), gradients_set_aside(pipe), pipe.executor.runs_aside():
        pipe.step(x, y)
        optimizer.step()
    return measure_memory(pipe, x, target=y, optimizer=optimizer).totals


def against_even(rows: Sequence[BenchRow]) -> list[str]:
    """Per schedule: the fastest automatic partition's measured step against `even`'s. Rows of
    even's own partition (units per stage and micro-batch count) are no comparison: their
    difference is the machine's drift alone."""
    lines = []
    for schedule in dict.fromkeys(r.schedule for r in rows):
        even = next((r for r in rows if r.schedule == schedule and r.partitioner == "even"), None)
        others = [] if even is None else [
            r for r in rows if r.schedule == schedule and r.partitioner != "even"
            and (r.sizes, r.micro_batches) != (even.sizes, even.micro_batches)]
        if not others:
            continue
        best = min(others, key=lambda r: r.measured_ms)
        lines.append(f"{schedule}: the fastest automatic partition, {best.partitioner} "
                     f"({format_sizes(best.sizes)}, p={best.micro_batches}), steps "
                     f"{even.measured_ms / best.measured_ms:.2f}x the speed of even "
                     f"({best.measured_ms:.1f} against {even.measured_ms:.1f} ms, medians of "
                     f"{best.timed_steps} and {even.timed_steps} steps)")
    return lines


def write_csv(path: str, rows: Sequence[BenchRow]) -> None:
    """One line per row: its fields (tuples space-separated; memory in bytes), then meas/pred."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([f.name for f in dataclasses.fields(BenchRow)] + ["ratio"])
        for r in rows:
            cells = {**dataclasses.asdict(r), "sizes": format_sizes(r.sizes),
                     "memory": " ".join(f"{m:.0f}" for m in r.memory),
                     "measured_memory": " ".join(f"{m:.0f}" for m in r.measured_memory)}
            writer.writerow([*cells.values(), r.ratio])


def rows_to_json(path: str, rows: Sequence[BenchRow]) -> None:
    with open(path, "w") as handle:
        json.dump([dataclasses.asdict(r) for r in rows], handle)


def rows_from_json(path: str) -> list[BenchRow]:
    """The rows rows_to_json wrote."""
    with open(path) as handle:
        return [BenchRow(**{name: tuple(value) if isinstance(value, list) else value
                            for name, value in row.items()})  # JSON's arrays: the tuples
                for row in json.load(handle)]


def bench_under_torchrun(nproc: int, args: Sequence[str]) -> list[BenchRow]:
    """Run `fxpipe bench ARGS` with --nproc ranks under torchrun and read rank 0's results."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc), "-m", "fxpipe", "bench", *args,
                   "--rows-json", out]
        job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
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
