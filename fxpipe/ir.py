"""The pipeline IR: stage, hook, send and recv nodes, the send/recv table, timeline events."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import fx
from torch.func import functional_call
from torch.utils.hooks import RemovableHandle

from fxpipe.meta import ValueInfo
from fxpipe.schedules import Action

__all__ = ["CommTable", "Edge", "Event", "Stage", "StageArgs", "StageHook", "StageIO", "ValueRef",
           "recv", "send", "tied_parameters"]


@dataclasses.dataclass(frozen=True)
class Edge:
    """One value crossing from stage `src` to stage `dst`."""

    value: str  # the producing node's name in the traced graph
    src: int
    dst: int
    info: ValueInfo
    shape: tuple[Any, ...] | None = None  # sympy shape in batch b (and sequence s), if known

    def __str__(self) -> str:
        return f"{self.value}: {self.src}->{self.dst} {self.info} ({self.info.nbytes} B)"


@dataclasses.dataclass(frozen=True)
class StageIO:
    """The values a stage takes (its placeholders, in order) and returns (in order)."""

    stage: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CommTable:
    """Everything the runtime needs to move values between stages, computed once by the rewrite.

    Stage 0 owns the model's inputs and the last stage owns the model's outputs: an input used by
    a later stage is sent from stage 0, an output made by an earlier stage is sent to the last.

    Run as an ordinary module, a PipelineGraph executes the stages one after another (the
    reference every pipelined run is checked against); the runtime never re-reads it: it runs
    the Stage and StageHook modules and moves tensors along this table.
    """

    stages: tuple[StageIO, ...]
    edges: tuple[Edge, ...]
    graph_inputs: tuple[str, ...]
    graph_outputs: tuple[str, ...]  # in the order of the flattened model output

    def sends(self, stage: int) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.src == stage)

    def recvs(self, stage: int) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.dst == stage)

    def by_pair(self) -> dict[tuple[int, int], tuple[Edge, ...]]:
        """The edges by (src, dst): what one message between two stages carries."""
        pairs: dict[tuple[int, int], list[Edge]] = {}
        for edge in self.edges:
            pairs.setdefault((edge.src, edge.dst), []).append(edge)
        return {pair: tuple(edges) for pair, edges in pairs.items()}

    def carries_grad(self) -> dict[str, bool]:
        """Per crossing value: whether a gradient travels back for it in training."""
        return {e.value: bool(e.info.tensors and e.info.tensors[0].requires_grad)
                for e in self.edges}


@dataclasses.dataclass(frozen=True)
class Event:
    """When `action` ran on `stage`, in seconds from the start of its run (for a simulated link
    transfer: when its message was on the wire)."""

    stage: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class ValueRef:
    """A value of the graph by name, where the model's output structure holds it (a plain
    class, so pytree treats it as a leaf and constants in the output stay distinguishable)."""

    name: str


def send(value: Any, *, src: int, dst: int) -> Any:
    """Hand `value` from stage `src` to stage `dst`; run sequentially, the value passes as is."""
    return value


def recv(message: Any, *, src: int, dst: int, device: str) -> Any:
    """Receive a value sent by stage `src` on stage `dst`'s device."""
    if isinstance(message, torch.Tensor) and message.device != torch.device(device):
        return message.to(device)
    return message


class StageArgs(NamedTuple):
    """What a stage runs on: its inputs and the weights to use (empty: the stage's own)."""

    inputs: tuple[Any, ...]
    weights: Mapping[str, torch.Tensor]


class Stage(torch.nn.Module):
    """One pipeline stage: the stage's graph module, run with the weights its hook hands it."""

    def __init__(self, index: int, module: fx.GraphModule) -> None:
        super().__init__()
        self.index = index
        self.module = module

    def forward(self, args: StageArgs) -> tuple[Any, ...]:
        if args.weights:
            return functional_call(self.module, dict(args.weights), tuple(args.inputs))
        return self.module(*args.inputs)


class StageHook(torch.nn.Module):
    """Identity in forward; in backward, fires the stage's callbacks once its backward is done.

    The hook passes the stage's inputs and trainable parameters through one autograd function,
    and the stage runs on what comes out. Autograd calls that function's backward only when the
    gradients of all of them are complete, so the callbacks see a finished stage backward, also
    for a first stage whose inputs need no gradient.
    """

    def __init__(self, index: int, weights: Mapping[str, torch.nn.Parameter]) -> None:
        super().__init__()
        self.index = index
        self._weights = dict(weights)  # a plain dict: the stage module owns the parameters
        self._callbacks: OrderedDict[int, Callable[[int], None]] = OrderedDict()  # weakref-able
        self.finishing = False  # set by the runtime: the mini-batch's last backward is running

    def rebind(self, weights: Mapping[str, torch.nn.Parameter]) -> None:
        """Pass these parameters through instead (the stage's, once a meta model's stage has
        been made real)."""
        self._weights = dict(weights)

    def register(self, callback: Callable[[int], None]) -> RemovableHandle:
        """Call `callback(stage)` after each backward of this stage; returns a removable handle."""
        handle = RemovableHandle(self._callbacks)
        self._callbacks[handle.id] = callback
        return handle

    def fire(self) -> None:
        for callback in list(self._callbacks.values()):
            callback(self.index)

    def forward(self, *inputs: Any) -> StageArgs:
        if not torch.is_grad_enabled():
            return StageArgs(inputs, {})
        weights = {name: w for name, w in self._weights.items() if w.requires_grad}
        slots = [i for i, x in enumerate(inputs)
                 if isinstance(x, torch.Tensor) and x.requires_grad]
        tensors = [inputs[i] for i in slots] + list(weights.values())
        if not tensors:
            return StageArgs(inputs, {})
        hooked = _HookFunction.apply(self, *tensors)
        passed = list(inputs)
        for i, tensor in zip(slots, hooked):
            passed[i] = tensor
        return StageArgs(tuple(passed), dict(zip(weights, hooked[len(slots):])))


class _HookFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hook: StageHook, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        ctx.set_materialize_grads(False)  # unused weights keep grad None, as in the plain model
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.hook.fire()
        return (None, *grads)


def tied_parameters(stages: Sequence[Stage], names: Mapping[int, str]
                    ) -> list[tuple[str, torch.nn.Parameter, list[int]]]:
    """(name, Parameter, the stages using it) for each weight more than one stage uses (a tied
    weight), sorted by name; `names` maps a Parameter's id to its name in the model."""
    found: dict[int, tuple[str, torch.nn.Parameter, list[int]]] = {}
    for stage in stages:
        for name, p in stage.module.named_parameters():
            entry = found.setdefault(id(p), (names.get(id(p), name), p, []))
            entry[2].append(stage.index)
    return sorted((entry for entry in found.values() if len(entry[2]) > 1),
                  key=lambda entry: entry[0])
