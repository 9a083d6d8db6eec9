"""Profile pass: measured forward and backward time of every unit at several micro-batch sizes.

Each unit runs alone, as the rewrite pass cuts it when every unit is a stage of its own, on the
outputs of the units before it: warm-up runs, then repeats (more of them where they are short,
see MIN_TIMED), and the median counts. Inputs that carry gradients in training get them here
too, so a unit's backward includes its input gradient as it will in a pipeline stage. A stage
runs one backward call for all its units, and a call has a fixed cost (the autograd engine's
start, the leaves' gradients) that timing each unit's backward on its own counts once per unit:
each repetition also runs the units connected, as one graph as a stage's module holds them, with
one backward call, and the difference gives that cost per call (`backward_call`), which the
units' backward times then leave out. A unit called as a module of its own runs its forward
slower than its part of a stage's graph does, too, and the units' forward times are scaled to
add up to the graph's (`python benchmarks/fused_forward.py --model gpt --bounds 9,18` measured
the GPT's two stages at 1020 and 943 us unit by unit, 904 and 827 scaled, and 856 and 826 as
one module each; the MLP's, VGG's and ResNet's move less). Given the
loss (the plan's loss_fn with a target), its forward and backward on the model's outputs are
timed too: the last stage runs them (the backward, too, without the fixed cost of its call, as
the stage's one call runs it). One more, untimed, repetition measures each unit's peak memory
(`memory.PeakMemory`). Nothing is left behind on the model: gradients accumulate into zeroed
.grad (as in a stage) and the parameters' own .grad, buffers and random number generators are
restored afterwards. Results are cached on disk by (model signature, device, micro-batch sizes,
repeats), so compiling the same model twice measures it once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import fx

from fxpipe.affinity import usable_cores
from fxpipe.allocator import kept
from fxpipe.batching import input_dims, resize
from fxpipe.ir import CommTable
from fxpipe.materialize import has_meta_tensors, kept_from, materialized_copy
from fxpipe.meta import PROFILE
from fxpipe.passes.analysis.memory import PeakMemory
from fxpipe.probes import gradients_set_aside, preserved_state
from fxpipe.units import Unit

__all__ = [
    "DEFAULT_LOAD",
    "LOADS",
    "MIN_TIMED",
    "MOST_REPEATS",
    "ProfileCache",
    "UnitProfile",
    "UnitTiming",
    "annotate_profile",
    "default_cache_dir",
    "profile_units",
    "real_bytes",
    "run_as_a_stage",
    "unit_parameters",
    "values_needing_grad",
]

_FORMAT = 11  # bump when the cached record changes (or how it is measured)

# what the background workers can run while the units are timed (profile_units' `load`)
LOADS = ("crossed", "same", "stage", "forwards", "backwards")
DEFAULT_LOAD = "crossed"
# Why "crossed" by default: `python benchmarks/profile_loads.py --model mlp --schedule S` (10
# rounds, one run each) measured the bundled MLP's step in 2 stage threads at 1.05 (1f1b) and
# 1.03 (gpipe) of the step predicted from crossed timings (the rounds' predictions spread
# 1.43x and 1.45x, max/min), and at 1.08 and 1.10 of the one from "stage" timings (1.58x and
# 1.98x); with `--partitioner balanced --rounds 6` the GPT (1f1b), ResNet (1f1b) and VGG (gpipe,
# --batch 64) came to 0.96, 0.98 and 0.97 crossed, and 0.92, 0.99 and 1.04 beside a stage
# (spreads 1.03x to 1.24x; before 0e39144, the script compiled without the target). With 4
# stage threads on 2 cores (`--stages 4 --micro-batches 8 --min-time 0.5`, the MLP, even),
# crossed came closest in two of four comparisons, "stage" and "backwards" each 0.02 closer in
# one, timing beside forwards or backwards alone put measured/predicted at 0.58 to 1.38, and
# "same" read 0.68 and 0.67 with gpipe where crossed read 0.84 and 0.89 (benchmarks/ACCURACY.md,
# "What the neighbours run, with 4 stage threads").


@dataclasses.dataclass(frozen=True, eq=False)
class UnitProfile:
    """Measurements per (micro-batch size, unit); times in seconds, sizes in bytes."""

    sizes: tuple[int, ...]  # micro-batch sizes measured, ascending
    forward: np.ndarray  # (M, K)
    backward: np.ndarray  # (M, K)
    boundary_bytes: np.ndarray  # (M, K): values crossing the cut after unit i
    boundary_grad_bytes: np.ndarray  # (M, K): their gradients (floating values only)
    activation_bytes: np.ndarray  # (M, K): tensors the unit saves for its backward
    peak_bytes: np.ndarray  # (M, K): most allocated above the start of its forward or backward
    param_bytes: np.ndarray  # (K,)
    params: np.ndarray  # (K,) parameter counts (a tied weight counts in its first unit)
    backward_call: np.ndarray  # (M,) fixed cost of one backward call (0: no run of 2 units)
    loss_forward: np.ndarray  # (M,) the loss on the outputs (0 when not timed)
    loss_backward: np.ndarray  # (M,)
    device: str
    cached: bool = False

    def to_json(self) -> dict[str, Any]:
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in arrays.items()
                if k != "cached"}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UnitProfile:
        fields = {f.name for f in dataclasses.fields(cls)} - {"cached", "sizes", "device"}
        arrays = {k: np.asarray(data[k], dtype=np.float64) for k in fields}
        return cls(tuple(data["sizes"]), device=data["device"], cached=True, **arrays)


@dataclasses.dataclass(frozen=True)
class UnitTiming:
    """What the profile measured for one unit, at each micro-batch size (seconds, bytes)."""

    unit: int
    sizes: tuple[int, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    peak_bytes: tuple[float, ...]  # most allocated above the start of its forward or backward


def annotate_profile(gm: fx.GraphModule, units: Sequence[Unit], profile: UnitProfile) -> None:
    """Write each unit's UnitTiming under node.meta[PROFILE] for every node of the unit."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for unit in units:
        k = unit.index
        timing = UnitTiming(k, tuple(profile.sizes), *(tuple(float(v) for v in table[:, k])
                            for table in (profile.forward, profile.backward,
                                          profile.activation_bytes, profile.peak_bytes)))
        for name in unit.nodes:
            nodes[name].meta[PROFILE] = timing


