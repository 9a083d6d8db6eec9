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

from fxpipe.batching import batch_norm_of_one, check_batch_norm, input_dims, rows, split_sizes
from fxpipe.cost import CostTable, Link, Partition
from fxpipe.errors import FxpipeError
from fxpipe.inspect import chrome_trace, describe_pipeline, format_graph
from fxpipe.ir import CommTable, Event, Stage, StageHook, tied_parameters
from fxpipe.plan import Plan
from fxpipe.plot import save_timeline
from fxpipe.predict import Calibration, predict_step
from fxpipe.report import (
    MeasuredMemory,
    check_measured,
    format_memory,
    format_report,
    step_time,
    unlike_prediction_lines,
)
from fxpipe.schedules import ActionKind
from fxpipe.simulate import Timeline
from fxpipe.snapshot import ModelSnapshot
from fxpipe.trace import Traced
from fxpipe.units import Unit

__all__ = ["CompiledPipeline"]


_MODES = {True: "training", False: "eval"}


class CompiledPipeline(torch.nn.Module):
    """A model compiled into pipeline stages, usable wherever the model was.

    It holds the model's own submodules, parameters and buffers under their original names, so
    `parameters()`, `state_dict()` and `load_state_dict()` are the model's; the stages share
    those objects. `graph` is the rewritten PipelineGraph (an fx.GraphModule), `passes` the
    compiler passes that made it, `executor` the runtime that runs it. Under torchrun a rank
    holds only its stage's share (`owned`, the names of its tensors).
    """

    def __init__(self, model: torch.nn.Module, plan: Plan, *, traced: Traced,
                 units: Sequence[Unit], partition: Partition, graph: fx.GraphModule,
                 comm: CommTable, devices: Sequence[str], cost: CostTable, link: Link,
                 executor: Any, passes: Sequence[Any] = (), splits: Sequence[Any] = (),
                 rank: int | None = None, owned: frozenset[str] | None = None,
                 retrace: Callable[[bool], CompiledPipeline] | None = None) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in
                                 model._non_persistent_buffers_set)
        self.training = model.training  # not train(): a submodule's own mode stays
        # plain attributes, not submodules: the stages share the parameters registered above
        vars(self).update(
            plan=plan, traced=traced, units=tuple(units), partition=partition, graph=graph,
            comm=comm, devices=tuple(devices), model_name=type(model).__name__, cost=cost,
            link=link, executor=executor, passes=passes, intra_layer=tuple(splits),
            rank=rank, owned=owned, state_dict_keys=tuple(model.state_dict()),
            source=model, batch_norm=batch_norm_of_one(traced.gm),
            retrace=retrace, twin=None,  # the pipeline traced in the other mode, once asked for
        )
        self.compiled_parts = ModelSnapshot(self, self.source)

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
        if self._twin_runs():
            return self.twin(*args, **kwargs)
        return self.executor.forward(self._bind(args, kwargs))

    def run_sequential(self, *args: Any, **kwargs: Any) -> Any:
        """The PipelineGraph run as an ordinary module, one stage after another: the reference
        every pipelined run is checked against."""
        if self._twin_runs():
            return self.twin.run_sequential(*args, **kwargs)
        self._check_unchanged()
        return self.traced.bind.unflatten(self.graph(*self.traced.bind(args, kwargs)))

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`pipe.step(*inputs, target)`: run the whole schedule on one mini-batch (forward and
        backward, interleaved as the schedule says) and return the mini-batch's loss.
        Gradients accumulate in the parameters' .grad; the optimizer step is yours."""
        if self._twin_runs():
            return self.twin.step(*args, **kwargs)
        if self.plan.loss_fn is None:
            raise FxpipeError("pipe.step(x, target) computes the loss inside the pipeline and "
                              "needs Plan(loss_fn=...), e.g. loss_fn=torch.nn.functional."
                              "cross_entropy; or call loss_fn(pipe(x), target).backward().")
        if not args:
            raise FxpipeError("pipe.step(*inputs, target) needs the target as its last "
                              "positional argument.")
        *inputs, target = args
        flat = self._bind(tuple(inputs), kwargs, "(pipe.step takes forward()'s arguments, then "
                          "the target as its last positional argument: pipe.step(x, target)).")
        return self.executor.step(flat, target, self.plan.loss_fn)

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """fp16's loss scaler (disabled otherwise): pipe.step scales the loss; then
        pipe.scaler.step(optimizer) (skipped on inf/nan on every stage) and .update()."""
        return self.executor.scaler

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
        if self._twin_runs():  # its optimizers are attached to the pipeline of the other mode
            raise FxpipeError(
                f"pipe.step_many runs the graph traced in {_MODES[self.traced.training]} mode, "
                f"and the pipeline is in {_MODES[self.training]} mode; call pipe.train("
                f"{self.traced.training}) first, or use pipe.step(x, target) with your own "
                "optimizer step.")
        if self.plan.loss_fn is None:
            raise FxpipeError("pipe.step_many(...) computes losses inside the pipeline and "
                              "needs Plan(loss_fn=...).")
        self._check_unchanged()  # once for all the batches
        flat = []
        for inputs, target in batches:
            args = inputs if isinstance(inputs, tuple) else (inputs,)
            flat.append((self._bind(args, {}, check=False), target))
        return self.executor.step_many(flat, self.plan.loss_fn)

    def weight_copies(self) -> list[int]:
        """Per stage held here, the most extra weight copies its consistency policy kept."""
        return list(self.executor.weight_copies().values())

    def last_trace(self) -> list[Event]:
        """Every action of the last pipelined forward/backward or step this process ran, with
        start and end in seconds from its beginning."""
        return self.executor.last_trace()

    def predicted_timeline(self, calibration: Calibration | None = None) -> Timeline:
        """The event simulator's timeline of the last run's schedule (or the plan's) with the
        partition's stage costs and the link, and `calibration`'s per-action overheads when
        given (`fxpipe.calibrate`, on micro-batches of compile's example's sizes)."""
        _check_calibration("predicted_timeline", calibration)
        predicted = self._predicted_sizes()
        if calibration is not None and predicted and list(calibration.sizes) != predicted:
            raise FxpipeError(
                f"this calibration ran micro-batches of {list(calibration.sizes)} samples, and "
                f"the prediction is of compile's example's, {predicted}: calibrate on a batch "
                "like compile's example."
            )
        return predict_step(self.executor.latest_schedule, self.partition, self.comm,
                            self.link, calibration)

    def _predicted_sizes(self) -> list[int]:
        """The micro-batch sizes compile's example splits into ([] where not known: under
        data parallelism a group's share of it)."""
        if self.cost.batch is None or self.plan.groups > 1:
            return []
        return split_sizes(self.cost.batch, self.partition.micro_batches)

    def report(self, file: Any = None, calibration: Calibration | None = None,
               memory: MeasuredMemory | None = None) -> str:
        """Predicted against measured for the last run, per stage and in total: bubble,
        send/receive (waits included) and idle shares, and the stage that bounds the pipeline;
        and when the last run is not the step predicted (forwards only, or micro-batches of
        other sizes than compile's example). `calibration` (`fxpipe.calibrate`): predict with
        its overheads; `memory` (`fxpipe.measure_memory`): each stage's predicted peak memory
        beside it. Printed (to `file`, default stdout; rank 0 under torchrun, where every
        rank must call it) and returned."""
        if file is not None and not hasattr(file, "write"):
            raise FxpipeError(f"pipe.report(file=...) takes an open text file (or None for "
                              f"stdout), not {file!r}: e.g. open('report.txt', 'w').")
        _check_calibration("report", calibration)
        check_measured(memory)
        measured = self.full_trace("pipe.report()")
        predicted = self.predicted_timeline(calibration).events
        stages, placement = self.plan.stages, self.executor.latest_schedule.placement
        notes = unlike_prediction_lines(
            self._predicted_sizes() or None, self.executor.last_sizes or [],
            any(e.action.kind is ActionKind.B for e in measured))
        text = format_report(step_time(measured, stages, placement),
                             step_time(predicted, stages, placement),
                             self.executor.latest_schedule.name,
                             calibration.step if calibration else None, notes)
        if memory is not None:
            text += "\n" + format_memory([s.memory for s in self.partition.stages], memory)
        if self._speaks():
            print(text, file=file)
        return text

    def full_trace(self, what: str = "this") -> list[Event]:
        """Every stage's events of the last run, on one time axis (under torchrun every rank of
        the pipeline must call it: the ranks exchange their traces)."""
        measured = self.executor.full_trace()
        if not measured:
            raise FxpipeError(f"nothing has run yet: call pipe.step(x, target) (or pipe(x) and "
                              f"backward) before {what}.")
        return measured

    def _speaks(self) -> bool:
        """Whether this process prints and writes reports: always, or rank 0 under torchrun."""
        return (self.rank or 0) == 0

    def save_timeline(self, path: str | os.PathLike,
                      calibration: Calibration | None = None) -> None:
        """Draw the last run's measured timeline above the predicted one (PNG, SVG, PDF...;
        needs matplotlib: pip install 'fxpipe[plot]'); `calibration` as in `report`."""
        _check_calibration("save_timeline", calibration)
        measured = self.full_trace("save_timeline()")
        if not self._speaks():
            return
        predicted = self.predicted_timeline(calibration).events
        part = self.partition
        save_timeline(path, {"measured": measured, "predicted": predicted},
                      self.plan.stages, f"{self.model_name}: {self.plan.stages} stages, "
                      f"{part.micro_batches} micro-batches, partition "
                      f"{part.partitioner} {list(part.sizes)}")

    def save_trace(self, path: str | os.PathLike, calibration: Calibration | None = None) -> None:
        """Write the last run's measured timeline and the predicted one as Chrome/Perfetto
        trace JSON (open it at ui.perfetto.dev); with pipeline groups, one measured process
        per group (every rank of the job must call it); `calibration` as in `report`."""
        _check_calibration("save_trace", calibration)
        self.full_trace("save_trace()")  # something has run
        groups = self.executor.job_trace()
        measured = ({"measured": groups[0]} if len(groups) == 1 else
                    {f"measured, group {g}": groups[g] for g in sorted(groups)})
        trace = chrome_trace({**measured,
                              "predicted": self.predicted_timeline(calibration).events})
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
        """A graph that fixed the mode it was traced in (torch.export's; fx's if forward()
        reads self.training) runs the other mode through a second pipeline, traced from the
        model in that mode when first asked for, with the same stages and parameters."""
        traced = vars(self).get("traced")
        other = traced is not None and traced.mode_fixed and mode != traced.training
        if other and self.twin is None and self.retrace is not None:
            vars(self)["twin"] = self.retrace(mode)
        elif other and self.twin is None:  # under torchrun, or with intra_layer
            how = ("torch.export fixes BatchNorm and dropout behaviour in the graph"
                   if traced.frontend == "export" else
                   "the model's forward() reads self.training, which tracing turned into a "
                   "constant")
            raise FxpipeError(
                f"this pipeline was traced in {_MODES[traced.training]} mode and {how}; "
                f"under torchrun or with intra_layer, compile a second pipeline from the model "
                f"in {_MODES[mode]} mode yourself (model.train({mode}) first)."
            )
        return super().train(mode)

    def _twin_runs(self) -> bool:
        return self.twin is not None and self.training != self.traced.training

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._relink()
        return self

    def _relink(self, checked: bool = False) -> None:
        """Point the stages at this module's tensors again (`.to()` replaces buffer objects);
        a submodule replaced since compile is refused, not hidden (unless `checked` already)."""
        if hasattr(self, "compiled_parts") and not checked:
            self._check_unchanged(parameters=False, buffers=False)
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
            self.stage_hook(stage.index).rebind(dict(stage.module.named_parameters()))
        self.executor.rebind_weights()
        if self.twin is not None:  # its stages hold the same tensors
            self.twin._relink()
        self.compiled_parts = ModelSnapshot(self, self.source)

    def _check_unchanged(self, parameters: bool = True, buffers: bool = True) -> None:
        """Refuse to run (or save) a model whose submodules or `parameters` were replaced
        since compile (the stages hold the old ones); take replaced `buffers` into the stages."""
        if self.compiled_parts.check(self.model_name, parameters) and buffers:
            self._relink(checked=True)

    def _bind(self, args: tuple, kwargs: dict[str, Any], hint: str = "",
              check: bool = True) -> list[Any]:
        """A call's inputs as the graph's, refused before any work if the model changed since
        compile (unless `check` is False: checked already), or if a batch norm layer would
        train on one sample (`hint` follows a message of the graph's)."""
        if check:
            self._check_unchanged()
        try:
            flat = self.traced.bind(args, kwargs)
        except FxpipeError as error:
            if hint:
                raise FxpipeError(f"{error} {hint}") from None
            raise
        if self.batch_norm is not None and self.training and rows(flat):
            batch, groups = input_dims(flat, self.executor.whole).batch, self.plan.groups
            check_batch_norm(self.batch_norm, batch // groups // self.partition.micro_batches,
                             f"this batch of {batch} (in {groups} pipeline groups)"
                             if groups > 1 else f"this batch of {batch}", batch // groups // 2)
        return flat

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
        return describe_pipeline(self)

    def shared_parameters(self) -> dict[str, list[int]]:
        """Parameters used by more than one stage (tied weights), by name -> stages."""
        names = {id(p): n for n, p in torch.nn.Module.named_parameters(self)}  # all, unfiltered
        return {name: holders for name, _, holders in tied_parameters(self.stages, names)}

    # Under torchrun, only this rank's share. A tied weight may be held here under its second
    # name only: filter, then de-duplicate.
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        yield from _owned(super().named_parameters(prefix, recurse, False),
                          self._owns, prefix, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):
        yield from _owned(super().named_buffers(prefix, recurse, False), self._owns, prefix,
                          remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._check_unchanged()
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")  # "m." (a parent's destination holds its own keys)
        for key in [k for k in state if k.startswith(prefix) and not self._owns(k, prefix)]:
            del state[key]
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load the entries this pipeline holds (a full model's state dict is fine)."""
        if self.owned is None:
            result = super().load_state_dict(state_dict, strict, assign)
        else:
            mine = {k: v for k, v in state_dict.items() if k in self.owned}
            result = super().load_state_dict(mine, strict=False, assign=assign)
            missing = sorted(self.owned - set(state_dict))
            if strict and missing:
                raise RuntimeError(f"state dict lacks this rank's entries: {missing}")
        if assign:  # new tensor objects: the stages must read them too
            self._relink()
        return result

    def _owns(self, name: str, prefix: str = "") -> bool:
        return self.owned is None or name.removeprefix(prefix) in self.owned


def _owned(named, owns, prefix: str, remove_duplicate: bool):
    seen: set[int] = set()
    prefix = prefix + "." if prefix else ""  # named_parameters(prefix="m") names "m.0.weight"
    for name, tensor in named:
        if not owns(name, prefix) or (remove_duplicate and id(tensor) in seen):
            continue
        seen.add(id(tensor))
        yield name, tensor


def _check_calibration(method: str, calibration: object) -> None:
    if calibration is not None and not isinstance(calibration, Calibration):
        raise FxpipeError(f"pipe.{method}(calibration=...) takes what fxpipe.calibrate(pipe, "
                          f"x, target=y) returns, not {calibration!r}.")

