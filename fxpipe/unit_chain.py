"""A stage's graph cut along its units into a chain of segments, each callable on its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import fx

from fxpipe.meta import SEGMENT, SHAPE, UNIT
from fxpipe.segments import checkpointed, kept_by_lifetimes, segmentation
from fxpipe.units import in_place

__all__ = ["Segment", "UnitChain", "mark_segments"]


class Segment(NamedTuple):
    """Consecutive nodes of one unit (or of several, see UnitChain) and what crosses its ends."""

    units: tuple[int, ...]  # the units whose nodes it runs
    inputs: tuple[str, ...]  # values it reads that the stage's inputs or earlier segments hold
    outputs: tuple[str, ...]  # values it makes that later segments or the stage's output read
    code: fx.GraphModule  # runs its nodes; reads the stage's attributes as `stage.<target>`
    targets: tuple[str, ...]  # the stage's submodules and attributes it reads (their buffers)


class UnitChain:
    """The stage module's graph as a chain of segments of whole units: running them in turn,
    each on the values the earlier ones made, computes what the module does.

    Where the chain is cut: a segment per unit (`per_unit`) keeps every unit's input, which
    is much of what autograd would save anyway (a Linear saves its input); so by default
    the cuts minimise the bytes a micro-batch needs at the peak of its backward, the values
    kept at the cuts plus the largest segment's activations (`fxpipe.segments`). The
    compiler marks where from the cost table, as the memory model counts them
    (node.meta[SEGMENT]: the first unit of each node's segment); unmarked, the same choice
    is made from the shapes the example batch gave (node.meta[SHAPE]: what each node makes,
    views counted as free).

    A segment reads the stage module's submodules and weights at each call, not copies of
    them: parameters replaced later (`.to()`, `load_state_dict(assign=True)`) are the ones it
    uses, and `torch.func.functional_call(segment.code, {"stage." + name: w})` substitutes
    weights as for the whole module. Nodes without a unit (added by later rewrites) join the
    segment before them. An in-place node that writes into a value an earlier
    segment made, or into a view of one, joins the segments from that one to its own: a
    segment's inputs must stay as they were for it to run again.
    """

    def __init__(self, module: fx.GraphModule, per_unit: bool = False) -> None:
        self.module = module
        nodes = [n for n in module.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
        self.inputs = tuple(n.name for n in module.graph.nodes if n.op == "placeholder")
        output = next(n for n in module.graph.nodes if n.op == "output")
        self._output = output.args[0]
        groups = _groups(module, nodes)
        if not per_unit:
            marked = _marked_cuts(groups)
            groups = _join(groups, _cheapest_cuts(groups, output) if marked is None else marked)
        read_later: set[str] = {n.name for n in output.all_input_nodes}
        built = []
        for group in reversed(groups):
            built.append(_segment(module, group, read_later))
            for node in group:
                read_later.update(v.name for v in node.all_input_nodes if v.op != "get_attr")
        self.segments: tuple[Segment, ...] = tuple(reversed(built))

    def run(self, inputs: Sequence[Any],
            call: Callable[[Segment, Sequence[Any]], Sequence[Any]] | None = None) -> Any:
        """What the module returns for `inputs`, computed segment by segment; `call(segment,
        values)` runs one (by default `segment.code(*values)`)."""
        env = dict(zip(self.inputs, inputs))
        for segment in self.segments:
            values = [env[name] for name in segment.inputs]
            made = call(segment, values) if call else segment.code(*values)
            env.update(zip(segment.outputs, made))
        return fx.map_arg(self._output, lambda node: env[node.name] if node.op != "get_attr"
                          else _attribute(self.module, node.target))

    def buffers(self, segment: Segment) -> list[torch.Tensor]:
        """The stage's buffers `segment` can update (of the submodules and attributes it
        reads), as they are now."""
        found: dict[int, torch.Tensor] = {}
        for target in segment.targets:
            value = _attribute(self.module, target)
            tensors = value.buffers() if isinstance(value, torch.nn.Module) else (
                [value] if isinstance(value, torch.Tensor)
                and not isinstance(value, torch.nn.Parameter) else [])
            found.update((id(t), t) for t in tensors)
        return list(found.values())


def _groups(module: fx.GraphModule, nodes: Sequence[fx.Node]) -> list[list[fx.Node]]:
    """The nodes in runs of one unit each, runs joined where an in-place node writes into a
    value of an earlier run."""
    groups: list[list[fx.Node]] = []
    unit, run_of = None, {}
    for node in nodes:
        label = node.meta.get(UNIT, unit)
        if not groups or label != unit:
            groups.append([])
        groups[-1].append(node)
        unit, run_of[node] = label, len(groups) - 1
    for node in nodes:
        target = _base(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
        if in_place(module, node) and target in run_of:
            first, last = run_of[target], run_of[node]
            if first < last:
                joined = [n for group in groups[first:last + 1] for n in group]
                groups[first:last + 1] = [joined]
                run_of.update((n, first) for n in joined)
                for later in nodes:  # the runs after it moved up
                    if run_of[later] > last:
                        run_of[later] -= last - first
    return groups


def _marked_cuts(groups: Sequence[Sequence[fx.Node]]) -> list[int] | None:
    """After which groups the compiler's marks (node.meta[SEGMENT]) begin a new segment, or
    None where nothing is marked. A mark inside a group (joined by an in-place write) is not
    a cut: a segment's inputs must stay as they were."""
    marks = [next((n.meta[SEGMENT] for n in g if SEGMENT in n.meta), None) for g in groups]
    if all(m is None for m in marks):
        return None
    cuts, current = [], None
    for i, mark in enumerate(marks):
        if mark is not None and current is not None and mark != current:
            cuts.append(i)
        current = mark if mark is not None else current
    return cuts


