"""What the ranks of a pipeline agree on per step: micro-batch sizes, the loss, tied gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.batching import input_dims, split
from fxpipe.errors import FxpipeError
from fxpipe.ir import Event
from fxpipe.runtime.gradient_sync import GradientSync
from fxpipe.schedules import Action

__all__ = ["Coordinator", "DistCoordinator"]

_LOSS_TAG = 2 ** 31 - 3  # the loss from the last stage's rank
_TIED_TAG = 2 ** 31 - 4  # a tied weight's gradient from its other holder
_DIMS_TAG = 2 ** 31 - 5  # the micro-batch sizes from the first stage's rank


class Coordinator:
    """What the ranks of one pipeline agree on per step; in one process, where every stage is
    held, there is nothing to share (DistCoordinator shares it over torch.distributed)."""

    def shard(self, batch: Any, whole: Sequence[int] = ()) -> Any:
        """This pipeline group's share of a global mini-batch (inputs or target); inputs at
        positions in `whole` go to every group whole."""
        return batch

    def dims(self, sizes: list[int] | None, seq: int | None, total: int | None
             ) -> tuple[list[int], int | None, int]:
        """The micro-batch sizes, sequence length and global mini-batch size, from the rank
        that holds the inputs."""
        return sizes, seq, total

    def expect(self, batches: int) -> None:
        """At a step's start: get ready for what its end brings from other ranks, the loss of
        each of `batches` mini-batches and tied weights' gradients."""

    def loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The step's loss, from the rank that computed it, on every rank (one call per
        mini-batch expected)."""
        return loss

    def counted_in_all_groups(self, count: torch.Tensor) -> torch.Tensor:
        """On the last stage, the sum of `count` (a mini-batch's counted target entries) over
        the pipeline groups, which a token mean divides by; in one process, `count`."""
        return count

    def start_allreduce(self, stage: int) -> None:
        """Start `stage`'s gradient all-reduce over its data-parallel group (the schedule's
        ALLREDUCE action); in one process there is no such group."""

    def after_backward(self) -> None:
        """Gradient work once the backward of a mini-batch is complete (tied weights; after
        expect())."""

    def drain_events(self) -> list[Event]:
        """Timed work it did (all-reduces), in wall-clock seconds, since the last call."""
        return []

    def gather_events(self, runs: Sequence[tuple[list[Event], float]]) -> list[list[Event]]:
        """Every stage's events of each run in `runs` (this rank's events of it and the
        wall-clock time they count from), each run on a time axis of its own: under torchrun,
        where each rank holds its own events, seconds from the earliest start among the ranks
        (one collective for all the runs; every rank must pass as many); in one process, the
        run's own."""
        return [list(events) for events, _ in runs]

    def gather_job_events(self, events: list[Event], origin: float) -> dict[int, list[Event]]:
        """As gather_events for one run, for every pipeline group of the job (a collective
        over all ranks), keyed by group."""
        return {0: events}


