"""Phase 2: which values are held as channel pieces, and how each merged op reads its inputs."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence

import torch
from torch import fx

from fxpipe.meta import ValueInfo
from fxpipe.passes.rewrite.split_merge.layers import Layer, shard_bounds
from fxpipe.passes.rewrite.split_merge.ops import channel_op
from fxpipe.passes.rewrite.split_merge.values import shape_of

__all__ = ["Read", "ShardPlan", "Sharding", "merged_chains", "propagate"]


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A value held as pieces: piece i is [bounds[i], bounds[i+1]) along `dim`."""

    dim: int
    bounds: tuple[int, ...]

    @property
    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]


@dataclasses.dataclass(frozen=True)
class Read:
    """How shard i reads one input: its own piece, a slice of a whole value, or the whole."""

    how: str  # "piece" | "scatter" | "whole"
    dim: int = 0
    bounds: tuple[int, ...] = ()  # "scatter": the slices, along `dim`


@dataclasses.dataclass
class ShardPlan:
    """Which values are held as pieces, how each shard reads its inputs, which layers split."""

    sharding: dict[fx.Node, Sharding]
    reads: dict[fx.Node, dict[fx.Node, Read]]  # merged op (or split layer) -> its inputs
    layers: dict[fx.Node, Layer]
    probes: set[fx.Node]  # shape queries answered by piece 0


def propagate(gm: fx.GraphModule, layers: dict[fx.Node, Layer],
              values: Mapping[fx.Node, ValueInfo], n: int) -> ShardPlan:
    """Which values of `gm` are held as pieces once `layers` are split over `n` devices."""
    plan = ShardPlan({}, {}, layers, set())
    for node in gm.graph.nodes:
        if node in layers:
            layer = layers[node]
            bounds = shard_bounds(layer, n)
            out_rank = len(shape_of(values, node))
            plan.sharding[node] = Sharding(out_rank - 1 - layer.spatial, bounds)
            plan.reads[node] = _layer_reads(node, layer, bounds, plan, values)
            continue
        if not any(value in plan.sharding for value in node.all_input_nodes):
            continue
        op = channel_op(node, gm)
        if op is not None and op[0] == "size":
            source = node.args[0]
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            rank = len(shape_of(values, source))
            if isinstance(dim, int) and dim % rank != plan.sharding[source].dim:
                plan.probes.add(node)
            continue
        merged = _merge(node, op, plan.sharding, values, gm) if op else None
        if merged is not None:
            plan.sharding[node], plan.reads[node] = merged
    return plan


