"""Phase 3: the rewritten graph, each merged op once per shard, a gather per value read whole."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxpipe.meta import GATHER, SHAPE, SHARD, ValueInfo
from fxpipe.passes.rewrite.split_merge.graphs import inherited_meta
from fxpipe.passes.rewrite.split_merge.layers import Layer, bind
from fxpipe.passes.rewrite.split_merge.ops import BN_MODULES, channel_op
from fxpipe.passes.rewrite.split_merge.propagate import Read, Sharding, ShardPlan, merged_chains
from fxpipe.passes.rewrite.split_merge.records import ShardTag
from fxpipe.passes.rewrite.split_merge.values import piece_info

__all__ = ["Builder"]

aten = torch.ops.aten


def _batch_norm_state(bn: nn.modules.batchnorm._BatchNorm) -> tuple[bool, float]:
    """Once per BatchNorm call: count the batch, return (use batch statistics, momentum).

    Mirrors `_BatchNorm.forward`, whose counter must advance once per call, not once per shard.
    """
    momentum = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            momentum = 1.0 / float(bn.num_batches_tracked)
    return bn.training or (bn.running_mean is None and bn.running_var is None), momentum


class Builder:
    """The emit phase's state: the new graph, and where each old value lives in it."""

    def __init__(self, gm: fx.GraphModule, plan: ShardPlan, values: Mapping[fx.Node, ValueInfo],
                 devices: Sequence[str], home: torch.device) -> None:
        self.gm, self.plan, self.values, self.devices = gm, plan, values, list(devices)
        self.graph = fx.Graph()
        self.graph.set_codegen(gm.graph._codegen)  # how inputs/outputs are (un)flattened
        self.aten = any(isinstance(n.target, torch._ops.OpOverload) for n in gm.graph.nodes)
        self.home = home
        self.chain = merged_chains(plan, list(gm.graph.nodes))
        self.env: dict[fx.Node, fx.Node] = {}
        self.pieces: dict[fx.Node, list[fx.Node]] = {}
        self.cache: dict[Any, Any] = {}
        self.gathers: list[str] = []
        self.gathered: dict[int, list[str]] = {}
        self.scatters: list[str] = []

    def run(self) -> None:
        for node in self.gm.graph.nodes:
            if node in self.plan.sharding:
                self.pieces[node] = [self.shard(node, i) for i in
                                     range(len(self.plan.sharding[node].sizes))]
            elif node in self.plan.probes:
                self.env[node] = self.graph.node_copy(
                    node, lambda v: self.pieces[v][0] if v in self.pieces else self.full(v))
            else:
                self.env[node] = self.graph.node_copy(node, self.full)

    # values -------------------------------------------------------------------------------
    def full(self, value: fx.Node) -> fx.Node:
        """The whole tensor of an old value: its copy, or the gather of its pieces."""
        if value in self.env:
            return self.env[value]
        key = ("gather", value)
        if key not in self.cache:
            sharding, chain = self.plan.sharding[value], self.chain[value]
            parts = [self.move(piece, self.home, None) for piece in self.pieces[value]]
            cat = self.graph.call_function(aten.cat.default if self.aten else torch.cat,
                                           (parts, sharding.dim))
            cat.name = self._name(f"{value.name}_gathered")
            cat.meta = inherited_meta(value, self.values[value])
            cat.meta[GATHER] = chain
            self.cache[key] = cat
            self.gathers.append(cat.name)
            self.gathered.setdefault(chain, []).append(value.name)
        return self.cache[key]

    def read(self, value: fx.Node, how: Read, tag: ShardTag, consumer: fx.Node) -> fx.Node:
        """Shard `tag.shard`'s view of an old value, on the shard's device."""
        if how.how == "piece":
            return self.pieces[value][tag.shard]
        part = self.full(value)
        if how.how == "scatter":
            part = self.scatter(part, how.dim, how.bounds, value, consumer)[tag.shard]
        if not self.values[value].is_tensor:
            return part
        return self.move(part, torch.device(tag.device), tag)

    def scatter(self, whole: fx.Node, dim: int, bounds: tuple[int, ...], origin: fx.Node,
                consumer: fx.Node) -> list[fx.Node]:
        """`whole` split into slices (views, so gradients flow back into it) for `consumer`."""
        key = ("scatter", whole, dim, bounds)
        if key not in self.cache:
            sizes = [b - a for a, b in zip(bounds, bounds[1:])]
            target = aten.split_with_sizes.default if self.aten else torch.split
            split = self.graph.call_function(target, (whole, sizes, dim))
            split.name = self._name(f"{whole.name}_split")
            split.meta = inherited_meta(consumer, None)
            parts = []
            for i, size in enumerate(sizes):
                part = self.graph.call_function(operator.getitem, (split, i))
                part.name = self._name(f"{whole.name}_part{i}")
                part.meta = inherited_meta(consumer, piece_info(whole.meta.get(SHAPE), dim, size))
                parts.append(part)
            self.cache[key] = parts
            if origin.op != "get_attr":
                self.scatters.append(origin.name)
        return self.cache[key]

    def move(self, value: fx.Node, device: torch.device, tag: ShardTag | None) -> fx.Node:
        """`value` on `device` (pieces live on their shard's device, the rest at home)."""
        here = self.home if tag is not None or SHARD not in value.meta else \
            torch.device(value.meta[SHARD].device)
        if device == here:
            return value
        key = ("move", value, device, tag)
        if key not in self.cache:
            if self.aten:
                moved = self.graph.call_function(aten._to_copy.default, (value,),
                                                 {"device": device})
            else:
                moved = self.graph.call_method("to", (value, device))
            moved.meta = {**value.meta}
            moved.meta.pop(SHARD, None)
            if tag is not None:
                moved.meta[SHARD] = tag
            self.cache[key] = moved
        return self.cache[key]

    def attr(self, target: str) -> fx.Node:
        key = ("attr", target)
        if key not in self.cache:
            node = self.graph.get_attr(target)
            value = operator.attrgetter(target)(self.gm)
            if isinstance(value, torch.Tensor):
                node.meta[SHAPE] = ValueInfo.of(value)
            self.cache[key] = node
        return self.cache[key]

    def _name(self, name: str) -> str:
        return self.graph._graph_namespace.create_name(name, None)

    # nodes ----------------------------------------------------------------------------------
    def shard(self, node: fx.Node, shard: int) -> fx.Node:
        """Shard `shard`'s copy of a split layer or a merged op."""
        sharding = self.plan.sharding[node]
        tag = ShardTag(self.chain[node], shard, self.devices[shard])
        reads = self.plan.reads[node]
        args = {v: self.read(v, reads.get(v, Read("whole")), tag, node)
                for v in node.all_input_nodes}
        if node in self.plan.layers:
            piece = self.layer_shard(node, self.plan.layers[node], sharding, tag, args)
        elif node.op == "call_module" and isinstance(self.gm.get_submodule(node.target),
                                                     BN_MODULES):
            piece = self.batch_norm_shard(node, sharding, tag, args)
        else:
            piece = self.graph.node_copy(node, args.__getitem__)
            if channel_op(node, self.gm) == ("batch_norm", 0):
                for value, how in reads.items():
                    if how.how == "scatter" and _is_buffer(self.gm, value):
                        home = self.scatter(self.full(value), 0, how.bounds, value, node)
                        self.write_back(home[shard], args[value], piece, tag)
        piece.name = self._name(f"{node.name}_s{shard}")
        piece.meta = inherited_meta(node, piece_info(self.values[node], sharding.dim,
                                                     sharding.sizes[shard]))
        piece.meta[SHARD] = tag
        return piece

    def param(self, whole: fx.Node, bounds: tuple[int, ...], tag: ShardTag, consumer: fx.Node
              ) -> fx.Node:
        """Slice `tag.shard` of a parameter or buffer (dim 0), on the shard's device."""
        return self.move(self.scatter(whole, 0, bounds, whole, consumer)[tag.shard],
                         torch.device(tag.device), tag)

    def layer_shard(self, node: fx.Node, layer: Layer, sharding: Sharding, tag: ShardTag,
                    args: Mapping[fx.Node, fx.Node]) -> fx.Node:
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            weight = self.attr(f"{node.target}.weight")
            bias = self.attr(f"{node.target}.bias") if module.bias is not None else None
            x = args[node.args[0]]
            if layer.spatial:
                target = (F.conv1d, F.conv2d, F.conv3d)[layer.spatial - 1]
                kwargs = {"stride": module.stride, "padding": module.padding,
                          "dilation": module.dilation}
                if module.padding_mode != "zeros":  # as Conv._conv_forward does
                    x = self.graph.call_function(
                        F.pad, (x, module._reversed_padding_repeated_twice),
                        {"mode": module.padding_mode})
                    x.meta = {**inherited_meta(node, None), SHARD: tag}
                    kwargs["padding"] = 0
            else:
                target, kwargs = F.linear, {}
        else:
            bound = bind(node)
            target, x = node.target, args[bound["input"]]
            weight = self.full(bound["weight"])
            bias = self.full(bound["bias"]) if isinstance(bound.get("bias"), fx.Node) else None
            kwargs = {k: v for k, v in bound.items() if k not in ("input", "weight", "bias")}
        if layer.spatial:
            kwargs["groups"] = max(1, sharding.sizes[tag.shard] * layer.groups // layer.channels)
        w = self.param(weight, sharding.bounds, tag, node)
        b = None if bias is None else self.param(bias, sharding.bounds, tag, node)
        return self.graph.call_function(target, (x, w, b), kwargs)

    def batch_norm_shard(self, node: fx.Node, sharding: Sharding, tag: ShardTag,
                         args: Mapping[fx.Node, fx.Node]) -> fx.Node:
        bn = self.gm.get_submodule(node.target)
        key = ("bn", node)
        if key not in self.cache:
            state = self.graph.call_function(_batch_norm_state, (self.attr(node.target),))
            state.meta = inherited_meta(node, None)
            items = [self.graph.call_function(operator.getitem, (state, i)) for i in (0, 1)]
            for item in items:
                item.meta = inherited_meta(node, None)
            self.cache[key] = items
        training, momentum = self.cache[key]

        def piece(name: str) -> fx.Node | None:
            if getattr(bn, name) is None:
                return None
            return self.param(self.attr(f"{node.target}.{name}"), sharding.bounds, tag, node)

        mean, var = piece("running_mean"), piece("running_var")
        out = self.graph.call_function(
            F.batch_norm, (args[node.args[0]], mean, var),
            {"weight": piece("weight"), "bias": piece("bias"), "training": training,
             "momentum": momentum, "eps": bn.eps})
        for name, moved in (("running_mean", mean), ("running_var", var)):
            if moved is not None:
                buffer = self.attr(f"{node.target}.{name}")
                home = self.scatter(buffer, 0, sharding.bounds, buffer, node)[tag.shard]
                self.write_back(home, moved, out, tag)
        return out

    def write_back(self, home: fx.Node, moved: fx.Node, after: fx.Node, tag: ShardTag) -> None:
        """A running-statistics slice updated on another device goes back into the buffer."""
        if home is moved:
            return  # the shard updated a view of the buffer itself
        done = self.graph.call_function(_write_back, (home, moved, after))
        done.meta = {**inherited_meta(after, None), SHARD: tag}


def _write_back(home: torch.Tensor, moved: torch.Tensor, _after: Any) -> None:
    """Copy `moved` into `home` unless they are one tensor; `_after` orders it after the update.

    A shard on another device updated a copy of its running-statistics slice. Like BatchNorm's
    own update, the write bypasses the version counter: a sibling shard saved its view of the
    same buffer for backward, which reads only the batch statistics.
    """
    if home.data_ptr() != moved.data_ptr() or home.device != moved.device:
        home.data.copy_(moved.data)


def _is_buffer(gm: nn.Module, node: fx.Node) -> bool:
    if node.op != "get_attr":
        return False
    value = operator.attrgetter(node.target)(gm)
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
