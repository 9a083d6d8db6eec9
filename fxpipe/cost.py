"""CostTable (per-unit f, b, cf, cb as functions of the micro-batch count p) and the cost model.

Notation follows ALGORITHMS §0-§1: K units, N stages, p micro-batches of a mini-batch of size B.
A partition is given by its `bounds`, the exclusive end unit of every stage (bounds[-1] == K).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["CostTable", "Link", "Partition", "StageCost", "check_bounds", "fit_to_flops",
           "step_times"]


@dataclasses.dataclass(frozen=True)
class Link:
    """A point-to-point link between two stages' devices: time = latency + bytes / bandwidth."""

    latency: float  # seconds per message
    bandwidth: float  # bytes per second (math.inf: no copy at all)
    source: str = "configured"  # where the figures come from: configured, default, measured
    post: float = 0.0  # the sender's own seconds to hand over one tensor (e.g. isend's call)
    # the same right after a backward, as a stage sends gradients: the longer the compute
    # before a send, the slower it goes (DistTransport.measure_posting; None: post)
    post_back: float | None = None
    post_recv: float | None = None  # the receiver's, to post one tensor's receive (None: post)
    # the same between two computes, where a stage posts its next receive under 1F1B (a
    # forwards-first stage posts them all back to back at the start; None: post_recv)
    post_recv_between: float | None = None
    # how much longer a stage's next compute runs after it blocked waiting for a message (a
    # process woken from a wait runs slower for a while: benchmarks/resume_penalty.py); one
    # figure, or one per stage (measured on each stage's own compute, which it depends on)
    resume: float | tuple[float, ...] = 0.0
    # how much longer the sender's next compute runs after it sent a message, per tensor: the
    # transport's work on the message goes on beside it (DistTransport.measure_posting)
    after_send: float = 0.0
    # the same where the message wakes a receiver blocked waiting for it that posts its next
    # receive between computes, at once, whose notice lands beside it (None: after_send)
    after_wake: float | None = None
    # how much longer the receiver's compute runs while a message lands, per tensor: the
    # transport's work to take it in shares its CPU (DistTransport.measure_posting)
    after_receive: float = 0.0
    # how much longer the compute a stage posts a receive right before runs, per tensor, where
    # it posts them between computes (the runtime posts the next receive before a compute):
    # the transport's work on the receive goes on beside it
    after_post: float = 0.0

    @property
    def posting_back(self) -> float:
        """The sender's seconds to hand over one tensor of gradients."""
        return self.post if self.post_back is None else self.post_back

    @property
    def waking(self) -> float:
        """How much longer the sender's next compute runs per tensor of a message that wakes
        a receiver which posts its next receive at once."""
        return self.after_send if self.after_wake is None else self.after_wake

    @property
    def receiving(self) -> float:
        """The receiver's seconds to post the receive of one tensor."""
        return self.post if self.post_recv is None else self.post_recv

    @property
    def receiving_between(self) -> float:
        """The receiver's seconds to post the receive of one tensor between two computes."""
        return self.receiving if self.post_recv_between is None else self.post_recv_between

    def time(self, nbytes: np.ndarray | float) -> np.ndarray:
        """Seconds to send `nbytes` (0 bytes cost nothing: no message is sent)."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        transfer = 0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth
        return np.where(nbytes > 0, self.latency + transfer, 0.0)

    def __str__(self) -> str:
        if math.isinf(self.bandwidth) and not (self.latency or self.post or self.posting_back
                                                or self.receiving
                                                or self.receiving_between
                                                or any(np.atleast_1d(self.resume))
                                                or self.after_send or self.after_receive
                                                or self.waking or self.after_post):
            return f"free (same device, no copy; {self.source})"
        posting = (f", {self.post * 1e6:.0f} us to post each tensor"
                   if self.post or self.posting_back else "")
        if self.posting_back != self.post:
            posting += f" ({self.posting_back * 1e6:.0f} us after a backward)"
        if self.receiving != self.post:
            posting += f", {self.receiving * 1e6:.0f} us to post its receive"
        if self.receiving_between != self.receiving:
            posting += f" ({self.receiving_between * 1e6:.0f} us between computes)"
        if any(np.atleast_1d(self.resume)):
            slower = "/".join(f"{r * 1e6:.0f}" for r in np.atleast_1d(self.resume))
            posting += f", compute {slower} us slower after a wait"
            if np.ndim(self.resume):
                posting += " (per stage)"
        if self.after_send or self.waking:
            posting += f", the sender's {self.after_send * 1e6:.0f} us slower per tensor sent"
        if self.waking != self.after_send:
            posting += f" ({self.waking * 1e6:.0f} us where it wakes the receiver)"
        if self.after_receive:
            posting += (f", the receiver's {self.after_receive * 1e6:.0f} us slower per tensor "
                        "taken in")
        if self.after_post:
            posting += (f", its compute {self.after_post * 1e6:.0f} us slower per tensor whose "
                        "receive it posted between computes")
        if math.isinf(self.bandwidth):
            return f"{self.latency * 1e6:.0f} us per message, no copy{posting} ({self.source})"
        return (f"{self.latency * 1e6:.0f} us + bytes / {self.bandwidth / 1e9:.1f} GB/s"
                f"{posting} ({self.source})")


@dataclasses.dataclass(frozen=True, eq=False)
class CostTable:
    """Per-unit costs in seconds for one micro-batch, measured at one or more micro-batch sizes.

    Row m of `f`, `b`, `cf`, `cb` holds the costs at micro-batch size `sizes[m]` (samples).
    `at(p)` interpolates linearly in the micro-batch size B/p between measured sizes and
    extrapolates linearly beyond them; it never assumes time proportional to batch size. A table
    with one row is the same for every p (the synthetic tables planners are tested on).

    cf[i] / cb[i] are the times to send the values crossing the cut after unit i forward /
    their gradients backward (0 for the last unit). `backward_call[m]` is what one stage's
    backward costs beyond its units' `b` at size `sizes[m]` (the fixed cost of a backward call,
    which a stage pays once whatever its units); 0 unless measured.
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
    peak_bytes: np.ndarray | None = None  # (M, K) most a unit's forward or backward allocates
    backward_call: np.ndarray | None = None  # (M,) seconds per stage backward, beyond b

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
        peak = saved if self.peak_bytes is None else np.nan_to_num(self.peak_bytes)  # unmeasured
        object.__setattr__(self, "peak_bytes", np.atleast_2d(np.asarray(peak, float)))
        call = np.zeros(shape[0]) if self.backward_call is None else \
            np.atleast_1d(np.asarray(self.backward_call, float))
        if call.shape != (shape[0],) or np.any(call < 0) or not np.all(np.isfinite(call)):
            raise ValueError(f"CostTable.backward_call must hold {shape[0]} finite non-negative "
                             f"times, one per micro-batch size")
        object.__setattr__(self, "backward_call", call)

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
        peak_bytes: Sequence[float] | np.ndarray | None = None,
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
                   activation_bytes, peak_bytes)

    @property
    def units(self) -> int:
        return self.f.shape[1]

    def saved_bytes(self, p: int) -> np.ndarray:
        """(K,) bytes each unit saves for backward per micro-batch, at micro-batch count p."""
        return np.maximum(self._interpolation(np.array([float(p)]))[0] @ self.activation_bytes,
                          0.0)

    def transient_bytes(self, p: int) -> np.ndarray:
        """(K,) bytes each unit allocates at its peak beyond what it keeps for backward (its
        workspace, outputs and gradients), per micro-batch at micro-batch count p."""
        weights = self._interpolation(np.array([float(p)]))[0]
        return np.maximum(weights @ self.peak_bytes - weights @ self.activation_bytes, 0.0)

    def at(self, p: int | Sequence[int] | np.ndarray) -> tuple[np.ndarray, ...]:
        """(f, b, cf, cb) at micro-batch count(s) p: shape (K,) for a scalar p, else (P, K)."""
        scalar = np.ndim(p) == 0
        counts = np.atleast_1d(np.asarray(p, dtype=np.float64))
        weights = self._interpolation(counts)
        result = tuple(weights @ table for table in (self.f, self.b, self.cf, self.cb))
        result = tuple(np.maximum(r, 0.0) for r in result)
        return tuple(r[0] for r in result) if scalar else result

    def call_at(self, p: int | Sequence[int] | np.ndarray) -> np.ndarray | float:
        """The per-stage backward call cost at micro-batch count(s) p (as `at`)."""
        counts = np.atleast_1d(np.asarray(p, dtype=np.float64))
        calls = np.maximum(self._interpolation(counts) @ self.backward_call, 0.0)
        return float(calls[0]) if np.ndim(p) == 0 else calls

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
        schedule: str = "gpipe",
        optimizer_slots: float = 2.0,
    ) -> Partition:
        """Score `bounds` with the closed-form model of ALGORITHMS §1.

        The memory estimate per stage counts weights, gradients and `optimizer_slots` more
        copies (2: Adam's moments), plus the activations of the micro-batches in flight (p for
        gpipe, at most N − s on stage s for the 1F1B schedules), plus the largest measured
        transient allocation of one of its units.
        """
        bounds = check_bounds(bounds, cost.units)
        f, b, cf, cb = cost.at(p)
        call = cost.call_at(p)
        saved, transient = cost.saved_bytes(p), cost.transient_bytes(p)
        starts = (0, *bounds[:-1])
        stages = []
        for s, (start, end) in enumerate(zip(starts, bounds)):
            last = s == len(bounds) - 1
            in_flight = p if schedule == "gpipe" else min(len(bounds) - s, p)
            weights = float(cost.param_bytes[start:end].sum()) * (2 + optimizer_slots)
            stages.append(StageCost(
                (start, end),
                float(f[start:end].sum()),
                float(b[start:end].sum()) + call,
                0.0 if last else float(cf[end - 1]),
                0.0 if last else float(cb[end - 1]),
                float(cost.params[start:end].sum()),
                weights + in_flight * float(saved[start:end].sum())
                + float(transient[start:end].max()),
            ))
        time, rho_f, rho_b = _closed_form(stages, p)
        busy = p * sum(s.f + s.b for s in stages)
        bubble = 1.0 - busy / (len(stages) * time) if time > 0 else 0.0
        return cls(bounds, p, partitioner, time, rho_f, rho_b, bubble, tuple(stages))


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