def default_cache_dir() -> pathlib.Path:
    """~/.cache/fxpipe/profiles (or under $XDG_CACHE_HOME)."""
    root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(root) / "fxpipe" / "profiles"


@dataclasses.dataclass(frozen=True)
class ProfileCache:
    """Profiles on disk, one JSON file per key."""

    directory: pathlib.Path

    def get(self, key: str) -> UnitProfile | None:
        path = self.directory / f"{key}.json"
        try:
            return UnitProfile.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError):
            return None

    def put(self, key: str, profile: UnitProfile) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(profile.to_json()))
            tmp.replace(self.directory / f"{key}.json")
        except OSError:
            pass  # an unwritable cache only costs a re-measurement next time


def profile_units(
    graph: fx.GraphModule,
    table: CommTable,
    flat_inputs: Sequence[Any],
    sizes: Sequence[int],
    device: str = "cpu",
    *,
    warmup: int = 2,
    repeats: int = 5,
    cache: ProfileCache | None = None,
    threads: int | None = None,
    concurrency: int = 1,
    whole: Sequence[int] = (),
    loss: Callable[[Mapping[str, Any], int], torch.Tensor] | None = None,
    load: str = DEFAULT_LOAD,
    min_time: float = 0.0,
    window: float = 0.0,
    stages: Sequence[range] = (),
) -> UnitProfile:
    """Measure every unit at each micro-batch size in `sizes`.

    `graph` and `table` are the rewrite pass's PipelineGraph and CommTable of the model split
    with one unit per stage. `threads`: intra-op threads to time with, as many as each stage's
    worker will have (stages sharing the CPU share its cores). `concurrency`: how many stage
    threads of this process compute in the pipeline (1 under torchrun, a stage per process);
    `concurrency - 1` background workers run the same units meanwhile, so the times include
    the slowdown that cores sharing caches and memory bandwidth cause, and threads sharing
    Python's interpreter lock (a unit alone on a quiet machine runs faster than it will inside
    the pipeline). Where they outnumber the CPU cores this process may use, the times leave
    out what the timing thread waited for a core (`_timer`; now and then a wait its own reads
    of schedstat caused too): the simulator shares the cores among the stages computing at
    once. Where that wait cannot be left out (no schedstat, more than one intra-op thread, or
    a GPU), and for a meta model (whose every timing thread holds real copies of its units),
    the units are timed with only as many stage threads busy as there are cores.
    `loss(outputs, size)`: the loss of a micro-batch of `size` samples from the graph's output
    values by name, timed forward and backward when given (never cached). `load`: what the
    background workers run, "crossed" (each kind of work timed beside the other: the
    forwards, and the loss's forward, beside workers running backwards only; the backwards,
    and the loss's backward, beside workers running forwards only: two timings of each size,
    so the timing takes about twice as long; once, as "stage", on a meta model timed in
    several runs), "same" (the other way round: the forwards beside workers running forwards
    only, the backwards beside workers running backwards only, as GPipe's phases run them;
    as "stage" where "crossed" is), "stage" (the units' forwards, then a backward, as a
    pipeline stage does),
    "forwards" (forwards only) or "backwards" (backwards only, again and
    again through one retained graph); profile_parts.py in benchmarks compares what each
    makes of the units. Stage threads of one process slow each other mostly through Python's
    interpreter lock, which a forward holds between its operators and a backward mostly does
    not. With 2 stage threads, predictions from "crossed" timings came closer to the local
    runtime's steps than from "stage" ones where the lock sets the units' pace, and about as
    close elsewhere (the note at LOADS). `min_time`:
    after the `repeats`, more repetitions (at most MOST_REPEATS timed in all) until the timed
    ones have taken that many seconds at each size (compile asks for MIN_TIMED). `window`:
    the bytes of a meta model's parameters and buffers (a tied one once) made real at once to
    time its units, in runs of consecutive units whose tensors add up to no more (one unit at
    least; compile allows the share of them the timing device will hold, or all of them when
    they are small); a real model is timed all at once. `stages`: consecutive runs of units
    covering them all (by default one), each timed as a run of its own (its units' forwards,
    then their backwards), as a process that holds only those units runs them: its caches
    then hold that stage's weights and activations alone, not the whole model's (a meta
    model's window may split a stage further).
    """
    if load not in LOADS:
        raise ValueError(f"load={load!r} is not a background load; use one of {LOADS}")
    sizes = tuple(sorted(set(int(s) for s in sizes)))
    threads = threads or torch.get_num_threads()
    modules = [graph.get_submodule(f"stage{io.stage}").module for io in table.stages]
    meta = has_meta_tensors(graph)
    cores = usable_cores()
    # more stage threads than cores: their turns on the cores are the simulator's to share out
    core_waits_out = (concurrency > cores and torch.device(device).type == "cpu"
                      and threads == 1 and not meta and _core_waits_known())
    if concurrency > cores and not core_waits_out:
        concurrency = cores
    stages = tuple(stages) or (range(len(modules)),)
    if (any(len(stage) == 0 or stage.step != 1 for stage in stages)
            or [u for stage in stages for u in stage] != list(range(len(modules)))):
        raise ValueError(f"stages={stages} do not cover the {len(modules)} units in order")
    if meta:  # a stage's units in runs whose tensors fit the window
        tensors = _tensor_bytes(modules)
        runs = _Runs(tuple(range(stage.start + r.start, stage.start + r.stop)
                           for stage in stages
                           for r in _runs(tensors[stage.start:stage.stop], window)), meta)
    else:
        runs = _Runs(stages, meta)
    if meta:
        timed_in: Any = [(r.start, r.stop) for r in runs.ranges]
    elif len(stages) > 1:
        timed_in = ("stages", [(s.start, s.stop) for s in stages])
    else:  # one run of a real model: keyed as before, so existing caches stay valid
        timed_in = None
    key = _cache_key(graph, flat_inputs, sizes, device, warmup, repeats, threads,
                     (concurrency, tuple(whole), load, min_time, timed_in, core_waits_out))
    cache = cache if loss is None else None
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    units = len(table.stages)
    params, param_bytes = unit_parameters(graph, units)
    dims = input_dims(flat_inputs, whole)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def timed_beside(kind: str) -> list[tuple]:
            with preserved_state(graph), gradients_set_aside(graph), \
                    _Load(concurrency - 1, graph, table, flat_inputs, dims, sizes, device,
                          threads, kind, runs) as background:
                rows = []
                for size in sizes:
                    background.size = size  # the neighbours run micro-batches of this size
                    rows.append(_measure(graph, table,
                                         _on(resize(flat_inputs, dims, size), device), device,
                                         warmup, repeats,
                                         loss=loss and functools.partial(loss, size=size),
                                         min_time=min_time, runs=runs,
                                         core_waits_out=core_waits_out))
                return rows

        # a meta model timed in several runs has its neighbours time copies of the units run
        # by run, whatever the load
        paired = load in ("crossed", "same")
        if not paired or concurrency < 2 or (runs.meta and len(runs.ranges) > 1):
            rows = timed_beside("stage" if paired else load)
        else:  # the forward figures from the first timing, the backward ones from the second
            first, second = (("backwards", "forwards") if load == "crossed"
                             else ("forwards", "backwards"))
            rows = [_crossed(forwards, backwards) for forwards, backwards in
                    zip(timed_beside(first), timed_beside(second))]
        with preserved_state(graph), gradients_set_aside(graph):
            saved, peak = _memory(graph, table, [_on(resize(flat_inputs, dims, size), device)
                                                 for size in sizes], device, runs)
    finally:
        torch.set_num_threads(previous_threads)
    forward, backward, crossing, crossing_grad, call, loss_f, loss_b = (
        np.array(r, dtype=float) for r in zip(*rows))
    profile = UnitProfile(sizes, forward, backward, crossing, crossing_grad, saved, peak,
                          param_bytes, params, call, loss_f, loss_b, device)
    if cache is not None:
        cache.put(key, profile)
    return profile


