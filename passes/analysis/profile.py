"""Profile pass: each unit's measured forward and backward time and saved bytes, cached."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch import fx

from fxpipe.batching import input_dims, resize
from fxpipe.devices import timer_kind
from fxpipe.ir import CommTable
from fxpipe.materialize import has_meta_tensors, kept_from, materialized_copy
from fxpipe.meta import PROFILE, SHAPE, ValueInfo
from fxpipe.passes.analysis.profile_cache import (
    STALE,
    ProfileCache,
    UnitProfile,
    cache_key,
    describe_key,
)
from fxpipe.precision import autocast, is_weight_cast, weight_casts
from fxpipe.preserve import gradients_set_aside, preserved_state
from fxpipe.units import Unit

__all__ = ["MIN_TIMED", "MOST_REPEATS", "UnitTiming", "annotate_profile", "model_outputs",
           "profile_units", "real_bytes", "time_loss"]

MOST_REPEATS = 100  # timed repetitions per micro-batch size at most, whatever min_time asks
# seconds of timed repetitions per micro-batch size at least: units of tens of microseconds
# timed a few times give medians that move a lot; more repetitions cost little where each
# repetition is long anyway
MIN_TIMED = 0.05


@dataclasses.dataclass(frozen=True)
class UnitTiming:
    """What the profile measured for one unit, at each micro-batch size (seconds, bytes)."""

    unit: int
    sizes: tuple[int, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    activation_bytes: tuple[float, ...]


def annotate_profile(gm: fx.GraphModule, units: Sequence[Unit], profile: UnitProfile) -> None:
    """Write each unit's UnitTiming under node.meta[PROFILE] for every node of the unit."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for unit in units:
        k = unit.index
        timing = UnitTiming(k, tuple(profile.sizes), *(tuple(float(v) for v in table[:, k])
                            for table in (profile.forward, profile.backward,
                                          profile.activation_bytes)))
        for name in unit.nodes:
            nodes[name].meta[PROFILE] = timing


def profile_units(
    graph: fx.GraphModule,
    table: CommTable,
    flat_inputs: Sequence[Any],
    sizes: Sequence[int],
    device: str = "cpu",
    *,
    warmup: int = 1,
    repeats: int = 5,
    min_time: float = MIN_TIMED,
    cache: ProfileCache | None = None,
    whole: Sequence[int] = (),
    window: float = float("inf"),
    precision: str | None = None,
) -> UnitProfile:
    """Measure every unit at each micro-batch size in `sizes`.

    `graph` and `table` are the rewrite pass's PipelineGraph and CommTable of the model split
    with one unit per stage. `warmup` untimed (at least 1) and `repeats` timed repetitions,
    then more until the timed ones took `min_time` seconds (at most MOST_REPEATS). `whole`:
    positions of inputs every micro-batch gets whole. `window`: the bytes of a meta model's
    parameters and buffers (a tied one once) made real at once to time its units, in runs of
    consecutive units whose tensors add up to no more (one unit at least); a real model is
    timed in one run. `precision` (Plan(precision)): each unit's forward runs under the
    autocast its stage will, so its times and saved bytes are those of bf16 or fp16.

    Each repetition runs the units as training does, all forwards in order, then all
    backwards in reverse, each unit a module of its own on the outputs of the units before it;
    inputs that carry gradients in training get them, so a unit's backward includes its input
    gradient. The medians count; the first, untimed, repetition also counts the bytes autograd
    saves for backward, each storage once, in the unit that made it, and which of the values
    crossing a cut it saves. Nothing is left on the model (its .grad, buffers and random number
    generators are restored). The times are what partitioning needs, the units' relative
    costs; what a stage costs inside a step beyond its units is calibration's. A profile is
    cached by what changes it (`_cache_key`); a cached one is checked by re-timing the first
    run's units at the smallest size (a warm-up and 3 repetitions) and measured afresh when
    its times are more than STALE times off. The profile's `origin` says which happened.
    """
    sizes, warmup = tuple(sorted(set(int(s) for s in sizes))), max(warmup, 1)
    modules = [graph.get_submodule(f"stage{io.stage}").module for io in table.stages]
    meta = has_meta_tensors(graph)
    runs = _runs(_tensor_bytes(modules), window) if meta else [range(len(modules))]
    key, signature = cache_key(graph, flat_inputs, sizes, device, warmup, repeats, min_time,
                                whole, runs if meta else None, precision)
    dims = input_dims(flat_inputs, whole)

    def measure(size: int, untimed: int, timed: int, least: float, which: list[range]):
        values = _on(resize(flat_inputs, dims, size), device)
        with preserved_state(graph), gradients_set_aside(graph):
            return _measure(table, modules, values, device, untimed, timed, least, which, meta,
                            precision)

    stale = ""
    hit = cache.get(key) if cache is not None else None
    if hit is not None:
        # a short re-time of the first run's units at the smallest size, against the cache
        units = list(runs[0])
        forward, backward, *_ = measure(sizes[0], 1, 3, 0.0, runs[:1])
        cached = hit.forward[0, units].sum() + hit.backward[0, units].sum()
        ratio = (cached + 1e-9) / (sum(forward) + sum(backward) + 1e-9)  # 1 ns: never 0 / 0
        if 1 / STALE <= ratio <= STALE:
            return dataclasses.replace(hit, origin=(
                f"from cache {hit.cached} (key: {describe_key(signature)}; its times "
                f"{ratio:.2f}x a re-time's)"))
        stale = (f"; the cache's entry had times {ratio:.2g}x a re-time's, more than {STALE:g}x "
                 "off, so they were measured again")
    rows = [measure(size, warmup, repeats, min_time, runs) for size in sizes]
    (forward, backward, crossing, crossing_grad, saved, crossing_saved, outputs, casts,
     inner_grad, lifetimes) = (np.array(r, dtype=float) for r in zip(*rows))
    profile = UnitProfile(sizes, forward, backward, crossing, crossing_grad, saved,
                          crossing_saved, outputs, device, weight_cast_bytes=casts,
                          inner_grad_bytes=inner_grad, lifetime_bytes=lifetimes)
    where = cache.put(key, profile) if cache is not None else "not cached"
    under = f" under {precision} autocast" if precision else ""
    return dataclasses.replace(profile, origin=f"measured now on {device}{under}, {where}{stale}")


