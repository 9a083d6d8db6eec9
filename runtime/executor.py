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

import contextlib
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import torch
from torch.utils import _pytree as pytree

from fxpipe.batching import input_dims
from fxpipe.errors import FxpipeError
from fxpipe.ir import CommTable, Stage, StageHook
from fxpipe.probes import gradients_set_aside, preserved_state
from fxpipe.runtime.bridge import (
    Call,
    Pipelined,
    inputs_wanting_grad,
    model_output_of,
    output_values,
)
from fxpipe.runtime.consistency import make_policy
from fxpipe.runtime.driver import Driver, Run
from fxpipe.runtime.microbatch import batch_size, merge, rows, split, split_sizes
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

if TYPE_CHECKING:
    from fxpipe.runtime.dist import Posting

__all__ = ["Coordinator", "LocalCoordinator", "PipelineExecutor", "lowered_schedule"]

K = ActionKind
_FORWARD = (K.RECV_F, K.F, K.SEND_F)
_BACKWARD = (K.RECV_B, K.B, K.SEND_B)

T = TypeVar("T")
RECENT_STEPS = 10  # training steps recent_steps() keeps, for pipe.report()
# rounds of _switch_time at most: a model of short computes gets many in its time
MOST_SWITCH_ROUNDS = 100


class Coordinator(Protocol):
    """What the ranks of one pipeline agree on per step (trivial in one process)."""

    def shard(self, batch: Any, whole: Sequence[int] = ()) -> Any:
        """This pipeline group's share of a global mini-batch (inputs or target); inputs at
        positions in `whole` go to every group whole."""

    def dims(self, sizes: list[int] | None, seq: int | None, total: int | None
             ) -> tuple[list[int], int | None, int]:
        """The micro-batch sizes, sequence length and global mini-batch size, from the rank
        that holds the inputs."""

    def expect(self, batches: int) -> None:
        """At a step's start: get ready for what its end brings from other ranks, the loss of
        each of `batches` mini-batches and tied weights' gradients."""

    def loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The step's loss, from the rank that computed it, on every rank (one call per
        mini-batch expected)."""

    def after_backward(self) -> None:
        """Gradient work once the backward of a mini-batch is complete (tied weights; after
        expect())."""

    def rehearsal_burst(self, quiet: bool = False) -> float:
        """Stand in for the end of a step's backward when rehearsing one: a short burst of
        compute, longer on the first stage's rank, which ends its backward last while the
        others wait; returns its seconds. `quiet`: the other ranks wait for it to end before
        they go on, so that nothing they send lands during it."""

    def rehearse(self) -> None:
        """The exchanges after_backward makes, on zeros, touching no gradient (to time them;
        after expect(), as a step)."""

    def from_first_stage(self, seconds: float) -> float:
        """The first stage's figure `seconds`, on every rank of the pipeline."""

    def barrier(self) -> None:
        """Wait for every rank of the pipeline (to start something timed together)."""

    def resume_penalty(self, compute: Callable[[], float]) -> list[float] | None:
        """Per stage, how much longer `compute()` (this rank's stage once, returning its
        seconds) runs right after the rank blocked waiting for a message than back to back;
        the same list on every rank (None in one process, where no stage blocks in a
        receive)."""

    def per_stage(self, figures: Mapping[int, T]) -> list[T]:
        """One figure per stage of the pipeline, in stage order, from `figures` (this process's
        stages' own, by stage); the same list on every rank."""

    def drain_events(self) -> list[Event]:
        """Timed work it did (all-reduces), in wall-clock seconds, since the last call."""

    def gather_events(self, runs: Sequence[tuple[list[Event], float]]) -> list[list[Event]]:
        """Every stage's events of each run in `runs` (this rank's events of it and the
        wall-clock time they count from), each run on a time axis of its own: under torchrun,
        where each rank holds its own events, seconds from the earliest start among the ranks
        (one collective for all the runs; every rank must pass as many); in one process, the
        run's own."""

    def gather_job_events(self, events: list[Event], origin: float) -> dict[int, list[Event]]:
        """As gather_events for one run, for every pipeline group of the job (a collective
        over all ranks), keyed by group."""


class LocalCoordinator:
    """Every stage in this process: nothing to share."""

    def shard(self, batch, whole=()):
        return batch

    def dims(self, sizes, seq, total):
        return sizes, seq, total

    def expect(self, batches: int) -> None:
        return None

    def loss(self, loss):
        return loss

    def after_backward(self) -> None:
        return None

    def rehearsal_burst(self, quiet: bool = False) -> float:
        return 0.0

    def rehearse(self) -> None:
        return None

    def from_first_stage(self, seconds: float) -> float:
        return seconds

    def barrier(self) -> None:
        return None

    def resume_penalty(self, compute):
        return None

    def per_stage(self, figures):
        return [figures[s] for s in sorted(figures)]

    def drain_events(self) -> list[Event]:
        return []

    def gather_events(self, runs):
        return [list(events) for events, _ in runs]

    def gather_job_events(self, events, origin):
        return {0: events}