class DistCoordinator(Coordinator):
    """What the ranks of one pipeline share per step: the micro-batch sizes (from the first
    stage's rank), the loss (from the last stage's), and the gradients of weights tied across
    stages (summed among the ranks that hold them, so the copies stay equal).

    A step ends with the first stage's backward, the other ranks long done and idle. Over
    gloo, what they send it then, the loss and tied gradients, goes point to point into
    receives posted when the step began (expect): it lands while the first stage computes, and
    the step ends without a collective that would wait for the idle ranks to wake (a send the
    receiver has not asked for yet also waits for that ask). NCCL keeps the collectives: it
    connects a pair on its first point-to-point call, which blocks until the peer makes one.
    Point-to-point waits end at the `watchdog`'s deadline (runtime/dist.py), so a stopped rank
    stops the others in a step's exchanges too.
    """

    def __init__(self, ranks: Sequence[int], micro_batches: int, device: str, group: Any = None,
                 tied: Sequence[tuple[torch.nn.Parameter, Any]] = (), *,
                 sync: GradientSync | None = None, data_parallel: Any = None,
                 group_index: int = 0, groups: int = 1, watchdog: Any = None) -> None:
        self.first, self.last = ranks[0], ranks[-1]  # of the first and the last stage
        self.ranks = list(dict.fromkeys(ranks))  # each once: a rank may run several stages
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
        self._wait = watchdog.wait if watchdog is not None else lambda work, what: work.wait()

    def shard(self, batch: Any, whole: Sequence[int] = ()) -> Any:
        """Pipeline group g takes the g-th of G near-equal row slices of the global batch."""
        if self.groups == 1 or batch is None:
            return batch
        total = input_dims(batch if isinstance(batch, list) else [batch], whole).batch
        if total < self.groups:
            raise FxpipeError(f"a mini-batch of {total} samples cannot feed {self.groups} "
                              "pipeline groups; use a larger batch or fewer groups.")
        return split(batch, self.groups, whole)[self.group_index] if isinstance(batch, list) \
            else split([batch], self.groups)[self.group_index][0]

    def dims(self, sizes, seq, total):
        data = torch.empty(self.micro_batches + 2, dtype=torch.int64, device=self.device)
        if sizes is not None:
            data.copy_(torch.tensor([*sizes, -1 if seq is None else seq, total]))
        if not self._point_to_point:
            self._wait(dist.broadcast(data, self.first, self.group, async_op=True),
                       f"the step's start on the first stage (rank {self.first})")
        elif sizes is not None:  # the first stage's rank
            for rank, work in [(rank, dist.isend(data, rank, self.group, _DIMS_TAG))
                               for rank in self.ranks[1:]]:
                self._wait(work, f"rank {rank} to start the step")
        else:
            self._wait(dist.irecv(data, self.first, self.group, _DIMS_TAG),
                       f"the step's start on the first stage (rank {self.first})")
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
            self._wait(work, f"the loss from the last stage (rank {self.last})")
            return data.cpu()
        data = torch.empty((), dtype=torch.float64, device=self.device)
        if loss is not None:
            data.copy_(loss.detach())
            if self.data_parallel is not None:  # the groups' weighted shares add up
                self._wait(dist.all_reduce(data, group=self.data_parallel, async_op=True),
                           "the other pipeline groups' losses (an all-reduce)")
        if self._point_to_point:  # the last stage's rank, into the receives expect posted
            for rank, work in [(rank, dist.isend(data, rank, self.group, _LOSS_TAG))
                               for rank in self.ranks if rank != self.last]:
                self._wait(work, f"the loss to reach rank {rank}")
        else:
            self._wait(dist.broadcast(data, self.last, self.group, async_op=True),
                       f"the loss from the last stage (rank {self.last})")
        return data.cpu()

    def counted_in_all_groups(self, count):
        if self.data_parallel is None:
            return count
        total = count.to(self.device)
        self._wait(dist.all_reduce(total, group=self.data_parallel, async_op=True),
                   "the other pipeline groups' counts of target entries (an all-reduce)")
        return total.to(count.device)

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

    def start_allreduce(self, stage: int) -> None:
        if self.sync is not None:  # this rank's stage
            self.sync.launch()

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
        sends = [(peer, dist.isend(tensor, peer, group, _TIED_TAG))
                 for tensor, (_, group), peer in zip(tensors, self.tied, self._peers)
                 if peer is not None]
        received = []
        for tensor, (_, group), posted, peer in zip(tensors, self.tied, self._gradients,
                                                    self._peers):
            if posted is None:
                self._wait(dist.all_reduce(tensor, group=group, async_op=True),
                           "a tied weight's gradients from its other holders (an all-reduce)")
            else:
                buffer, work = posted
                self._wait(work, f"a tied weight's gradient from rank {peer}")
                received.append((tensor, buffer))
        for peer, work in sends:
            self._wait(work, f"a tied weight's gradient to reach rank {peer}")
        for tensor, buffer in received:
            tensor += buffer
        self._gradients = []


def _other_holder(group: Any) -> int | None:
    """The other rank of a two-rank process group; None for a larger group."""
    ranks = dist.get_process_group_ranks(group)
    others = [rank for rank in ranks if rank != dist.get_rank()]
    return others[0] if len(ranks) == 2 and len(others) == 1 else None


def _posted(buffer: torch.Tensor, source: int, group: Any, tag: int
            ) -> tuple[torch.Tensor, Any]:
    """`buffer` and its receive from rank `source`, posted now."""
    return buffer, dist.irecv(buffer, source, group, tag)