def time_loss(outputs: Callable[[int], Mapping[str, Any]], sizes: Sequence[int],
              loss: Callable[[Mapping[str, Any], int], torch.Tensor], device: str,
              repeats: int = 5, precision: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of `loss(outputs(size), size)`'s forward and of its backward at each micro-batch
    size: medians of `repeats` runs after one untimed. `outputs(size)`: the graph's output
    values by name for a micro-batch of `size` samples (`model_outputs`). The loss runs under
    `precision`'s autocast, as the last stage runs it."""
    timer = _timer(torch.device(device))
    forward, backward = [], []
    for size in sizes:
        values = outputs(size)
        times = [_time_loss(loss, values, size, timer, autocast(device, precision))
                 for _ in range(repeats + 1)][1:]
        forward.append(statistics.median(t[0] for t in times))
        backward.append(statistics.median(t[1] for t in times))
    return np.array(forward), np.array(backward)


def model_outputs(gm: fx.GraphModule, flat_inputs: Sequence[Any], whole: Sequence[int],
                  device: str, precision: str | None = None) -> Callable[[int], dict[str, Any]]:
    """size -> the graph's output values by name for the example cut to `size` samples, as the
    last stage holds them (leaves needing a gradient): computed by running the graph (its
    buffers and the random number generators put back after), or, for a model on the meta
    device, stand-ins of their shapes and dtypes drawn from a generator of their own.
    `precision`: the graph runs under its autocast, as the stages do."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    dims = input_dims(flat_inputs, whole)

    def computed(size: int) -> dict[str, Any]:
        with preserved_state(gm), torch.no_grad(), autocast(device, precision):
            result = fx.Interpreter(gm).run(*_on(resize(flat_inputs, dims, size), device),
                                            enable_io_processing=False)
        values = zip(pytree.tree_leaves(output.args[0]), pytree.tree_leaves(result))
        return {node.name: _as_input(value, True) for node, value in values
                if isinstance(node, fx.Node)}

    def stand_ins(size: int) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(0)
        return {node.name: _stand_in(node.meta[SHAPE], dims.batch, size, device, generator)
                for node in output.all_input_nodes}

    return stand_ins if has_meta_tensors(gm) else computed


def _stand_in(info: ValueInfo, batch: int, size: int, device: str,
              generator: torch.Generator) -> Any:
    """A value of `info`'s shape and dtype, its first dimension `size` where it was `batch`:
    floats in [0, 1) (a probability as much as a logit), other dtypes zeros."""
    if not info.tensors:
        return None
    tensors = []
    for tensor in info.tensors:
        shape = (size, *tensor.shape[1:]) if tensor.shape and tensor.shape[0] == batch \
            else tensor.shape
        floating = tensor.dtype.is_floating_point
        made = (torch.rand(shape, generator=generator).to(tensor.dtype) if floating else
                torch.zeros(shape, dtype=tensor.dtype))
        tensors.append(made.to(device).requires_grad_(floating))
    return tensors[0] if info.is_tensor else tuple(tensors)


def _time_loss(loss, values, size, timer, autocast) -> tuple[float, float]:
    with autocast:
        value, forward = timer(loss, values, size)
    if not (isinstance(value, torch.Tensor) and value.requires_grad):
        return forward, 0.0
    _, backward = timer(value.backward)
    return forward, backward


def _measure(table, modules, inputs, device, warmup, repeats, min_time, runs, meta,
             precision=None) -> tuple[list[float], ...]:
    """One micro-batch size: per-unit forward and backward times, the bytes crossing each cut,
    the bytes each unit's forward saves for backward (counted in the first repetition,
    which is untimed: the counting slows the forward), and under `precision`'s autocast (the
    forwards', not the backwards': autograd runs them in the forward's dtypes) the bytes of
    its weights' bf16/fp16 copies autocast casts."""
    needs_grad = table.carries_grad()
    timer = _timer(torch.device(device))
    units = len(modules)
    f_times: list[list[float]] = [[] for _ in range(units)]
    b_times: list[list[float]] = [[] for _ in range(units)]
    saved = [0.0] * units
    casts = [0.0] * units  # autocast's copies of the unit's weights
    saved_values: set[str] = set()  # values autograd saves (in any unit)
    maker = {v: i for i, io in enumerate(table.stages) for v in io.outputs}  # value -> unit
    env = dict(zip(table.graph_inputs, inputs))
    for run in runs:
        # storage -> the unit of this run that made it (first repetition): a storage saved by
        # several units, or by the unit after its maker, counts once, in its maker, as a stage
        # holds it once. Per run: a run's storages are freed after it, and their addresses
        # reused by the next run's
        made_by: dict[int, int] = {}
        counted: set[int] = set()
        # a meta model's units: real copies, made together (a tied weight stays one), freed after
        mine = torch.nn.ModuleList([modules[i] for i in run])
        with materialized_copy(mine, device) if meta else contextlib.nullcontext(mine) as real:
            for rep in _repetitions(warmup, repeats, min_time):
                values = dict(env)  # this repetition's, from the runs before on
                pending = []
                for i, module in zip(run, real):
                    io = table.stages[i]
                    args = [_as_input(values[v], needs_grad.get(v, False)) for v in io.inputs]
                    if rep == 0:
                        with (_saved_storages(module, precision is not None) as found,
                              weight_casts(list(module.parameters())) as cast,
                              autocast(device, precision)):
                            outputs, seconds = timer(module, *args)
                        casts[i] = float(sum(cast.values()))
                        # a value from an earlier run: its storage is this run's copy, so
                        # it is known by name (counted once, in the unit that made it)
                        earlier = {a.untyped_storage().data_ptr(): v
                                   for v, a in zip(io.inputs, args)
                                   if isinstance(a, torch.Tensor) and v in env and v in maker}
                        for storage in found.keys() - counted:
                            name = earlier.get(storage)
                            if name is None:
                                saved[made_by.get(storage, i)] += found[storage]
                            elif name not in saved_values:
                                saved_values.add(name)
                                saved[maker[name]] += found[storage]
                        counted.update(found)
                        for out in outputs:
                            if isinstance(out, torch.Tensor):
                                made_by.setdefault(out.untyped_storage().data_ptr(), i)
                    else:
                        with autocast(device, precision):
                            outputs, seconds = timer(module, *args)
                    wants = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
                    wants += [p for p in module.parameters() if p.requires_grad]
                    pending.append((outputs, wants))
                    for value, out in zip(io.outputs, outputs):  # before a copy's weights go
                        values[value] = kept_from(module, out) if meta else (
                            out.detach() if isinstance(out, torch.Tensor) else out)
                    if rep >= warmup:
                        f_times[i].append(seconds)
                if rep == 0:
                    saved_values.update(v for v, t in values.items() if v not in env and
                                        isinstance(t, torch.Tensor) and
                                        t.untyped_storage().data_ptr() in counted)
                for i in reversed(run):
                    outputs, wants = pending.pop()
                    grads_for = [o for o in outputs
                                 if isinstance(o, torch.Tensor) and o.requires_grad]
                    seconds = 0.0
                    if grads_for and wants:  # into .grad, as a stage does
                        ones = [torch.ones_like(o) for o in grads_for]
                        _, seconds = timer(torch.autograd.backward, grads_for, ones,
                                           inputs=wants)
                    if rep >= warmup:
                        b_times[i].append(seconds)
            env = values  # the next run starts from the last repetition's values
    crossing, crossing_grad, crossing_saved, inner_grad, lifetimes = (
        _crossing_bytes(table, env, units, saved_values))
    forward = [statistics.median(t) if t else 0.0 for t in f_times]
    backward = [statistics.median(t) if t else 0.0 for t in b_times]
    outputs = sum(env[v].nbytes for v in table.graph_outputs
                  if isinstance(env.get(v), torch.Tensor))
    return (forward, backward, crossing, crossing_grad, saved, crossing_saved, outputs, casts,
            inner_grad, lifetimes)


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


