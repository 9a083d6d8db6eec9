"""DistTransport: stages in separate processes, over torch.distributed point-to-point messages.

Both ends know every message's layout ahead: the values of each (src, dst) edge in send/recv
table order, each tensor's dtype from the shape pass and its shape as an expression of the
micro-batch size (and sequence length) from the symbolic pass, evaluated per micro-batch, so
an uneven last micro-batch or a new batch size needs no extra handshake. Sends are posted
(isend) and completed at the end of a run; receives block. A rank that fails posts its error
to the job's store; when a peer's wait ends without its message (the failed process exited,
or the wait timed out) the peer reads that note and stops with the failed rank's error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import sympy
import torch
import torch.distributed as dist

from fxpipe.errors import FxpipeError
from fxpipe.ir import CommTable, Edge
from fxpipe.probes import ComputeBurst, swap_figures
from fxpipe.runtime.hooks import GradientSync
from fxpipe.runtime.microbatch import batch_size, split
from fxpipe.runtime.transport import PipelineAborted
from fxpipe.schedules import Action
from fxpipe.simulate import Event

__all__ = ["DistCoordinator", "DistTransport", "ErrorBoard", "Posting"]

T = TypeVar("T")
_ERROR_KEY = "fxpipe/error"
_AFTER_SEND_BURSTS = 3  # measure_posting's default compute: bursts per call
_ROUND_KINDS = ("forward", "backward", "wake")  # measure_posting's rounds, in turn
# seconds measure_posting aims to take at most, by its estimate: a stage whose computes are
# slow gets fewer rounds (its messages' per-tensor terms matter less beside them)
_POSTING_BUDGET = 1.0
# what a message of its rounds takes, in computes of the slowest, on average over the kinds of
# round (the receiver's busy stretches outlast the sender's computes; a wake round is shorter):
# VGG's 2 stages under torchrun, batch 64, ran 10 rounds of 5 messages in 1.6 s at about 4 ms
# a compute
_COMPUTES_PER_MESSAGE = 8
_READY_TAG = 2 ** 31 - 2  # the posting measurement's "receives posted" note, apart from _tag's
_LOSS_TAG = 2 ** 31 - 3  # the loss from the last stage's rank
_TIED_TAG = 2 ** 31 - 4  # a tied weight's gradient from its other holder
_LAGGING_BURSTS = 3  # how much longer the first stage's rank computes in a rehearsal
_RESUME_TAG = 2 ** 31 - 5  # the turn passed around the ranks measuring the resume penalty
_QUIET_TAG = 2 ** 31 - 6  # the first stage's rank's burst is done, in a quiet rehearsal


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
        if self.store is None:
            return None
        try:
            if self.store.check([_ERROR_KEY]):
                return self.store.get(_ERROR_KEY).decode()
        except RuntimeError:
            return None
        return None


class DistCoordinator:
    """What the ranks of one pipeline share per step: the micro-batch sizes (from the first
    stage's rank), the loss (from the last stage's), and the gradients of weights tied across
    stages (summed among the ranks that hold them, so the copies stay equal).

    A step ends with the first stage's backward, the other ranks long done and idle. Over
    gloo, what they send it then, the loss and tied gradients, goes point to point into
    receives posted when the step began (expect): it lands while the first stage computes, and
    the step ends without a collective that would wait for the idle ranks to wake (a send the
    receiver has not asked for yet also waits for that ask). NCCL keeps the collectives: it
    connects a pair on its first point-to-point call, which blocks until the peer makes one.
    """

    def __init__(self, ranks: Sequence[int], micro_batches: int, device: str, group: Any = None,
                 tied: Sequence[tuple[torch.nn.Parameter, Any]] = (), *,
                 sync: GradientSync | None = None, data_parallel: Any = None,
                 group_index: int = 0, groups: int = 1) -> None:
        self.ranks = list(ranks)
        self.first, self.last = ranks[0], ranks[-1]
        self.micro_batches = micro_batches
        self.group = group
        self.tied = list(tied)
        self.sync, self.data_parallel = sync, data_parallel
        self.group_index, self.groups = group_index, groups
        backend = dist.get_backend(group)
        self._point_to_point = backend != "nccl"
        # a weight held by two ranks swaps gradients with the other holder; by more, all-reduced
        self._peers = [_other_holder(group) if self._point_to_point else None
                       for _, group in self.tied]
        self._losses: list[tuple[torch.Tensor, Any]] = []  # receives posted by expect
        self._gradients: list[tuple[torch.Tensor, Any] | None] = []
        # the other holder's gradient, per swapped weight: made at the first step, as a
        # model built on the meta device has storage only after compile
        self._buffers: dict[int, torch.Tensor] = {}
        self.device = torch.device(device) if backend == "nccl" else torch.device("cpu")
        self._burst = ComputeBurst(device)

    def shard(self, batch: Any, whole: Sequence[int] = ()) -> Any:
        """Pipeline group g takes the g-th of G near-equal row slices of the global batch."""
        if self.groups == 1 or batch is None:
            return batch
        total = batch_size(batch if isinstance(batch, list) else [batch], whole)
        if total < self.groups:
            raise FxpipeError(f"a mini-batch of {total} samples cannot feed {self.groups} "
                              "pipeline groups; use a larger batch or fewer groups.")
        return split(batch, self.groups, whole)[self.group_index] if isinstance(batch, list) \
            else split([batch], self.groups)[self.group_index][0]

    def dims(self, sizes, seq, total):
        data = torch.empty(self.micro_batches + 2, dtype=torch.int64, device=self.device)
        if sizes is not None:
            data.copy_(torch.tensor([*sizes, -1 if seq is None else seq, total]))
        dist.broadcast(data, self.first, self.group)
        values = data.tolist()
        return values[:-2], None if values[-2] < 0 else values[-2], values[-1]

    def expect(self, batches: int) -> None:
        if self._losses or any(posted is not None for posted in self._gradients):
            raise FxpipeError("a step on this rank stopped part way and left messages "
                              "unreceived, which the next step would take for its own; "
                              "restart the job (every rank) to train on.")
        sent_here = self._point_to_point and dist.get_rank() != self.last
        self._losses = [_posted(torch.empty((), dtype=torch.float64, device=self.device),
                                self.last, self.group, _LOSS_TAG)
                        for _ in range(batches if sent_here else 0)]
        self._gradients = [None if peer is None else
                           _posted(self._buffer(index, param), peer, group, _TIED_TAG)
                           for index, ((param, group), peer)
                           in enumerate(zip(self.tied, self._peers))]

    def _buffer(self, index: int, param: torch.nn.Parameter) -> torch.Tensor:
        if index not in self._buffers:
            self._buffers[index] = torch.empty_like(param)
        return self._buffers[index]

    def loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        if loss is None and self._point_to_point:
            if not self._losses:
                raise RuntimeError("DistCoordinator.loss before expect(): no receive posted")
            data, work = self._losses.pop(0)
            work.wait()
            return data.cpu()
        data = torch.empty((), dtype=torch.float64, device=self.device)
        if loss is not None:
            data.copy_(loss.detach())
            if self.data_parallel is not None:  # the groups' weighted shares add up
                dist.all_reduce(data, group=self.data_parallel)
        if self._point_to_point:  # the last stage's rank, into the receives expect posted
            for work in [dist.isend(data, rank, self.group, _LOSS_TAG)
                         for rank in self.ranks if rank != self.last]:
                work.wait()
        else:
            dist.broadcast(data, self.last, self.group)
        return data.cpu()

    def gather_events(self, runs):
        return [by_group[self.group_index] for by_group in self._gathered(runs, self.group)]

    def gather_job_events(self, events, origin):
        return self._gathered([(events, origin)], None)[0]

    def _gathered(self, runs, group) -> list[dict[int, list[Event]]]:
        """Per run of `runs` (this rank's events, and the wall-clock time they count from),
        the events of the ranks of `group` (None: the job) by pipeline group, on one time axis
        from the earliest start among them; one collective for all the runs."""
        mine = [[(self.group_index, e.stage, str(e.action), origin + e.start, origin + e.end)
                 for e in events] for events, origin in runs]
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        if len({len(share) for share in everyone}) > 1:  # every rank sees it, and raises
            counts = ", ".join(f"rank {r}: {len(share)}" for r, share in enumerate(everyone))
            raise FxpipeError(f"the ranks gathered the traces of different numbers of runs "
                              f"({counts}); every rank must pass the same runs")
        gathered = []
        for run in range(len(runs)):
            flat = [item for share in everyone for item in share[run]]
            start = min((item[3] for item in flat), default=0.0)
            by_group: dict[int, list[Event]] = {self.group_index: []}
            for g, stage, action, a, b in flat:
                by_group.setdefault(g, []).append(Event(stage, Action.parse(action), a - start,
                                                        b - start))
            gathered.append({g: sorted(evs, key=lambda e: (e.stage, e.start))
                             for g, evs in by_group.items()})
        return gathered

    def drain_events(self):
        if self.sync is None:
            return []
        events, self.sync.events = self.sync.events, []
        return events

    def rehearsal_burst(self, quiet: bool = False) -> float:
        me = dist.get_rank()
        bursts = 1 + (_LAGGING_BURSTS if me == self.first else 0)
        seconds = sum(self._burst() for _ in range(bursts))
        if quiet:  # the other ranks go on to send their part once the first's burst is done
            token = torch.zeros(1, device=self.device)
            if me == self.first:
                for rank in self.ranks:
                    if rank != me:
                        dist.send(token, rank, self.group, _QUIET_TAG)
            else:
                dist.recv(token, self.first, self.group, _QUIET_TAG)
        return seconds

    def rehearse(self) -> None:
        self._sum_tied([torch.zeros_like(param) for param, _ in self.tied])

    def from_first_stage(self, seconds: float) -> float:
        data = torch.tensor(seconds, dtype=torch.float64, device=self.device)
        dist.broadcast(data, self.first, self.group)
        return data.item()

    def barrier(self) -> None:
        dist.barrier(self.group)

    def resume_penalty(self, compute: Callable[[], float], rounds: int = 3,
                       repeats: int = 10, budget: float = 0.1) -> list[float]:
        """Back to back, every rank computes at once, as every rank times the units at compile;
        resumed, the ranks take turns around the pipeline's ring, each woken from a receive
        that the rank before it sends once it has computed. Rounds alternate the two; each
        rank's figure is the difference of its medians (never below 0). Each round computes
        `repeats` times each way, fewer (at least 3) where the slowest stage's compute would
        take longer than `budget` seconds, as measure_link repeats this for each prediction."""
        me = self.ranks.index(dist.get_rank())
        after, before = self.ranks[(me + 1) % len(self.ranks)], self.ranks[me - 1]
        token = torch.zeros(1, device=self.device)
        seconds: list[Any] = [None] * len(self.ranks)
        # the first run after the last step allocates; the slowest sets every rank's repeats
        dist.all_gather_object(seconds, compute(), group=self.group)
        repeats = max(3, min(repeats, int(budget / max(max(seconds), 1e-9))))
        back_to_back, resumed = [], []
        for _ in range(rounds):
            dist.barrier(self.group)
            back_to_back += [compute() for _ in range(repeats)]
            dist.barrier(self.group)
            for _ in range(repeats):
                if me == 0:  # starts the turn and waits for it to come round
                    dist.send(token, after, self.group, _RESUME_TAG)
                dist.recv(token, before, self.group, _RESUME_TAG)
                resumed.append(compute())
                if me != 0:
                    dist.send(token, after, self.group, _RESUME_TAG)
        return self.per_stage({me: max(statistics.median(resumed)
                                       - statistics.median(back_to_back), 0.0)})

    def per_stage(self, figures: Mapping[int, T]) -> list[T]:
        everyone: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(everyone, dict(figures), group=self.group)
        return [figure for _, figure in sorted(f for share in everyone for f in share.items())]

    def after_backward(self) -> None:
        if self.sync is not None:
            self.sync.finish()
        for param, _ in self.tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        self._sum_tied([param.grad for param, _ in self.tied])

    def _sum_tied(self, tensors: Sequence[torch.Tensor]) -> None:
        """Add the other holders' `tensors` (one per tied weight, as self.tied) into them: two
        holders swap theirs into the receives expect() posted (a + b == b + a in floating
        point, so the copies stay equal), more all-reduce. Every send is posted before any
        wait, so a swap never waits on a peer blocked in another weight's all-reduce; a sent
        tensor changes only once its send is done (the peer's receive was posted already)."""
        if len(self._gradients) != len(self.tied):
            raise RuntimeError("DistCoordinator: tied gradients summed before expect()")
        sends = [dist.isend(tensor, peer, group, _TIED_TAG)
                 for tensor, (_, group), peer in zip(tensors, self.tied, self._peers)
                 if peer is not None]
        received = []
        for tensor, (_, group), posted in zip(tensors, self.tied, self._gradients):
            if posted is None:
                dist.all_reduce(tensor, group=group)
            else:
                buffer, work = posted
                work.wait()
                received.append((tensor, buffer))
        for work in sends:
            work.wait()
        for tensor, buffer in received:
            tensor += buffer
        self._gradients = []


@dataclasses.dataclass(frozen=True)
class Posting:
    """A transport's own seconds per tensor around a message (DistTransport.measure_posting)."""

    send: float  # the sender's, in send() right after a forward
    send_back: float  # the same right after a backward, as gradients are sent
    receive: float  # the receiver's, to post a receive back to back with others
    receive_between: float  # the same between two computes
    after_send: float  # how much longer the sender's compute right after send() runs
    after_wake: float  # the same where it wakes a blocked receiver, which posts its next receive
    after_post: float  # how much longer the receiver's compute after posting a receive runs
    after_receive: float  # how much longer the receiver's compute runs while a message lands


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One value of a message: how to allocate, encode and decode it."""

    value: str
    dtype: torch.dtype
    shape: Callable[[int, int], tuple[int, ...]]  # (batch, seq) -> shape
    number: type | None  # int / float / bool values travel as 0-d tensors


class DistTransport:
    """Moves values between this rank's stage and the stages of other ranks."""

    def __init__(self, comm: CommTable, ranks: Sequence[int], device: str, *,
                 group: Any = None, links: Mapping[tuple[int, int], Any] | None = None,
                 timeout: float = 300.0, rank: int = 0) -> None:
        self.ranks = list(ranks)  # rank of each stage in this pipeline
        self.device = torch.device(device)
        self.group = group
        self.links = dict(links or {})  # (sending stage, receiving stage) -> its own group
        self.timeout = timeout
        self.rank = rank
        self.board = ErrorBoard()
        self._forward = {pair: [_slot(e) for e in edges] for pair, edges in _by_pair(comm)}
        carries = comm.carries_grad()
        self._backward = {pair: [s for s in slots if s.number is None and s.dtype.is_floating_point
                                 and carries[s.value]]
                          for pair, slots in self._forward.items()}
        self._dims: dict[Any, tuple[list[int], int | None]] = {}
        self._pending: list[Any] = []
        self._posted: dict[Any, tuple[list[_Slot], list[torch.Tensor], list[Any]]] = {}
        self._error: BaseException | None = None

    def prepare(self, key: Any, sizes: Sequence[int], seq: int | None) -> None:
        """The micro-batch sizes (and sequence length) of run `key`, known to every rank."""
        self._dims[key] = (list(sizes), seq)

    def send(self, src: int, dst: int, direction: str, mb: Any,
             values: Mapping[str, Any]) -> None:
        for index, tensor in enumerate(self._encode(src, dst, direction, mb, values)):
            tag = _tag(direction, mb, index)
            self._pending.append(dist.isend(tensor, self.ranks[dst], self._group(src, dst), tag))

    def prefetch(self, src: int, dst: int, direction: str, mb: Any) -> None:
        """Post the receive of a message the stage will wait for later, so the transfer
        overlaps the compute before it (the driver calls this for the next RECV action)."""
        key = (src, dst, direction, mb)
        if key not in self._posted:
            self._posted[key] = self._post_receive(src, dst, direction, mb)

    def recv(self, src: int, dst: int, direction: str, mb: Any) -> dict[str, Any]:
        self.prefetch(src, dst, direction, mb)
        slots, received, works = self._posted.pop((src, dst, direction, mb))
        for work in works:
            self._wait(work, f"{direction} micro-batch {mb[1]} from stage {src}")
        return {slot.value: buffer.item() if slot.number else buffer
                for slot, buffer in zip(slots, received)}

    def abort(self, error: BaseException) -> None:
        if self._error is None and not isinstance(error, PipelineAborted):
            self.board.post(f"rank {self.rank} failed: {type(error).__name__}: {error}")
        self._error = error
        self._pending.clear()  # a failed run's sends and receives are never waited for
        self._posted.clear()

    def reset(self) -> None:
        self._error = None

    def flush(self) -> None:
        """Complete every posted send (their buffers may then be reused)."""
        pending, self._pending = self._pending, []
        for work in pending:
            self._wait(work, "a send")

    def measure_posting(self, key: Any, forward: Callable[[], float] | None = None,
                        backward: Callable[[], float] | None = None, rounds: int = 9,
                        per_round: int = 5) -> Posting | None:
        """Seconds this transport spends per tensor around a message, measured on the first
        stage pair's forward message of run `key` (prepared): its own time in send() and in
        posting a receive, and how much slower the compute beside its work runs. The raw isend
        call that the link's ping-pong times misses all of it.

        `forward` and `backward` compute as the stage does and return their seconds (the
        stage's own, best: the send path runs slower right after compute, the more so the
        longer it was; default: bursts of about a small stage's forward and backward, for
        both). Of the `rounds`, as many as the computes' pace lets fit in _POSTING_BUDGET
        seconds by its estimate, whole cycles of the kinds and one at least, are run
        (`_rounds_within`). The rounds come in three kinds, in turn, the first round untimed:

        - forward: the receiver posts its `per_round` receives back to back, as a
          forwards-first stage does at the start, and tells the sender on the same connection,
          behind their notices, so that send() writes the whole message itself, as in a
          pipeline (over gloo a send the peer has not asked for yet only posts a notice). The
          sender runs `forward` twice before each send and once after it: `send` is send()'s
          time, `after_send` how much longer the forward right after it runs than the one
          right before (never below 0; the transport's work on the message goes on beside it).
        - backward: the same with `backward` before each send, as gradients are sent
          (`send_back`); the receiver runs `forward` before and after posting each receive, as
          a 1F1B stage posts its next receive between two computes (`receive_between`, several
          times the back-to-back posting, `receive`), and `after_post` is how much longer the
          forward after the posting runs.
        - wake: the receiver waits for each message, blocked, and once woken posts the receive
          of the next, as a stage that posts between computes does (the runtime posts a
          receive before the compute ahead of it); `after_wake` is how much longer the
          sender's forward after a send runs than before it: the notice of that posting
          lands beside it.

        In the forward and backward rounds the receiver computes while the messages land, as
        long as the sender's computes and sends take (the peers swap their compute times
        first), and in a quiet stretch before, while the sender computes as it will but sends
        nothing: the difference per message is `after_receive` (never below 0), the
        transport's work to take a message in on the receiver's CPU. The two peers return the
        same figures; other ranks None."""
        if rounds < len(_ROUND_KINDS):
            raise ValueError(f"measure_posting needs a round of each kind, {_ROUND_KINDS}: "
                             f"rounds={rounds}")
        sender, receiver = self.ranks[0], self.ranks[1]
        if self.rank not in (sender, receiver) or (0, 1) not in self._forward:
            return None
        if forward is None:
            burst = ComputeBurst(self.device, size=64, depth=8, backward=True)  # like a stage

            def forward() -> float:
                return sum(burst() for _ in range(_AFTER_SEND_BURSTS))

        backward = backward or forward
        first, peer = self.rank == sender, receiver if self.rank == sender else sender

        def swap(mine: list[float]) -> list[float]:
            return swap_figures(mine, peer, first, self._group(0, 1), self._group(1, 0),
                                self.device)

        # how long the computes take, for the receiver to compute as long as the sender sends
        # (each message lands while it computes): the sender's forward and backward, the
        # receiver's forward
        computes = [statistics.median(f() for _ in range(3))
                    for f in ((forward, backward) if first else (forward,))]
        computes += [0.0] * (2 - len(computes))
        theirs = swap(computes)
        paced = _paced_by(first, computes, theirs)  # the same on both peers
        rounds = _rounds_within(rounds, per_round, paced)
        count = len(self._dims[key][0])
        rounds_of = [[(key, i % count) for i in range(per_round)] for _ in range(rounds + 1)]
        if first:  # each side measures its part; the other's figures are 0 here
            mine = self._time_sending(rounds_of, receiver, forward, backward)
        else:
            mine = self._time_receiving(rounds_of, sender, forward, computes[0], theirs)
        theirs = swap(mine)
        tensors = max(len(self._slots(0, 1, "F")), 1)
        return Posting(*((a + b) / tensors for a, b in zip(mine, theirs)))

    def _time_sending(self, rounds_of: list[list[Any]], receiver: int,
                      forward: Callable[[], float], backward: Callable[[], float]
                      ) -> list[float]:
        """The sender's half of measure_posting, in Posting's order (the receiver's figures
        0)."""
        slots = self._slots(0, 1, "F")

        def values(mb):  # what the stage would send: tensors of the micro-batch's shapes
            batch, seq = self._micro_batch(mb)
            return {s.value: 0 if s.number is not None else
                    torch.zeros(s.shape(batch, seq), dtype=s.dtype, device=self.device)
                    for s in slots}

        ready = torch.zeros(1, device=self.device)
        sending: dict[str, list[float]] = {kind: [] for kind in _ROUND_KINDS}
        before: dict[str, list[float]] = {kind: [] for kind in _ROUND_KINDS}
        after: dict[str, list[float]] = {kind: [] for kind in _ROUND_KINDS}
        for index, mbs in enumerate(rounds_of):
            kind = _ROUND_KINDS[index % len(_ROUND_KINDS)]
            compute = backward if kind == "backward" else forward
            dist.recv(ready, receiver, self._group(0, 1), _READY_TAG)
            if kind != "wake":  # a quiet stretch: the same computes without the sends
                for _ in mbs:
                    compute()
                    compute()
            dist.recv(ready, receiver, self._group(0, 1), _READY_TAG)
            for mb in mbs:
                message = values(mb)
                compute()  # the last send's work done before the next is timed
                computed = compute()  # a pipeline sends right after computing
                start = time.perf_counter()
                self.send(0, 1, "F", mb, message)
                sent = time.perf_counter() - start
                slowed = compute()
                if index > 0:
                    sending[kind].append(sent)
                    before[kind].append(computed)
                    after[kind].append(slowed)
            self.flush()

        def slower(kind: str) -> float:
            return max(statistics.median(after[kind]) - statistics.median(before[kind]), 0.0)

        return [statistics.median(sending["forward"]), statistics.median(sending["backward"]),
                0.0, 0.0, slower("forward"), slower("wake"), 0.0, 0.0]

    def _time_receiving(self, rounds_of: list[list[Any]], sender: int,
                        compute: Callable[[], float], own: float, senders: list[float]
                        ) -> list[float]:
        """The receiver's half of measure_posting, in Posting's order (the sender's figures
        0). `own`: the seconds of `compute`; `senders`: those of the sender's forward and
        backward."""
        ready = torch.zeros(1, device=self.device)
        alone, between, before, after, slower = [], [], [], [], []
        own = max(own, 1e-9)
        per_round = len(rounds_of[0])

        def busy(kind: str) -> float:  # as a stage is while messages come: as long as the
            # sender's 3 computes and a send per message, or longer (a send taking at most
            # one compute's time), with a margin
            sending = per_round * 4 * senders[1 if kind == "backward" else 0]
            return sum(compute() for _ in range(math.ceil(1.25 * sending / own)))

        for index, mbs in enumerate(rounds_of):
            kind, timed = _ROUND_KINDS[index % len(_ROUND_KINDS)], index > 0
            dist.send(ready, sender, self._group(0, 1), _READY_TAG)
            if kind == "wake":  # blocked in each wait, posting the next receive once woken
                dist.send(ready, sender, self._group(0, 1), _READY_TAG)
                for mb in mbs:
                    for work in self._post_receive(0, 1, "F", mb)[2]:
                        self._wait(work, "a measured message")
                continue
            quiet = busy(kind)
            posted = []
            for mb in mbs:
                if kind == "backward":
                    compute()  # the last posting's work done before the next is timed
                    computed = compute()
                start = time.perf_counter()
                posted.append(self._post_receive(0, 1, "F", mb))
                took = time.perf_counter() - start
                if kind == "backward":
                    slowed = compute()
                if timed and kind == "backward":
                    between.append(took)
                    before.append(computed)
                    after.append(slowed)
                elif timed:
                    alone.append(took)
            dist.send(ready, sender, self._group(0, 1), _READY_TAG)
            landing = busy(kind)
            if timed:  # the same computes with the messages landing, per message
                slower.append((landing - quiet) / per_round)
            for _, _, works in posted:
                for work in works:
                    self._wait(work, "a measured message")
        posting = max(statistics.median(after) - statistics.median(before), 0.0)
        return [0.0, 0.0, statistics.median(alone), statistics.median(between), 0.0, 0.0,
                posting, max(statistics.median(slower), 0.0)]

    # --- internals ----------------------------------------------------------------------------

    def _group(self, src: int, dst: int) -> Any:
        return self.links.get((src, dst), self.group)

    def _slots(self, src: int, dst: int, direction: str) -> list[_Slot]:
        if direction == "F":
            return self._forward[src, dst]
        return self._backward[dst, src]  # gradients go back along the activations' edge

    def _encode(self, src, dst, direction, mb, values):
        batch, seq = self._micro_batch(mb)
        for slot in self._slots(src, dst, direction):
            value = values.get(slot.value)
            if slot.number is not None:
                tensor = torch.tensor(value, dtype=slot.dtype)
            elif value is None:  # a gradient that is zero: send zeros, the receiver expects it
                tensor = torch.zeros(slot.shape(batch, seq), dtype=slot.dtype, device=self.device)
            else:
                tensor = value.detach().contiguous()
            yield tensor

    def _post_receive(self, src, dst, direction, mb):
        """Allocate a message's buffers and post their receives: (slots, buffers, works)."""
        slots = self._slots(src, dst, direction)
        batch, seq = self._micro_batch(mb)
        received, works = [], []
        for index, slot in enumerate(slots):
            buffer = torch.empty(slot.shape(batch, seq), dtype=slot.dtype, device=self.device)
            received.append(buffer)
            works.append(dist.irecv(buffer, self.ranks[src], self._group(src, dst),
                                    _tag(direction, mb, index)))
        return slots, received, works

    def _micro_batch(self, mb: Any) -> tuple[int, int]:
        key, index = mb
        sizes, seq = self._dims[key]
        return sizes[index], seq if seq is not None else 0

    def _wait(self, work: Any, what: str) -> None:
        """Block until `work` completes. A peer that failed has posted its error and closed its
        connections, which ends the wait; report that rank's error rather than our own."""
        if self._error is not None:
            raise PipelineAborted(f"stopped before waiting for {what}: {self._error}")
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as error:  # gloo/NCCL report a lost peer or a timeout this way
            failure = self.board.read()
            if failure is not None:
                raise PipelineAborted(f"the pipeline stopped because {failure}") from error
            raise FxpipeError(f"rank {self.rank} gave up waiting for {what} after at most "
                              f"{self.timeout:.0f} s: {error}") from error


def _other_holder(group: Any) -> int | None:
    """The other rank of a two-rank process group; None for a larger group."""
    ranks = dist.get_process_group_ranks(group)
    others = [rank for rank in ranks if rank != dist.get_rank()]
    return others[0] if len(ranks) == 2 and len(others) == 1 else None


def _posted(buffer: torch.Tensor, source: int, group: Any, tag: int
            ) -> tuple[torch.Tensor, Any]:
    """`buffer` and its receive from rank `source`, posted now."""
    return buffer, dist.irecv(buffer, source, group, tag)


def _by_pair(comm: CommTable):
    pairs: dict[tuple[int, int], list[Edge]] = {}
    for edge in comm.edges:
        pairs.setdefault((edge.src, edge.dst), []).append(edge)
    return pairs.items()


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


def _tag(direction: str, mb: Any, index: int) -> int:
    """Distinct tags per message slot keep gloo from matching the wrong buffers."""
    _, micro_batch = mb
    return ((micro_batch * 1024 + index) * 2 + (direction == "B")) % (2 ** 31 - 1)


def _paced_by(first: bool, mine: Sequence[float], theirs: Sequence[float]) -> list[float]:
    """The compute times measure_posting paces its rounds by, from one peer's own figures and
    the other's (swapped exactly, as float64): the sender's forward and backward, then the
    receiver's forward, the same list on both peers, so both run as many rounds."""
    senders, receivers = (mine, theirs) if first else (theirs, mine)
    return [senders[0], senders[1], receivers[0]]


def _rounds_within(rounds: int, per_round: int, computes: Sequence[float]) -> int:
    """How many of measure_posting's `rounds` (of `per_round` messages each, and one untimed
    round before them) fit in _POSTING_BUDGET seconds at _COMPUTES_PER_MESSAGE of the slowest
    of `computes` a message: whole cycles of the kinds of round, one at least."""
    per_message = _COMPUTES_PER_MESSAGE * max(computes, default=0.0)
    kinds = len(_ROUND_KINDS)
    if not per_message > 0 or (rounds + 1) * per_round * per_message <= _POSTING_BUDGET:
        return rounds
    # the quotient is below rounds + 1 here, so finite
    fitting = int(_POSTING_BUDGET / (per_round * per_message)) - 1
    return max(kinds, fitting - fitting % kinds)
