"""The driver: runs per-stage action lists over StageRunners, a worker thread per stage (or
per group of stages: Driver.share).

Each worker walks its stage's list in order (GroPipe's PMPIA: a worker per device, fed by its
in/out messages); a worker holding several stages runs, an action at a time, the first of them
whose next action need not wait for a message. F and B call the runner; SEND/RECV go through
the transport; the action list alone decides what runs when, so gpipe, 1f1b and async
schedules share this loop. Every action is timed; a failing stage aborts the transport so the
others stop instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from fxpipe.errors import FxpipeError
from fxpipe.ir import CommTable
from fxpipe.runtime.stage import StageRunner
from fxpipe.runtime.transport import PipelineAborted, Transport, device_context
from fxpipe.schedules import Action, ActionKind, forwards_first
from fxpipe.simulate import Event

__all__ = ["Driver", "Run"]

K = ActionKind
T = TypeVar("T")


@dataclasses.dataclass
class Run:
    """One execution of action lists: what goes in, and what comes out, per micro-batch."""

    feeds: Sequence[Mapping[str, Any]]  # per micro-batch: the model's inputs by name
    grad_enabled: bool = True
    loss: Callable[[int, Mapping[str, Any]], torch.Tensor] | None = None  # (mb, outputs) -> loss
    output_grads: Sequence[Mapping[str, Any]] | None = None  # per mb: grads of model outputs
    outputs: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    losses: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    input_grads: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    events: list[Event] = dataclasses.field(default_factory=list)
    on_action: Callable[[Action], None] | None = None  # STEP / ALLREDUCE handler
    started: float = 0.0  # wall-clock time (time.time()) the run began: events are relative
    # a thread running several stages: its stages and seconds, each time it waited for a message
    waits: list[tuple[tuple[int, ...], float]] = dataclasses.field(default_factory=list)
    autocast: list[tuple[str, torch.dtype]] = dataclasses.field(default_factory=list)


class Driver:
    """Executes action lists over the runners this process holds: every stage (one worker
    thread each) in one process, or one stage under torch.distributed (run inline)."""

    def __init__(self, runners: Mapping[int, StageRunner], comm: CommTable,
                 transport: Transport, threads: int | None = None) -> None:
        self.runners = dict(runners)
        self.last_stage = len(comm.stages) - 1
        self.threads = threads  # intra-op threads of each worker
        self.comm = comm
        self.transport = transport
        self.pool = (ThreadPoolExecutor(len(runners), thread_name_prefix="fxpipe-stage")
                     if len(runners) > 1 else None)
        self._state: dict[int, _StageState] = {}
        self.cores_of: dict[int, tuple[int, ...]] = {}  # stage -> the CPUs its worker runs on
        self._everywhere: tuple[int, ...] | None = None  # the process's CPUs, once bound
        # the stages each worker thread runs, in the order it prefers them (share)
        self.workers: tuple[tuple[int, ...], ...] = tuple((s,) for s in self.runners)

    def bind(self, cores_of: Mapping[int, Sequence[int]]) -> None:
        """From the next run on, run each stage s of `cores_of` on the CPUs cores_of[s] only,
        and every other stage on the CPUs the process could use when first bound: the worker
        taking a stage binds itself (a pool's workers take whichever stage comes next, so each
        binds afresh). Only with a worker per stage: never the caller's thread. It gives each
        stage a thread of its own again (undoing `share`)."""
        if self.pool is None or not hasattr(os, "sched_setaffinity"):
            return
        self.workers = tuple((s,) for s in self.runners)  # a worker per stage, each bound
        if self._everywhere is None:
            self._everywhere = tuple(sorted(os.sched_getaffinity(0)))
        self.cores_of = {s: tuple(cpus) for s, cpus in cores_of.items()}

    def share(self, groups: Sequence[Sequence[int]]) -> None:
        """From the next run on, run each group of stages on one worker thread: it takes, of
        its stages, the first in the group's order whose next action can run without waiting
        (for a receive, its message is there), and waits for a message only when none can.
        Every stage held here in exactly one group, a group's stages on one device, and a
        transport that tells whether a message arrived (LocalTransport). Fewer threads than
        stages contend less for Python's interpreter lock. Where a thread runs several stages,
        the binding of stage threads to cores (`bind`) ends, and `bind` undoes this."""
        groups = tuple(tuple(int(s) for s in group) for group in groups)
        held = sorted(s for group in groups for s in group)
        if not groups or not all(groups) or held != sorted(self.runners):
            raise ValueError(f"groups={groups}: give every stage held here "
                             f"({sorted(self.runners)}) in exactly one non-empty group")
        for group in groups:
            if len({self.runners[s].device for s in group}) > 1:
                raise ValueError(f"stages {group} are on different devices: a thread running "
                                 "several stages runs them on one device")
        if any(len(group) > 1 for group in groups):
            if not hasattr(self.transport, "wait_for_any"):
                raise ValueError(f"{type(self.transport).__name__} cannot tell a thread "
                                 "running several stages which message arrived")
            self.transport.share_wakeups(groups)
            self.cores_of = {}
        self.workers = groups

    def _on_own_cores(self, s: int) -> None:
        if self._everywhere is None:
            return
        try:
            os.sched_setaffinity(0, self.cores_of.get(s, self._everywhere))
        except OSError:  # a CPU no longer the process's (its cpuset changed): bind no more
            self.cores_of = {}
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._everywhere)

    def run(self, programs: Sequence[Sequence[Action]], run: Run, key: Any = None) -> Run:
        """Execute `programs[s]` on every stage s held here; `key` keeps this run's in-flight
        micro-batches apart from another run's (a forward now, its backward later)."""
        self.transport.reset()
        run.autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
                        if torch.is_autocast_enabled(kind)]
        run.started = time.time()
        start = time.perf_counter()
        if self.pool is None:
            outcomes = [_error_of(self._worker_loop, self.workers[0], programs, run, key, start)]
        else:
            futures = [self.pool.submit(self._worker_loop, group, programs, run, key, start)
                       for group in self.workers]
            outcomes = [f.exception() for f in futures]
        # every worker's failure is a _StageFailed (_worker_loop)
        failures = [(e.stage, e.error) for e in outcomes if e is not None]
        if not failures:
            self.transport.flush()
        else:
            for runner in self.runners.values():
                runner.discard(key)
            self.discard(key)
            stage, error = next(((s, e) for s, e in failures
                                 if not isinstance(e, PipelineAborted)), failures[0])
            if isinstance(error, FxpipeError):  # ours, or another rank's failure: as it is
                raise error
            raise RuntimeError(f"stage {stage} failed: {type(error).__name__}: {error}"
                               ) from error
        run.events.sort(key=lambda e: (e.stage, e.start))
        return run

    def on_stage_workers(self, fn: Callable[[int], T]) -> dict[int, T]:
        """fn(s) for every stage s held here, each on the stage's worker thread (with its
        intra-op threads), the workers all at once, as the stages run in a step (a worker's
        stages one after another); inline for one."""
        def on_worker(group: tuple[int, ...]) -> dict[int, T]:
            if self.threads is not None:
                torch.set_num_threads(self.threads)
            self._on_own_cores(group[0])  # several stages: no binding (share), every CPU
            return {s: fn(s) for s in group}  # a worker's stages one after another

        if self.pool is None:
            return on_worker(tuple(self.runners))
        done: dict[int, T] = {}
        for future in [self.pool.submit(on_worker, group) for group in self.workers]:
            done.update(future.result())
        return {s: done[s] for s in self.runners}

    def _worker_loop(self, stages: tuple[int, ...], programs: Sequence[Sequence[Action]],
                     run: Run, key: Any, start: float) -> None:
        """Walk the programs of `stages` on this thread: one stage's in order, blocking in its
        receives; several stages' an action at a time, the first in order that need not wait
        (share). A failure aborts the transport and is raised as the stage's (_StageFailed)."""
        current = stages[0]
        try:
            torch.set_grad_enabled(run.grad_enabled)
            if self.threads is not None:
                torch.set_num_threads(self.threads)  # per thread: this worker's parallel regions
            self._on_own_cores(stages[0])  # several stages: no binding (share), every CPU
            context = contextlib.ExitStack()
            context.enter_context(device_context(self.runners[stages[0]].device))
            for device_type, dtype in run.autocast:  # thread-local, like grad mode: carried over
                context.enter_context(torch.autocast(device_type, dtype=dtype))
            walks = [_Walk(s, programs[s], self._state.setdefault(s, _StageState()))
                     for s in stages]
            with context:
                for walk in walks:
                    # GPipe: post every receive now (its gradient buffers, one per micro-batch
                    # like its inputs, then exist from the start too): over gloo, a receive
                    # posted on a connection while data arrives on it stalls for milliseconds,
                    # and GPipe's messages come back to back. Otherwise only the next receive
                    # is posted ahead, which keeps 1F1B's bound on micro-batches in flight.
                    if forwards_first(walk.program):
                        for ahead in (walk.program[i] for i in walk.receives):
                            self.transport.prefetch(ahead.peer, walk.stage, _direction(ahead),
                                                    (key, ahead.mb))
                if len(walks) == 1:  # the stage's list in order, as quickly as it goes
                    (walk,) = walks
                    for _ in walk.program:
                        self._advance(walk, run, key, start)
                    return
                pending = [w for w in walks if not w.done]
                while pending:
                    walk = next((w for w in pending if self._can_go_on(w, key)), None)
                    if walk is None:  # every stage's next action is a receive still on its way
                        waiting = time.perf_counter()
                        self.transport.wait_for_any([w.awaited(key) for w in pending])
                        run.waits.append((stages, time.perf_counter() - waiting))
                        continue
                    current = walk.stage
                    self._advance(walk, run, key, start)
                    if walk.done:
                        pending.remove(walk)
        except BaseException as error:
            self.transport.abort(error)
            raise _StageFailed(current, error) from error

    def _can_go_on(self, walk: _Walk, key: Any) -> bool:
        """Whether the stage's next action runs without waiting for a message."""
        awaited = walk.awaited(key)
        return awaited is None or self.transport.arrived(*awaited)

    def _advance(self, walk: _Walk, run: Run, key: Any, start: float) -> None:
        """Run the stage's next action, timed, and drop what no later action of it needs."""
        s, i, state = walk.stage, walk.next, walk.state
        action, ahead = walk.program[i], walk.ahead[i]
        if ahead is not None:  # start its transfer during this compute
            self.transport.prefetch(ahead.peer, s, _direction(ahead), (key, ahead.mb))
        began = time.perf_counter()
        self._execute(s, action, run, key, state)
        run.events.append(Event(s, action, began - start, time.perf_counter() - start))
        if walk.last_value_use.get(action.mb) == i:
            state.values.pop((key, action.mb), None)
        if walk.last_grad_use.get(action.mb) == i:
            state.input_grads.pop((key, action.mb), None)
        walk.next += 1

    def _execute(self, s: int, a: Action, run: Run, key: Any, state: _StageState) -> None:
        runner, mb = self.runners[s], (key, a.mb)
        if a.kind is K.RECV_F:
            state.values[mb].update(self.transport.recv(a.peer, s, "F", mb))
        elif a.kind is K.F:
            values = state.values[mb]
            if s == 0:
                values.update(run.feeds[a.mb])
            values.update(runner.forward(mb, values))
            if s == self.last_stage:
                self._finish_forward(runner, mb, a.mb, values, run)
        elif a.kind is K.SEND_F:
            values = state.values[mb]
            self.transport.send(s, a.peer, "F", mb, {e.value: values[e.value]
                                                     for e in self.comm.sends(s)
                                                     if e.dst == a.peer})
        elif a.kind is K.RECV_B:
            _accumulate(state.grads[mb], self.transport.recv(a.peer, s, "B", mb))
        elif a.kind is K.B:
            grads = state.grads.pop(mb, {})
            if run.output_grads is not None and s == self.last_stage:
                _accumulate(grads, run.output_grads[a.mb])
            state.input_grads[mb] = runner.backward(mb, grads, last=a == state.last_backward)
            if s == 0:
                run.input_grads[a.mb] = state.input_grads[mb]
        elif a.kind is K.SEND_B:
            grads = state.input_grads[mb]
            self.transport.send(s, a.peer, "B", mb, {e.value: grads.get(e.value)
                                                     for e in self.comm.recvs(s)
                                                     if e.src == a.peer})
        elif a.kind in (K.STEP, K.ALLREDUCE):
            if run.on_action is not None:
                run.on_action(a)
        else:
            raise FxpipeError(f"the local runtime cannot run {a} ({a.kind.name}) yet")

    def _finish_forward(self, runner, mb, index, values, run: Run) -> None:
        outputs = {name: values[name] for name in self.comm.graph_outputs}
        run.outputs[index] = outputs
        if run.loss is not None:
            loss = run.loss(index, outputs)
            if run.grad_enabled:
                runner.add_root(mb, loss)
            run.losses[index] = loss.detach()

    def discard(self, key: Any) -> None:
        """Forget what the stages hold between actions for run `key`."""
        for state in self._state.values():
            for table in (state.values, state.grads, state.input_grads):
                for mb in [mb for mb in table if mb[0] == key]:
                    del table[mb]


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
        self.stage, self.program, self.state, self.next = stage, program, state, 0
        # after these actions, a micro-batch's values / input gradients are no longer needed
        self.last_value_use = {a.mb: i for i, a in enumerate(program)
                               if a.kind in (K.F, K.SEND_F)}
        self.last_grad_use = {a.mb: i for i, a in enumerate(program)
                              if a.kind in (K.B, K.SEND_B)}
        backwards = [a for a in program if a.kind is K.B]
        state.last_backward = backwards[-1] if backwards else None
        self.receives = [i for i, a in enumerate(program) if a.kind in (K.RECV_F, K.RECV_B)]
        # per action, the receive to post ahead while it runs: a compute's first one after it
        self.ahead: list[Action | None] = []
        following = None
        for a in reversed(program):
            self.ahead.append(following if a.kind in (K.F, K.B) else None)
            if a.kind in (K.RECV_F, K.RECV_B):
                following = a
        self.ahead.reverse()

    @property
    def done(self) -> bool:
        return self.next == len(self.program)

    def awaited(self, key: Any) -> tuple[int, int, str, Any] | None:
        """The message (src, dst, direction, micro-batch) the next action receives, if any."""
        a = self.program[self.next]
        if a.kind not in (K.RECV_F, K.RECV_B):
            return None
        return a.peer, self.stage, _direction(a), (key, a.mb)


class _StageState:
    """What one stage holds between actions, per micro-batch key."""

    def __init__(self) -> None:
        self.values: dict[Any, dict[str, Any]] = defaultdict(dict)
        self.grads: dict[Any, dict[str, Any]] = defaultdict(dict)
        self.input_grads: dict[Any, dict[str, Any]] = {}
        self.last_backward: Action | None = None


def _accumulate(into: dict[str, Any], grads: Mapping[str, Any]) -> None:
    """Sum gradients per value: a value sent to several stages gets one gradient from each."""
    for name, grad in grads.items():
        if grad is None:
            continue
        into[name] = grad if into.get(name) is None else into[name] + grad