def _crossed(forwards: tuple, backwards: tuple) -> tuple:
    """One size's row of _measure from two timings: the forward figures (the units', the
    crossing bytes, the loss's forward) of the one, the backward figures (the units', the fixed
    cost of a call, the loss's backward) of the other."""
    forward, _, crossing, crossing_grad, _, loss_f, _ = forwards
    _, backward, _, _, call, _, loss_b = backwards
    return forward, backward, crossing, crossing_grad, call, loss_f, loss_b


class _Load:
    """Background workers running the same units while the measurement runs: of `kind`
    "stage", as a pipeline stage runs them, the forwards in a row on connected values, then
    one backward; of kind "forwards" or "backwards", that kind of work alone (a crossed
    profile times with one of each in turn). (Running
    them as the timed thread does, with a timer and a backward call per unit, loaded the
    interpreter more than a stage does: `fxpipe bench gpt` measured 0.79-0.89 of the
    predicted step.) They run micro-batches of `size`, the one being timed, as the other
    stages of a pipeline do: a neighbour cycling through every size slowed the timed units
    by more or less than the pipeline's stages do, depending on the sizes it ran meanwhile.
    (A worker finishes the micro-batch it is running when the size changes, so the first
    warm-up runs of the next size may still meet one of the last.) On a meta model timed in
    one run, a worker makes one real copy of the units for its life and runs it as it would
    the model's; timed in several, it times copies of a run at a time as `_measure` does, made
    afresh each pass (their making then loads the interpreter more than their work)."""

    def __init__(self, workers: int, graph, table, flat_inputs, dims, sizes, device,
                 threads: int, kind: str, runs: _Runs) -> None:
        self.workers, self.kind, self.runs = workers, kind, runs
        self.args = (graph, table, flat_inputs, dims, sizes, device, threads)
        self.size = sizes[0]  # set by the timing as it moves from size to size
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def _work(self) -> None:
        graph, table, flat_inputs, dims, sizes, device, threads = self.args
        try:
            torch.set_num_threads(threads)
            inputs = [_on(resize(flat_inputs, dims, size), device) for size in sizes]
            modules = [graph.get_submodule(f"stage{io.stage}").module for io in table.stages]
            if self.runs.meta and len(self.runs.ranges) > 1:  # copies made afresh, run by run
                while not self.stop.is_set():
                    _measure(graph, table, inputs[sizes.index(self.size)], device, 0, 1,
                             runs=self.runs)
                return
            with _real_units(modules, device, self.runs.meta) as real:  # one for its life
                self._run(table, real, [dict(zip(table.graph_inputs, values))
                                        for values in inputs], sizes)
        except BaseException as error:  # re-raised by __exit__: a dead load would go unnoticed
            self.errors.append(error)

    def _run(self, table, modules: list[torch.nn.Module], inputs: list[dict[str, Any]],
             sizes: Sequence[int]) -> None:
        """Run the units as the load's kind asks until stopped, on `inputs` by size."""
        needs_grad = values_needing_grad(table)
        # (size index, outputs) of one forward of the size being timed, kept (one size at a
        # time: a graph kept per size would hold several micro-batches' activations)
        retained: tuple[int, list[Any]] | None = None
        while not self.stop.is_set():
            i = sizes.index(self.size)
            if self.kind == "stage":
                run_as_a_stage(table, modules, inputs[i], needs_grad)
            elif self.kind == "forwards":
                _connected_forward(table, modules, inputs[i], needs_grad)
            else:  # backwards, again and again through one graph of the size
                if retained is None or retained[0] != i:
                    retained = (i, _connected_forward(table, modules, inputs[i], needs_grad))
                _backward_from(retained[1], retain_graph=True)

    def __enter__(self) -> _Load:
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._work, daemon=True)
                        for _ in range(self.workers)]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()
        if self.errors and exc[0] is None:
            raise RuntimeError("the background load of the unit timing failed") \
                from self.errors[0]