def _cheapest_cuts(groups: Sequence[Sequence[fx.Node]], output: fx.Node) -> list[int]:
    """After which groups to cut (`fxpipe.segments.segmentation`), from the bytes each group
    makes and the lifetimes of the values read across groups."""
    if len(groups) < 2:
        return []
    made = np.array([sum(_bytes(n) for n in g if not _is_view(n)) for g in groups], float)
    lifetimes = np.zeros((len(groups), len(groups)))  # [m, r]: made by group m, r reads last
    group_of = {n: i for i, g in enumerate(groups) for n in g}
    for node, i in group_of.items():
        users = [group_of.get(u) for u in node.users]
        if output not in node.users and all(u is not None for u in users) and users:
            lifetimes[i, max(users)] += _bytes(node)  # held from group i until its last reader
    # each checkpoint also keeps the CPU generator's state (preserve_rng_state)
    out = checkpointed(kept_by_lifetimes(lifetimes), torch.get_rng_state().nbytes)
    return list(segmentation(out, made).cuts)


def _join(groups: list[list[fx.Node]], cuts: Sequence[int]) -> list[list[fx.Node]]:
    """The groups joined between the cuts (each the number of groups before it)."""
    edges = [0, *cuts, len(groups)]
    return [[n for g in groups[a:b] for n in g] for a, b in zip(edges, edges[1:])]


_VIEWS = {"view", "view_as", "reshape", "flatten", "transpose", "permute", "t", "split",
          "chunk", "unbind", "unsqueeze", "squeeze", "expand", "narrow", "select",
          "getitem", "getattr", "contiguous", "detach"}


def _is_view(node: fx.Node) -> bool:
    """Whether the node likely makes no new storage (a view, an item of a tuple)."""
    if isinstance(node.target, torch._ops.OpOverload):  # torch.export's aten ops say so
        return node.target.is_view
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.op != "call_module" and target in _VIEWS


def _base(node: fx.Node) -> fx.Node:
    """The value a view was taken of (writing into a view writes into it)."""
    while _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _bytes(node: fx.Node) -> int:
    info = node.meta.get(SHAPE)
    return info.nbytes if info is not None else 0


def _segment(module: fx.GraphModule, nodes: list[fx.Node], read_later: set[str]) -> Segment:
    inside = set(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[str] = []
    targets: dict[str, None] = {}
    for node in nodes:
        for value in node.all_input_nodes:
            if value in env or value in inside:
                continue
            if value.op == "get_attr":
                env[value] = graph.get_attr(f"stage.{value.target}")
                targets.setdefault(value.target)
            else:
                env[value] = graph.placeholder(value.name)
                inputs.append(value.name)
            env[value].meta = dict(value.meta)
        copy = graph.node_copy(node, lambda n: env[n])
        if node.op == "call_module":
            copy.target = f"stage.{node.target}"
            targets.setdefault(node.target)
        env[node] = copy
    outputs = tuple(n.name for n in nodes if n.name in read_later)
    graph.output(tuple(env[inside_node] for inside_node in nodes if inside_node.name in read_later))
    holder = torch.nn.Module()
    holder.stage = module
    code = fx.GraphModule(holder, graph, class_name="Segment")
    # GraphModule copies the attributes it reads into fresh parent modules; its code looks
    # them up through `self.stage` at each call, so point that at the stage module itself
    code.stage = module
    units = tuple(dict.fromkeys(n.meta[UNIT] for n in nodes if UNIT in n.meta))
    return Segment(units, tuple(inputs), outputs, code, tuple(targets))


def _attribute(module: torch.nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner), name)


def mark_segments(module: fx.GraphModule, starts: Sequence[int]) -> None:
    """Mark each node of a stage's graph with the first unit of its checkpointed segment,
    the segments beginning at the units `starts` (ascending; nodes of units before the first
    mark its segment), for UnitChain to cut there."""
    for node in module.graph.nodes:
        if UNIT in node.meta:
            node.meta[SEGMENT] = max((u for u in starts if u <= node.meta[UNIT]),
                                     default=starts[0])