def fit_to_flops(cost: CostTable, flops: Callable[[float], np.ndarray],
                 loss: tuple[np.ndarray, np.ndarray] | None = None) -> CostTable:
    """The table with each unit's forward and backward time modelled as α·FLOPs(m) + β at
    micro-batch size m (least squares over the measured sizes, α, β >= 0), tabulated at the
    size B/p of every count p up to 512, so that `at(p)` follows the FLOP count
    between and beyond the measured sizes instead of a straight line. `flops(m)` is the (K,)
    FLOPs of each unit at size m (the symbolic pass's expressions); link times keep their
    interpolation (bytes are linear in m). One measured size fits α alone (β = 0).
    `loss`: the (M,) seconds of the loss's forward and backward at the measured sizes, which
    the last unit's f and b hold (cost_table): fitted as α·m + β of their own, as the loss's
    work grows with the micro-batch's rows, not with the last unit's FLOPs (a unit of no
    FLOPs, a reshape, would have made it a constant)."""
    if cost.batch is None:
        raise ValueError("fit_to_flops needs CostTable.batch (the mini-batch size)")
    measured = np.array([flops(m) for m in cost.sizes], dtype=np.float64)  # (M, K)
    counts = np.arange(1, min(cost.batch, 512) + 1)
    sizes = np.unique(np.concatenate([cost.sizes, cost.batch / counts]))
    grid = np.array([flops(m) for m in sizes], dtype=np.float64)
    tables = [cost.f.copy(), cost.b.copy()]
    losses = [np.zeros(len(sizes))] * 2
    if loss is not None:
        rows = np.asarray(cost.sizes, dtype=np.float64)[:, None]
        for table, seconds in zip(tables, loss):
            table[:, -1] -= seconds
        losses = [sizes * alpha[0] + beta[0] for alpha, beta in
                  (_affine_fit(rows, np.asarray(seconds)[:, None]) for seconds in loss)]
    fitted = [grid * alpha + beta for alpha, beta in
              (_affine_fit(measured, table) for table in tables)]
    for table, seconds in zip(fitted, losses):
        table[:, -1] += seconds
    links = cost._interpolation(cost.batch / sizes)
    return dataclasses.replace(
        cost, f=np.maximum(fitted[0], 0.0), b=np.maximum(fitted[1], 0.0),
        cf=links @ cost.cf, cb=links @ cost.cb, sizes=sizes,
        backward_call=np.maximum(links @ cost.backward_call, 0.0),
        activation_bytes=np.maximum(links @ cost.activation_bytes, 0.0),
        peak_bytes=np.maximum(links @ cost.peak_bytes, 0.0))