def values_needing_grad(table: CommTable) -> dict[str, bool]:
    """Whether each value crossing between the units carries a gradient in training."""
    return {e.value: bool(e.info.tensors and e.info.tensors[0].requires_grad)
            for e in table.edges}


def run_as_a_stage(table: CommTable, modules: Sequence[torch.nn.Module],
                   values: Mapping[str, Any], needs_grad: dict[str, bool]) -> None:
    """The units' forwards in a row on connected values, then one backward from the outputs."""
    _backward_from(_connected_forward(table, modules, values, needs_grad))


def _backward_from(outputs: list[Any], retain_graph: bool = False) -> None:
    """One backward call from `outputs` with all-ones gradients (none when there are none)."""
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs],
                                retain_graph=retain_graph)


def _connected_forward(table, modules, values: Mapping[str, Any], needs_grad: dict[str, bool]
                       ) -> list[Any]:
    """The units' forwards in a row, each on the others' outputs (not cut from their graphs),
    from the graph's inputs `values` by name; returns the graph's outputs that need a
    gradient."""
    env = {v: _as_input(x, needs_grad.get(v, False)) for v, x in values.items()}
    for io, module in zip(table.stages, modules):
        env.update(zip(io.outputs, module(*[env[v] for v in io.inputs])))
    return list({id(o): o for o in (env[v] for v in table.graph_outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad}.values())


def _memory(graph, table, inputs_per_size, device, runs: _Runs
            ) -> tuple[np.ndarray, np.ndarray]:
    """One untimed repetition per micro-batch size measuring each unit's memory, in one memory
    profiler session: the bytes its forward saves for backward, and its peak, the larger of
    its forward's and its backward's. Apart from the timed runs, as both hooks and the memory
    profiler slow what they watch. Returns (saved, peak), each (sizes, units)."""
    saved: list[list[float]] = []
    with PeakMemory(device) as peaks:
        for m, inputs in enumerate(inputs_per_size):
            saved.append([])
            _measure(graph, table, inputs, device, 0, 1,
                     lambda name, m=m: peaks.span(f"{m}.{name}"), saved[-1], runs=runs)
    nan = float("nan")
    peak = [[max(peaks.result.get(f"{m}.{i}.forward", nan),
                 peaks.result.get(f"{m}.{i}.backward", 0.0)) for i in range(len(table.stages))]
            for m in range(len(saved))]
    return np.array(saved, dtype=float), np.array(peak, dtype=float)


def _measure(graph, table, inputs, device, warmup, repeats, span=None, saved=None, loss=None,
             min_time=0.0, *, runs: _Runs, core_waits_out: bool = False):
    """One micro-batch size: per-unit forward and backward times, crossing bytes, the fixed
    cost of a backward call (`_without_call_cost`; 0 when measuring memory), and the forward
    and backward times of `loss(outputs)` when given (else 0). With
    `span` (name -> context manager, e.g. a PeakMemory's), unit i's forward and backward run
    inside span("i.forward") and span("i.backward"); with `saved` (a list), the bytes each
    unit's forward saves for backward are appended to it.

    Each repetition runs the units as training does, all forwards in order, then all backwards
    in reverse, so a unit meets the caches the units around it leave (a unit repeated on its
    own would find its weights hot and look faster than it is inside a stage). A model on the
    meta device is timed a run of consecutive units at a time (`runs`, from `_runs`), on real
    copies of that run's units made for all its repetitions, so no more than a run's weights
    exist at once in each timing thread (this one, and each background worker of `_Load`); a
    real model is one run, or one per stage where profile_units is given the stages. Each
    repetition first runs the run's units as one graph
    (`_fused`), forward and one backward call, for the units' forward scale and the fixed
    cost of a call. `core_waits_out`: the times leave out what this thread waited for a core
    (`_timer`)."""
    needs_grad = values_needing_grad(table)
    timer = _timer(torch.device(device), core_waits_out)
    modules = [graph.get_submodule(f"stage{io.stage}").module for io in table.stages]
    units = len(modules)
    f_times: list[list[float]] = [[] for _ in range(units)]
    b_times: list[list[float]] = [[] for _ in range(units)]
    called = [False] * units  # units whose backward is a call of its own
    connect = span is None and saved is None  # not when measuring memory
    span = span or (lambda name: contextlib.nullcontext())
    counter = _SavedBytes if saved is not None else lambda module: contextlib.nullcontext()

    def backward(i, outputs, wants, timed):
        grads_for = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        seconds = 0.0
        if grads_for and wants:
            called[i] = True
            ones = [torch.ones_like(o) for o in grads_for]
            # accumulate into .grad as a pipeline stage does (the adds cost memory traffic)
            with span(f"{i}.backward"):
                _, seconds = timer(torch.autograd.backward, grads_for, ones, inputs=wants)
        if timed:
            b_times[i].append(seconds)

    connected: list[float] = []  # per run, the median of its connected backward calls
    fused_runs: list[tuple[range, float]] = []  # each run, the median of its fused forwards
    loss_times: list[tuple[float, float]] = []
    env = dict(zip(table.graph_inputs, inputs))
    for run in runs.ranges:
        with _real_units([modules[i] for i in run], device, runs.meta) as real:
            connected_times: list[float] = []
            fused_times: list[float] = []
            fused = _fused(table, real, run) if connect else None
            for rep in _repetitions(warmup, repeats, min_time):
                if connect:
                    forward, backward_call = _connected(fused, env, needs_grad, timer)
                    if rep >= warmup:
                        fused_times.append(forward)
                        if backward_call is not None:
                            connected_times.append(backward_call)
                values = dict(env)  # this repetition's, from the runs before on
                pending = []
                for i, module in zip(run, real):
                    io = table.stages[i]
                    args = [_as_input(values[v], needs_grad.get(v, False)) for v in io.inputs]
                    with counter(module) as counted, span(f"{i}.forward"):
                        outputs, seconds = timer(module, *args)
                    if saved is not None and rep == warmup + repeats - 1:
                        saved.append(float(counted.nbytes))
                    wants = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
                    wants += [p for p in module.parameters() if p.requires_grad]
                    pending.append((outputs, wants))
                    for value, out in zip(io.outputs, outputs):  # before a copy's weights go
                        values[value] = kept_from(module, out) if runs.meta else (
                            out.detach() if isinstance(out, torch.Tensor) else out)
                    if rep >= warmup:
                        f_times[i].append(seconds)
                if loss is not None and run.stop == units:
                    seconds = _time_loss(loss, table, values, timer)
                    if rep >= warmup:
                        loss_times.append(seconds)
                for i in reversed(run):
                    backward(i, *pending.pop(), rep >= warmup)
            env = values  # the next run starts from the last repetition's values
            if connected_times:
                connected.append(statistics.median(connected_times))
            if fused_times:
                fused_runs.append((run, statistics.median(fused_times)))
    forward = _as_fused([statistics.median(t) for t in f_times], fused_runs)
    backward_times = np.array([statistics.median(t) for t in b_times])
    call = 0.0
    if connected:
        backward_times, call = _without_call_cost(backward_times, np.array(called),
                                                  sum(connected), len(connected))
    loss_f, loss_b = (statistics.median(t) for t in zip(*loss_times)) if loss_times else (0, 0)
    # the last stage runs the loss's backward in its one backward call, whose fixed cost the
    # stage pays once (`call`): the loss's own call leaves it out, as the units' do
    loss_b = max(loss_b - call, 0.0)
    crossing, crossing_grad = _crossing_bytes(table, env, units)
    return forward, list(backward_times), crossing, crossing_grad, call, loss_f, loss_b


@dataclasses.dataclass(frozen=True)
class _Runs:
    """How the units are timed: in runs of consecutive ones (`ranges`), each on real copies
    made for it where `meta` (the model's tensors on the meta device: `_runs`), else on the
    model itself (one run, or one per stage given)."""

    ranges: tuple[range, ...]
    meta: bool


def _runs(tensors: Sequence[Mapping[int, int]], window: float) -> list[range]:
    """The units in runs of consecutive ones whose tensors (per unit, bytes by the tensor's
    identity: a weight tied between units of a run counts once, as its copy holds it once)
    add up to at most `window` bytes; a unit heavier than that is a run of its own."""
    runs: list[range] = []
    start, held = 0, {}
    for i, unit in enumerate(tensors):
        grown = {**held, **unit}
        if i > start and sum(grown.values()) > window:
            runs.append(range(start, i))
            start, grown = i, dict(unit)
        held = grown
    return [*runs, range(start, len(tensors))] if len(tensors) else runs


def real_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers once real (each tied one once)."""
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


def _tensor_bytes(modules: Sequence[torch.nn.Module]) -> list[dict[int, int]]:
    """Per module, the bytes of its parameters and buffers by the tensor's identity (what a
    real copy of it holds)."""
    return [{id(t): t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]}
            for m in modules]


@contextlib.contextmanager
def _real_units(modules: list[torch.nn.Module], device: str, meta: bool
                ) -> Iterator[list[torch.nn.Module]]:
    """The modules themselves, or, of a meta model, real copies of them made together (a
    weight tied between them stays one weight) and freed on exit."""
    if not meta:
        yield modules
        return
    with materialized_copy(torch.nn.ModuleList(modules), device) as copies:
        yield list(copies)


MOST_REPEATS = 100  # timed repetitions per micro-batch size at most, whatever min_time asks
# Seconds of timed repetitions per micro-batch size that compile and fxpipe.retime ask for.
# Units of tens of microseconds, timed a few times beside a busy stage thread (contending for
# Python's interpreter lock), give medians that move a lot from one timing to the next; more
# repetitions steady them, and cost little where a repetition is long anyway
# (benchmarks/timing_noise.py --min-time 0,0.05 compares the two).
MIN_TIMED = 0.05


def _repetitions(warmup: int, repeats: int, min_time: float) -> Iterator[int]:
    """The repetitions' indices: `warmup` untimed, `repeats` timed, then more timed ones until
    the timed ones have taken `min_time` seconds (at most MOST_REPEATS timed in all)."""
    started = time.perf_counter()
    for rep in range(warmup + repeats):
        if rep == warmup:
            started = time.perf_counter()
        yield rep
    rep = warmup + repeats
    while rep < warmup + MOST_REPEATS and time.perf_counter() - started < min_time:
        yield rep
        rep += 1


def _time_loss(loss, table, env, timer) -> tuple[float, float]:
    """Seconds of the loss's forward and of its backward, on the outputs as the last stage
    holds them (leaves needing gradients)."""
    outputs = {v: _as_input(env[v], True) for v in table.graph_outputs}
    value, forward = timer(loss, outputs)
    if not (isinstance(value, torch.Tensor) and value.requires_grad):
        return forward, 0.0
    _, backward = timer(value.backward)
    return forward, backward


class _Fused(NamedTuple):
    """Consecutive units as one graph module: it takes the values `reads` (by name, in order)
    and returns the values `passes` on to the units after it or out of the graph."""

    module: fx.GraphModule
    reads: list[str]
    passes: list[str]


def _fused(table, modules, run: range) -> _Fused:
    """The units of `run` (`modules`) as one graph, as a stage's module runs them: a unit
    called as a module of its own costs more than its part of a stage (a module call, its
    inputs' bookkeeping), which a connected run of unit modules would count too."""
    made = [v for i in run for v in table.stages[i].outputs]
    reads = list(dict.fromkeys(v for i in run for v in table.stages[i].inputs
                               if v not in made))
    graph, root = fx.Graph(), torch.nn.Module()
    env = {v: graph.placeholder(f"input_{k}") for k, v in enumerate(reads)}  # names first
    for i, module in zip(run, modules):
        io = table.stages[i]
        root.add_module(f"unit{i}", module)  # its attributes under its own name
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        before = set(graph.nodes)
        outputs = graph.graph_copy(module.graph, {p: env[v] for p, v in
                                                  zip(placeholders, io.inputs)})
        for node in graph.nodes:
            if node not in before and node.op in ("call_module", "get_attr"):
                node.target = f"unit{i}.{node.target}"
        env.update(zip(io.outputs, outputs))
    later = {*table.graph_outputs, *(v for io in table.stages[run.stop:] for v in io.inputs)}
    passes = [v for v in made if v in later]
    graph.output(tuple(env[v] for v in passes))
    return _Fused(fx.GraphModule(root, graph), reads, passes)


def _connected(fused: _Fused, values: Mapping[str, Any], needs_grad: dict[str, bool],
               timer) -> tuple[float, float | None]:
    """Seconds of the fused units' forward from `values` by name, and of one backward call
    from what they pass on (None when none of it needs a gradient: no call)."""
    inputs = [_as_input(values[v], needs_grad.get(v, False)) for v in fused.reads]
    outputs, forward = timer(fused.module, *inputs)
    outputs = list({id(o): o for o in outputs
                    if isinstance(o, torch.Tensor) and o.requires_grad}.values())
    if not outputs:
        return forward, None
    _, backward = timer(torch.autograd.backward, outputs, [torch.ones_like(o) for o in outputs])
    return forward, backward


def _as_fused(forward: list[float], fused: list[tuple[range, float]]) -> list[float]:
    """The units' forward times scaled, run by run, to add up to the run's forward as one
    graph (`fused`: each run and that time)."""
    forward = list(forward)
    for run, seconds in fused:
        timed = sum(forward[i] for i in run)
        for i in run:  # each unit's share of the run first: no overflow of a tiny `timed`
            forward[i] = forward[i] / timed * seconds if timed > 0 else forward[i]
    return forward


def _without_call_cost(backward: np.ndarray, called: np.ndarray, connected: float,
                       calls: int = 1) -> tuple[np.ndarray, float]:
    """Per-unit backward times without the fixed cost of a backward call, and that cost.

    n units timed one call each took Σ b; connected, in `calls` calls (one per run of units),
    they took `connected`; so a call costs (Σ b − connected) / (n − calls) beyond the units'
    work. That is taken off each called unit (never below zero), and the rest scaled so the
    units' work still adds up to the connected calls less their fixed cost."""
    n = int(called.sum())
    if n <= calls:
        return backward, 0.0
    call = max((float(backward[called].sum()) - connected) / (n - calls), 0.0)
    work = np.where(called, np.maximum(backward - call, 0.0), 0.0)
    if work.sum() > 0:
        work = work * (max(connected - calls * call, 0.0) / work.sum())
    return work, call


def _on(values: list[Any], device: str) -> list[Any]:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, values)


