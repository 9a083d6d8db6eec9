"""CostTable (per-unit f, b, cf, cb as functions of the micro-batch count p) and the cost model."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from fxpipe.memory import (
    MemoryBudget,
    StageBytes,
    peak_of,
    stage_actions,
    stage_let_go,
    stage_memory,
    stage_terms,
    workspace_bytes,
)
from fxpipe.policy_copies import stage_copies
from fxpipe.schedules import Schedule, build
from fxpipe.segments import Segmentation, recompute_segments
from fxpipe.simulate import Timeline, simulate

__all__ = ["CostTable", "Link", "Partition", "StageCost", "check_bounds", "simulate_stages",
           "stage_bytes", "stage_costs_at", "step_times"]


@dataclasses.dataclass(frozen=True)
class Link:
    """A point-to-point link between two stages' devices: a message of n bytes takes
    latency + n / bandwidth on the wire, and its sender `per_message` seconds per tensor it
    holds to hand over (a transport posts one send a tensor)."""

    latency: float  # seconds per message
    bandwidth: float  # bytes per second (math.inf: no copy at all)
    per_message: float = 0.0  # the sender's own seconds per tensor sent (its isend call)
    source: str = "configured"  # where the figures come from: configured, default, measured

    def time(self, nbytes: np.ndarray | float) -> np.ndarray:
        """Seconds to send `nbytes` (0 bytes cost nothing: no message is sent)."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        transfer = 0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth
        return np.where(nbytes > 0, self.latency + transfer, 0.0)

    def __str__(self) -> str:
        sending = (f", {self.per_message * 1e6:.0f} us to send each tensor"
                   if self.per_message else "")
        if math.isinf(self.bandwidth) and not self.latency:
            return f"free (same memory, no copy{sending}; {self.source})"
        if math.isinf(self.bandwidth):
            return f"{self.latency * 1e6:.0f} us per message, no copy{sending} ({self.source})"
        return (f"{self.latency * 1e6:.0f} us + bytes / {self.bandwidth / 1e9:.1f} GB/s"
                f"{sending} ({self.source})")


