"""The zero-bubble backward split: input gradients first, the weights' later from what B left."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightWork", "input_backward", "weight_backward"]

Edge = tuple[Node, int]  # (node, which of its gradient inputs)


@dataclass
class WeightWork:
    """What the weight gradient of a micro-batch still has to compute once B has run.

    The autograd graph from the stage's roots splits in two: the activation path (nodes from
    which a gradient reaches an input of the stage) and the weight path (every other node that
    reaches a leaf: parameters, through transposes, views, ...). B runs the activation path
    only. The activation nodes with an edge into the weight path (for a Linear, its addmm,
    whose weight edge is dW = dy^T x) are the "intermediates": B records the gradients flowing
    into them, and W runs each again with only its weight edges needed, then the weight path
    from the gradients these edges got. So every gradient of every node is computed once,
    as in the unsplit backward, and the activation path is not walked a second time.
    """

    # intermediates whose weight paths share a node (a weight used twice, ...) form one group:
    # run alone, one intermediate's call would also reach the other's edges through the
    # activation path between them and count that part twice
    groups: list[list[Node]] = field(default_factory=list)
    captured: dict[Node, dict[int, torch.Tensor]] = field(default_factory=dict)
    clamped: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    weight_edges: dict[Node, list[Edge]] = field(default_factory=dict)
    roots: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)


def input_backward(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   leaves: Sequence[torch.Tensor]
                   ) -> tuple[tuple[torch.Tensor | None, ...], WeightWork]:
    """The gradients of `leaves` (the stage's inputs) from `tensors` with `grads`, computed on
    the activation path only; and the weight gradients' work left for `weight_backward`."""
    work = WeightWork()
    if not tensors:
        return (None,) * len(leaves), work
    root_edges = [(e.node, e.output_nr) for e in map(get_gradient_edge, tensors)]
    inputs = {get_gradient_edge(leaf).node for leaf in leaves}
    graph = _Graph(root_edges, inputs)
    for tensor, grad, (node, _) in zip(tensors, grads, root_edges):
        if node is not None and not graph.to_input[node] and graph.to_leaf[node]:
            work.roots.append((tensor, grad))  # reaches no input: all its backward is W's
    for node in graph.order:
        if graph.to_input[node]:
            edges = [(c, nr) for c, nr in graph.children[node]
                     if not graph.to_input[c] and graph.to_leaf[c]]
            if edges:
                work.weight_edges[node] = edges
    work.groups = _groups(work.weight_edges, graph.children, graph.to_input)

    slots = [(node, nr) for node in work.weight_edges for nr in sorted(graph.slots[node])]
    handles = []
    try:
        for group in work.groups:
            if len(group) > 1:  # their calls overwrite what reaches them (see weight_backward)
                for node in group:
                    handles.append(node.register_prehook(
                        lambda g, node=node: work.clamped.__setitem__(node, tuple(g))))
        asked = [*leaves, *(GradientEdge(node, nr) for node, nr in slots)]
        found = torch.autograd.grad(tensors, asked, grads, retain_graph=True,
                                    allow_unused=True) if asked else ()
    finally:
        for handle in handles:
            handle.remove()
    for (node, nr), grad in zip(slots, found[len(leaves):]):
        if grad is not None:
            work.captured.setdefault(node, {})[nr] = grad
    return tuple(found[:len(leaves)]), work


def weight_backward(work: WeightWork) -> None:
    """Accumulate the leaves' (the parameters') gradients left by `input_backward` into their
    `.grad`, as the unsplit backward does, and free the graph's part it ran."""
    seeds: dict[Edge, torch.Tensor] = {}
    # groups of several first: their calls run activation nodes between their intermediates,
    # which the single intermediates' calls free after them
    for group in sorted(work.groups, key=len, reverse=True):
        outputs = [(node, nr, g) for node in group
                   for nr, g in work.captured.get(node, {}).items()]
        if not outputs:
            continue  # no gradient reached them
        edges = list(dict.fromkeys(e for node in group for e in work.weight_edges[node]))
        handles = [node.register_prehook(lambda g, held=work.clamped[node]: held)
                   for node in group if len(group) > 1 and node in work.clamped]
        try:
            found = torch.autograd.grad([GradientEdge(node, nr) for node, nr, _ in outputs],
                                        [GradientEdge(*e) for e in edges],
                                        [g for _, _, g in outputs],
                                        retain_graph=len(group) > 1, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for edge, grad in zip(edges, found):
            if grad is not None:
                seeds[edge] = grad if edge not in seeds else seeds[edge] + grad
    tensors = [GradientEdge(*e) for e in seeds] + [t for t, _ in work.roots]
    if tensors:
        torch.autograd.backward(tensors, [*seeds.values(), *(g for _, g in work.roots)])


class _Graph:
    """The autograd graph below `roots`: each node's children, which gradient inputs of it
    receive one, and whether it reaches an input of the stage or any other leaf."""

    def __init__(self, roots: Sequence[Edge], inputs: set[Node]) -> None:
        self.children: dict[Node, list[Edge]] = {}
        self.slots: dict[Node, set[int]] = {}
        self.order: list[Node] = []  # children before parents
        stack = []
        for node, nr in roots:
            if node is not None:
                self.slots.setdefault(node, set()).add(nr)
                stack.append((node, False))
        while stack:  # iterative: a deep model's graph exceeds the recursion limit
            node, done = stack.pop()
            if done:
                self.order.append(node)
                continue
            if node in self.children:
                continue
            kids = [(c, nr) for c, nr in node.next_functions if c is not None]
            self.children[node] = kids
            stack.append((node, True))
            for child, nr in kids:
                self.slots.setdefault(child, set()).add(nr)
                if child not in self.children:
                    stack.append((child, False))
        self.to_input: dict[Node, bool] = {}
        self.to_leaf: dict[Node, bool] = {}  # a leaf other than the stage's inputs
        for node in self.order:
            kids = self.children[node]
            self.to_input[node] = node in inputs or any(self.to_input[c] for c, _ in kids)
            self.to_leaf[node] = (node not in inputs and hasattr(node, "variable")) or any(
                self.to_leaf[c] and not self.to_input[c] for c, _ in kids)


def _groups(weight_edges: dict[Node, list[Edge]], children: dict[Node, list[Edge]],
            to_input: dict[Node, bool]) -> list[list[Node]]:
    """The intermediates, grouped where their weight paths share a node (union-find)."""
    parent = {node: node for node in weight_edges}

    def find(node: Node) -> Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    owner: dict[Node, Node] = {}
    for node, edges in weight_edges.items():
        stack = [c for c, _ in edges]
        while stack:
            child = stack.pop()
            seen = owner.get(child)
            if seen is node:
                continue
            if seen is not None:  # reached from another intermediate's weight path too
                parent[find(seen)] = find(node)
                continue  # its nodes below are the other one's already
            owner[child] = node
            stack += [c for c, _ in children[child] if not to_input[c]]
    groups: dict[Node, list[Node]] = {}
    for node in weight_edges:
        groups.setdefault(find(node), []).append(node)
    return list(groups.values())