def _as_input(value: Any, needs_grad: bool) -> Any:
    """A unit's input as a pipeline stage receives it: detached, needing a gradient if the
    value needs one in training."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(needs_grad and value.is_floating_point())


def _crossing_bytes(table, env, units: int) -> tuple[list[float], list[float]]:
    """Bytes of the values crossing each cut (after unit i), and of their gradients."""
    last_use: dict[str, tuple[int, int]] = {}
    for edge in table.edges:
        src, dst = last_use.get(edge.value, (edge.src, edge.dst))
        last_use[edge.value] = (src, max(dst, edge.dst))
    crossing, crossing_grad = [0.0] * units, [0.0] * units
    for value, (src, dst) in last_use.items():
        tensor = env.get(value)
        if not isinstance(tensor, torch.Tensor):
            continue
        carries_grad = tensor.is_floating_point()
        for cut in range(src, dst):
            crossing[cut] += tensor.nbytes
            if carries_grad:
                crossing_grad[cut] += tensor.nbytes
    return crossing, crossing_grad


class _SavedBytes:
    """Counts the bytes autograd saves for backward during a forward (parameters excluded)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = {p.data_ptr() for p in module.parameters()}
        self.storages: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> _SavedBytes:
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)


def _timer(device: torch.device, core_waits_out: bool = False
           ) -> Callable[..., tuple[Any, float]]:
    """timer(fn, *args, **kwargs) -> (result, seconds): CUDA events on GPU, perf_counter else,
    less, with `core_waits_out`, the time the calling thread was ready to run but waited for a
    core between a read of it (`_core_wait`) right before the call and one right after."""
    if device.type == "cuda":
        def cuda_timed(fn, *args, **kwargs):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            result = fn(*args, **kwargs)
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end) / 1e3
        return cuda_timed

    def cpu_timed(fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        return result, time.perf_counter() - start

    def without_core_waits(fn, *args, **kwargs):
        # read outside the timed span. A read through Python's files lets the interpreter lock
        # go around its system calls, and taking it back from busy stage threads can wait for a
        # core outside the span, which the difference counts too: the clamp keeps the time at
        # 0 or more. The predictions past the cores were measured with times read this way;
        # benchmarks/core_waits.py compares a read that keeps the lock
        waited = _core_wait()
        result, seconds = cpu_timed(fn, *args, **kwargs)
        return result, max(seconds - (_core_wait() - waited), 0.0)
    return without_core_waits if core_waits_out else cpu_timed


def _schedstat() -> tuple[float, float] | None:
    """The calling thread's seconds on a core so far, and ready to run but waiting for one
    (Linux's /proc/thread-self/schedstat); None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            ran, waited = stat.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):  # no such file, or fewer than two numbers
        return None


def _core_wait() -> float:
    """The calling thread's seconds so far ready to run but waiting for a core (0: unknown)."""
    known = _schedstat()
    return known[1] if known is not None else 0.0


def _core_waits_known() -> bool:
    """Whether the kernel counts this thread's waits for a core: it says the thread has run (a
    kernel built without scheduler statistics gives zeros)."""
    known = _schedstat()
    return known is not None and known[0] > 0


def unit_parameters(graph: fx.GraphModule, units: int) -> tuple[np.ndarray, np.ndarray]:
    """Parameter count and bytes of each unit (a weight shared by units counts in the first)."""
    seen: set[int] = set()
    counts, nbytes = np.zeros(units), np.zeros(units)
    for i in range(units):
        for p in graph.get_submodule(f"stage{i}").module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                counts[i] += p.numel()
                nbytes[i] += p.numel() * p.element_size()
    return counts, nbytes


def _cache_key(graph, flat_inputs, sizes, device, warmup, repeats, threads,
               how: tuple) -> str:
    """`how`: the rest of what the timings depend on (concurrency, whole inputs, the
    background load, min_time, a meta model's runs of units, a real model's stages timed
    each as a run of its own or None for one run, whether
    the waits for a core are left out)."""
    stages = [m for name, m in graph.named_children() if name.startswith("stage")]
    signature = {
        "format": _FORMAT, "torch": torch.__version__, "device": device, "sizes": sizes,
        "warmup": warmup, "repeats": repeats,
        "code": [stage.module.code for stage in stages],
        "state": [(n, list(t.shape), str(t.dtype), t.requires_grad)
                  for n, t in [*graph.named_parameters(), *graph.named_buffers()]],
        "inputs": [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x)
                   for x in flat_inputs],
        "threads": threads, "how": how,
        "memory kept": kept(),  # the allocator's handling of freed memory changes the times
    }
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:32]