@dataclasses.dataclass(frozen=True, eq=False)
class CostTable:
    """Per-unit costs in seconds for one micro-batch, measured at one or more micro-batch sizes.

    Row m of `f`, `b`, `cf`, `cb` holds the costs at micro-batch size `sizes[m]` (samples).
    `at(p)` interpolates linearly in the micro-batch size B/p between measured sizes and
    extrapolates linearly beyond them; it never assumes time proportional to batch size. A table
    with one row is the same for every p (the synthetic tables planners are tested on).

    cf[i] / cb[i] are the times to send the values crossing the cut after unit i forward /
    their gradients backward (0 for the last unit).

    Notation follows ALGORITHMS §0-§1: K units, N stages, p micro-batches of a mini-batch of
    size B; a partition is its `bounds`, each stage's exclusive end unit (bounds[-1] == K).
    """

    f: np.ndarray
    b: np.ndarray
    cf: np.ndarray
    cb: np.ndarray
    sizes: np.ndarray  # (M,) micro-batch sizes of the rows, ascending
    batch: int | None = None  # mini-batch size B; needed to turn p into a micro-batch size
    params: np.ndarray | None = None  # (K,) parameter count per unit
    names: tuple[str, ...] = ()
    param_bytes: np.ndarray | None = None  # (K,) bytes of each unit's parameters
    activation_bytes: np.ndarray | None = None  # (M, K) bytes saved for backward per micro-batch
    source: str = ""  # where the times come from (measured, read from a cache file, ...)
    # (M, K) per micro-batch: bytes of the values crossing the cut after unit i, of their
    # gradients, and of the part of them autograd saves (the memory model's boundary buffers,
    # in the dtypes the stages make them in, as they are handed over and travel: bf16 under
    # a bf16 autocast)
    boundary_bytes: np.ndarray | None = None
    boundary_grad_bytes: np.ndarray | None = None
    boundary_saved_bytes: np.ndarray | None = None
    # (M, K) the gradients of the values crossing the cut after unit i as a backward inside a
    # stage holds them (None: boundary_grad_bytes, which they are in a profile)
    inner_grad_bytes: np.ndarray | None = None
    output_bytes: np.ndarray | None = None  # (M,) per micro-batch: the model's outputs
    # (K,) autocast's bf16/fp16 copies of each unit's weights, which its stage holds for the
    # whole step (Plan(precision); 0 in full precision)
    weight_cast_bytes: np.ndarray | None = None
    # (M, K, K) per micro-batch: bytes of the values unit m makes and unit r reads last (r > m);
    # None: not measured (a recomputing stage's segments then count each cut's whole crossing)
    lifetime_bytes: np.ndarray | None = None
    # per micro-batch, what a recomputing stage keeps for each checkpoint beyond its values:
    # the CPU generator's state (preserve_rng_state)
    checkpoint_bytes: float = 0.0

    def __post_init__(self) -> None:
        arrays = {}
        for field in ("f", "b", "cf", "cb"):
            value = np.atleast_2d(np.asarray(getattr(self, field), dtype=np.float64))
            arrays[field] = value
        shape = arrays["f"].shape
        for field, value in arrays.items():
            if value.shape != shape:
                raise ValueError(f"CostTable.{field} has shape {value.shape}, f has {shape}")
            if np.any(value < 0) or not np.all(np.isfinite(value)):
                raise ValueError(f"CostTable.{field} must hold finite non-negative times")
            value.setflags(write=False)
            object.__setattr__(self, field, value)
        sizes = np.atleast_1d(np.asarray(self.sizes, dtype=np.float64))
        if sizes.shape != (shape[0],) or np.any(np.diff(sizes) <= 0):
            raise ValueError(f"CostTable.sizes must be {shape[0]} ascending micro-batch sizes")
        object.__setattr__(self, "sizes", sizes)
        params = np.zeros(shape[1]) if self.params is None else np.asarray(self.params, float)
        object.__setattr__(self, "params", params)
        param_bytes = params * 4 if self.param_bytes is None else self.param_bytes
        object.__setattr__(self, "param_bytes", np.asarray(param_bytes, float))
        saved = np.zeros(shape) if self.activation_bytes is None else self.activation_bytes
        object.__setattr__(self, "activation_bytes", np.atleast_2d(np.asarray(saved, float)))
        for field in ("boundary_bytes", "boundary_grad_bytes", "boundary_saved_bytes"):
            value = getattr(self, field)
            object.__setattr__(self, field, np.zeros(shape) if value is None else
                               np.atleast_2d(np.asarray(value, float)))
        if self.inner_grad_bytes is not None:
            object.__setattr__(self, "inner_grad_bytes",
                               np.atleast_2d(np.asarray(self.inner_grad_bytes, float)))
        outputs = np.zeros(shape[0]) if self.output_bytes is None else self.output_bytes
        object.__setattr__(self, "output_bytes", np.asarray(outputs, float).reshape(shape[0]))
        casts = np.zeros(shape[1]) if self.weight_cast_bytes is None else self.weight_cast_bytes
        object.__setattr__(self, "weight_cast_bytes", np.asarray(casts, float).reshape(shape[1]))
        if self.lifetime_bytes is not None:
            object.__setattr__(self, "lifetime_bytes", np.asarray(
                self.lifetime_bytes, float).reshape(shape[0], shape[1], shape[1]))

    @classmethod
    def from_arrays(
        cls,
        f: Sequence[float] | np.ndarray,
        b: Sequence[float] | np.ndarray,
        cf: Sequence[float] | np.ndarray | None = None,
        cb: Sequence[float] | np.ndarray | None = None,
        *,
        sizes: Sequence[float] | None = None,
        batch: int | None = None,
        params: Sequence[float] | None = None,
        param_bytes: Sequence[float] | None = None,
        activation_bytes: Sequence[float] | np.ndarray | None = None,
        boundary_bytes: Sequence[float] | np.ndarray | None = None,
    ) -> CostTable:
        """A table from plain arrays: 1-D (the same at every p) or 2-D (one row per size)."""
        f = np.atleast_2d(np.asarray(f, dtype=np.float64))
        zeros = np.zeros_like(f)
        cf = zeros if cf is None else cf
        cb = zeros if cb is None else cb
        if sizes is None:
            if f.shape[0] != 1:
                raise ValueError("a CostTable with several rows needs the micro-batch `sizes`")
            sizes = [1.0]
        return cls(f, b, cf, cb, np.asarray(sizes, float), batch, params, (), param_bytes,
                   activation_bytes, boundary_bytes=boundary_bytes)

    @property
    def units(self) -> int:
        return self.f.shape[1]

    def saved_bytes(self, p: int) -> np.ndarray:
        """(K,) bytes each unit saves for backward per micro-batch, at micro-batch count p."""
        return np.maximum(self._bytes_weights(p) @ self.activation_bytes, 0.0)

    def _bytes_weights(self, p: int) -> np.ndarray:
        """(M,) weights of the rows for byte counts at micro-batch count p: interpolated as the
        times are, or, measured at one size only, that row scaled to the micro-batch size
        (tensors hold so many bytes a sample; a time, unlike them, is not assumed to scale)."""
        if len(self.sizes) == 1 and self.batch is not None:
            return np.array([self.batch / p / self.sizes[0]])
        return self._interpolation(np.array([float(p)]))[0]

    def crossing_bytes(self, p: int) -> tuple[np.ndarray, ...]:
        """Per micro-batch at micro-batch count p: (K,) bytes crossing the cut after unit i,
        their gradients' bytes, and the bytes of them autograd saves; and the bytes of the
        model's outputs."""
        weights = self._bytes_weights(p)
        return (*(np.maximum(weights @ table, 0.0) for table in (
            self.boundary_bytes, self.boundary_grad_bytes, self.boundary_saved_bytes)),
            max(float(weights @ self.output_bytes), 0.0))

    def lifetimes(self, p: int) -> np.ndarray | None:
        """(K, K) per micro-batch at count p: `lifetime_bytes` (None where not measured)."""
        if self.lifetime_bytes is None:
            return None
        return np.maximum(np.tensordot(self._bytes_weights(p), self.lifetime_bytes, 1), 0.0)

    def input_bytes(self, p: int) -> np.ndarray:
        """(K+1,) bytes entering a stage that starts at unit i, per micro-batch at count p:
        what crosses the cut before it (0 at i = 0, whose inputs are the caller's; and at K)."""
        return np.concatenate([[0.0], self.crossing_bytes(p)[0][:-1], [0.0]])

    def inner_grads(self, p: int) -> np.ndarray:
        """(K,) per micro-batch at count p: the gradients of the values crossing the cut after
        unit i, as a backward inside a stage holds them (`inner_grad_bytes`)."""
        table = self.boundary_grad_bytes if self.inner_grad_bytes is None else \
            self.inner_grad_bytes
        return np.maximum(self._bytes_weights(p) @ table, 0.0)

    def unit_workspace(self, p: int) -> np.ndarray:
        """(K,) per unit, what its backward holds beyond the activations at count p
        (`fxpipe.memory.workspace_bytes` of a stage is the largest over its units)."""
        grads = self.inner_grads(p)
        inner = np.concatenate([[0.0], grads[:-1]])
        return inner + grads + (self.param_bytes if p > 1 else 0.0)

    def at(self, p: int | Sequence[int] | np.ndarray) -> tuple[np.ndarray, ...]:
        """(f, b, cf, cb) at micro-batch count(s) p: shape (K,) for a scalar p, else (P, K)."""
        scalar = np.ndim(p) == 0
        counts = np.atleast_1d(np.asarray(p, dtype=np.float64))
        weights = self._interpolation(counts)
        result = tuple(weights @ table for table in (self.f, self.b, self.cf, self.cb))
        result = tuple(np.maximum(r, 0.0) for r in result)
        return tuple(r[0] for r in result) if scalar else result

    def _interpolation(self, counts: np.ndarray) -> np.ndarray:
        """(P, M) weights so that weights @ rows interpolates at micro-batch size B/p."""
        rows = len(self.sizes)
        weights = np.zeros((len(counts), rows))
        if rows == 1:
            weights[:, 0] = 1.0
            return weights
        if self.batch is None:
            raise ValueError("CostTable.batch is needed to interpolate between micro-batch sizes")
        size = self.batch / counts
        hi = np.clip(np.searchsorted(self.sizes, size), 1, rows - 1)
        lo = hi - 1
        t = (size - self.sizes[lo]) / (self.sizes[hi] - self.sizes[lo])
        weights[np.arange(len(counts)), lo] = 1.0 - t
        weights[np.arange(len(counts)), hi] += t
        return weights


