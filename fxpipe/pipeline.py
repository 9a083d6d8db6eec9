"""CompiledPipeline: the drop-in module `fxpipe.compile` returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils.hooks import RemovableHandle

from fxpipe.cost import CostTable, Link, Partition
from fxpipe.errors import FxpipeError
from fxpipe.inspect import format_graph, format_stage_table
from fxpipe.ir import CommTable, Stage, StageHook
from fxpipe.plan import Plan
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
            link=link,
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
        return self.traced.bind.unflatten(self.graph(*self.traced.bind(args, kwargs)))

    def register_stage_hook(self, stage: int, callback: Callable[[int], None]) -> RemovableHandle:
        """Call `callback(stage)` each time `stage` finishes a backward pass."""
        if not 0 <= stage < self.plan.stages:
            raise FxpipeError(f"stage {stage} does not exist; this pipeline has stages "
                              f"0..{self.plan.stages - 1}.")
        return self.stage_hook(stage).register(callback)

    def train(self, mode: bool = True) -> CompiledPipeline:
        traced = vars(self).get("traced")
        if traced is not None and traced.frontend == "export" and mode != traced.training:
            modes = {True: "training", False: "eval"}
            raise FxpipeError(
                f"this pipeline was traced with torch.export in {modes[traced.training]} mode, "
                f"which fixes BatchNorm and dropout behaviour in the graph; compile a second "
                f"pipeline from the model in {modes[mode]} mode (model.train({mode}) first)."
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
        return format_stage_table(title, self.units, partition, self.comm, self.devices, params,
                                  self.shared_parameters(), self.plan.costs == "measure",
                                  self.link)

    def shared_parameters(self) -> dict[str, list[int]]:
        """Parameters used by more than one stage (tied weights), by name -> stages."""
        names = {id(p): n for n, p in self.named_parameters()}
        users: dict[int, list[int]] = {}
        for stage in self.stages:
            for p in stage.module.parameters():
                users.setdefault(id(p), []).append(stage.index)
        return {names[i]: s for i, s in users.items() if len(s) > 1 and i in names}