class ThreadCosts(NamedTuple):
    """A stage's seconds on a thread that runs several stages (shared_thread_costs)."""

    between: float  # the thread's own time between two of its actions
    send_f: float  # per SEND of activations
    send_b: float  # per SEND of gradients
    recv_f: float  # per RECV of activations
    recv_b: float  # per RECV of gradients
    # how much longer the stage's first forward of a step, and its first backward, take than
    # its others (the thread was idle between steps)
    first_f: float = 0.0
    first_b: float = 0.0


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
        self.output_leaves, self.output_spec = pytree.tree_flatten(outputs)
        self.unflatten = unflatten
        self._model_output = model_output_of(outputs, unflatten)
        self.micro_batches = micro_batches
        self.schedule = lowered_schedule(schedule, len(comm.stages), micro_batches, comm)
        # the drop-in forward/backward handle one mini-batch at a time, with a flush
        self.forward_schedule = (self.schedule if schedule != "async-1f1b" else
                                 lowered_schedule("gpipe", len(comm.stages), micro_batches,
                                                  comm))
        self.driver = Driver(self.runners, comm, transport, threads)
        self.coordinator = coordinator or LocalCoordinator()
        self.first, self.last = 0 in runners, len(comm.stages) - 1 in runners
        self.everything_here = len(runners) == len(comm.stages)
        self._calls = itertools.count()
        self._trace: list[Event] = []
        self.trace_origin = 0.0
        self.whole: tuple[int, ...] = ()  # inputs every micro-batch receives whole
        self.last_schedule: Schedule | None = None  # what the last run executed
        self.last_sizes: list[int] | None = None  # and its micro-batches' sizes (samples)
        # the training steps up to the last run that ran its schedule on micro-batches of its
        # sizes ([] when the last run was not one): recent_steps()
        self._recent: list[tuple[list[Event], float]] = []

    @classmethod
    def local(cls, stages: Sequence[Stage], hooks: Sequence[StageHook], comm: CommTable,
              devices: Sequence[str], outputs: Any, schedule: str, micro_batches: int,
              unflatten: Callable[[Any], Any] = lambda out: out, timeout: float = 300.0,
              threads: int | None = None) -> PipelineExecutor:
        """Every stage in this process, one worker thread each."""
        needs_grad = comm.carries_grad()
        runners = {io.stage: StageRunner(stage, hook, io, device, needs_grad)
                   for stage, hook, io, device in zip(stages, hooks, comm.stages, devices)}
        return cls(runners, comm, LocalTransport(list(devices), timeout), outputs, schedule,
                   micro_batches, unflatten, threads)

    def forward(self, flat_inputs: Sequence[Any] | None) -> Any:
        """The model's output for a mini-batch, run micro-batch by micro-batch through the stages;
        connected to autograd when gradients are enabled."""
        if not self.everything_here:
            return self._forward_only_distributed(flat_inputs)
        chunks = split(flat_inputs, self.micro_batches, self.whole)
        call = Call(next(self._calls), chunks, self.comm.graph_inputs,
                    split_sizes(batch_size(flat_inputs, self.whole), self.micro_batches))
        if not torch.is_grad_enabled():
            run = self._run(_FORWARD, Run(call.feeds, grad_enabled=False), call,
                            schedule=self.forward_schedule)
            return self._merged_outputs(run, call.sizes)
        call.wanted = inputs_wanting_grad(flat_inputs)
        phony = torch.empty(0, requires_grad=True)  # makes autograd call our backward
        results = Pipelined.apply(self, call, phony, *(flat_inputs[i] for i in call.wanted))
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
        call = Call.joined(next(self._calls), calls)
        targets = (self._targets([self.coordinator.shard(t) for _, t in batches], calls)
                   if self.last else [])

        def loss(mb: int, outputs: dict[str, Any]) -> torch.Tensor:
            value = loss_fn(self.model_output(outputs), targets[mb])
            if not isinstance(value, torch.Tensor) or value.dim() != 0:
                raise FxpipeError("Plan(loss_fn=...) must return a scalar tensor (the mean "
                                  f"loss of a micro-batch), got {type(value).__name__}.")
            return value * (call.sizes[mb] / calls[mb // p].total)

        # a series is of the last run's schedule and sizes, which this run now replaces
        earlier = self._recent
        earlier_of = (self.last_schedule.name, self.last_sizes) if earlier else None
        losses = self._run_step(call, len(batches), loss, schedule)[0]
        alike = earlier if earlier_of == (schedule.name, self.last_sizes) else []
        self._recent = [*alike, (list(self._trace), self.trace_origin)][-RECENT_STEPS:]
        return losses

    def recent_steps(self) -> list[tuple[list[Event], float]]:
        """The last training steps (at most RECENT_STEPS), the last run the newest, that ran its
        schedule on micro-batches of its sizes, each as `full_traces` takes it (its last_trace()
        and trace_origin); [] when the last run was not a training step."""
        return list(self._recent)

    def _run_step(self, call: Call, batches: int,
                  loss: Callable[[int, dict[str, Any]], torch.Tensor], schedule: Schedule
                  ) -> tuple[list[torch.Tensor], Run]:
        """Run `schedule` on `call`, cut into `batches` mini-batches, with `loss(mb, outputs)`
        on the last stage; returns each mini-batch's loss, on every rank, and the run."""
        p = self.micro_batches

        def on_action(action: Action) -> None:
            if action.kind is K.STEP:
                self.runners[action.stage].step()

        self.coordinator.expect(batches)  # once the inputs and targets passed their checks
        run = self._run(None, Run(call.feeds, loss=loss, on_action=on_action), call,
                        schedule=schedule)
        losses = []  # shared first: the last stage sends them once its schedule ends
        for i in range(batches):
            mine = (torch.stack([run.losses[i * p + m] for m in range(p)]).sum()
                    if self.last else None)
            losses.append(self.coordinator.loss(mine))
        self.coordinator.after_backward()
        self._trace += [Event(e.stage, e.action, e.start - run.started, e.end - run.started)
                        for e in self.coordinator.drain_events()]
        return losses, run

    def step_overhead(self, flat_inputs: Sequence[Any] | None, repeats: int = 25,
                      budget: float = 0.25) -> float:
        """Seconds a step spends outside its schedule's actions: splitting the inputs and the
        target and agreeing on the micro-batch sizes, starting and joining the stage workers,
        their bookkeeping around the actions, sharing the loss and the tied weights'
        gradients. Measured on steps of `flat_inputs` (their loss a stand-in: the sum of the
        outputs, times 0; as many steps as fill `budget` seconds, 3 to `repeats`), as each
        step's time less the span of its actions, the median counting; they leave no
        gradient, buffer, random number generator or trace behind. Plus how much slower the
        first stage's last backward runs as the others' part of those exchanges lands on it
        (see `_landing`). A step ends with the first stage's backward, the other ranks
        waiting for it, so what it pays past its schedule is the first stage's rank's time:
        every rank returns that figure. Every rank of the pipeline must call it."""
        schedule = self._stand_in_schedule()
        with self._timing_the_stages():
            self._outside_of_step(flat_inputs, schedule)  # the first one allocates
            step_seconds = self.coordinator.from_first_stage(self._outside_of_step(
                flat_inputs, schedule, wall=True))  # every rank then runs as many
            steps = max(3, min(repeats, int(budget / max(step_seconds, 1e-9))))
            outside = [self._outside_of_step(flat_inputs, schedule) for _ in range(steps)]
        return self.coordinator.from_first_stage(statistics.median(outside)
                                                 + self._landing(flat_inputs, repeats))

    def _stand_in_schedule(self) -> Schedule:
        """The schedule a measurement runs steps of: the pipeline's, but for an asynchronous
        one, which steps the stages' optimizers, its flushed form."""
        steps_optimizers = any(a.kind is K.STEP for stage in self.schedule.actions for a in stage)
        return (self.schedule if not steps_optimizers
                else lowered_schedule("gpipe", len(self.comm.stages), self.micro_batches,
                                      self.comm))

    def shared_thread_costs(self, flat_inputs: Sequence[Any] | None, repeats: int = 15
                            ) -> dict[int, ThreadCosts]:
        """Per stage on a thread that runs several (Driver.share): the thread's own seconds
        between two actions (choosing the next, recording it), the stage's seconds per SEND
        and per RECV of each direction, in one process where a message needs no wake-up of its
        receiver's thread, and how much longer its first forward and its first backward of a
        step take than its others (at least 0; the units are timed back to back, and the
        thread idles between steps). Medians over `repeats` steps of `flat_inputs` (their loss
        a stand-in, as in step_overhead); a thread's time between actions is the span of its
        actions less their durations and its waits for a message, per action. {} where every
        stage has a thread of its own. Leaves no gradient, buffer or trace behind."""
        shared = [group for group in self.driver.workers if len(group) > 1]
        if not shared:
            return {}
        schedule = self._stand_in_schedule()
        gaps: dict[tuple[int, ...], list[float]] = {group: [] for group in shared}
        took: dict[tuple[int, ActionKind], list[float]] = {}
        firsts: dict[tuple[int, ActionKind], list[float]] = {}
        with self._timing_the_stages():
            for i in range(repeats + 1):
                run = self._stand_in_step(self._call(flat_inputs), schedule)
                if i == 0:  # the first one allocates
                    continue
                for group in shared:
                    events = [e for e in run.events if e.stage in group]
                    span = max(e.end for e in events) - min(e.start for e in events)
                    waited = sum(t for stages, t in run.waits if stages == group)
                    gaps[group].append((span - sum(e.duration for e in events) - waited)
                                       / len(events))
                for e in run.events:
                    if e.action.kind.is_send or e.action.kind.is_recv:
                        took.setdefault((e.stage, e.action.kind), []).append(e.duration)
                for key, excess in _first_compute_excess(run.events).items():
                    firsts.setdefault(key, []).append(excess)
        costs = {}
        for group in shared:
            gap = max(statistics.median(gaps[group]), 0.0)
            for s in group:
                costs[s] = ThreadCosts(gap, *(
                    statistics.median(took.get((s, kind), [0.0]))
                    for kind in (K.SEND_F, K.SEND_B, K.RECV_F, K.RECV_B)), *(
                    max(statistics.median(firsts.get((s, kind), [0.0])), 0.0)
                    for kind in (K.F, K.B)))
        return costs

    def _stand_in_step(self, call: Call, schedule: Schedule) -> Run:
        """One step of `schedule` on `call`, its loss a stand-in (_stand_in_loss)."""
        return self._run_step(call, 1, lambda mb, outputs: _stand_in_loss(outputs), schedule)[1]

    def _outside_of_step(self, flat_inputs: Sequence[Any] | None, schedule: Schedule,
                         wall: bool = False) -> float:
        """One step's seconds outside the span of its actions here (`wall`: the whole step's),
        its loss a stand-in and its target a stand-in split as a target is; the ranks start
        together."""
        self.coordinator.barrier()
        start = time.perf_counter()
        call = self._call(flat_inputs if self.first else None)
        if self.last:  # the target is split as the inputs are (a stand-in of its rows)
            split([torch.empty(sum(call.sizes))], self.micro_batches)
        run = self._stand_in_step(call, schedule)
        seconds = time.perf_counter() - start
        if wall or not run.events:
            return seconds
        return seconds - (max(e.end for e in run.events) - min(e.start for e in run.events))

    def _landing(self, flat_inputs: Sequence[Any] | None, repeats: int) -> float:
        """How much slower the first stage's last backward runs as the others' share of the
        loss and the tied weights' gradients lands on it: rehearsals of a step's end with no
        compute but a burst in the backward's place, the burst's median time against quiet
        rehearsals', where the other ranks wait for it to end (`repeats` of each; never
        below 0)."""
        bursts: dict[bool, list[float]] = {False: [], True: []}
        for quiet in [False, True] * repeats:
            self.coordinator.barrier()
            call = self._call(flat_inputs if self.first else None)
            self.coordinator.expect(1)
            self.driver.run([[] for _ in self.comm.stages], Run(call.feeds), call.key)
            bursts[quiet].append(self.coordinator.rehearsal_burst(quiet))
            self.coordinator.loss(torch.zeros(()) if self.last else None)
            self.coordinator.rehearse()
        return max(statistics.median(bursts[False]) - statistics.median(bursts[True]), 0.0)

    def resume_penalty(self, flat_inputs: Sequence[Any] | None) -> list[float] | None:
        """Per stage, how much longer its forward and backward of a micro-batch run right
        after its rank blocked waiting for a message than back to back (a process woken from
        a wait runs slower for a while, by how much depends on what it then computes), run
        by each stage on the values a forward of `flat_inputs` hands it. None in one process
        and on GPUs, whose host does not block in a receive. Leaves no gradient, buffer or
        trace behind. Every rank of the pipeline must call it."""
        if self.everything_here or any(r.device.type != "cpu" for r in self.runners.values()):
            return None
        (runner,) = self.runners.values()
        keys = itertools.count()

        def compute(values: Mapping[str, Any]) -> float:
            start = time.perf_counter()
            key = ("resume", next(keys))
            runner.backward(key, _ones_for(runner, runner.forward(key, values)))
            return time.perf_counter() - start

        try:
            with self.timing_the_stages(flat_inputs) as inputs:
                return self.coordinator.resume_penalty(
                    functools.partial(compute, inputs[runner.index]))
        finally:
            runner.discard("resume")  # what a failed run left in flight

    def switch_overhead(self, flat_inputs: Sequence[Any] | None, rounds: int = 8,
                        seconds: float = 0.05) -> tuple[list[float], list[float]]:
        """Per stage, how much longer its module's call takes right after a backward than
        after a forward (a step switching from backwards to forwards), and its autograd call
        right after a forward than after a backward (the units' timings run each kind back to
        back), at least 0. Each stage runs rounds of forwards and backwards, in runs of a kind
        and alternating, at least `rounds` and more until they took `seconds`
        (_switch_time), on the values a forward of `flat_inputs` hands it, on its worker. The
        stages take turns, the others idle: a difference of microseconds is lost in the noise
        of threads or ranks sharing a core or the interpreter lock. 0 on a GPU. Leaves no
        gradient, buffer or random number generator changed. Every rank of the pipeline must
        call it."""
        mine: dict[int, tuple[float, float]] = {}
        with self.timing_the_stages(flat_inputs) as inputs:
            for turn in range(len(self.comm.stages)):
                self.coordinator.barrier()  # the ranks take turns too
                if turn in self.runners:  # on the stage's own worker, the others idle
                    mine[turn] = self.driver.on_stage_workers(
                        lambda s, turn=turn: _switch_time(self.runners[s], inputs[s], rounds,
                                                          seconds) if s == turn else None)[turn]
        forward, backward = zip(*self.coordinator.per_stage(mine))
        return list(forward), list(backward)

    def action_overhead(self, flat_inputs: Sequence[Any] | None, repeats: int = 30
                        ) -> tuple[list[float], list[float]]:
        """Per stage, the runtime's own seconds per forward action beyond its stage module's
        call, and per backward action beyond its autograd call (which the units' timings
        hold): detaching the inputs, the value dicts, the in-flight bookkeeping; gathering the
        output gradients, firing the stage's hook, handing the input gradients back. Each stage
        held here runs forward and backward `repeats` times on the values a forward of
        `flat_inputs` hands it, every stage at once on its worker as in a step (stage threads
        in one process contend for the interpreter lock, which makes this work slower than
        alone); the medians of the actions' time less the module's call, and less the autograd
        call, count. 0 on a GPU, whose host prepares an action while the device computes the
        one before. Leaves no gradient, buffer or random number generator changed. Every rank
        of the pipeline must call it."""
        with self.timing_the_stages(flat_inputs) as inputs:
            mine = self.driver.on_stage_workers(
                lambda s: _own_time_per_action(self.runners[s], inputs[s], repeats))
        forward, backward = zip(*self.coordinator.per_stage(mine))
        return list(forward), list(backward)

    @contextlib.contextmanager
    def timing_the_stages(self, flat_inputs: Sequence[Any] | None
                          ) -> Iterator[dict[int, dict[str, Any]]]:
        """Per stage held here, its first micro-batch's inputs, as one forward of
        `flat_inputs` hands them over, to time the stages' modules on meanwhile: nothing the
        timing does to the stages stays after (_timing_the_stages)."""
        with self._timing_the_stages():
            yield self._stage_inputs(flat_inputs)

    def _stage_inputs(self, flat_inputs: Sequence[Any] | None) -> dict[int, dict[str, Any]]:
        """Per stage held here, its first micro-batch's inputs, as one forward of `flat_inputs`
        through the pipeline (run without gradients) hands them over."""
        call = self._call(flat_inputs if self.first else None)
        programs = [[a for a in stage if a.kind in _FORWARD]
                    for stage in self.forward_schedule.actions]
        seen: dict[int, dict[str, Any]] = {}

        def watching(s: int, runner: StageRunner) -> Callable[..., dict[str, Any]]:
            def forward(mb: Any, values: Mapping[str, Any]) -> dict[str, Any]:
                seen.setdefault(s, {name: values[name] for name in runner.io.inputs})
                return type(runner).forward(runner, mb, values)
            return forward

        with contextlib.ExitStack() as watched:  # for this run only
            for s, runner in self.runners.items():
                watched.enter_context(_replaced(runner, "forward", watching(s, runner)))
            self.transport.prepare(call.key, call.sizes, call.seq)
            with torch.no_grad():
                self.driver.run(programs, Run(call.feeds, grad_enabled=False), call.key)
        return seen

    @contextlib.contextmanager
    def _timing_the_stages(self) -> Iterator[None]:
        """Meanwhile the stages run only to be timed: without their weight consistency
        policies (whose bookkeeping is for steps), their gradients set aside, and their
        buffers, the random number generators and the trace put back after. All stages'
        modules at once, as stages may share a tied weight."""
        modules = torch.nn.ModuleList(r.stage.module for r in self.runners.values())
        kept = (self._trace, self.trace_origin, self.last_schedule, self.last_sizes,
                self._recent)
        try:
            with _without_policies(self.runners.values()), gradients_set_aside(modules), \
                    preserved_state(modules):
                yield
        finally:
            (self._trace, self.trace_origin, self.last_schedule, self.last_sizes,
             self._recent) = kept

    def posting_time(self, flat_inputs: Sequence[Any] | None) -> Posting | None:
        """The transport's seconds per tensor around a message (DistTransport.measure_posting),
        measured on the micro-batches of `flat_inputs`, each rank computing as its stage does:
        its forward and backward on the values a forward of `flat_inputs` hands it (None where
        the transport has no such measure, or this rank sends and receives none of the
        measured message). Leaves no gradient, buffer or trace behind. Every rank of the
        pipeline must call it."""
        measure = getattr(self.transport, "measure_posting", None)
        if measure is None:
            return None
        with self.timing_the_stages(flat_inputs) as inputs:
            call = self._call(flat_inputs if self.first else None)
            self.transport.prepare(call.key, call.sizes, call.seq)
            if len(self.runners) != 1:  # one stage per rank is what the measure is made for
                return measure(call.key)
            (runner,) = self.runners.values()
            try:
                return measure(call.key, *_stage_timers(runner, inputs[runner.index]))
            finally:
                runner.discard("posting")  # what a failed run left in flight

    def _targets(self, targets: Sequence[Any], calls: Sequence[Call]) -> list[Any]:
        """Each mini-batch's target cut like its inputs; one clear error per kind of mismatch."""
        pieces = []
        for target, call in zip(targets, calls):
            if target is None:
                raise FxpipeError("the last stage computes the loss and needs the target: "
                                  "pass it to pipe.step(x, target) on every rank.")
            if rows([target]) == 0:
                raise FxpipeError(f"the target must be a tensor with one row per sample, got "
                                  f"{type(target).__name__}; e.g. pipe.step(x, labels).")
            if rows([target]) != sum(call.sizes):
                raise FxpipeError(f"the target has {rows([target])} rows but the inputs "
                                  f"{sum(call.sizes)}; give one target row per sample.")
            pieces += [chunk[0] for chunk in split([target], self.micro_batches)]
        return pieces

    @property
    def latest_schedule(self) -> Schedule:
        """The schedule the last run executed, or the planned one before any run."""
        return self.last_schedule or self.schedule

    def last_trace(self) -> list[Event]:
        """Every action of the last forward/backward or step this process ran, timed (seconds
        from its start)."""
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

    def run_forward(self, call: Call) -> Run:
        """The schedule's forward actions for `call`, keeping what its backward needs."""
        return self._run(_FORWARD, Run(call.feeds, grad_enabled=True), call,
                         schedule=self.forward_schedule)

    def run_backward(self, call: Call, output_grads: list[dict[str, Any]]) -> Run:
        """The schedule's backward actions for `call`, from the outputs' gradients."""
        run = Run(call.feeds, grad_enabled=True, output_grads=output_grads)
        return self._run(_BACKWARD, run, call, append=True, schedule=self.forward_schedule)

    def release(self, key: Any) -> None:
        """Forget a call whose backward will never run (its outputs were freed)."""
        for runner in self.runners.values():
            runner.discard(key)
        self.driver.discard(key)

    # --- internals ----------------------------------------------------------------------------

    def _call(self, flat_inputs: Sequence[Any] | None) -> Call:
        """Split the inputs (on the first stage) and agree on the micro-batch sizes."""
        if self.first:
            if flat_inputs is None:
                raise FxpipeError("the first stage reads the inputs: pass them to "
                                  "pipe.step(x, target) on every rank.")
            total = batch_size(flat_inputs, self.whole)
            flat_inputs = self.coordinator.shard(list(flat_inputs), self.whole)
            chunks = split(flat_inputs, self.micro_batches, self.whole)
            sizes = split_sizes(batch_size(flat_inputs, self.whole), self.micro_batches)
            seq = input_dims(flat_inputs, self.whole).seq
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
                        schedule=self.forward_schedule)
        return self._merged_outputs(run, call.sizes) if self.last else None

    def _run(self, kinds, run: Run, call: Call, append: bool = False,
             schedule: Schedule | None = None) -> Run:
        self.last_schedule, self.last_sizes = schedule or self.schedule, list(call.sizes)
        self._recent = []  # until a training step keeps itself (_train)
        programs = [[a for a in stage if kinds is None or a.kind in kinds]
                    for stage in self.last_schedule.actions]
        offset = max((e.end for e in self._trace), default=0.0) if append else 0.0
        self.transport.prepare(call.key, call.sizes, call.seq)
        self.driver.run(programs, run, call.key)
        self.trace_origin = run.started - offset  # wall-clock time of the trace's zero
        events = [Event(e.stage, e.action, e.start + offset, e.end + offset) for e in run.events]
        self._trace = (self._trace + events) if append else events
        return run

    def model_output(self, values: Mapping[str, Any]) -> Any:
        """The model's output, as its forward returns it, from the graph's output values by
        name (what the loss function is given)."""
        return self._model_output(values)

    def _merged_outputs(self, run: Run, sizes: list[int]) -> Any:
        per_mb = [output_values(self.output_leaves, run.outputs[mb])
                  for mb in range(len(sizes))]
        merged = merge(per_mb, sizes)
        return self.unflatten(pytree.tree_unflatten(merged, self.output_spec))


def _first_compute_excess(events: Sequence[Event]) -> dict[tuple[int, ActionKind], float]:
    """Per stage and kind of compute (F, B) that a step ran more than once: how much longer
    its first ran than the median of the others."""
    durations: dict[tuple[int, ActionKind], list[float]] = {}
    for e in sorted(events, key=lambda e: e.start):
        if e.action.kind in (K.F, K.B):
            durations.setdefault((e.stage, e.action.kind), []).append(e.duration)
    return {key: first - statistics.median(rest)
            for key, (first, *rest) in durations.items() if rest}


@contextlib.contextmanager
def _without_policies(runners: Iterable[StageRunner]) -> Iterator[None]:
    """The runners run without their weight consistency policies meanwhile: a policy's
    bookkeeping is for steps, not for timing the stages."""
    policies = [(runner, runner.policy) for runner in runners]
    for runner, _ in policies:
        runner.policy = None
    try:
        yield
    finally:
        for runner, policy in policies:
            runner.policy = policy


@contextlib.contextmanager
def _call_spans(runner: StageRunner, key: str) -> Iterator[list[float]]:
    """Meanwhile, the seconds of each call of `runner`'s stage module and of each autograd
    call of its backward, appended in order to the list yielded; with gradients enabled (a
    worker keeps its grad mode), and whatever runs under micro-batch keys (`key`, i) forgotten
    after."""
    module, began = runner.stage.module, [0.0]
    spans: list[float] = []
    backpropagate = runner.backpropagate

    def timed_backpropagate(*args: Any) -> None:
        start = time.perf_counter()
        backpropagate(*args)
        spans.append(time.perf_counter() - start)

    with contextlib.ExitStack() as undo, torch.enable_grad():
        for hook in (
                module.register_forward_pre_hook(
                    lambda *_: began.__setitem__(0, time.perf_counter())),
                module.register_forward_hook(
                    lambda *_: spans.append(time.perf_counter() - began[0]))):
            undo.callback(hook.remove)
        undo.callback(runner.discard, key)
        undo.enter_context(_replaced(runner, "backpropagate", timed_backpropagate))
        yield spans


def _own_time_per_action(runner: StageRunner, values: Mapping[str, Any], repeats: int
                         ) -> tuple[float, float]:
    """The medians of `repeats` forwards' time in `runner.forward` outside its stage module's
    call, and of their backwards' time in `runner.backward` outside its autograd call, each
    forward followed by its backward, as a stage runs ((0, 0) on a GPU)."""
    if runner.device.type != "cpu":
        return 0.0, 0.0
    forwards: list[float] = []
    backwards: list[float] = []
    with _call_spans(runner, "overhead") as spans:  # the last call's seconds: spans[-1]
        for i in range(repeats):
            key = ("overhead", i)
            start = time.perf_counter()
            outputs = runner.forward(key, values)
            forwards.append(time.perf_counter() - start - spans[-1])
            grads = _ones_for(runner, outputs)
            spans.append(0.0)  # no autograd call where no output needs a gradient
            start = time.perf_counter()
            runner.backward(key, grads)
            backwards.append(time.perf_counter() - start - spans[-1])
    return max(statistics.median(forwards), 0.0), max(statistics.median(backwards), 0.0)


def _switch_time(runner: StageRunner, values: Mapping[str, Any], rounds: int, seconds: float,
                 run: int = 4) -> tuple[float, float]:
    """How much longer `runner`'s stage module's call takes right after a backward than right
    after a forward, and its autograd call right after a forward than after a backward: the
    medians' differences, at least 0, over rounds of `run` forwards, then their backwards,
    then `run` forwards each followed by its backward (after a first round to warm up): at
    least `rounds`, and more until they took `seconds` (at most MOST_SWITCH_ROUNDS). (0, 0) on
    a GPU, whose host prepares an action while the device computes the one before."""
    if runner.device.type != "cpu":
        return 0.0, 0.0
    after: dict[tuple[str, str], list[float]] = {}  # (kind, the kind before) -> call seconds
    last = ["B"]
    keys = itertools.count()

    def took(kind: str) -> None:  # the call just made (its seconds: spans[-1])
        after.setdefault((kind, last[0]), []).append(spans[-1])
        last[0] = kind

    def forward() -> tuple[Any, dict[str, Any]]:
        key = ("switch", next(keys))
        outputs = runner.forward(key, values)
        took("F")
        return key, outputs

    def backward(key: Any, outputs: dict[str, Any]) -> None:
        spans.append(0.0)  # no autograd call where no output needs a gradient
        runner.backward(key, _ones_for(runner, outputs))
        took("B")

    with _call_spans(runner, "switch") as spans:
        start = time.perf_counter()
        for i in range(MOST_SWITCH_ROUNDS + 1):
            if i == 1:
                after.clear()  # the first round warmed up
                start = time.perf_counter()
            elif i > rounds and time.perf_counter() - start >= seconds:
                break
            for ran in [forward() for _ in range(run)]:
                backward(*ran)
            for _ in range(run):
                backward(*forward())
    median = {kinds: statistics.median(calls) for kinds, calls in after.items()}
    return (max(median["F", "B"] - median["F", "F"], 0.0),
            max(median["B", "F"] - median["B", "B"], 0.0))


_NOTHING = object()


@contextlib.contextmanager
def _replaced(obj: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """`obj.name` is `replacement` on this instance meanwhile; after, whatever the instance had
    before again (its class's method, or an attribute of its own)."""
    own = vars(obj).get(name, _NOTHING)
    setattr(obj, name, replacement)
    try:
        yield
    finally:
        if own is _NOTHING:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


def _stage_timers(runner: StageRunner, values: Mapping[str, Any]
                  ) -> tuple[Callable[[], float], Callable[[], float]]:
    """Two calls that return their seconds: one runs the stage's forward on `values`, as a
    step does (its graph dropped after); the other a forward, untimed, and its backward."""
    keys = itertools.count()

    def timed(work: Callable[[], Any]) -> float:
        start = time.perf_counter()
        work()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return time.perf_counter() - start

    def forward() -> float:
        with torch.enable_grad():  # a worker thread keeps the last run's grad mode
            seconds = timed(lambda: runner.forward(("posting", next(keys)), values))
        runner.discard("posting")  # the graph goes, as its backward would free it
        return seconds

    def backward() -> float:
        key = ("posting", next(keys))
        with torch.enable_grad():
            gradients = _ones_for(runner, runner.forward(key, values))
            timed(lambda: None)  # the forward's kernels done (on a GPU) before the timing
            return timed(lambda: runner.backward(key, gradients))

    return forward, backward


def _stand_in_loss(outputs: Mapping[str, Any]) -> torch.Tensor:
    """A loss with a step's backward and no target: the sum of the floating outputs that carry
    a gradient, times 0."""
    leaves = [value.sum() for value in outputs.values() if isinstance(value, torch.Tensor)
              and value.is_floating_point() and value.requires_grad]
    return torch.stack(leaves).sum() * 0.0 if leaves else torch.zeros((), requires_grad=True)


def _ones_for(runner: StageRunner, values: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """All-ones gradients for the stage's outputs among `values` that need one."""
    return {name: torch.ones_like(value) for name, value in values.items()
            if name in runner.io.outputs and isinstance(value, torch.Tensor)
            and value.requires_grad}


def lowered_schedule(name: str, stages: int, micro_batches: int, comm: CommTable,
                     minibatches: int = 2) -> Schedule:
    """The schedule with its sends and receives for the stage edges, checked to not hang
    (async-1f1b streams `minibatches` mini-batches)."""
    extra = {"minibatches": minibatches} if name == "async-1f1b" else {}
    edges = {(e.src, e.dst) for e in comm.edges}
    schedule = add_communication(build(name, stages, micro_batches, **extra), edges)
    check_communication(schedule)
    return schedule