@dataclasses.dataclass(frozen=True)
class StageCost:
    """What one stage costs per micro-batch: compute, boundary communication, parameters."""

    units: tuple[int, int]  # [start, end) unit range
    f: float
    b: float
    cf: float
    cb: float
    params: float
    memory: float = 0.0  # bytes: weights, gradients, optimizer state, in-flight activations


@dataclasses.dataclass(frozen=True)
class Partition:
    """A partition of the units into stages, with what the cost model predicts for it."""

    bounds: tuple[int, ...]
    micro_batches: int
    partitioner: str
    predicted_time: float
    rho_f: float
    rho_b: float
    bubble: float
    stages: tuple[StageCost, ...]
    schedule: str = "gpipe"  # the schedule predicted_time and bubble are for
    recompute: tuple[bool, ...] = ()  # per stage: recomputes its forward in backward (): none

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in (s.units for s in self.stages))

    @classmethod
    def evaluate(
        cls,
        cost: CostTable,
        bounds: Sequence[int],
        p: int = 1,
        partitioner: str = "given",
        *,
        schedule: str | Schedule = "gpipe",
        optimizer_slots: float = 2.0,
        recompute: Sequence[bool] = (),
        memory: MemoryBudget | None = None,
        consistency: str = "none",
    ) -> Partition:
        """Score `bounds` with the closed-form model of ALGORITHMS §1 for GPipe, which is
        GPipe's simulated step on a chain of stages; for any other `schedule`, its step as
        `simulate_stages` plays it (per mini-batch for async-1f1b, which streams two).

        The memory estimate per stage (`fxpipe.memory.stage_memory`) counts weights,
        gradients and `optimizer_slots` more copies (2: Adam's moments), plus the most that
        the stage's actions hold at once (`fxpipe.memory.stage_terms`, the walk of
        `stage_peak`): the activations of its micro-batches in flight (p for gpipe, at most
        N − s on stage s for 1f1b), its message buffers and its backward's workspace
        (docs/memory.md); autocast's copies of the weights (`CostTable.weight_cast_bytes`),
        and the copies of the weights the `consistency` policy keeps
        (`fxpipe.policy_copies.weight_copies`). `memory`, where given, counts it by its schedule,
        optimizer and consistency (the planners' `Capacity` counts exactly this).

        `recompute` (one bool per stage, () for none): such a stage's backward runs its
        forward again (b + f), in checkpointed segments (`fxpipe.segments`): per micro-batch
        it keeps the values at their cuts, and its backward holds the largest segment's
        activations again.
        """
        bounds = check_bounds(bounds, cost.units)
        recompute = tuple(bool(r) for r in recompute)
        if recompute and len(recompute) != len(bounds):
            raise ValueError(f"recompute lists {len(recompute)} stages for {len(bounds)}")
        if memory is not None:
            optimizer_slots, consistency = memory.optimizer_slots, memory.consistency
        f, b, cf, cb = cost.at(p)
        saved = cost.saved_bytes(p)
        starts = (0, *bounds[:-1])
        counted = schedule if memory is None else memory.schedule
        own = stage_actions(counted, len(bounds), p)
        stages = []
        for s, (start, end) in enumerate(zip(starts, bounds)):
            last = s == len(bounds) - 1
            again = bool(recompute) and recompute[s]
            peak = peak_of(stage_terms(own[s], again, stage_let_go(counted, len(bounds), p).get(s)),
                           stage_bytes(cost, p, bounds, s, again))
            memory_s = stage_memory(
                cost.param_bytes[start:end], saved[start:end], 0,
                optimizer_slots=optimizer_slots, boundary=peak.boundary,
                workspace=peak.workspace, activations=peak.activations,
                casts=float(cost.weight_cast_bytes[start:end].sum()),
                copies=stage_copies(consistency, counted, len(bounds), p, s))
            forward = float(f[start:end].sum())
            stages.append(StageCost(
                (start, end),
                forward,
                float(b[start:end].sum()) + (forward if again else 0.0),
                0.0 if last else float(cf[end - 1]),
                0.0 if last else float(cb[end - 1]),
                float(cost.params[start:end].sum()),
                memory_s.total,
            ))
        time, rho_f, rho_b = _closed_form(stages, p)
        busy = p * sum(s.f + s.b for s in stages)
        bubble = 1.0 - busy / (len(stages) * time) if time > 0 else 0.0
        if isinstance(schedule, Schedule) or schedule != "gpipe":
            timeline = simulate_stages(stages, p, schedule)
            time, bubble = timeline.makespan / timeline.schedule.minibatches, timeline.bubble
        name = schedule.name if isinstance(schedule, Schedule) else schedule
        return cls(bounds, p, partitioner, time, rho_f, rho_b, bubble, tuple(stages), name,
                   recompute if any(recompute) else ())


