"""LocalExecutor: a compiled pipeline run in one process, as a drop-in module and as a schedule.

`forward` splits the mini-batch into micro-batches and runs the schedule's forward actions; in
training it returns outputs connected to autograd through one function whose backward runs the
schedule's backward actions on the same stage threads. `step` runs the whole schedule, forward
and backward interleaved as the schedule says (1F1B needs this), with the loss on the last stage.
Both drive the same StageRunners through the same Driver.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from fxpipe.runtime.driver import Driver, Run
from fxpipe.runtime.microbatch import merge, split, split_sizes
from fxpipe.runtime.stage import StageRunner
from fxpipe.runtime.transport import LocalTransport
from torch.utils import _pytree as pytree

from fxpipe.errors import FxpipeError
from fxpipe.ir import CommTable, Stage, StageHook
from fxpipe.schedules import ActionKind, Schedule, add_communication, build, check_communication
from fxpipe.simulate import Event

__all__ = ["LocalExecutor"]

K = ActionKind
_FORWARD = (K.RECV_F, K.F, K.SEND_F)
_BACKWARD = (K.RECV_B, K.B, K.SEND_B)


class LocalExecutor:
    """Runs the stages of a compiled pipeline on worker threads of this process."""

    def __init__(
        self,
        stages: Sequence[Stage],
        hooks: Sequence[StageHook],
        comm: CommTable,
        devices: Sequence[str],
        outputs: Any,
        schedule: str,
        micro_batches: int,
        unflatten: Callable[[Any], Any] = lambda out: out,
        timeout: float = 300.0,
        threads: int | None = None,
    ) -> None:
        needs_grad = {e.value: bool(e.info.tensors and e.info.tensors[0].requires_grad)
                      for e in comm.edges}
        self.runners = [StageRunner(stage, hook, io, device, needs_grad)
                        for stage, hook, io, device in zip(stages, hooks, comm.stages, devices)]
        self.comm = comm
        self.output_names, self.output_spec = pytree.tree_flatten(outputs)
        self.unflatten = unflatten
        self.micro_batches = micro_batches
        self.schedule = lowered_schedule(schedule, len(stages), micro_batches, comm)
        self.driver = Driver(self.runners, comm, LocalTransport(list(devices), timeout), threads)
        self._calls = itertools.count()
        self._trace: list[Event] = []

    def forward(self, flat_inputs: Sequence[Any]) -> Any:
        """The model's output for a mini-batch, run micro-batch by micro-batch through the stages;
        connected to autograd when gradients are enabled."""
        chunks = split(flat_inputs, self.micro_batches)
        call = _Call(next(self._calls), chunks, self.comm.graph_inputs)
        if not torch.is_grad_enabled():
            run = self._run(_FORWARD, Run(call.feeds, grad_enabled=False), call.key)
            return self._merged_outputs(run, call.sizes)
        call.wanted = _inputs_wanting_grad(flat_inputs)
        phony = torch.empty(0, requires_grad=True)  # makes autograd call our backward
        results = _Pipelined.apply(self, call, phony, *(flat_inputs[i] for i in call.wanted))
        tensors = iter(results)
        merged = [next(tensors) if isinstance(x, torch.Tensor) else x for x in call.merged]
        return self.unflatten(pytree.tree_unflatten(merged, self.output_spec))

    def step(self, flat_inputs: Sequence[Any], target: Any,
             loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Run the whole schedule on one mini-batch and return its mean loss (detached).

        Each micro-batch's loss (loss_fn averages over its samples, as PyTorch's losses do)
        counts with its share of the mini-batch, so the result and the parameters' gradients
        are those of loss_fn on the whole mini-batch. The optimizer step is the caller's.
        """
        chunks = split(flat_inputs, self.micro_batches)
        targets = [chunk[0] for chunk in split([target], self.micro_batches)]
        call = _Call(next(self._calls), chunks, self.comm.graph_inputs)
        total = sum(call.sizes)

        def loss(mb: int, outputs: dict[str, Any]) -> torch.Tensor:
            value = loss_fn(self._output(outputs), targets[mb])
            if not isinstance(value, torch.Tensor) or value.dim() != 0:
                raise FxpipeError("Plan(loss_fn=...) must return a scalar tensor (the mean "
                                  f"loss of a micro-batch), got {type(value).__name__}.")
            return value * (call.sizes[mb] / total)

        run = self._run(None, Run(call.feeds, loss=loss), call.key)
        return torch.stack([run.losses[mb] for mb in range(len(call.sizes))]).sum()

    def last_trace(self) -> list[Event]:
        """Every action of the last forward/backward or step, timed (seconds from its start)."""
        return list(self._trace)

    def in_flight(self) -> list[int]:
        return [runner.in_flight for runner in self.runners]

    # --- internals ----------------------------------------------------------------------------

    def _run(self, kinds, run: Run, key: Any, append: bool = False) -> Run:
        programs = [[a for a in stage if kinds is None or a.kind in kinds]
                    for stage in self.schedule.actions]
        offset = max((e.end for e in self._trace), default=0.0) if append else 0.0
        self.driver.run(programs, run, key)
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

    def __init__(self, key: int, chunks: list[list[Any]], names: Sequence[str]) -> None:
        self.key = key
        self.feeds = [dict(zip(names, chunk)) for chunk in chunks]
        self.sizes = split_sizes(sum(_rows(chunk) for chunk in chunks), len(chunks))
        self.merged: list[Any] = []
        self.wanted: list[int] = []  # positions of inputs whose gradient autograd asks for


def _rows(chunk: list[Any]) -> int:
    for leaf in pytree.tree_leaves(chunk):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return 0


class _Pipelined(torch.autograd.Function):
    """Autograd's view of a pipelined forward: its backward runs the pipeline's backward."""

    @staticmethod
    def forward(ctx, executor: LocalExecutor, call: _Call, phony: torch.Tensor,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.executor, ctx.call = executor, call
        ctx.set_materialize_grads(False)
        run = executor._run(_FORWARD, Run(call.feeds, grad_enabled=True), call.key)
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
        executor._run(_BACKWARD, run, call.key, append=True)
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


def lowered_schedule(name: str, stages: int, micro_batches: int, comm: CommTable) -> Schedule:
    """The schedule with its sends and receives for the stage edges, checked to not hang."""
    if name == "async-1f1b":
        raise FxpipeError("schedule='async-1f1b' is not available in the local runtime yet; "
                          "use 'gpipe' or '1f1b'.")
    edges = {(e.src, e.dst) for e in comm.edges}
    schedule = add_communication(build(name, stages, micro_batches), edges)
    check_communication(schedule)
    return schedule
