"""CompiledPipeline: the drop-in module `fxpipe.compile` returns."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils.hooks import RemovableHandle

from fxpipe.affinity import format_cpus, usable_cores
from fxpipe.allocator import describe
from fxpipe.cost import CostTable, Link, Partition
from fxpipe.errors import FxpipeError
from fxpipe.inspect import chrome_trace, format_bytes, format_graph, format_stage_table
from fxpipe.ir import CommTable, Stage, StageHook
from fxpipe.materialize import materialize
from fxpipe.plan import Plan
from fxpipe.plot import save_timeline
from fxpipe.report import (
    format_report,
    interference,
    late_messages,
    shared_cores_lines,
    step_time,
    unlike_prediction_lines,
)
from fxpipe.runtime.executor import ThreadCosts
from fxpipe.runtime.microbatch import split_sizes
from fxpipe.schedules import ActionKind, Schedule, forwards_first
from fxpipe.simulate import Event, Timeline, simulate
from fxpipe.trace import Traced
from fxpipe.units import Unit

__all__ = ["CompiledPipeline"]


class CompiledPipeline(torch.nn.Module):
    """A model compiled into pipeline stages, usable wherever the model was.

    It holds the model's own submodules, parameters and buffers under their original names, so
    `parameters()`, `state_dict()` and `load_state_dict()` are the model's; the stages share
    those objects. `graph` is the rewritten PipelineGraph (an fx.GraphModule).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        plan: Plan,
        traced: Traced,
        units: Sequence[Unit],
        partition: Partition,
        graph: fx.GraphModule,
        comm: CommTable,
        devices: Sequence[str],
        cost: CostTable,
        link: Link,
    ) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in
                                 model._non_persistent_buffers_set)
        self.train(model.training)
        # Plain attributes, not submodules: the stages share the parameters registered above.
        vars(self).update(
            plan=plan, traced=traced, units=tuple(units), partition=partition, graph=graph,
            comm=comm, devices=tuple(devices), model_name=type(model).__name__, cost=cost,
            link=link, executor=None, intra_layer=[], timing=None,  # timing: set by compile
            step_overhead=0.0,  # seconds a step spends outside its schedule, once measured
            forward_overhead=(0.0,) * plan.stages,  # per stage: the runtime's own per forward
            backward_overhead=(0.0,) * plan.stages,  # and per backward
            # per stage: how much longer a forward takes right after a backward, and a
            # backward right after a forward, than after their own kind
            forward_switch=(0.0,) * plan.stages,
            backward_switch=(0.0,) * plan.stages,
            # per stage on a thread running several: that thread's costs (ThreadCosts)
            thread_costs={},
            link_probe=None,  # flat inputs -> the link measured as compile did: set by compile
            # under torchrun: (ranks computing on this host's CPU, the CPUs they may use)
            host_cores=None,
            # stage threads beyond this process's cores: how much of the units' work as many
            # threads as the stages and as the cores got through at once (a ThreadCapacity,
            # set by compile)
            thread_capacity=None,
        )

    @property
    def frontend(self) -> str:
        return self.traced.frontend

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(self.graph.get_submodule(f"stage{s}") for s in range(self.plan.stages))

    def stage_hook(self, stage: int) -> StageHook:
        return self.graph.get_submodule(f"hook{stage}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output, computed micro-batch by micro-batch through the pipeline stages;
        `loss.backward()` then runs the pipelined backward."""
        flat = self.traced.bind(args, kwargs)
        if self.executor is None:
            return self.run_sequential(*args, **kwargs)
        return self.executor.forward(flat)

    def run_sequential(self, *args: Any, **kwargs: Any) -> Any:
        """The PipelineGraph run as an ordinary module, one stage after another: the reference
        every pipelined run is checked against."""
        return self.traced.bind.unflatten(self.graph(*self.traced.bind(args, kwargs)))

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`pipe.step(*inputs, target)`: run the whole schedule on one mini-batch (forward and
        backward, interleaved as the schedule says) and return the mini-batch's mean loss.
        Gradients accumulate in the parameters' .grad; the optimizer step is yours."""
        if self.plan.loss_fn is None:
            raise FxpipeError("pipe.step(x, target) computes the loss inside the pipeline and "
                              "needs Plan(loss_fn=...), e.g. loss_fn=torch.nn.functional."
                              "cross_entropy; or call loss_fn(pipe(x), target).backward().")
        if not args:
            raise FxpipeError("pipe.step(*inputs, target) needs the target as its last "
                              "positional argument.")
        *inputs, target = args
        try:
            flat = self.traced.bind(tuple(inputs), kwargs)
        except FxpipeError as error:
            raise FxpipeError(f"{error} (pipe.step takes forward()'s arguments, then the target "
                              "as its last positional argument: pipe.step(x, target)).") from None
        return self.executor.step(flat, target, self.plan.loss_fn)

    def attach_optimizer(self, factory: Callable[[list[torch.nn.Parameter]], Any],
                         predictor: Callable[..., torch.Tensor] | None = None) -> None:
        """Give each stage its own optimizer, `factory(stage_parameters)`, stepped by
        `step_many` (and inside the schedule under async-1f1b, with the plan's consistency
        policy; `predictor(optimizer, param, last_grad) -> ΔW` overrides PipeOptim's rule)."""
        if self.plan.schedule == "async-1f1b" and self.shared_parameters():
            raise FxpipeError(
                f"weights {sorted(self.shared_parameters())} are used by several stages, and "
                "async-1f1b steps each stage on its own schedule; untie them or use a "
                "synchronous schedule ('gpipe' or '1f1b')."
            )
        self.executor.attach_optimizer(factory, self.plan.consistency, predictor)

    def step_many(self, batches: Sequence[tuple[Any, Any]]) -> list[torch.Tensor]:
        """Train on `[(inputs, target), ...]` (inputs: a tensor or a tuple of forward()'s
        arguments), stepping each stage's attached optimizer after every mini-batch; under
        async-1f1b the mini-batches overlap with no flush between them. Returns their losses."""
        if self.plan.loss_fn is None:
            raise FxpipeError("pipe.step_many(...) computes losses inside the pipeline and "
                              "needs Plan(loss_fn=...).")
        flat = []
        for inputs, target in batches:
            args = inputs if isinstance(inputs, tuple) else (inputs,)
            flat.append((self.traced.bind(args, {}), target))
        return self.executor.step_many(flat, self.plan.loss_fn)

    def weight_copies(self) -> list[int]:
        """Per stage held here, the most extra weight copies its consistency policy kept."""
        return [runner.policy.peak_copies if runner.policy else 0
                for runner in self.executor.runners.values()]

    def last_trace(self) -> list[Event]:
        """Every action of the last pipelined forward/backward or step, with start and end
        in seconds from its beginning."""
        return self.executor.last_trace() if self.executor is not None else []

    def predicted_timeline(self, partition: Partition | None = None) -> Timeline:
        """The event simulator's timeline of the last run's schedule (or the plan's), with the
        stage costs of `partition` (default: the one compiled; e.g. `fxpipe.retime(...)`),
        every forward and backward also taking the runtime's own time per forward and per
        backward (`forward_overhead`, `backward_overhead`), and the time a switch from the
        other kind costs it where it follows one on its thread (`forward_switch`,
        `backward_switch`); on a thread that runs several stages, its own costs
        (`thread_costs`)."""
        stages = (partition or self.partition).stages
        schedule = self.executor.latest_schedule
        post_f, post_b = self._posting(self.link.post, self.link.posting_back)
        recv_post_f, recv_post_b = self._by_receiver(schedule, self.link.receiving,
                                                     self.link.receiving_between)
        after_f, after_b = self._posting(self.link.after_send)
        # a woken receiver posting between computes posts its next receive at once
        wake_f, wake_b = self._by_receiver(schedule, self.link.after_send, self.link.waking)
        landing_f, landing_b = self._posting(self.link.after_receive)
        # a forwards-first stage's work on its receives goes on while it waits at the start
        after_post_f, after_post_b = self._by_receiver(schedule, 0.0, self.link.after_post)
        forward = [s.f + overhead for s, overhead in zip(stages, self.forward_overhead)]
        backward = [s.b + overhead for s, overhead in zip(stages, self.backward_overhead)]
        send_f = {(e.src, e.dst): stages[e.src].cf for e in self.comm.edges}
        send_b = {(e.src, e.dst): stages[e.src].cb for e in self.comm.edges}
        self._on_shared_threads(forward, backward, links=(send_f, send_b),
                                posts=(post_f, post_b), receives=(recv_post_f, recv_post_b))
        forward, backward = self._first_computes(schedule, forward, backward)
        cores, sharing = self.cpu_sharing()
        bound = {s: core for s, core in (self.bound_cores() or {}).items() if s in sharing}
        if bound:  # the cores they are bound to (bound_cores numbers them from 0)
            cores = max(bound.values()) + 1
        return simulate(schedule, forward, backward, send_f, send_b,
                        post_f=post_f, post_b=post_b, recv_post_f=recv_post_f,
                        recv_post_b=recv_post_b, resume=self.link.resume,
                        after_send_f=after_f, after_send_b=after_b,
                        after_wake_f=wake_f, after_wake_b=wake_b,
                        after_receive_f=landing_f, after_receive_b=landing_b,
                        after_post_f=after_post_f, after_post_b=after_post_b,
                        cores=cores, sharing=sharing, bound=bound or None,
                        workers=self.shared_threads() or None,
                        switch_f=self.forward_switch, switch_b=self.backward_switch)

    def _on_shared_threads(self, forward: list[float], backward: list[float], *,
                           links: tuple[dict, dict], posts: tuple[dict, dict],
                           receives: tuple[dict, dict]) -> None:
        """The figures `predicted_timeline` simulates with (each pair forward, backward; the
        edges' keyed (src, dst)), for stages on a thread that runs several (`thread_costs`):
        every action also takes the thread's time between actions; a SEND and a RECV take
        what they took on it; a message between two stages of one thread is there once sent."""
        (send_f, send_b), (post_f, post_b), (recv_post_f, recv_post_b) = links, posts, receives
        thread_of = {s: i for i, group in enumerate(self.shared_threads()) for s in group}
        # measured on the threads as they are (a later bind gives each stage its own again)
        costs = {s: c for s, c in self.thread_costs.items() if s in thread_of}
        for s, c in costs.items():
            forward[s] += c.between
            backward[s] += c.between
        for src, dst in send_f:
            if src in costs:  # src sends the activations, dst the gradients back
                post_f[src, dst] = costs[src].send_f + costs[src].between
                recv_post_b[src, dst] = costs[src].recv_b + costs[src].between
            if dst in costs:
                post_b[src, dst] = costs[dst].send_b + costs[dst].between
                recv_post_f[src, dst] = costs[dst].recv_f + costs[dst].between
            if src in thread_of and thread_of[src] == thread_of.get(dst):
                send_f[src, dst] = send_b[src, dst] = 0.0

    def _first_computes(self, schedule: Schedule, forward: list[float], backward: list[float]
                        ) -> tuple[Any, Any]:
        """The compute times to simulate, per stage or, where a stage on a thread that runs
        several took longer for its first forward or backward of a step than for its others
        (`thread_costs`), per stage and micro-batch: the first of each kind in the stage's list
        takes that much longer."""
        shared = {s for group in self.shared_threads() for s in group}
        costs = {s: c for s, c in self.thread_costs.items()
                 if s in shared and (c.first_f or c.first_b)}
        if not costs:
            return forward, backward
        total = schedule.micro_batches * schedule.minibatches
        per_mb = {ActionKind.F: [[f] * total for f in forward],
                  ActionKind.B: [[b] * total for b in backward]}
        for s, c in costs.items():
            for kind, extra in ((ActionKind.F, c.first_f), (ActionKind.B, c.first_b)):
                first = next((a for a in schedule.actions[s] if a.kind is kind), None)
                if first is not None:
                    per_mb[kind][s][first.mb] += extra
        return per_mb[ActionKind.F], per_mb[ActionKind.B]

    def shared_threads(self) -> list[tuple[int, ...]]:
        """The stages of each thread that runs several (Plan(stage_threads)), in the order it
        prefers them; [] where each stage has a thread of its own."""
        if self.executor is None or not self.executor.everything_here:
            return []
        return [group for group in self.executor.driver.workers if len(group) > 1]

    def cpu_sharing(self) -> tuple[int | None, tuple[int, ...]]:
        """The CPU cores the stage threads computing on this process's CPU have between them,
        and those stages, for the simulator to split among the ones computing at once (compile
        timed the units beside every other stage thread, less the time it waited for a core
        where they outnumber the cores). Under torchrun (None, ()): every rank timed the units
        at once, so their times hold the ranks' sharing of the cores."""
        if not self.executor.everything_here:
            return None, ()
        on_cpu = tuple(s for s, r in self.executor.runners.items() if r.device.type == "cpu")
        return usable_cores(), on_cpu

    def bound_cores(self) -> dict[int, int] | None:
        """Where compile bound the stage threads to cores (`Plan(cpu_affinity="auto")`), each
        stage's core, numbered from 0 among the CPUs they are bound to, for the simulator to
        share each core between the stages on it; else None (also where a stage may run on
        several CPUs)."""
        here = self.executor is not None and self.executor.everything_here
        cores_of = self.executor.driver.cores_of if here else {}
        if not cores_of or any(len(c) != 1 for c in cores_of.values()):
            return None
        cpus = sorted(set().union(*map(set, cores_of.values())))
        return {s: cpus.index(c[0]) for s, c in cores_of.items()}

    def _posting(self, per_tensor: float, per_gradient: float | None = None
                 ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
        """The time per message on each edge, forward and backward, at `per_tensor` seconds
        per tensor the message holds (`per_gradient` for the gradients, when it differs: the
        sender's to post them, the receiver's, or the sender's compute after it, or the
        receiver's while it lands)."""
        per_gradient = per_tensor if per_gradient is None else per_gradient
        carries = self.comm.carries_grad()
        forward = {(e.src, e.dst): 0.0 for e in self.comm.edges}
        backward = dict(forward)
        for e in self.comm.edges:
            forward[e.src, e.dst] += per_tensor
            backward[e.src, e.dst] += per_gradient if carries[e.value] else 0.0
        return forward, backward

    def _by_receiver(self, schedule: Schedule, alone: float, between: float
                     ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
        """A figure per message on each edge, forward and backward, that depends on how its
        receiver posts its receives: `alone` seconds per tensor where it runs its forwards
        first and posts them back to back at the start, `between` where it posts each between
        two computes (the runtime's driver)."""
        alone_f, alone_b = self._posting(alone)
        between_f, between_b = self._posting(between)
        first = [forwards_first(actions) for actions in schedule.actions]
        # activations are received by the edge's dst, their gradients by its src
        forward = {e: (alone_f if first[e[1]] else between_f)[e] for e in alone_f}
        backward = {e: (alone_b if first[e[0]] else between_b)[e] for e in alone_b}
        return forward, backward

    def measure_step_overhead(self, *inputs: Any, **kwargs: Any) -> float:
        """Seconds a step spends outside its schedule here (see PipelineExecutor.step_overhead:
        timed on a few steps with a stand-in loss, which leave nothing behind), measured now on
        `inputs` (a mini-batch) and kept as `step_overhead`. Under torchrun every rank of the
        pipeline must call it."""
        flat = self.traced.bind(inputs, kwargs)
        vars(self)["step_overhead"] = self.executor.step_overhead(flat)
        return self.step_overhead

    def measure_action_overhead(self, *inputs: Any, **kwargs: Any
                                ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per stage, the runtime's own seconds per forward action beyond its units' compute,
        and per backward action (see PipelineExecutor.action_overhead), measured now on
        `inputs` (a mini-batch) and kept as `forward_overhead` and `backward_overhead`, which
        `predicted_timeline` adds to every forward and every backward. Under torchrun every
        rank of the pipeline must call it."""
        flat = self.traced.bind(inputs, kwargs)
        forward, backward = self.executor.action_overhead(flat)
        vars(self).update(forward_overhead=tuple(forward), backward_overhead=tuple(backward))
        return self.forward_overhead, self.backward_overhead

    def measure_switch_overhead(self, *inputs: Any, **kwargs: Any
                                ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per stage, how much longer a forward takes right after a backward than after a
        forward, and a backward right after a forward than after a backward (see
        PipelineExecutor.switch_overhead): the units were timed each kind back to back, and a
        1F1B step switches between the two at almost every compute. Measured now on `inputs`
        (a mini-batch) and kept as `forward_switch` and `backward_switch`, which
        `predicted_timeline` adds to every compute that follows the other kind on its thread.
        Under torchrun every rank of the pipeline must call it."""
        flat = self.traced.bind(inputs, kwargs)
        forward, backward = self.executor.switch_overhead(flat)
        vars(self).update(forward_switch=tuple(forward), backward_switch=tuple(backward))
        return self.forward_switch, self.backward_switch

    def measure_runtime_overhead(self, *inputs: Any, **kwargs: Any) -> None:
        """The runtime's own time that a prediction of whole steps adds to the units' compute,
        measured now on `inputs` (a mini-batch): per step (`measure_step_overhead`), per
        action (`measure_action_overhead`), per switch between forwards and backwards
        (`measure_switch_overhead`) and on threads running several stages
        (`measure_thread_costs`). Under torchrun every rank of the pipeline must call it."""
        self.measure_step_overhead(*inputs, **kwargs)
        self.measure_action_overhead(*inputs, **kwargs)
        self.measure_switch_overhead(*inputs, **kwargs)
        self.measure_thread_costs(*inputs, **kwargs)

    def measure_thread_costs(self, *inputs: Any, **kwargs: Any) -> dict[int, ThreadCosts]:
        """Per stage on a thread that runs several (Plan(stage_threads)), the thread's own
        time between actions and the stage's per SEND and per RECV (see
        PipelineExecutor.shared_thread_costs), measured now on `inputs` (a mini-batch) and
        kept as `thread_costs`, which `predicted_timeline` takes in place of the link's
        hand-over between threads; {} where each stage has a thread of its own."""
        flat = self.traced.bind(inputs, kwargs)
        vars(self)["thread_costs"] = self.executor.shared_thread_costs(flat)
        return self.thread_costs

    def measure_link(self, *inputs: Any, **kwargs: Any) -> Link:
        """The link between the stages measured now as compile measured it (the plan's figures
        where it gave them), on `inputs` (a mini-batch), and kept as `link`, which
        `fxpipe.retime` then times the values' sending with and `predicted_timeline` takes its
        posting and slowdown terms from (`pipe.partition` and `pipe.cost` keep compile's: pass
        retime's partition to `predicted_timeline` for a prediction from the new link alone). A
        shared machine's speed drifts, and so do these figures. Under torchrun every rank of
        the job must call it."""
        if self.link_probe is None:
            raise FxpipeError("measure_link() measures what compile measured, and this pipeline "
                              "was not made by compile: make it with fxpipe.compile(model, "
                              "plan, example_inputs=...).")
        vars(self)["link"] = self.link_probe(self.traced.bind(inputs, kwargs))
        return self.link

    def report(self, file: Any = None, partition: Partition | None = None) -> str:
        """Predicted against measured for the last run: per stage and in total, bubble,
        send/receive (waits for a message included) and idle shares, and the stage that bounds
        the pipeline; where the last run was a training step after others like it (the same
        schedule, micro-batches of the same sizes), the range and median of the last of them
        (up to 10), as a single step moves with the machine's speed; where more stages
        compute on a host's CPU than they may use cores (stage threads of this process, or
        under torchrun the ranks on rank 0's host), how the prediction took that in and, for
        stage threads, how much work they got through at once (`thread_capacity`; see
        shared_cores_lines); and when the last run is not the step predicted: forwards only,
        or micro-batches of other sizes than compile's example (told only for compile's
        prediction). Printed (to `file`, default stdout; rank 0 under torchrun, where every
        rank must call it) and returned. `partition`: the stage costs to predict with
        (default: the compiled ones; e.g. `fxpipe.retime(pipe, x, target=y)`, timed beside
        the run)."""
        _check_partition("report", partition)
        if file is not None and not hasattr(file, "write"):
            raise FxpipeError(f"pipe.report(file=...) takes an open text file (or None for "
                              f"stdout), not {file!r}: e.g. open('report.txt', 'w').")
        # every rank holds as many recent training steps (the same runs), the last run the
        # last of them: their traces in one exchange
        kept_steps = self.executor.recent_steps() if self.executor is not None else []
        traces = (self.executor.full_traces(kept_steps) if kept_steps
                  else [self.full_trace("pipe.report()")])
        measured = traces[-1]
        predicted = self.predicted_timeline(partition).events
        stages = self.plan.stages
        # stage threads of one process sharing the cores it may use, or under torchrun the
        # ranks on this rank's host (which compile found out)
        if self.executor.everything_here:
            cores, on_cpu = self.cpu_sharing()
            shared = shared_cores_lines(len(on_cpu), cores, capacity=self.thread_capacity,
                                        bound=self.bound_cores() is not None,
                                        threads=len(self.executor.driver.workers))
        else:
            shared = shared_cores_lines(*self.host_cores, ranks=True) if self.host_cores else []
        # compile's prediction is of its example's micro-batches (under data parallelism a
        # group's share of it, which is not known here)
        known = partition is None and self.cost.batch is not None and self.plan.groups == 1
        notes = unlike_prediction_lines(
            split_sizes(self.cost.batch, self.partition.micro_batches) if known else None,
            self.executor.last_sizes or [], any(e.action.kind is ActionKind.B for e in measured))
        recent = [step_time(events, stages).makespan for events in traces] if kept_steps else []
        text = format_report(step_time(measured, stages), step_time(predicted, stages),
                             self.executor.latest_schedule.name,
                             self.step_overhead, interference(measured),
                             late_messages(measured, predicted), notes, shared, recent)
        if self._speaks():
            print(text, file=file)
        return text

    def full_trace(self, what: str = "this") -> list[Event]:
        """Every stage's events of the last run, on one time axis (under torchrun every rank of
        the pipeline must call it: the ranks exchange their traces)."""
        measured = self.executor.full_trace() if self.executor is not None else []
        if not measured:
            raise FxpipeError(f"nothing has run yet: call pipe.step(x, target) (or pipe(x) and "
                              f"backward) before {what}.")
        return measured

    def _speaks(self) -> bool:
        """Whether this process prints and writes reports: always, or rank 0 under torchrun."""
        return vars(self).get("rank", 0) == 0

    def save_timeline(self, path: str | os.PathLike, partition: Partition | None = None) -> None:
        """Draw the last run's measured timeline above the predicted one (PNG, SVG, PDF...;
        needs matplotlib: pip install 'fxpipe[plot]'). `partition`: the stage costs to predict
        with, as in `report`."""
        _check_partition("save_timeline", partition)
        measured = self.full_trace("save_timeline()")
        if not self._speaks():
            return
        predicted = self.predicted_timeline(partition).events
        drawn = partition or self.partition
        save_timeline(path, {"measured": measured, "predicted": predicted},
                      self.plan.stages, f"{self.model_name}: {self.plan.stages} stages, "
                      f"{drawn.micro_batches} micro-batches, partition "
                      f"{drawn.partitioner} {list(drawn.sizes)}")

    def save_trace(self, path: str | os.PathLike, partition: Partition | None = None) -> None:
        """Write the last run's measured timeline and the predicted one as Chrome/Perfetto
        trace JSON (open it at ui.perfetto.dev or chrome://tracing); with pipeline groups,
        one measured process per group (every rank of the job must call it). `partition`: the
        stage costs to predict with, as in `report`."""
        _check_partition("save_trace", partition)
        self.full_trace("save_trace()")  # something has run
        groups = self.executor.job_trace()
        measured = ({"measured": groups[0]} if len(groups) == 1 else
                    {f"measured, group {g}": groups[g] for g in sorted(groups)})
        trace = chrome_trace({**measured, "predicted": self.predicted_timeline(partition).events})
        if self._speaks():
            pathlib.Path(path).write_text(json.dumps(trace))

    def register_stage_hook(self, stage: int, callback: Callable[[int], None]) -> RemovableHandle:
        """Call `callback(stage)` each time `stage` finishes a backward pass: once per
        micro-batch, after that micro-batch's backward through the stage (so p times per step;
        `pipe.stage_hook(stage).finishing` is True on the last)."""
        if not 0 <= stage < self.plan.stages:
            raise FxpipeError(f"stage {stage} does not exist; this pipeline has stages "
                              f"0..{self.plan.stages - 1}.")
        return self.stage_hook(stage).register(callback)

    def train(self, mode: bool = True) -> CompiledPipeline:
        traced = vars(self).get("traced")
        if traced is not None and traced.mode_fixed and mode != traced.training:
            modes = {True: "training", False: "eval"}
            how = ("torch.export fixes BatchNorm and dropout behaviour in the graph"
                   if traced.frontend == "export" else
                   "the model's forward() reads self.training, which tracing turned into a "
                   "constant")
            raise FxpipeError(
                f"this pipeline was traced in {modes[traced.training]} mode and {how}; "
                f"compile a second pipeline from the model in {modes[mode]} mode "
                f"(model.train({mode}) first)."
            )
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._relink()
        return self

    def _relink(self) -> None:
        """Point the stages at this module's tensors again (`.to()` replaces buffer objects)."""
        own = dict(self.named_parameters(remove_duplicate=False))
        own.update(self.named_buffers(remove_duplicate=False))
        for stage in self.stages:
            for name, tensor in [*stage.module.named_parameters(remove_duplicate=False),
                                 *stage.module.named_buffers(remove_duplicate=False)]:
                if name in own and own[name] is not tensor:
                    owner, _, attr = name.rpartition(".")
                    target = stage.module.get_submodule(owner)
                    if isinstance(own[name], torch.nn.Parameter):
                        target.register_parameter(attr, own[name])
                    else:
                        target._buffers[attr] = own[name]
            hook = self.stage_hook(stage.index)
            hook._weights = dict(stage.module.named_parameters())
        for runner in (self.executor.runners.values() if self.executor is not None else ()):
            if runner.policy is not None:
                runner.policy.weights = dict(runner.stage.module.named_parameters())

    def print_graph(self, stages: bool = False) -> None:
        """Print the rewritten top-level graph; with `stages=True`, every stage's code too."""
        print(self.format_graph(stages))

    def format_graph(self, stages: bool = False) -> str:
        parts = [format_graph(self.graph, f"PipelineGraph of {self.model_name}: "
                                          f"{self.plan.stages} stages")]
        if stages:
            for stage in self.stages:
                parts.append(f"\nstage {stage.index}:{stage.module.code}")
        return "\n".join(parts)

    def __repr__(self) -> str:
        partition = self.partition
        sizes = " + ".join(map(str, partition.sizes))
        title = (f"CompiledPipeline({self.model_name}): traced with {self.frontend}, "
                 f"{len(self.units)} units in {self.plan.stages} stages, "
                 f"partition {partition.partitioner} ({sizes})")
        params = [sum(p.numel() for p in s.module.parameters()) for s in self.stages]
        simulated = None
        if self.executor is not None and self.plan.costs != "none":
            schedule = self.executor.latest_schedule
            simulated = (schedule.name, self.predicted_timeline().makespan)
        table = format_stage_table(title, self.units, partition, self.comm, self.devices, params,
                                   self.shared_parameters(), self.plan.costs != "none",
                                   self.link, simulated)
        if any(self.forward_switch) or any(self.backward_switch):
            table += "\n" + self._switch_line()
        if self.plan.schedule == "async-1f1b" and self.executor is not None:
            table += "\n" + self._weight_copies_line()
        for split in self.intra_layer:
            table += "\n" + split.format()
        memory = describe(self.plan.cpu_memory)
        if memory and any(str(d).startswith("cpu") for d in self.devices):
            table += "\n" + memory
        if self.shared_threads():
            threads = "; ".join(f"stages {', '.join(map(str, sorted(group)))} on one"
                                for group in self.shared_threads())
            count = len(self.executor.driver.workers)
            run = f"{count} threads run" if count > 1 else "one thread runs"
            table += (f"\nstage threads: {run} the {len(self.executor.runners)} stages "
                      f"(Plan(stage_threads={self.plan.stage_threads!r})): {threads}; "
                      f"{'each' if count > 1 else 'it'} runs its stages' actions one at a time, "
                      "the first in its order (the stage nearest the loss first) of those that "
                      "need not wait")
            if self.thread_costs:
                table += "\n" + self._thread_costs_line()
        if self.bound_cores() is not None:
            places = ", ".join(f"stage {s} on CPU {format_cpus(cpus)}"
                               for s, cpus in sorted(self.executor.driver.cores_of.items()))
            table += ("\nstage threads bound to cores (Plan(cpu_affinity='auto'), as they "
                      f"outnumber the cores): {places}; the prediction shares each core among "
                      "the stages on it")
        return table

    def _thread_costs_line(self) -> str:
        """The thread costs the prediction takes for stages on a shared thread, in us."""
        def us(s: int, field: str) -> str:
            return f"{getattr(self.thread_costs[s], field) * 1e6:.0f}"

        stages = sorted(self.thread_costs)
        per_stage = "; ".join(
            f"stage {s}: {us(s, 'between')} between actions, send {us(s, 'send_f')}/"
            f"{us(s, 'send_b')}, receive {us(s, 'recv_f')}/{us(s, 'recv_b')}, first forward "
            f"+{us(s, 'first_f')}, first backward +{us(s, 'first_b')}" for s in stages)
        return ("thread costs (us, measured on steps; sends and receives of activations/"
                f"gradients; a step's first compute of each kind over the others): {per_stage}")

    def _switch_line(self) -> str:
        def per_stage(seconds: tuple[float, ...]) -> str:
            return "/".join(f"{t * 1e6:.0f}" for t in seconds)

        return (f"switching kind: a forward right after a backward takes "
                f"{per_stage(self.forward_switch)} us longer, a backward right after a forward "
                f"{per_stage(self.backward_switch)} us (per stage; the units were timed each "
                "kind back to back), which the prediction adds where a compute follows the "
                "other kind on its thread")

    def _weight_copies_line(self) -> str:
        runners = self.executor.runners
        if not any(r.policy for r in runners.values()):
            return (f"async-1f1b weights (consistency={self.plan.consistency!r}): no optimizer "
                    "attached yet (pipe.attach_optimizer)")
        parts = []
        for index, runner in runners.items():
            copies = runner.policy.peak_copies if runner.policy else 0
            nbytes = copies * sum(p.numel() * p.element_size()
                                  for p in runner.stage.module.parameters())
            parts.append(f"stage {index}: {copies} ({format_bytes(nbytes)})")
        return (f"async-1f1b weights (consistency={self.plan.consistency!r}), most extra "
                f"copies held so far: {'; '.join(parts)}")

    def shared_parameters(self) -> dict[str, list[int]]:
        """Parameters used by more than one stage (tied weights), by name -> stages."""
        return {name: stages for name, _, stages in self.shared_parameter_objects()}

    def shared_parameter_objects(self) -> list[tuple[str, torch.nn.Parameter, list[int]]]:
        """(name, Parameter, stages using it) for each weight tied across stages, by name."""
        canonical = {id(p): n for n, p in torch.nn.Module.named_parameters(self)}  # the model's
        found: dict[int, tuple[str, torch.nn.Parameter, list[int]]] = {}
        for stage in self.stages:
            for name, p in stage.module.named_parameters():
                entry = found.setdefault(id(p), (canonical.get(id(p), name), p, []))
                entry[2].append(stage.index)
        return sorted((entry for entry in found.values() if len(entry[2]) > 1),
                      key=lambda entry: entry[0])

    def materialize_stage(self, stage: int, device: str, model: torch.nn.Module) -> None:
        """Give a meta model's stage `stage` storage on `device` (fxpipe.materialize), under
        every name the model, this pipeline and its graphs have for its tensors."""
        module = self.stages[stage].module
        materialize(module, device, holders=(model, self, self.graph, self.traced.gm))
        # rebound even when nothing here was meta: a tied weight another stage made real is
        # a new tensor too
        self.stage_hook(stage).rebind(dict(module.named_parameters()))

    def restrict_to_stage(self, stage: int, rank: int,
                          cpus: Sequence[int] | None = None) -> None:
        """Hold only `stage`'s parameters and buffers (one rank's share under torchrun):
        parameters(), state_dict() and load_state_dict() see that share, under original names.
        `cpus`: the CPUs the rank is bound to, if any (shown with its device)."""
        names = {n for n, _ in self.stages[stage].module.named_parameters()}
        names |= {n for n, _ in self.stages[stage].module.named_buffers()}
        vars(self)["owned"] = frozenset(names)
        vars(self)["rank"] = rank
        bound = f", CPUs {format_cpus(cpus)}" if cpus else ""
        self.devices = tuple(f"{d} (rank {rank}{bound})" if s == stage else "another rank"
                             for s, d in enumerate(self.devices))

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        if vars(self).get("owned") is None:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        # a tied weight may be held here under its second name only: filter, then de-duplicate
        yield from _owned(super().named_parameters(prefix, recurse, False),
                          self._owns, prefix, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):
        if vars(self).get("owned") is None:
            yield from super().named_buffers(prefix, recurse, remove_duplicate)
            return
        yield from _owned(super().named_buffers(prefix, recurse, False), self._owns, prefix,
                          remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        for key in [k for k in state if not self._owns(k, prefix)]:
            del state[key]
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load the entries this pipeline holds (a full model's state dict is fine)."""
        owned = vars(self).get("owned")
        if owned is None:
            result = super().load_state_dict(state_dict, strict, assign)
        else:
            mine = {k: v for k, v in state_dict.items() if k in owned}
            result = super().load_state_dict(mine, strict=False, assign=assign)
            missing = sorted(owned - set(state_dict))
            if strict and missing:
                raise RuntimeError(f"state dict lacks this rank's entries: {missing}")
        if assign:  # new tensor objects: the stages must read them too
            self._relink()
        return result

    def _owns(self, name: str, prefix: str = "") -> bool:
        owned = vars(self).get("owned")
        return owned is None or name.removeprefix(prefix) in owned


def _owned(named, owns, prefix: str, remove_duplicate: bool):
    seen: set[int] = set()
    for name, tensor in named:
        if not owns(name, prefix) or (remove_duplicate and id(tensor) in seen):
            continue
        seen.add(id(tensor))
        yield name, tensor


def _check_partition(method: str, partition: object) -> None:
    if partition is not None and not isinstance(partition, Partition):
        raise FxpipeError(f"pipe.{method}(partition=...) takes a Partition, e.g. "
                          f"fxpipe.retime(pipe, x, target=y), not {partition!r}.")
