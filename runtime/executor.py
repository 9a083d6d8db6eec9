"""PipelineExecutor: runs a compiled pipeline, as a drop-in module and as a whole schedule.

`forward` splits the mini-batch into micro-batches and runs the schedule's forward actions; in
training it returns outputs connected to autograd through one function whose backward runs the
schedule's backward actions on the same stage workers. `step` runs the whole schedule, forward
and backward interleaved as the schedule says (1F1B needs this), with the loss on the last stage.
Both drive the same StageRunners through the same Driver. In one process the executor holds
every stage; under torch.distributed it holds this rank's, and a Coordinator shares what only
one rank knows (the micro-batch sizes, the loss).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from fxpipe.batching import input_dims
from fxpipe.errors import FxpipeError
from fxpipe.ir import CommTable, Stage, StageHook
from fxpipe.runtime.consistency import make_policy
from fxpipe.runtime.driver import Driver, Run
from fxpipe.runtime.microbatch import merge, split
from fxpipe.runtime.stage import StageRunner
from fxpipe.runtime.transport import LocalTransport, Transport
from fxpipe.schedules import (
    Action,
    ActionKind,
    Schedule,
    add_communication,
    build,
    check_communication,
)
from fxpipe.simulate import Event

__all__ = ["Coordinator", "LocalCoordinator", "PipelineExecutor", "lowered_schedule"]

K = ActionKind
_FORWARD = (K.RECV_F, K.F, K.SEND_F)
_BACKWARD = (K.RECV_B, K.B, K.SEND_B)


class Coordinator(Protocol):
    """What the ranks of one pipeline agree on per step (trivial in one process)."""

    def shard(self, batch: Any) -> Any:
        """This pipeline group's share of a global mini-batch (inputs or target)."""

    def dims(self, sizes: list[int] | None, seq: int | None, total: int | None
             ) -> tuple[list[int], int | None, int]:
        """The micro-batch sizes, sequence length and global mini-batch size, from the rank
        that holds the inputs."""

    def loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The step's loss, from the rank that computed it, on every rank."""

    def after_backward(self) -> None:
        """Gradient work once the backward of a mini-batch is complete (tied weights)."""

    def drain_events(self) -> list[Event]:
        """Timed work it did (all-reduces), in wall-clock seconds, since the last call."""

    def gather_events(self, events: list[Event], origin: float) -> list[Event]:
        """Every stage's events of the last run (each rank's own under torchrun: a collective)
        on one time axis, seconds from the earliest start."""


class LocalCoordinator:
    """Every stage in this process: nothing to share."""

    def shard(self, batch):
        return batch

    def dims(self, sizes, seq, total):
        return sizes, seq, total

    def loss(self, loss):
        return loss

    def after_backward(self) -> None:
        return None

    def drain_events(self) -> list[Event]:
        return []

    def gather_events(self, events, origin):
        return events


