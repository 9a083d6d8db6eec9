"""The driver: runs device programs over StageRunners, one worker thread per device."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from fxpipe.errors import FxpipeError
from fxpipe.ir import CommTable, Event
from fxpipe.precision import weight_casts_kept
from fxpipe.runtime.clock import action_clock
from fxpipe.runtime.stage import StageRunner
from fxpipe.runtime.transport import (
    DeviceCopies,
    MicroBatchKey,
    PipelineAborted,
    Transport,
    device_context,
    to_device,
)
from fxpipe.schedules import Action, ActionKind, delivered_sends, forwards_first
from fxpipe.schedules.lowering import Message

__all__ = ["Driver", "Run"]

K = ActionKind


@dataclasses.dataclass
class Run:
    """One execution of action lists: what goes in, and what comes out, per micro-batch."""

    feeds: Sequence[Mapping[str, Any]]  # per micro-batch: the model's inputs by name
    grad_enabled: bool = True
    loss: Callable[[int, Mapping[str, Any]], torch.Tensor] | None = None  # (mb, outputs) -> loss
    output_grads: Sequence[Mapping[str, Any]] | None = None  # per mb: grads of model outputs
    # per micro-batch: the model's outputs, kept only by a run without a loss (the drop-in
    # forward returns them); a run with a loss keeps its detached losses, so that each
    # micro-batch's graph (and the weight copies it reaches) goes with its backward
    outputs: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    losses: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    input_grads: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    events: list[Event] = dataclasses.field(default_factory=list)
    on_action: Callable[[Action], None] | None = None  # STEP / ALLREDUCE handler
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None  # a loss -> its backward's root
    started: float = 0.0  # wall-clock time (time.time()) the run began: events are relative


class Driver:
    """Executes device programs over the runners this process holds: every device (one
    worker thread each, walking the actions of the stages it holds) in one process, or one
    rank's stages under torch.distributed (its one program, run inline).

    Each worker walks its device's program in order (GroPipe's PMPIA): F, B and W call the
    stage's runner, SEND/RECV go through the transport (between two stages of one device too:
    the lowered programs send before they receive, so a device never waits on itself), so
    every schedule shares this loop. Every action is recorded as a timeline Event; a failing
    stage aborts the transport so the others stop.
    """

    def __init__(self, runners: Mapping[int, StageRunner], comm: CommTable,
                 transport: Transport) -> None:
        self.runners = dict(runners)
        self.last_stage = len(comm.stages) - 1
        self.comm = comm
        # per (src, dst): the values one message carries (a gradient travels back for each)
        self.crossing = {pair: [e.value for e in edges] for pair, edges in comm.by_pair().items()}
        self.transport = transport
        self.pool = (ThreadPoolExecutor(len(runners), thread_name_prefix="fxpipe-stage")
                     if len(runners) > 1 else None)
        self._state: dict[int, _StageState] = {}
        self.stuck: list[int] = []  # stages whose worker never returned from a failed run
        self.copies = DeviceCopies()  # the inputs' copies to the first stage's device

    def run(self, programs: Sequence[Sequence[Action]], run: Run, run_id: Any = None) -> Run:
        """Execute each of `programs` (a device's: the actions of the stages it holds, in the
        order it runs them) on its own worker, those whose stages are held here; `run_id`
        keeps this run's in-flight micro-batches apart from another run's (a forward now, its
        backward later)."""
        if self.stuck:
            raise FxpipeError(
                f"the worker of stage(s) {self.stuck} is still running that stage's own code "
                "from a step that failed, and a thread cannot be stopped, so this pipeline "
                "cannot run again: compile the model again (and find why that code does not "
                "return).")
        self.transport.reset()
        # thread-local, like grad mode: carried over to the workers
        autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
                    if torch.is_autocast_enabled(kind)]
        run.started = time.time()
        start = time.perf_counter()
        # where each device learns that a message it sent was received: its send completes
        # there, so a long run holds only the messages in flight, not every one it sent
        delivered = delivered_sends(programs)
        walks = [(self._walk, program, run, run_id, start, autocast, known)
                 for program, known in zip(programs, delivered)
                 if program and program[0].stage in self.runners]
        if self.pool is None or len(walks) == 1:
            outcomes = [_error_of(*walk) for walk in walks]
        else:
            outcomes = self._outcomes([self.pool.submit(*walk) for walk in walks], walks)
        failures = [(e.stage, e.error) for e in outcomes if e is not None]  # _StageFailed
        if not failures:
            self.transport.flush()
        else:
            self.discard(run_id)
            stage, error = next(((s, e) for s, e in failures
                                 if not isinstance(e, PipelineAborted)), failures[0])
            if isinstance(error, FxpipeError):  # ours, or another rank's failure: as it is
                raise error
            raise RuntimeError(f"stage {stage} failed: {type(error).__name__}: {error}"
                               ) from error
        run.events.sort(key=lambda e: (e.stage, e.start))
        return run

    def _outcomes(self, futures: Sequence[Future], walks: Sequence[tuple]) -> list[Any]:
        """Each worker's failure, or None. Once one fails the others stop at their next
        message (the transport is aborted), but a worker stuck in its stage's own code does
        not: it gets the transport's timeout, then the run fails naming its stages."""
        pending = wait(futures, return_when=FIRST_EXCEPTION).not_done
        if pending:
            pending = wait(pending, timeout=getattr(self.transport, "timeout", None)).not_done
        if not pending:
            return [f.exception() for f in futures]
        self.stuck = sorted({a.stage for f, walk in zip(futures, walks) if f in pending
                             for a in walk[1]})
        failed = next(f.exception() for f in futures if f.done() and f.exception())
        raise FxpipeError(
            f"stage(s) {self.stuck} did not stop after the step failed ({failed.error!r}): "
            "their worker is stuck in the stage's own code (a forward or backward that does not "
            "return), and a thread cannot be stopped; this pipeline cannot run again (compile "
            "the model again), and the process exits only once that code returns.") \
            from failed.error

    def _walk(self, program: Sequence[Action], run: Run, run_id: Any, start: float,
              autocast: Sequence[tuple[str, torch.dtype]],
              delivered: Mapping[int, Sequence[Message]]) -> None:
        """Walk a device's program in order on this thread, blocking in its receives: each
        action goes to its stage's runner, with that stage's own bookkeeping (a `_Walk` of
        the stage's actions); after action i, the transport completes the sends
        `delivered[i]` (delivered_sends). A failure aborts the transport and is raised as the
        failing action's stage's (_StageFailed)."""
        held = sorted({a.stage for a in program})
        s = held[0]
        try:
            walks = {t: _Walk(t, [a for a in program if a.stage == t],
                              self._state.setdefault(t, _StageState())) for t in held}
            devices = {self.runners[t].device for t in held}
            if len(devices) > 1:  # one worker runs on one device
                raise FxpipeError(f"stages {held} run on one worker but sit on devices "
                                  f"{sorted(map(str, devices))}; place them on one device")
            marks: list[tuple[int, Action, Any, Any]] = []
            with contextlib.ExitStack() as context:  # undone after, on the caller's thread too
                context.enter_context(torch.set_grad_enabled(run.grad_enabled))
                context.enter_context(device_context(self.runners[s].device))
                # a GPU's actions are timed on its stream: the kernels, not their launch
                clock = action_clock(self.runners[s].device, start)
                for device_type, dtype in autocast:
                    context.enter_context(torch.autocast(device_type, dtype=dtype))
                if any(self.runners[t].precision for t in held):  # one cast of each weight
                    context.enter_context(weight_casts_kept())
                # GPipe: post every receive now, as its messages come back to back (over gloo
                # a receive posted while data arrives on its connection stalls); otherwise
                # only the next receive is posted ahead, which keeps 1F1B's bound on the
                # micro-batches in flight
                for walk in walks.values():
                    if forwards_first(walk.program):
                        for ahead in (walk.program[i] for i in walk.receives):
                            self.transport.prefetch(ahead.peer, walk.stage, _direction(ahead),
                                                    MicroBatchKey(run_id, ahead.mb))
                position = dict.fromkeys(held, 0)  # each stage's next action in its own list
                for i, a in enumerate(program):
                    s = a.stage
                    marks.append(self._advance(walks[s], position[s], run, run_id, clock))
                    position[s] += 1
                    for src, dst, direction, mb in delivered.get(i, ()):
                        self.transport.delivered(src, dst, direction, MicroBatchKey(run_id, mb))
                run.events.extend(Event(t, a, clock.seconds(began), clock.seconds(ended))
                                  for t, a, began, ended in marks)
        except BaseException as error:
            self.transport.abort(error)
            raise _StageFailed(s, error) from error

    def _advance(self, walk: _Walk, i: int, run: Run, run_id: Any, clock: Any
                 ) -> tuple[int, Action, Any, Any]:
        """Run the stage's action i and drop what no later action of it needs; returns its
        clock's marks around it."""
        s, state = walk.stage, walk.state
        action, ahead = walk.program[i], walk.ahead[i]
        if ahead is not None:  # start its transfer during this compute
            self.transport.prefetch(ahead.peer, s, _direction(ahead),
                                    MicroBatchKey(run_id, ahead.mb))
        key = MicroBatchKey(run_id, action.mb)
        began = clock.mark()
        self._execute(walk, action, run, key)
        ended = clock.mark()
        if walk.last_value_use.get(action.mb) == i:
            state.values.pop(key, None)
        if walk.last_grad_use.get(action.mb) == i:
            state.input_grads.pop(key, None)
        return s, action, began, ended

    def _execute(self, walk: _Walk, a: Action, run: Run, key: MicroBatchKey) -> None:
        s, state = walk.stage, walk.state
        runner = self.runners[s]
        if a.kind is K.RECV_F:
            state.values[key].update(self.transport.recv(a.peer, s, "F", key))
        elif a.kind is K.F:
            values = state.values[key]
            if s == 0:  # the inputs, from wherever the caller has them
                values.update(to_device(run.feeds[a.mb], runner.device, self.copies))
            values.update(runner.forward(key, values, split=a.mb in walk.split))
            if s == self.last_stage:
                self._finish_forward(runner, key, values, run)
        elif a.kind is K.SEND_F:
            values = state.values[key]
            self.transport.send(s, a.peer, "F", key,
                                {v: values[v] for v in self.crossing[s, a.peer]})
        elif a.kind is K.RECV_B:
            _accumulate(state.grads[key], self.transport.recv(a.peer, s, "B", key))
        elif a.kind is K.B:
            grads = state.grads.pop(key, {})
            if run.output_grads is not None and s == self.last_stage:
                _accumulate(grads, run.output_grads[a.mb])
            split = a.mb in walk.split  # its W comes later: input gradients only now
            state.input_grads[key] = runner.backward(key, grads, last=a == walk.last_gradient,
                                                     split=split)
            if s == 0:
                run.input_grads[a.mb] = state.input_grads[key]
        elif a.kind is K.SEND_B:
            grads = state.input_grads[key]
            self.transport.send(s, a.peer, "B", key,
                                {v: grads.get(v) for v in self.crossing[a.peer, s]})
        elif a.kind is K.W:
            runner.weight_backward(key, last=a == walk.last_gradient)
        elif a.kind in (K.STEP, K.ALLREDUCE):
            if run.on_action is not None:
                run.on_action(a)
            if a.kind is K.STEP:  # the weights changed: autocast's casts of them are stale
                torch.clear_autocast_cache()
        else:
            raise FxpipeError(f"the runtime cannot run {a} ({a.kind.name}) yet")

    def _finish_forward(self, runner: StageRunner, key: MicroBatchKey,
                        values: Mapping[str, Any], run: Run) -> None:
        outputs = {name: values[name] for name in self.comm.graph_outputs}
        if run.loss is None:
            run.outputs[key.mb] = outputs
        else:
            with runner.autocast():
                loss = run.loss(key.mb, outputs)
            if run.grad_enabled:  # fp16: the loss scaled, so that small gradients stay above 0
                runner.add_root(key, run.scale(loss) if run.scale is not None else loss)
            run.losses[key.mb] = loss.detach()

    def discard(self, run: Any) -> None:
        """Forget what the stages hold for `run`: between actions, and its micro-batches in
        flight (those whose backward never ran)."""
        for runner in self.runners.values():
            runner.discard(run)
        for state in self._state.values():
            for table in (state.values, state.grads, state.input_grads):
                for key in [key for key in table if key.run == run]:
                    del table[key]


