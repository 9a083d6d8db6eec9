"""Thread capacity pass: how much of the units' work several threads of one process do at once."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import fx

from fxpipe.batching import input_dims, resize
from fxpipe.ir import CommTable
from fxpipe.materialize import has_meta_tensors
from fxpipe.passes.analysis.profile import run_as_a_stage, values_needing_grad
from fxpipe.probes import gradients_set_aside, preserved_state

__all__ = ["BIND_FROM", "FEWER_THREADS_BELOW", "ThreadCapacity", "thread_capacity"]

# past the cores, more threads count as getting less done where as many threads as the stages
# got through less than this share of the work as many as the cores did (the measurement moves
# by a few percent from run to run)
FEWER_THREADS_BELOW = 0.9
# as many threads as the stages count as sharing mostly the cores where they got through at
# least this much of one thread's work at once: 4 threads of the bundled MLP, whose pace the
# interpreter lock sets, measured 0.58 to 0.82 on 2 cores, of the GPT 1.26 to 1.92, of the other
# bundled and HF models 1.55 or more (benchmarks/ACCURACY.md)
BIND_FROM = 1.0


class ThreadCapacity(NamedTuple):
    """How much of the units' work as many threads as the cores (as the stage threads, where
    they are fewer), and as the stage threads, got through at once, each against one thread
    alone (`thread_capacity`)."""

    cores: int
    stages: int
    at_cores: float
    at_stages: float

    @property
    def past_the_cores(self) -> bool:
        """Whether the stage threads outnumber the cores."""
        return self.stages > self.cores

    @property
    def more_threads_lose(self) -> bool:
        """Whether as many threads as the stages got less done than as many as the cores (by
        FEWER_THREADS_BELOW): then the threads contend for more than the cores (Python's
        interpreter lock, mostly), and fewer stages per process are likely faster."""
        return self.at_stages < FEWER_THREADS_BELOW * self.at_cores

    @property
    def shares_mostly_cores(self) -> bool:
        """Whether as many threads as the stages got through at least BIND_FROM times one
        thread's work at once: what they share is then mostly the cores, not the interpreter
        lock, and a stage thread bound to a core runs as that core's share predicts."""
        return self.at_stages >= BIND_FROM


def thread_capacity(graph: fx.GraphModule, table: CommTable, flat_inputs: Sequence[Any],
                    size: int, counts: Sequence[int], *, threads: int = 1,
                    whole: Sequence[int] = (), window: float = 0.1) -> dict[int, float]:
    """For each k of `counts`: how much of the units' work k threads of this process get
    through at once, against one thread alone (1.0 for k = 1).

    Each thread runs all the units as a pipeline stage runs its own (their forwards on a
    micro-batch of `size` samples, then one backward), again and again, on the same modules,
    with `threads` intra-op threads; k threads' rate is the runs they finish in a `window` of
    seconds (at least two runs of one thread alone), a run that straddles an end of it
    counted for its share inside. Every k is measured twice, in rising and then falling order,
    and the median counts, so a drift of the machine's speed meets both ends. Threads of one
    process share its cores, their caches and Python's interpreter lock: past the cores, more
    of them can get through less work than fewer. The units must be real (not on the meta
    device). Leaves no gradient, buffer or random number generator changed."""
    if has_meta_tensors(graph):
        raise ValueError("thread_capacity runs the units themselves: make the model real "
                         "first (its tensors are on the meta device)")
    counts = sorted({1, *(int(k) for k in counts)})
    if counts[0] < 1:
        raise ValueError(f"counts={counts}: give thread counts of at least 1")
    modules = [graph.get_submodule(f"stage{io.stage}").module for io in table.stages]
    needs_grad = values_needing_grad(table)
    values = dict(zip(table.graph_inputs, resize(flat_inputs, input_dims(flat_inputs, whole),
                                                 size)))
    rates: dict[int, list[float]] = {k: [] for k in counts}
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with preserved_state(graph), gradients_set_aside(graph):
            started = time.perf_counter()
            for _ in range(2):  # warm-up runs, and how long one takes alone
                run_as_a_stage(table, modules, values, needs_grad)
            window = max(window, time.perf_counter() - started)  # the two runs
            for k in [*counts, *reversed(counts)]:
                rates[k].append(_runs_per_second(k, window, table, modules, values,
                                                 needs_grad, threads))
    finally:
        torch.set_num_threads(previous_threads)
    alone = statistics.median(rates[1])
    return {k: statistics.median(r) / alone for k, r in rates.items()}


def _runs_per_second(k: int, window: float, table, modules, values, needs_grad,
                     threads: int) -> float:
    """Runs of the units (`run_as_a_stage`) that k threads finish per second between them, over
    `window` seconds after a fifth of it to settle."""
    spans: list[list[tuple[float, float]]] = [[] for _ in range(k)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def work(mine: list[tuple[float, float]]) -> None:
        try:
            torch.set_num_threads(threads)
            while not stop.is_set():
                start = time.perf_counter()
                run_as_a_stage(table, modules, values, needs_grad)
                mine.append((start, time.perf_counter()))
        except BaseException as error:  # re-raised below: a dead thread would count as slow
            errors.append(error)

    workers = [threading.Thread(target=work, args=(mine,), daemon=True) for mine in spans]
    begin = time.perf_counter() + window / 5
    try:
        for worker in workers:
            worker.start()
        time.sleep(max(begin + window - time.perf_counter(), 0.0))
    finally:  # an interrupted measurement leaves no thread running on the model
        stop.set()
        for worker in workers:
            if worker.is_alive():
                worker.join()
    if errors:
        raise RuntimeError(
            f"running the model's units on {k} thread{'s' if k > 1 else ''} at once, on the "
            "same modules, failed (the error above): stage threads of one process run their "
            "stages at once in every step too; run one stage per process under torchrun, or "
            "compile with Plan(costs='none') to time nothing") from errors[0]
    return sum(_runs_inside(mine, begin, begin + window) for mine in spans) / window


def _runs_inside(spans: Sequence[tuple[float, float]], begin: float, end: float) -> float:
    """How many of the runs (start, end) fall between `begin` and `end`, a run that straddles
    either counted for its share inside."""
    return sum((min(b, end) - max(a, begin)) / (b - a)
               for a, b in spans if b > begin and a < end and b > a)