def _on(values: list[Any], device: str) -> list[Any]:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, values)


def _as_input(value: Any, needs_grad: bool) -> Any:
    """A unit's input as a pipeline stage receives it: detached, needing a gradient if the
    value needs one in training."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(needs_grad and value.is_floating_point())


def _crossing_bytes(table, env, units: int, saved: set[str]
                    ) -> tuple[list, ...]:
    """Bytes of the values crossing each cut (after unit i), of their gradients, and of those
    of them autograd saves (the values named in `saved`), in the dtypes the units made them in
    (under autocast, a bf16 value is handed over, and travels between processes, as bf16, and
    its gradient so); the gradients' bytes as a backward within a stage holds them (the same);
    and by lifetime, [m][r]: the bytes of the values unit m makes and unit r reads last."""
    last_use: dict[str, tuple[int, int]] = {}
    for edge in table.edges:
        src, dst = last_use.get(edge.value, (edge.src, edge.dst))
        last_use[edge.value] = (src, max(dst, edge.dst))
    crossing, crossing_grad, crossing_saved, inner = ([0.0] * units for _ in range(4))
    lifetimes = [[0.0] * units for _ in range(units)]
    for value, (src, dst) in last_use.items():
        tensor = env.get(value)
        if not isinstance(tensor, torch.Tensor):
            continue
        if 0 <= src < dst < units:
            lifetimes[src][dst] += tensor.nbytes
        for cut in range(src, dst):
            crossing[cut] += tensor.nbytes
            if tensor.is_floating_point():
                crossing_grad[cut] += tensor.nbytes
                inner[cut] += tensor.nbytes
            if value in saved:  # the sent tensor is the saved one
                crossing_saved[cut] += tensor.nbytes
    return crossing, crossing_grad, crossing_saved, inner, lifetimes


@contextlib.contextmanager
def _saved_storages(module: torch.nn.Module, autocast: bool = False
                    ) -> Iterator[dict[int, int]]:
    """Bytes by storage of what autograd saves for backward meanwhile (parameters excluded,
    and, under `autocast`, its copies of them, which a stage casts once per step, not once per
    micro-batch)."""
    params = {p.data_ptr() for p in module.parameters()}
    weights = list(module.parameters())
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and not (autocast and is_weight_cast(tensor, weights)):
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield storages


def _timer(device: torch.device) -> Callable[..., tuple[Any, float]]:
    """timer(fn, *args, **kwargs) -> (result, seconds): CUDA events on a GPU (the kernels'
    time, not their launch), perf_counter on the CPU (fxpipe.devices.timer_kind)."""
    if timer_kind(device) == "cuda-events":
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
    return cpu_timed