def _layer_reads(node: fx.Node, layer: Layer, bounds: tuple[int, ...], plan: ShardPlan,
                 values: Mapping[fx.Node, ValueInfo]) -> dict[fx.Node, Read]:
    """A grouped conv reads input pieces that line up with its groups; others read the whole."""
    x = node.args[0] if node.args else node.kwargs["input"]
    if layer.groups == 1:
        return {x: Read("whole")}
    in_dim = len(shape_of(values, x)) - 1 - layer.spatial
    per_out = layer.channels // layer.groups
    in_bounds = tuple(b // per_out * layer.in_per_group for b in bounds)
    if plan.sharding.get(x) == Sharding(in_dim, in_bounds):
        return {x: Read("piece")}
    return {x: Read("scatter", in_dim, in_bounds)}


def _merge(node: fx.Node, op: tuple[str, int], sharding: Mapping[fx.Node, Sharding],
           values: Mapping[fx.Node, ValueInfo], gm: fx.GraphModule
           ) -> tuple[Sharding, dict[fx.Node, Read]] | None:
    """The sharding of `node`'s output if it acts on each channel alone, else None."""
    kind, spatial = op
    out = values.get(node)
    if out is None or not out.is_tensor:
        return None  # tuple outputs (pooling indices, ...) are read whole
    out_rank = len(out.tensors[0].shape)
    tensors = [v for v in node.all_input_nodes if values[v].is_tensor]
    split = [v for v in tensors if v in sharding]
    first = node.args[0] if node.args else next(iter(node.kwargs.values()), None)
    if kind != "binary" and split != [first]:
        return None
    if kind == "binary":
        return _merge_binary(node, tensors, sharding, values, out_rank)
    source = sharding[first]
    dim, in_rank = source.dim, len(shape_of(values, first))
    reads = {v: Read("whole") for v in node.all_input_nodes}
    reads[first] = Read("piece")
    if kind == "batch_norm":
        if dim != 1 or not _batch_norm_mergeable(node, gm):
            return None
        channels = source.bounds[-1]
        for v in tensors:
            if v is not first:
                if shape_of(values, v) != (channels,):
                    return None
                reads[v] = Read("scatter", 0, source.bounds)
    elif (len(tensors) > 1  # an op we treat as unary, given a tensor besides its input
          or (kind == "channel" and dim != 1) or (kind == "pool" and dim >= in_rank - spatial)):
        return None
    elif kind == "flatten":
        start, end = _flatten_dims(node, gm)
        start, end = start % in_rank, end % in_rank
        if start <= dim <= end and start != end:
            return None
        dim = dim if dim < start else dim - (end - start)
    return Sharding(dim, source.bounds), reads


def _merge_binary(node: fx.Node, tensors: Sequence[fx.Node],
                  sharding: Mapping[fx.Node, Sharding], values: Mapping[fx.Node, ValueInfo],
                  out_rank: int) -> tuple[Sharding, dict[fx.Node, Read]] | None:
    """Elementwise ops: split operands must line up; whole ones broadcast or are sliced."""
    aligned = {sharding[v].dim + out_rank - len(shape_of(values, v)) for v in tensors
               if v in sharding}
    bounds = {sharding[v].bounds for v in tensors if v in sharding}
    if len(aligned) != 1 or len(bounds) != 1:
        return None
    dim, (bounds_,) = aligned.pop(), bounds
    if _inplace(node) and node.args[0] not in sharding:
        return None  # writing into a slice of an unsplit tensor: read it whole instead
    reads = {v: Read("whole") for v in node.all_input_nodes}
    for v in tensors:
        if v in sharding:
            reads[v] = Read("piece")
            continue
        shape = shape_of(values, v)
        own = dim - (out_rank - len(shape))
        if own >= 0 and shape[own] == bounds_[-1] and bounds_[-1] > 1:
            reads[v] = Read("scatter", own, bounds_)
        elif own >= 0 and shape[own] != 1:
            return None
    return Sharding(dim, bounds_), reads


def _inplace(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_")
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target.overloadpacket.__name__.endswith("_")
    return node.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv)


def _batch_norm_mergeable(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op != "call_module":
        return True
    bn = gm.get_submodule(node.target)
    # without tracked statistics the buffers, if any, are used in eval mode only: read it whole
    return bn.track_running_stats or bn.running_mean is None


def _flatten_dims(node: fx.Node, gm: fx.GraphModule) -> tuple[int, int]:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return module.start_dim, module.end_dim
    names = ("input", "start_dim", "end_dim")
    args = {"start_dim": 0, "end_dim": -1, **dict(zip(names, node.args)), **node.kwargs}
    return args["start_dim"], args["end_dim"]


def merged_chains(plan: ShardPlan, nodes: Sequence[fx.Node]) -> dict[fx.Node, int]:
    """Merged chains: values joined by a piece flowing from one to the other."""
    parent = {node: node for node in plan.sharding}

    def root(node: fx.Node) -> fx.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for node, reads in plan.reads.items():
        for value, how in reads.items():
            if how.how == "piece":
                parent[root(value)] = root(node)
    index: dict[fx.Node, int] = {}
    return {node: index.setdefault(root(node), len(index))
            for node in nodes if node in plan.sharding}
