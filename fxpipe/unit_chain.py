"""A stage's graph cut along its units into a chain of segments, each callable on its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import fx

from fxpipe.meta import SHAPE, UNIT
from fxpipe.units import in_place

__all__ = ["Segment", "UnitChain"]


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
    kept at the cuts plus the largest segment's activations, estimated from the shapes the
    example batch gave (node.meta[SHAPE]: what each node makes, views counted as free).

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
            groups = _join(groups, _cheapest_cuts(groups, output))
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


def _cheapest_cuts(groups: Sequence[Sequence[fx.Node]], output: fx.Node) -> list[int]:
    """After which groups to cut: the fewest bytes kept at the cuts plus in the largest
    segment. The bound on a segment's bytes is tried at a few dozen values; for each, the
    cheapest cuts under it by dynamic programming."""
    if len(groups) < 2:
        return []
    made = np.array([sum(_bytes(n) for n in g if not _is_view(n)) for g in groups], float)
    kept = np.zeros(len(groups))  # kept[i]: bytes live across the cut after group i
    group_of = {n: i for i, g in enumerate(groups) for n in g}
    for node, i in group_of.items():
        users = [group_of.get(u) for u in node.users]
        if output not in node.users and all(u is not None for u in users) and users:
            kept[i:max(users)] += _bytes(node)  # held from group i until its last reader
    ends = np.concatenate(([0.0], np.cumsum(made)))
    sums = np.unique([ends[j] - ends[i] for i in range(len(groups))
                      for j in range(i + 1, len(groups) + 1)])
    bounds = sums[sums >= made.max()]
    bounds = bounds[np.unique(np.linspace(0, len(bounds) - 1, 48).round().astype(int))]
    best_cost, best_cuts = np.inf, []
    for bound in bounds:
        cost, back = np.full(len(groups) + 1, np.inf), np.zeros(len(groups) + 1, int)
        cost[0] = 0.0
        for j in range(1, len(groups) + 1):  # cost[j]: groups[:j] cut, the last cut at j
            first = int(np.searchsorted(ends, ends[j] - bound, side="left"))
            options = cost[first:j] + np.concatenate(([0.0], kept[:j - 1]))[first:j]
            back[j] = first + int(np.argmin(options))
            cost[j] = options[back[j] - first]
        if cost[-1] + bound < best_cost:
            best_cost, best_cuts, j = cost[-1] + bound, [], len(groups)
            while j > 0:
                j = back[j]
                best_cuts.append(j)
    return sorted(c for c in best_cuts if c > 0)


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