def stage_bytes(cost: CostTable, p: int, bounds: Sequence[int], s: int,
                recompute: bool = False) -> StageBytes:
    """What stage s of `bounds` holds per micro-batch at count p: its saved activations, in
    from the cut before it (its gradient back), out over the cut after it (its gradient in;
    the last stage's "out": the model's outputs, kept until the micro-batch's backward); and where
    it `recompute`s, what its segments keep at their cuts and the largest one saves
    (`recompute_segments`)."""
    start, end = (0, *bounds)[s], bounds[s]
    last = s == len(bounds) - 1
    crossing, grads, crossing_saved, outputs = cost.crossing_bytes(p)
    into, back = (crossing[start - 1], grads[start - 1]) if s else (0.0, 0.0)
    out, grads_in, out_saved = ((outputs, 0.0, 0.0) if last else (
        crossing[end - 1], grads[end - 1], crossing_saved[end - 1]))
    held = cost.inner_grads(p)  # a backward's own gradients, in their dtypes
    inner = np.concatenate([[0.0], held])[start:end]  # the cut before each unit
    workspace = workspace_bytes(cost.param_bytes[start:end], inner, held[start:end], p)
    chain = recompute_segments(cost, p, start, end) if recompute else Segmentation((), 0.0, 0.0)
    return StageBytes(float(cost.saved_bytes(p)[start:end].sum()), float(into), float(out),
                      float(out_saved), float(grads_in), float(back), workspace, chain.kept,
                      chain.largest)



