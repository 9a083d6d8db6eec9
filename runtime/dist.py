"""DistTransport: stages in separate processes, over torch.distributed point-to-point messages."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.distributed as dist

from fxpipe.devices import wire_device
from fxpipe.errors import FxpipeError
from fxpipe.ir import CommTable, Edge
from fxpipe.runtime.transport import DeviceCopies, MicroBatchKey, PipelineAborted, to_device

__all__ = ["DistTransport", "ErrorBoard", "Watchdog"]

_ERROR_KEY = "fxpipe/error"
_NAMES = {"F": "forward", "B": "backward"}


class ErrorBoard:
    """The job's shared note of the first failure: rank, stage and error text."""

    def __init__(self) -> None:
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError, ValueError):
            self.store = None

    def post(self, text: str) -> None:
        if self.store is not None:
            with contextlib.suppress(RuntimeError):  # a gone store: the job is ending anyway
                self.store.compare_set(_ERROR_KEY, "", text)  # the first failure wins

    def read(self) -> str | None:
        if self.store is not None:
            with contextlib.suppress(RuntimeError):  # a gone store: no message to read
                if self.store.check([_ERROR_KEY]):
                    return self.store.get(_ERROR_KEY).decode()
        return None


class Watchdog:
    """How long a wait on another rank may last, and what to say when it ends without its
    message: the first failure another rank posted, a deadline passed, or a lost peer.

    A wait gives up after max(timeout, 10 x the longest run so far), the run timed from
    prepare() to the end of flush() (a deadline, not a cost: nothing else reads it); timeout
    None is 300 s until a run has completed (the first one sets up), 30 s after."""

    def __init__(self, timeout: float | None, rank: int, stage: int, board: ErrorBoard,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout, self.rank, self.stage, self.board = timeout, rank, stage, board
        self.clock = clock
        self.longest = 0.0  # seconds, the longest completed run
        self._began: float | None = None

    def deadline(self) -> float:
        default = 30.0 if self.longest else 300.0
        return max(default if self.timeout is None else self.timeout, 10 * self.longest)

    def started(self) -> None:
        self._began = self.clock()

    def finished(self) -> None:
        if self._began is not None:
            self.longest = max(self.longest, self.clock() - self._began)
        self._began = None

    def wait(self, work: Any, what: str) -> None:
        """Block until `work` completes, at most the deadline; raise what went wrong."""
        deadline, began = self.deadline(), self.clock()
        try:
            work.wait(datetime.timedelta(seconds=deadline))
        except Exception as error:  # gloo/NCCL report a lost peer or a timeout this way
            raise self.failure(error, what, self.clock() - began, deadline) from error

    def failure(self, error: BaseException, what: str, waited: float = 0.0,
                deadline: float | None = None) -> FxpipeError:
        """The error to raise for an operation on `what` that failed after `waited` s."""
        posted = self.board.read()
        if posted is not None:  # a failed peer posted its error, then closed its connections
            return PipelineAborted(f"the pipeline stopped because {posted}")
        here = f"rank {self.rank} (stage {self.stage})"
        if deadline is not None and waited >= 0.99 * deadline:
            text = (
                f"{here} waited {waited:.1f} s for {what}, its deadline (Plan(timeout=...), "
                "or 10 x the longest step so far): that rank, or one it waits for, is stopped "
                "or stuck. Every rank stops (the others at their own deadline); restart the "
                "job. If a rank may work alone this long between steps (say, saving a "
                "checkpoint), give a larger Plan(timeout=seconds).")
        else:
            text = (f"{here} lost its connection after {waited:.1f} s of waiting for {what}, "
                    "and no rank reported an error: a rank exited or was killed "
                    f"({type(error).__name__}: {error})")
        self.board.post(text)  # the coordinator's waits are outside the runs the driver posts
        return FxpipeError(text)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One value of a message: how to allocate, encode and decode it."""

    value: str
    dtype: torch.dtype
    shape: Callable[[int, int], tuple[int, ...]]  # (batch, seq) -> shape
    number: type | None  # int / float / bool values travel as 0-d tensors


class DistTransport:
    """Moves values between this rank's stages and the stages of other ranks; between two
    stages of this rank, a message is handed over in the process (its program sends it
    before it receives it, so it is there when received).

    Both ends know every message's layout ahead: the values of each (src, dst) edge in table
    order, each tensor's dtype from the shape pass (under Plan(precision), the dtype the
    stage's autocast makes it in, so a bf16 value travels as bf16, as one process hands it
    over, and its gradient too, as autograd makes it) and its shape as an expression of the
    micro-batch size (and sequence length) from the symbolic pass, so an uneven micro-batch needs
    no handshake. Sends are posted (isend) and completed (their buffers released) once the
    driver knows them received (`delivered`), the rest at the end of a run; receives block,
    each at most the watchdog's deadline. A failing rank posts its error to the job's store,
    and a peer whose wait ends without its message reads it and stops with that rank's error.
    """

    def __init__(self, comm: CommTable, ranks: Sequence[int], device: str, *,
                 group: Any = None, links: Mapping[tuple[int, int], Any] | None = None,
                 timeout: float | None = None, rank: int = 0,
                 stage_types: Sequence[str] | None = None) -> None:
        self.ranks = list(ranks)  # rank of each stage in this pipeline
        self.device = torch.device(device)
        # per stage, the device a message to or from it travels from: this rank's GPU when the
        # peer's rank has one too (NCCL), else the host (gloo), where this rank stages it
        kinds = stage_types or [self.device.type] * len(self.ranks)
        self.wire = [wire_device(self.device, kind) for kind in kinds]
        self.copies = DeviceCopies()
        self.group = group
        self.links = dict(links or {})  # (sending stage, receiving stage) -> its own group
        self.rank = rank
        self.board = ErrorBoard()
        stage = self.ranks.index(rank) if rank in self.ranks else 0
        self.watchdog = Watchdog(timeout, rank, stage, self.board)
        self._forward = {pair: [_slot(e) for e in edges]
                         for pair, edges in comm.by_pair().items()}
        carries = comm.carries_grad()
        self._backward = {pair: [s for s in slots if s.number is None and s.dtype.is_floating_point
                                 and carries[s.value]]
                          for pair, slots in self._forward.items()}
        self._dims: dict[Any, tuple[list[int], int | None]] = {}  # of the run in progress
        # posted sends not known complete, by message: their works and what they carry
        self._pending: dict[Any, list[tuple[Any, str]]] = {}
        self._posted: dict[Any, tuple[list[_Slot], list[torch.Tensor], list[Any]]] = {}
        self._error: BaseException | None = None
        self._local: dict[Any, Mapping[str, Any]] = {}  # between two stages of this rank

    def prepare(self, run: Any, sizes: Sequence[int], seq: int | None) -> None:
        """The micro-batch sizes (and sequence length) of `run`, known to every rank."""
        self._dims = {run: (list(sizes), seq)}  # a run's messages all complete within it
        self.watchdog.started()

    def send(self, src: int, dst: int, direction: str, key: MicroBatchKey,
             values: Mapping[str, Any]) -> None:
        if self.ranks[dst] == self.rank:
            self._local[src, dst, direction, key] = dict(values)
            return
        what = (f"{_NAMES[direction]} micro-batch {key.mb} to reach stage {dst} "
                f"(rank {self.ranks[dst]})")
        for index, tensor in enumerate(self._encode(src, dst, direction, key, values)):
            tag = _tag(direction, key, index)
            try:
                work = dist.isend(tensor, self.ranks[dst], self._group(src, dst), tag)
            except Exception as error:  # a connection a peer closed fails at once
                raise self.watchdog.failure(error, what) from error
            self._pending.setdefault((src, dst, direction, key), []).append((work, what))

    def delivered(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> None:
        """Complete the sends of a message its receiver has taken: the wait returns at once
        (a gloo send reports its completion only through a wait), and the buffers go."""
        for work, what in self._pending.pop((src, dst, direction, key), ()):
            self._wait(work, what)

    def prefetch(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> None:
        """Post the receive of a message the stage will wait for later, so the transfer
        overlaps the compute before it (the driver calls this for the next RECV action)."""
        message = (src, dst, direction, key)
        if self.ranks[src] != self.rank and message not in self._posted:
            self._posted[message] = self._post_receive(src, dst, direction, key)

    def recv(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> dict[str, Any]:
        if self.ranks[src] == self.rank:
            message = (src, dst, direction, key)
            if message not in self._local:  # the lowered programs never let this happen
                raise FxpipeError(f"stage {dst} receives {_NAMES[direction]} micro-batch "
                                  f"{key.mb} from stage {src} on its own rank before it was "
                                  "sent: the rank's program runs the receive before the send")
            return self._local.pop(message)
        self.prefetch(src, dst, direction, key)
        slots, received, works = self._posted.pop((src, dst, direction, key))
        for work in works:
            self._wait(work, f"{_NAMES[direction]} micro-batch {key.mb} from stage {src} "
                             f"(rank {self.ranks[src]})")
        values = {slot.value: buffer.item() if slot.number else buffer
                  for slot, buffer in zip(slots, received)}
        return to_device(values, self.device, self.copies)  # staged on the host: to the GPU

    def abort(self, error: BaseException) -> None:
        if self._error is None and not isinstance(error, PipelineAborted):
            self.board.post(f"rank {self.rank} failed: {type(error).__name__}: {error}")
        self._error = error
        self._pending.clear()  # a failed run's sends and receives are never waited for
        self._posted.clear()
        self._local.clear()

    def reset(self) -> None:
        self._error = None

    def flush(self) -> None:
        """Complete every posted send (their buffers may then be reused)."""
        pending, self._pending = self._pending, {}
        for work, what in (sent for message in pending.values() for sent in message):
            self._wait(work, what)
        self.watchdog.finished()

    # --- internals ----------------------------------------------------------------------------

    def _group(self, src: int, dst: int) -> Any:
        return self.links.get((src, dst), self.group)

    def _slots(self, src: int, dst: int, direction: str) -> list[_Slot]:
        if direction == "F":
            return self._forward[src, dst]
        return self._backward[dst, src]  # gradients go back along the activations' edge

    def _encode(self, src, dst, direction, key, values):
        batch, seq = self._micro_batch(key)
        for slot in self._slots(src, dst, direction):
            value = values.get(slot.value)
            wire = self.wire[dst]
            if slot.number is not None:
                tensor = torch.tensor(value, dtype=slot.dtype, device=wire)
            elif value is None:  # a gradient that is zero: send zeros, the receiver expects it
                tensor = torch.zeros(slot.shape(batch, seq), dtype=slot.dtype, device=wire)
            else:
                tensor = value.detach().to(wire, _wire_dtype(value, slot, src, dst))
                tensor = tensor.contiguous()
            yield tensor

    def _post_receive(self, src, dst, direction, key):
        """Allocate a message's buffers and post their receives: (slots, buffers, works)."""
        slots = self._slots(src, dst, direction)
        batch, seq = self._micro_batch(key)
        received, works = [], []
        for index, slot in enumerate(slots):
            buffer = torch.empty(slot.shape(batch, seq), dtype=slot.dtype,
                                 device=self.wire[src])
            received.append(buffer)
            works.append(dist.irecv(buffer, self.ranks[src], self._group(src, dst),
                                    _tag(direction, key, index)))
        return slots, received, works

    def _micro_batch(self, key: MicroBatchKey) -> tuple[int, int]:
        sizes, seq = self._dims[key.run]
        return sizes[key.mb], seq if seq is not None else 0

    def _wait(self, work: Any, what: str) -> None:
        if self._error is not None:
            raise PipelineAborted(f"stopped before waiting for {what}: {self._error}")
        self.watchdog.wait(work, what)