def _affine_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column, α >= 0 and β >= 0 minimising Σ_m (α·x[m] + β − y[m])²."""
    if len(x) == 1:
        with np.errstate(divide="ignore", invalid="ignore"):
            alpha = np.where(x[0] > 0, y[0] / x[0], 0.0)
        return alpha, np.where(x[0] > 0, 0.0, y[0])
    x_mean, y_mean = x.mean(0), y.mean(0)
    spread = ((x - x_mean) ** 2).sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = np.where(spread > 0, ((x - x_mean) * (y - y_mean)).sum(0) / spread, 0.0)
    alpha = np.maximum(alpha, 0.0)
    beta = np.maximum(y_mean - alpha * x_mean, 0.0)
    return alpha, beta


def step_times(cost: CostTable, bounds: Sequence[int], counts: Sequence[int]) -> np.ndarray:
    """T(λ, p) of ALGORITHMS §1 for every micro-batch count in `counts`, in one numpy pass."""
    bounds = check_bounds(bounds, cost.units)
    counts = np.asarray(counts, dtype=np.float64)
    f, b, cf, cb = cost.at(counts)  # (P, K)
    ends = np.asarray(bounds)
    starts = np.concatenate([[0], ends[:-1]])
    stage_f = np.add.reduceat(f, starts, axis=1)
    stage_b = np.add.reduceat(b, starts, axis=1) + cost.call_at(counts)[:, None]
    link_f = cf[:, ends[:-1] - 1]
    link_b = cb[:, ends[:-1] - 1]
    rho_f = np.maximum(stage_f.max(axis=1), link_f.max(axis=1, initial=0.0))
    rho_b = np.maximum(stage_b.max(axis=1), link_b.max(axis=1, initial=0.0))
    trip = stage_f.sum(1) + stage_b.sum(1) + link_f.sum(1) + link_b.sum(1)
    return trip + (counts - 1) * (rho_f + rho_b)
