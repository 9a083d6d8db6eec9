"""Phase 4 (optional): each merged chain becomes a ShardGroup submodule, shards on a thread pool."""

from __future__ import annotations

import concurrent.futures
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.tools_common import stable_topological_sort
from torch.fx.passes.utils.fuser_utils import fuse_as_graphmodule, validate_partition

from fxpipe.meta import SHARD
from fxpipe.passes.rewrite.split_merge.graphs import copy_graph, graph_module, inherited_meta

__all__ = ["ShardGroup", "outline_shards"]


class ShardGroup(nn.Module):
    """The shards of one merged chain, one GraphModule each; runs them in turn or on threads.

    Threads overlap the shards' forward passes (on GPUs each shard's kernels run on its own
    device; on CPU they share the cores). Autograd runs the backward as usual.
    """

    def __init__(self, shards: Sequence[nn.Module], devices: Sequence[str],
                 concurrent: bool = True) -> None:
        super().__init__()
        self.shards = nn.ModuleList(shards)
        self.devices = tuple(devices)
        self.concurrent = concurrent
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def forward(self, *inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self.concurrent or len(self.shards) == 1:
            return tuple(shard(*args) for shard, args in zip(self.shards, inputs))
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                len(self.shards) - 1, thread_name_prefix="fxpipe-shard")
        grad = torch.is_grad_enabled()  # grad mode is per thread

        def run(shard: nn.Module, args: tuple[Any, ...]) -> Any:
            with torch.set_grad_enabled(grad):
                return shard(*args)

        futures = [self._pool.submit(run, shard, args)
                   for shard, args in zip(self.shards[1:], inputs[1:])]
        first = self.shards[0](*inputs[0])
        return (first, *(future.result() for future in futures))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pool"] = None  # threads are not copied or pickled
        return state

    def extra_repr(self) -> str:
        return f"devices={self.devices}, concurrent={self.concurrent}"


def outline_shards(gm: fx.GraphModule, *, concurrent: bool = True) -> fx.GraphModule:
    """Move each merged chain of a `split_merge` graph into a `ShardGroup` submodule.

    Shard i of chain c becomes `chain{c}.shards.{i}`, a GraphModule taking parameter slices and
    activations as inputs (so it owns no parameters and `state_dict()` is unchanged). A chain
    whose shards read a value computed from its own gathered output (e.g. a squeeze-excitation
    scale) is cut into segments `chain{c}_{k}` at that point. `gm` is not modified.
    """
    out = graph_module(gm, copy_graph(gm.graph))
    segments: dict[tuple[int, int], dict[int, list[fx.Node]]] = {}
    for node, (chain, level) in _segments(out.graph).items():
        segments.setdefault((chain, level), {}).setdefault(node.meta[SHARD].shard, []).append(node)
    levels: dict[int, int] = {}
    for chain, _ in segments:
        levels[chain] = levels.get(chain, 0) + 1
    for (chain, level), by_shard in segments.items():
        name = f"chain{chain}" if levels[chain] == 1 else f"chain{chain}_{level}"
        _outline(out, name, [by_shard[s] for s in sorted(by_shard)],
                 [by_shard[s][0].meta[SHARD].device for s in sorted(by_shard)], concurrent)
    stable_topological_sort(out)
    out.graph.lint()
    out.recompile()
    return out


def _segments(graph: fx.Graph) -> dict[fx.Node, tuple[int, int]]:
    """(chain, segment) of every shard node: a node that depends on its own chain through a
    value computed outside it belongs to a later segment than that chain's nodes it reads."""
    level: dict[fx.Node, int] = {}
    after: dict[fx.Node, dict[int, int]] = {}  # chain -> lowest segment a dependent may take
    for node in graph.nodes:
        tag = node.meta.get(SHARD)
        need: dict[int, int] = {}
        own = 0
        for value in node.all_input_nodes:
            for chain, lowest in after.get(value, {}).items():
                need[chain] = max(need.get(chain, 0), lowest)
            other = value.meta.get(SHARD)
            if other is None:
                continue
            if tag is not None and other.chain == tag.chain:
                own = max(own, level[value])
            else:
                need[other.chain] = max(need.get(other.chain, 0), level[value] + 1)
        if tag is not None:
            level[node] = max(own, need.pop(tag.chain, 0))
        after[node] = need
    return {node: (node.meta[SHARD].chain, lvl) for node, lvl in level.items()}


def _outline(gm: fx.GraphModule, name: str, shards: Sequence[list[fx.Node]],
             devices: Sequence[str], concurrent: bool) -> None:
    subs, inputs, outputs = [], [], []
    for i, nodes in enumerate(shards):
        sub, ins, outs = fuse_as_graphmodule(gm, nodes, f"{name.title()}Shard{i}",
                                             always_return_tuple=True)
        subs.append(sub)
        inputs.append(ins)
        outputs.append(outs)
    everything = {node for nodes in shards for node in nodes}
    if not validate_partition(list(everything)):
        raise RuntimeError(f"outline_shards: the shards of {name} depend on each other")
    gm.add_submodule(name, ShardGroup(subs, devices, concurrent))
    last = max(everything, key=list(gm.graph.nodes).index)
    with gm.graph.inserting_after(last):
        call = gm.graph.call_module(name, tuple(tuple(ins) for ins in inputs))
    call.meta = inherited_meta(shards[0][0], None)
    anchor = call
    for i, outs in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            shard_out = gm.graph.call_function(operator.getitem, (call, i))
        anchor = shard_out
        for k, value in enumerate(outs):
            with gm.graph.inserting_after(anchor):
                item = gm.graph.call_function(operator.getitem, (shard_out, k))
            item.meta = {key: v for key, v in value.meta.items() if key != SHARD}
            anchor = item
            value.replace_all_uses_with(item, delete_user_cb=lambda user: user not in everything)
    for nodes in shards:
        for node in reversed(nodes):
            gm.graph.erase_node(node)
