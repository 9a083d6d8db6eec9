"""PipelineExecutor: runs a compiled pipeline, as a drop-in module and as a whole schedule."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxpipe.batching import (
    ScalarJoin,
    check_loss,
    input_dims,
    loss_reduction,
    loss_weight,
    merge,
    rows,
    scalar_shares,
    split,
    split_sizes,
)
from fxpipe.devices import shares_cpu_generator
from fxpipe.errors import FxpipeError
from fxpipe.ir import CommTable, Event, Stage, StageHook
from fxpipe.runtime.bridge import (
    Call,
    Pipelined,
    inputs_wanting_grad,
    model_output_of,
    output_values,
)
from fxpipe.runtime.consistency import make_policy
from fxpipe.runtime.coordinator import Coordinator
from fxpipe.runtime.driver import Driver, Run
from fxpipe.runtime.loss_scaling import PipelineScaler
from fxpipe.runtime.stage import StageRunner
from fxpipe.runtime.transport import LocalTransport, Transport, to_device
from fxpipe.schedules import ActionKind, Schedule

__all__ = ["PipelineExecutor"]

K = ActionKind
_FORWARD = (K.RECV_F, K.F, K.SEND_F)
_BACKWARD = (K.RECV_B, K.B, K.SEND_B, K.W)


class PipelineExecutor:
    """Runs the stages this process holds: all of them, one worker thread per device (a
    device's stages share its thread), or one rank's.

    `schedule` is the lowered schedule of a step; `forward_schedule` the flushed one the
    drop-in forward and backward run (the same but for asynchronous schedules); for an
    asynchronous schedule, `streamed(minibatches)` is the one pipe.step_many runs over several
    mini-batches with no flush between them (None for a synchronous one).

    `forward` runs the schedule's forward actions and, in training, returns outputs whose
    backward runs its backward actions on the same workers; `step` runs the whole schedule with
    the loss on the last stage. Under torch.distributed a Coordinator shares what only one rank
    knows (the micro-batch sizes, the loss).
    """

    def __init__(
        self,
        runners: dict[int, StageRunner],
        comm: CommTable,
        transport: Transport,
        outputs: Any,
        schedule: Schedule,
        forward_schedule: Schedule,
        streamed: Callable[[int], Schedule] | None = None,
        unflatten: Callable[[Any], Any] = lambda out: out,
        coordinator: Coordinator | None = None,
        whole: Sequence[int] = (),
        scalar_joins: Mapping[int, ScalarJoin] | None = None,
        precision: str | None = None,
    ) -> None:
        self.runners = runners
        self.comm = comm
        self.transport = transport
        self.output_leaves, self.output_spec = pytree.tree_flatten(outputs)
        self.unflatten = unflatten
        self.model_output = model_output_of(outputs, unflatten)
        self.schedule, self.forward_schedule, self.streamed = schedule, forward_schedule, streamed
        self.steps_itself = any(a.kind is K.STEP for stage in schedule.actions for a in stage)
        self.micro_batches = schedule.micro_batches
        self.driver = Driver(self.runners, comm, transport)
        self.coordinator = coordinator or Coordinator()
        self.whole = tuple(whole)  # positions of inputs every micro-batch receives whole
        self.scalar_joins = dict(scalar_joins or {})  # how one-number outputs join, by position
        self.first, self.last = 0 in runners, len(comm.stages) - 1 in runners
        self.everything_here = len(runners) == len(comm.stages)
        self._calls = itertools.count()
        self._trace: list[Event] = []
        self.trace_origin = 0.0  # wall-clock time (time.time()) of the trace's zero
        self.last_schedule: Schedule | None = None  # what the last run executed
        self.last_sizes: list[int] | None = None  # and its micro-batches' sizes (samples)
        self.loss_reduction: tuple | None = None  # ((loss_fn, its reduction), "mean"/"sum"/None)
        for runner in runners.values():  # Plan(precision): each stage under its autocast
            runner.precision = precision
        home = runners[max(runners)].device  # the last stage's (held here), where the loss is
        self.scaler = PipelineScaler(home, coordinator is not None, enabled=precision == "fp16")

    @classmethod
    def local(cls, stages: Sequence[Stage], hooks: Sequence[StageHook], comm: CommTable,
              devices: Sequence[str], timeout: float = 300.0,
              recompute: Sequence[bool] = (), **kwargs: Any) -> PipelineExecutor:
        """Every stage in this process, one worker thread per device of the schedule;
        `recompute`: per stage, whether it recomputes its forward in backward; `kwargs` as
        __init__'s."""
        needs_grad = comm.carries_grad()
        recompute = tuple(recompute) or (False,) * len(stages)
        lock = threading.Lock()  # the workers' shared CPU generator, for those that share it
        shared = shares_cpu_generator(devices, recompute)
        runners = {io.stage: StageRunner(stage, hook, io, device, needs_grad, again,
                                         lock if sharing else None)
                   for stage, hook, io, device, again, sharing
                   in zip(stages, hooks, comm.stages, devices, recompute, shared)}
        return cls(runners, comm, LocalTransport(devices, timeout), **kwargs)

    def forward(self, flat_inputs: Sequence[Any] | None) -> Any:
        """The model's output for a mini-batch, run micro-batch by micro-batch through the
        stages; connected to autograd when gradients are enabled."""
        if not self.everything_here:
            return self._forward_only_distributed(flat_inputs)
        batch = input_dims(flat_inputs, self.whole).batch
        call = Call(next(self._calls), split(flat_inputs, self.micro_batches, self.whole, batch),
                    self.comm.graph_inputs, split_sizes(batch, self.micro_batches))
        if not torch.is_grad_enabled():
            run = self._run(_FORWARD, Run(call.feeds, grad_enabled=False), call,
                            self.forward_schedule)
            return self._model_output(run, call)
        call.wanted = inputs_wanting_grad(flat_inputs)
        phony = torch.empty(0, requires_grad=True)  # makes autograd call our backward
        results = Pipelined.apply(self, call, phony, *(flat_inputs[i] for i in call.wanted))
        tensors = iter(results)
        merged = [next(tensors) if isinstance(x, torch.Tensor) else x for x in call.merged]
        return self.unflatten(pytree.tree_unflatten(merged, self.output_spec))

    def step(self, flat_inputs: Sequence[Any] | None, target: Any,
             loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Run the whole schedule on one mini-batch and return its loss (detached), on every
        rank. The first stage reads the inputs, the last stage the target.

        Each micro-batch's loss counts with its share of the mini-batch where loss_fn is a mean
        over samples (as PyTorch's losses are by default), as it is where loss_fn is a sum, so
        the result and the parameters' gradients are those of loss_fn on the whole mini-batch.
        The optimizer step is the caller's.
        """
        if self.steps_itself:
            raise FxpipeError(
                f"schedule={self.schedule.name!r} overlaps mini-batches and steps each stage "
                "itself: call pipe.attach_optimizer(factory) once, then losses = "
                "pipe.step_many([(x1, y1), (x2, y2), ...])."
            )
        return self._train([(flat_inputs, target)], loss_fn, self.schedule)[0]

    def step_many(self, batches: Sequence[tuple[Sequence[Any] | None, Any]],
                  loss_fn: Callable[[Any, Any], torch.Tensor]) -> list[torch.Tensor]:
        """Train on several mini-batches, stepping every stage's attached optimizer after each:
        asynchronously (no flush between them) where the schedule streams them, else one
        flushed schedule per mini-batch. Returns each mini-batch's loss."""
        missing = [s for s, runner in self.runners.items() if runner.policy is None
                   or runner.policy.optimizer is None]
        if missing:
            raise FxpipeError(f"stages {missing} have no optimizer: call "
                              "pipe.attach_optimizer(lambda params: torch.optim.SGD(params, "
                              "lr=0.1)) before pipe.step_many(...).")
        if self.streamed is not None:
            return self._train(batches, loss_fn, self.streamed(len(batches)))
        losses = []
        for batch in batches:
            losses += self._train([batch], loss_fn, self.schedule)
            # fp16: every stage steps, or (an inf or nan anywhere) none does
            if not self.scaler.unscale_all_([r.policy.optimizer for r in self.runners.values()]):
                for runner in self.runners.values():
                    runner.step()
            else:
                for runner in self.runners.values():
                    runner.policy.optimizer.zero_grad()
            self.scaler.update()
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
        """One run of `schedule` over `batches` (micro-batch m of mini-batch i is i * p + m);
        returns each mini-batch's loss, on every rank."""
        p = self.micro_batches
        calls = [self._call(flat) for flat, _ in batches]
        call = Call.joined(next(self._calls), calls)
        targets = (self._targets([self.coordinator.shard(t) for _, t in batches], calls)
                   if self.last else [])

        # what each micro-batch's mean averages over (samples, or counted target entries),
        # and each mini-batch's total of it: its entries counted in every pipeline group
        weights = [loss_weight(loss_fn, t) for t in targets]
        totals = [sum(weights[i:i + p]) for i in range(0, len(weights), p)]
        totals = [self.coordinator.counted_in_all_groups(total)
                  if isinstance(total, torch.Tensor) else total for total in totals]
        checked = []  # this run's check of the reduction, when the last could not tell

        last_device = self.runners[len(self.comm.stages) - 1].device if self.last else None

        def loss(mb: int, outputs: dict[str, Any]) -> torch.Tensor:
            output = self.model_output(outputs)
            # the target on the last stage's device, copied on its worker thread and stream
            targets[mb] = to_device({"target": targets[mb]}, last_device,
                                    self.driver.copies)["target"]
            value = check_loss(loss_fn(output, targets[mb]))
            if call.sizes[mb] == calls[mb // p].total:  # the whole mini-batch: nothing to combine
                return value
            found = (loss_fn, getattr(loss_fn, "reduction", None))  # what the check holds for
            known = self.loss_reduction is not None and self.loss_reduction[0] == found
            if not known or (self.loss_reduction[1] is None and not checked):
                # checked once, not every step: it costs loss_fn calls and a device sync
                self.loss_reduction = (found, loss_reduction(loss_fn, output, targets[mb], value))
                checked.append(mb)
            if self.loss_reduction[1] == "sum":
                return value
            # a mean counts with its share of the global mini-batch's samples, or of its
            # counted target entries
            share = call.sizes[mb] / calls[mb // p].total
            if isinstance(weights[mb], torch.Tensor):
                weight = weights[mb].to(value.device)  # counted on the host
                share = weight.to(value.dtype) / totals[mb // p].to(value.device)
                # nothing counted (all padding): its mean is nan, and it adds nothing
                return torch.where(weight > 0, value * share, 0.0)
            return value * share

        def on_action(action) -> None:
            if action.kind is K.STEP:
                self.runners[action.stage].step()
            elif action.kind is K.ALLREDUCE:
                self.coordinator.start_allreduce(action.stage)

        self.coordinator.expect(len(batches))  # once the inputs and targets passed their checks
        scale = self.scaler.scale if self.scaler.is_enabled() else None
        if scale is not None and torch.is_grad_enabled() and not self.steps_itself:
            self.scaler.scaling([p for r in self.runners.values()
                                 for p in r.stage.module.parameters()])
        run = self._run(None, Run(call.feeds, loss=loss, on_action=on_action, scale=scale), call,
                        schedule)
        losses = []  # shared first: the last stage sends them once its schedule ends
        for i in range(len(batches)):
            mine = (torch.stack([run.losses[i * p + m] for m in range(p)]).sum()
                    if self.last else None)
            losses.append(self.coordinator.loss(mine))
        self.coordinator.after_backward()
        self._trace += [Event(e.stage, e.action, e.start - run.started, e.end - run.started)
                        for e in self.coordinator.drain_events()]
        return losses

    def _targets(self, targets: Sequence[Any], calls: Sequence[Call]) -> list[Any]:
        """Each mini-batch's target cut like its inputs; one clear error per kind of mismatch."""
        pieces = []
        for target, call in zip(targets, calls):
            if target is None:
                raise FxpipeError("the last stage computes the loss and needs the target: "
                                  "pass it to pipe.step(x, target) on every rank.")
            found = rows([target])
            if found == 0:
                raise FxpipeError(f"the target must be a tensor with one row per sample, got "
                                  f"{type(target).__name__}; e.g. pipe.step(x, labels).")
            if found != sum(call.sizes):
                raise FxpipeError(f"the target has {found} rows but the inputs "
                                  f"{sum(call.sizes)}; give one target row per sample.")
            pieces += [chunk[0] for chunk in split([target], self.micro_batches)]
        return pieces

    @property
    def latest_schedule(self) -> Schedule:
        """The schedule the last run executed, or the planned one before any run."""
        return self.last_schedule or self.schedule

    def last_trace(self) -> list[Event]:
        """Every action of the last forward/backward or step this process ran (seconds from
        its start)."""
        return list(self._trace)

    def full_trace(self) -> list[Event]:
        """The last run's actions of every stage of this pipeline (under torchrun every rank of
        the pipeline must call it: the ranks exchange their traces)."""
        return self.full_traces([(self._trace, self.trace_origin)])[0]

    def full_traces(self, kept: Sequence[tuple[list[Event], float]]) -> list[list[Event]]:
        """full_trace of each run `kept` (its `last_trace()` and `trace_origin`, taken right
        after it), so that several runs are gathered at once after they all ran (under
        torchrun every rank of the pipeline must call it, with as many runs)."""
        return self.coordinator.gather_events(kept)  # which copies the events

    def job_trace(self) -> dict[int, list[Event]]:
        """full_trace for every pipeline group of the job (every rank of the job must call it)."""
        return self.coordinator.gather_job_events(list(self._trace), self.trace_origin)

    def in_flight(self) -> list[int]:
        return [runner.in_flight for runner in self.runners.values()]

    @contextlib.contextmanager
    def runs_aside(self) -> Iterator[None]:
        """Runs meanwhile (a calibration's) leave the last run's trace, schedule and sizes as
        they were, for the report of the user's own last run."""
        kept = (self._trace, self.trace_origin, self.last_schedule, self.last_sizes)
        try:
            yield
        finally:
            self._trace, self.trace_origin, self.last_schedule, self.last_sizes = kept

    def optimizers_attached(self) -> bool:
        return any(runner.policy for runner in self.runners.values())

    def weight_copies(self) -> dict[int, int]:
        """Per stage held here, the most extra weight copies its consistency policy kept."""
        return {s: runner.policy.peak_copies if runner.policy else 0
                for s, runner in self.runners.items()}

    def rebind_weights(self) -> None:
        """Point the consistency policies at their stages' parameters again (after the
        parameters were replaced: `.to()`, `load_state_dict(assign=True)`)."""
        for runner in self.runners.values():
            if runner.policy is not None:
                runner.policy.weights = dict(runner.stage.module.named_parameters())

    def run_forward(self, call: Call) -> Run:
        """The schedule's forward actions for `call`, keeping what its backward needs."""
        return self._run(_FORWARD, Run(call.feeds, grad_enabled=True), call,
                         self.forward_schedule)

    def run_backward(self, call: Call, output_grads: list[dict[str, Any]]) -> Run:
        """The schedule's backward actions for `call`, from the outputs' gradients."""
        run = Run(call.feeds, grad_enabled=True, output_grads=output_grads)
        return self._run(_BACKWARD, run, call, self.forward_schedule, append=True)

    def release(self, run: Any) -> None:
        """Forget a call whose backward will never run (its outputs were freed)."""
        self.driver.discard(run)

    def _call(self, flat_inputs: Sequence[Any] | None) -> Call:
        """Split the inputs (on the first stage) and agree on the micro-batch sizes."""
        if self.first:
            if flat_inputs is None:
                raise FxpipeError("the first stage reads the inputs: pass them to "
                                  "pipe.step(x, target) on every rank.")
            listed = list(flat_inputs)
            dims = input_dims(listed, self.whole)
            total = dims.batch
            shard = self.coordinator.shard(listed, self.whole)
            if shard is not listed:  # this pipeline group's rows of the global batch
                dims = input_dims(shard, self.whole)
            chunks = split(shard, self.micro_batches, self.whole, dims.batch)
            sizes, seq = split_sizes(dims.batch, self.micro_batches), dims.seq
        else:
            chunks = [[] for _ in range(self.micro_batches)]
            sizes, seq, total = None, None, None
        sizes, seq, total = self.coordinator.dims(sizes, seq, total)
        call = Call(next(self._calls), chunks, self.comm.graph_inputs, sizes)
        call.seq, call.total = seq, total
        return call

    def _forward_only_distributed(self, flat_inputs):
        if torch.is_grad_enabled():
            raise FxpipeError(
                "under torch.distributed, train with loss = pipe.step(x, target) (every rank "
                "calls it); pipe(x) runs inference only: wrap it in torch.no_grad()."
            )
        call = self._call(flat_inputs)
        run = self._run(_FORWARD, Run(call.feeds, grad_enabled=False), call,
                        self.forward_schedule)
        return self._model_output(run, call) if self.last else None

    def _run(self, kinds, run: Run, call: Call, schedule: Schedule,
             append: bool = False) -> Run:
        self.last_schedule, self.last_sizes = schedule, list(call.sizes)
        for runner in self.runners.values():
            if runner.policy is not None:  # the weight versions it meets, by micro-batch
                runner.policy.follow(schedule)
        programs = [[a for a in program if kinds is None or a.kind in kinds]
                    for program in schedule.device_programs]  # per device, its stages' actions
        offset = max((e.end for e in self._trace), default=0.0) if append else 0.0
        self.transport.prepare(call.key, call.sizes, call.seq)
        self.driver.run(programs, run, call.key)
        self.trace_origin = run.started - offset
        events = [Event(e.stage, e.action, e.start + offset, e.end + offset) for e in run.events]
        self._trace = (self._trace + events) if append else events
        return run

    def joined_outputs(self, run: Run, call: Call) -> list[Any]:
        """The model's flat output of a run, its micro-batches' outputs joined; the shares of
        one-number outputs' micro-batches are kept on `call` for the backward."""
        call.shares = scalar_shares(self.scalar_joins, call.feeds, call.sizes)
        return merge([output_values(self.output_leaves, run.outputs[mb])
                      for mb in range(len(call.sizes))], call.sizes, call.shares)

    def _model_output(self, run: Run, call: Call) -> Any:
        return self.unflatten(pytree.tree_unflatten(self.joined_outputs(run, call),
                                                    self.output_spec))