class PipelineExecutor:
    """Runs the stages this process holds: all of them on worker threads, or one rank's."""

    def __init__(
        self,
        runners: dict[int, StageRunner],
        comm: CommTable,
        transport: Transport,
        outputs: Any,
        schedule: str,
        micro_batches: int,
        unflatten: Callable[[Any], Any] = lambda out: out,
        threads: int | None = None,
        coordinator: Coordinator | None = None,
    ) -> None:
        self.runners = runners
        self.comm = comm
        self.transport = transport
        self.output_names, self.output_spec = pytree.tree_flatten(outputs)
        self.unflatten = unflatten
        self.micro_batches = micro_batches
        self.schedule = lowered_schedule(schedule, len(comm.stages), micro_batches, comm)
        self.driver = Driver(self.runners, comm, transport, threads)
        self.coordinator = coordinator or LocalCoordinator()
        self.first, self.last = 0 in runners, len(comm.stages) - 1 in runners
        self.everything_here = len(runners) == len(comm.stages)
        self._calls = itertools.count()
        self._trace: list[Event] = []
        self.trace_origin = 0.0
        self.last_schedule: Schedule | None = None  # what the last run executed

    @classmethod
    def local(cls, stages: Sequence[Stage], hooks: Sequence[StageHook], comm: CommTable,
              devices: Sequence[str], outputs: Any, schedule: str, micro_batches: int,
              unflatten: Callable[[Any], Any] = lambda out: out, timeout: float = 300.0,
              threads: int | None = None) -> PipelineExecutor:
        """Every stage in this process, one worker thread each."""
        needs_grad = _needs_grad(comm)
        runners = {io.stage: StageRunner(stage, hook, io, device, needs_grad)
                   for stage, hook, io, device in zip(stages, hooks, comm.stages, devices)}
        return cls(runners, comm, LocalTransport(list(devices), timeout), outputs, schedule,
                   micro_batches, unflatten, threads)

    def forward(self, flat_inputs: Sequence[Any] | None) -> Any:
        """The model's output for a mini-batch, run micro-batch by micro-batch through the stages;
        connected to autograd when gradients are enabled."""
        if not self.everything_here:
            return self._forward_only_distributed(flat_inputs)
        chunks = split(flat_inputs, self.micro_batches)
        call = _Call(next(self._calls), chunks, self.comm.graph_inputs)
        if not torch.is_grad_enabled():
            run = self._run(_FORWARD, Run(call.feeds, grad_enabled=False), call)
            return self._merged_outputs(run, call.sizes)
        call.wanted = _inputs_wanting_grad(flat_inputs)
        phony = torch.empty(0, requires_grad=True)  # makes autograd call our backward
        results = _Pipelined.apply(self, call, phony, *(flat_inputs[i] for i in call.wanted))
        tensors = iter(results)
        merged = [next(tensors) if isinstance(x, torch.Tensor) else x for x in call.merged]
        return self.unflatten(pytree.tree_unflatten(merged, self.output_spec))

    def step(self, flat_inputs: Sequence[Any] | None, target: Any,
             loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Run the whole schedule on one mini-batch and return its mean loss (detached), on
        every rank. The first stage reads the inputs, the last stage the target.

        Each micro-batch's loss (loss_fn averages over its samples, as PyTorch's losses do)
        counts with its share of the mini-batch, so the result and the parameters' gradients
        are those of loss_fn on the whole mini-batch. The optimizer step is the caller's.
        """
        if self.schedule.name == "async-1f1b":
            raise FxpipeError(
                "schedule='async-1f1b' overlaps mini-batches and steps each stage itself: "
                "call pipe.attach_optimizer(factory) once, then losses = "
                "pipe.step_many([(x1, y1), (x2, y2), ...])."
            )
        return self._train([(flat_inputs, target)], loss_fn, self.schedule)[0]

    def step_many(self, batches: Sequence[tuple[Sequence[Any] | None, Any]],
                  loss_fn: Callable[[Any, Any], torch.Tensor]) -> list[torch.Tensor]:
        """Train on several mini-batches, stepping every stage's attached optimizer after each:
        asynchronously (no flush between them) under async-1f1b, else one flushed schedule per
        mini-batch. Returns each mini-batch's mean loss."""
        missing = [s for s, runner in self.runners.items() if runner.policy is None
                   or runner.policy.optimizer is None]
        if missing:
            raise FxpipeError(f"stages {missing} have no optimizer: call "
                              "pipe.attach_optimizer(lambda params: torch.optim.SGD(params, "
                              "lr=0.1)) before pipe.step_many(...).")
        if self.schedule.name == "async-1f1b":
            schedule = lowered_schedule("async-1f1b", len(self.comm.stages),
                                        self.micro_batches, self.comm, len(batches))
            return self._train(batches, loss_fn, schedule)
        losses = []
        for batch in batches:
            losses += self._train([batch], loss_fn, self.schedule)
            for runner in self.runners.values():
                runner.step()
        return losses

    def attach_optimizer(self, factory: Callable[[list[torch.nn.Parameter]], Any],
                         consistency: str = "none", predictor: Any = None) -> None:
        """Give every stage held here its own optimizer over its parameters (and, for
        async-1f1b, its weight consistency policy)."""
        for index, runner in self.runners.items():
            weights = dict(runner.stage.module.named_parameters())
            runner.policy = make_policy(consistency, weights, index, len(self.comm.stages),
                                        predictor)
            runner.policy.optimizer = factory(list(weights.values()))

    def _train(self, batches, loss_fn, schedule: Schedule) -> list[torch.Tensor]:
        """One run of `schedule` over `batches` (micro-batch m of mini-batch i is i * p + m)."""
        p = self.micro_batches
        calls = [self._call(flat) for flat, _ in batches]
        call = _Call.joined(next(self._calls), calls)
        targets = (self._targets([self.coordinator.shard(t) for _, t in batches], calls)
                   if self.last else [])

        def loss(mb: int, outputs: dict[str, Any]) -> torch.Tensor:
            value = loss_fn(self._output(outputs), targets[mb])
            if not isinstance(value, torch.Tensor) or value.dim() != 0:
                raise FxpipeError("Plan(loss_fn=...) must return a scalar tensor (the mean "
                                  f"loss of a micro-batch), got {type(value).__name__}.")
            return value * (call.sizes[mb] / calls[mb // p].total)

        def on_action(action: Action) -> None:
            if action.kind is K.STEP:
                self.runners[action.stage].step()

        run = self._run(None, Run(call.feeds, loss=loss, on_action=on_action), call,
                        schedule=schedule)
        self.coordinator.after_backward()
        self._trace += [Event(e.stage, e.action, e.start - run.started, e.end - run.started)
                        for e in self.coordinator.drain_events()]
        losses = []
        for i in range(len(batches)):
            mine = (torch.stack([run.losses[i * p + m] for m in range(p)]).sum()
                    if self.last else None)
            losses.append(self.coordinator.loss(mine))
        return losses

    def _targets(self, targets: Sequence[Any], calls: Sequence[_Call]) -> list[Any]:
        pieces = []
        for target, call in zip(targets, calls):
            if target is None:
                raise FxpipeError("the last stage computes the loss and needs the target: "
                                  "pass it to pipe.step(x, target) on every rank.")
            chunks = [chunk[0] for chunk in split([target], self.micro_batches)]
            if [_rows(t) for t in chunks] != call.sizes:
                raise FxpipeError(f"the target has {_rows([target])} rows but the inputs "
                                  f"{sum(call.sizes)}; give one target row per sample.")
            pieces += chunks
        return pieces

    def last_trace(self) -> list[Event]:
        """Every action of the last forward/backward or step this process ran, timed (seconds
        from its start)."""
        return list(self._trace)

    def full_trace(self) -> list[Event]:
        """The last run's actions of every stage of this pipeline (under torchrun every rank of
        the pipeline must call it: the ranks exchange their traces)."""
        return self.coordinator.gather_events(list(self._trace), self.trace_origin)

    def in_flight(self) -> list[int]:
        return [runner.in_flight for runner in self.runners.values()]

    # --- internals ----------------------------------------------------------------------------

    def _call(self, flat_inputs: Sequence[Any] | None) -> _Call:
        """Split the inputs (on the first stage) and agree on the micro-batch sizes."""
        if self.first:
            if flat_inputs is None:
                raise FxpipeError("the first stage reads the inputs: pass them to "
                                  "pipe.step(x, target) on every rank.")
            total = _rows(list(flat_inputs))
            flat_inputs = self.coordinator.shard(list(flat_inputs))
            chunks = split(flat_inputs, self.micro_batches)
            sizes, seq = [_rows(c) for c in chunks], _seq_len(flat_inputs)
        else:
            chunks = [[] for _ in range(self.micro_batches)]
            sizes, seq, total = None, None, None
        sizes, seq, total = self.coordinator.dims(sizes, seq, total)
        call = _Call(next(self._calls), chunks, self.comm.graph_inputs, sizes)
        call.seq, call.total = seq, total
        return call

    def _forward_only_distributed(self, flat_inputs):
        if torch.is_grad_enabled():
            raise FxpipeError(
                "under torch.distributed, train with loss = pipe.step(x, target) (every rank "
                "calls it); pipe(x) runs inference only: wrap it in torch.no_grad()."
            )
        call = self._call(flat_inputs)
        run = self._run(_FORWARD, Run(call.feeds, grad_enabled=False), call)
        return self._merged_outputs(run, call.sizes) if self.last else None

    def _run(self, kinds, run: Run, call: _Call, append: bool = False,
             schedule: Schedule | None = None) -> Run:
        self.last_schedule = schedule or self.schedule
        programs = [[a for a in stage if kinds is None or a.kind in kinds]
                    for stage in self.last_schedule.actions]
        offset = max((e.end for e in self._trace), default=0.0) if append else 0.0
        self.transport.prepare(call.key, call.sizes, call.seq)
        self.driver.run(programs, run, call.key)
        self.trace_origin = run.started - offset  # wall-clock time of the trace's zero
        events = [Event(e.stage, e.action, e.start + offset, e.end + offset) for e in run.events]
        self._trace = (self._trace + events) if append else events
        return run

    def _output(self, values: dict[str, Any]) -> Any:
        flat = [values[name] for name in self.output_names]
        return self.unflatten(pytree.tree_unflatten(flat, self.output_spec))

    def _merged_outputs(self, run: Run, sizes: list[int]) -> Any:
        per_mb = [[run.outputs[mb][name] for name in self.output_names]
                  for mb in range(len(sizes))]
        merged = merge(per_mb, sizes)
        return self.unflatten(pytree.tree_unflatten(merged, self.output_spec))


class _Call:
    """One mini-batch's trip through the pipeline: its micro-batches and what comes back."""

    def __init__(self, key: int, chunks: list[list[Any]], names: Sequence[str],
                 sizes: list[int] | None = None) -> None:
        self.key = key
        self.feeds = [dict(zip(names, chunk)) for chunk in chunks]
        self.sizes = sizes if sizes is not None else [_rows(chunk) for chunk in chunks]
        self.seq: int | None = None
        self.total = sum(self.sizes)  # samples in the global mini-batch (all pipeline groups)
        self.merged: list[Any] = []
        self.wanted: list[int] = []  # positions of inputs whose gradient autograd asks for

    @classmethod
    def joined(cls, key: int, calls: Sequence[_Call]) -> _Call:
        """Several mini-batches as one run: micro-batch m of mini-batch i is i * p + m."""
        joined = cls(key, [], [], [size for call in calls for size in call.sizes])
        joined.feeds = [feed for call in calls for feed in call.feeds]
        joined.seq = calls[0].seq
        return joined


def _rows(chunk: Any) -> int:
    for leaf in pytree.tree_leaves(chunk):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return 0


def _seq_len(flat_inputs: Sequence[Any]) -> int | None:
    leaves = [x for x in pytree.tree_leaves(list(flat_inputs)) if isinstance(x, torch.Tensor)]
    return input_dims(leaves).seq if leaves else None


def _needs_grad(comm: CommTable) -> dict[str, bool]:
    return {e.value: bool(e.info.tensors and e.info.tensors[0].requires_grad)
            for e in comm.edges}


class _Pipelined(torch.autograd.Function):
    """Autograd's view of a pipelined forward: its backward runs the pipeline's backward."""

    @staticmethod
    def forward(ctx, executor: PipelineExecutor, call: _Call, phony: torch.Tensor,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.executor, ctx.call = executor, call
        ctx.set_materialize_grads(False)
        run = executor._run(_FORWARD, Run(call.feeds, grad_enabled=True), call)
        per_mb = [[run.outputs[mb][name] for name in executor.output_names]
                  for mb in range(len(call.sizes))]
        call.merged = pytree.tree_leaves(merge(per_mb, call.sizes))
        outputs = tuple(x.detach() for x in call.merged if isinstance(x, torch.Tensor))
        ctx.mark_non_differentiable(*(o for o in outputs if not o.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        executor, call = ctx.executor, ctx.call
        names = [n for n, x in zip(executor.output_names, call.merged)
                 if isinstance(x, torch.Tensor)]
        ends = torch.tensor(call.sizes).cumsum(0)[:-1].tolist()
        output_grads: list[dict[str, Any]] = [{} for _ in call.sizes]
        for name, grad in zip(names, grads):
            if grad is None:
                continue
            pieces = torch.tensor_split(grad, ends) if grad.dim() > 0 else [grad]
            for mb, piece in enumerate(pieces):
                previous = output_grads[mb].get(name)
                output_grads[mb][name] = piece if previous is None else previous + piece
        run = Run(call.feeds, grad_enabled=True, output_grads=output_grads)
        executor._run(_BACKWARD, run, call, append=True)
        return (None, None, None, *_input_grads(call, run))


def _inputs_wanting_grad(flat_inputs: Sequence[Any]) -> list[int]:
    wanted = []
    for i, value in enumerate(flat_inputs):
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                wanted.append(i)
        elif any(isinstance(x, torch.Tensor) and x.requires_grad
                 for x in pytree.tree_leaves(value)):
            raise FxpipeError(
                f"input #{i} nests a tensor that requires grad inside a "
                f"{type(value).__name__}; fxpipe computes input gradients only for tensor "
                "arguments: pass that tensor as an argument of its own."
            )
    return wanted


def _input_grads(call: _Call, run: Run) -> list[torch.Tensor | None]:
    """Gradients of the mini-batch inputs that wanted one, joined from the micro-batches':
    concatenated for inputs split along the batch, summed for inputs every micro-batch saw."""
    names = list(call.feeds[0])
    grads: list[torch.Tensor | None] = []
    for position in call.wanted:
        name = names[position]
        pieces = [run.input_grads.get(mb, {}).get(name) for mb in range(len(call.sizes))]
        if any(piece is None for piece in pieces):
            grads.append(None)  # this input does not influence the outputs
        elif call.feeds[0][name] is not call.feeds[-1][name]:  # split along the batch
            grads.append(torch.cat(pieces))
        else:
            grads.append(torch.stack(pieces).sum(0))
    return grads


def lowered_schedule(name: str, stages: int, micro_batches: int, comm: CommTable,
                     minibatches: int = 2) -> Schedule:
    """The schedule with its sends and receives for the stage edges, checked to not hang
    (async-1f1b streams `minibatches` mini-batches)."""
    extra = {"minibatches": minibatches} if name == "async-1f1b" else {}
    edges = {(e.src, e.dst) for e in comm.edges}
    schedule = add_communication(build(name, stages, micro_batches, **extra), edges)
    check_communication(schedule)
    return schedule