def _direction(receive: Action) -> str:
    return "F" if receive.kind is K.RECV_F else "B"


def _error_of(fn: Callable[..., Any], *args: Any) -> BaseException | None:
    try:
        fn(*args)
    except BaseException as error:  # reported like a worker thread's failure
        return error
    return None


class _StageFailed(Exception):
    """A worker's failure, and the stage whose action raised it."""

    def __init__(self, stage: int, error: BaseException) -> None:
        super().__init__(stage, error)
        self.stage, self.error = stage, error


class _Walk:
    """One stage's action list in a run, walked an action at a time."""

    def __init__(self, stage: int, program: Sequence[Action], state: _StageState) -> None:
        self.stage, self.program, self.state = stage, program, state
        # after these actions, a micro-batch's values / input gradients are no longer needed
        self.last_value_use = {a.mb: i for i, a in enumerate(program)
                               if a.kind in (K.F, K.SEND_F)}
        self.last_grad_use = {a.mb: i for i, a in enumerate(program)
                              if a.kind in (K.B, K.SEND_B)}
        # micro-batches whose backward is split: B computes the input gradients, W (later)
        # the weights'
        self.split = {a.mb for a in program if a.kind is K.W}
        finishing = [a for a in program if a.kind is K.W or (a.kind is K.B and a.mb not in
                                                              self.split)]
        # the action that completes the stage's last gradient: its hook's "finishing"
        self.last_gradient = finishing[-1] if finishing else None
        self.receives = [i for i, a in enumerate(program) if a.kind in (K.RECV_F, K.RECV_B)]
        # per action, the receive to post ahead while it runs: a compute's first one after it
        self.ahead: list[Action | None] = []
        following = None
        for a in reversed(program):
            self.ahead.append(following if a.kind.is_compute else None)
            if a.kind in (K.RECV_F, K.RECV_B):
                following = a
        self.ahead.reverse()


class _StageState:
    """What one stage holds between actions, per micro-batch."""

    def __init__(self) -> None:
        self.values: dict[MicroBatchKey, dict[str, Any]] = defaultdict(dict)
        self.grads: dict[MicroBatchKey, dict[str, Any]] = defaultdict(dict)
        self.input_grads: dict[MicroBatchKey, dict[str, Any]] = {}


def _accumulate(into: dict[str, Any], grads: Mapping[str, Any]) -> None:
    """Sum gradients per value: a value sent to several stages gets one gradient from each."""
    for name, grad in grads.items():
        if grad is None:
            continue
        into[name] = grad if into.get(name) is None else into[name] + grad