def simulate_stages(stages: Sequence[StageCost], p: int, schedule: str | Schedule,
                    edges: Sequence[tuple[int, int]] | None = None) -> Timeline:
    """`schedule` (a name, built for the stages and p micro-batches, or a user's) played by the
    event simulator with each stage's per-micro-batch f and b, lowered for the stage `edges`
    (default: the chain; a user's lowered schedule keeps its own), a message from stage s
    taking its cut's cf or cb. Where the lists split a backward into B and W, each takes half
    of b (`fxpipe.simulate.WEIGHT_SHARE`)."""
    if isinstance(schedule, str):
        schedule = build(schedule, len(stages), p)
    return simulate(schedule, [s.f for s in stages], [s.b for s in stages],
                    [s.cf for s in stages], [s.cb for s in stages],
                    edges=None if schedule.lowered else edges)


def check_bounds(bounds: Sequence[int], units: int) -> tuple[int, ...]:
    """`bounds` as a tuple, or ValueError unless they are increasing and end at `units`."""
    bounds = tuple(int(x) for x in bounds)
    if not bounds or bounds[-1] != units or any(a >= b for a, b in zip((0, *bounds), bounds)):
        raise ValueError(f"bounds {bounds} are not increasing stage ends covering {units} units")
    return bounds


def _closed_form(stages: Sequence[StageCost], p: int) -> tuple[float, float, float]:
    rho_f = max(max(s.f, s.cf) for s in stages)
    rho_b = max(max(s.b, s.cb) for s in stages)
    trip = sum(s.f + s.cf + s.b + s.cb for s in stages)
    return trip + (p - 1) * (rho_f + rho_b), rho_f, rho_b


def stage_costs_at(cost: CostTable, bounds: Sequence[int], counts: Sequence[int]
                   ) -> tuple[np.ndarray, ...]:
    """Per micro-batch count in `counts` (rows) and stage (columns): forward, backward, and
    the links after each stage but the last, forward and backward."""
    bounds = check_bounds(bounds, cost.units)
    f, b, cf, cb = cost.at(np.asarray(counts, dtype=np.float64))  # (P, K)
    ends = np.asarray(bounds)
    starts = np.concatenate([[0], ends[:-1]])
    return (np.add.reduceat(f, starts, axis=1), np.add.reduceat(b, starts, axis=1),
            cf[:, ends[:-1] - 1], cb[:, ends[:-1] - 1])


def step_times(cost: CostTable, bounds: Sequence[int], counts: Sequence[int]) -> np.ndarray:
    """T(λ, p) of ALGORITHMS §1 for every micro-batch count in `counts`, in one numpy pass."""
    counts = np.asarray(counts, dtype=np.float64)
    stage_f, stage_b, link_f, link_b = stage_costs_at(cost, bounds, counts)
    rho_f = np.maximum(stage_f.max(axis=1), link_f.max(axis=1, initial=0.0))
    rho_b = np.maximum(stage_b.max(axis=1), link_b.max(axis=1, initial=0.0))
    trip = stage_f.sum(1) + stage_b.sum(1) + link_f.sum(1) + link_b.sum(1)
    return trip + (counts - 1) * (rho_f + rho_b)