def _slot(edge: Edge) -> _Slot:
    info = edge.info
    if info.type_name in ("int", "float", "bool", "SymInt", "SymFloat", "SymBool"):
        number = {"int": int, "float": float, "bool": bool}.get(info.type_name.removeprefix("Sym")
                                                                .lower(), int)
        dtype = {int: torch.int64, float: torch.float64, bool: torch.bool}[number]
        return _Slot(edge.value, dtype, lambda b, s: (), number)
    if not info.is_tensor:
        raise FxpipeError(
            f"value {edge.value!r} ({info}) crosses from stage {edge.src} to stage {edge.dst}, "
            "but only tensors and numbers can travel between processes; move the cut so the "
            "stage that makes it also uses it (Plan(partitioner=[...]))."
        )
    tensor = info.tensors[0]
    return _Slot(edge.value, tensor.dtype, _shape_function(edge), None)


def _shape_function(edge: Edge) -> Callable[[int, int], tuple[int, ...]]:
    """(batch, seq) -> the value's shape: its symbolic shape evaluated, or the example's."""
    example = edge.info.tensors[0].shape
    if edge.shape is None:
        return lambda b, s: example
    b, s = sympy.Symbol("b", positive=True, integer=True), sympy.Symbol("s", positive=True,
                                                                          integer=True)
    dims = [sympy.lambdify((b, s), dim, "math") for dim in edge.shape]
    return lambda batch, seq: tuple(round(d(batch, seq)) for d in dims)


def _wire_dtype(value: torch.Tensor, slot: _Slot, src: int, dst: int) -> torch.dtype:
    """The slot's dtype, which `value` has (the compiler derived it under the plan's autocast)
    or widens to without loss (a value the derivation left in the trace's dtype): only a
    float into a wider float, since an integer in a float slot may round."""
    widens = (value.dtype.is_floating_point and slot.dtype.is_floating_point
              and torch.promote_types(value.dtype, slot.dtype) == slot.dtype)
    if value.dtype != slot.dtype and not widens:
        raise FxpipeError(
            f"value {slot.value!r} crossing from stage {src} to stage {dst} is "
            f"{value.dtype}, but the receiver expects {slot.dtype} (the dtype the compiler "
            "derived for it under the plan's autocast): the stage made it otherwise than "
            "compiled (a dtype that depends on the data?); cast it in the model, or use "
            "Plan(precision=None).")
    return slot.dtype


def _tag(direction: str, key: MicroBatchKey, index: int) -> int:
    """Distinct tags per message slot keep gloo from matching the wrong buffers."""
    return ((key.mb * 1024 + index) * 2 + (direction == "B")) % (2 ** 31 - 1)
