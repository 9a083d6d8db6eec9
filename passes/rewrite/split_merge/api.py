"""The split-and-merge pass: choose the layers, propagate, emit, and record what was done."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from fxpipe.passes.rewrite.split_merge.emit import Builder
from fxpipe.passes.rewrite.split_merge.graphs import graph_module
from fxpipe.passes.rewrite.split_merge.layers import candidates, choose
from fxpipe.passes.rewrite.split_merge.propagate import propagate
from fxpipe.passes.rewrite.split_merge.records import MergedChain, SplitLayer, SplitMergeResult
from fxpipe.passes.rewrite.split_merge.values import value_infos

__all__ = ["split_merge"]


def split_merge(
    gm: fx.GraphModule,
    layers: Sequence[str] | None,
    devices: Sequence[str],
    *,
    threshold: float | None = None,
    costs: Mapping[str, float] | None = None,
    example_inputs: Sequence[Any] | None = None,
    home: str | None = None,
) -> SplitMergeResult:
    """Split Conv/Linear layers of `gm` into channel shards on `devices`; merge what follows.

    `layers`: names from `splittable_layers(gm)` (module paths such as "features.0", or node
    names); None splits every splittable layer, or, with `threshold`, each layer whose share of
    `costs` (name -> time, e.g. the units of one stage) exceeds it. A layer with C output
    channels (G > 1 groups: G groups) gets n_l = min(C or G, len(devices)) shards. Shapes come
    from a run on `example_inputs` (the graph's flat inputs) or from the shape pass's metadata.
    `home` is the device the unsplit values and the parameters live on when the graph runs
    (default: where gm's parameters are now); shard inputs move from it, gathers move to it.
    `gm` is not modified; the result's graph module shares its modules and parameters.

    ALGORITHMS §9 (Akintoye et al., Alg. 1), in phases, each a module: `layers` finds the
    Conv1d/2d/3d and Linear calls it can split; `propagate` finds the values held as channel
    pieces (a split layer's output, and that of every op acting on each channel alone, as the
    table in `ops` says; any other consumer reads the gathered tensor); `emit` builds the graph
    in which shard i of each merged chain computes its channels on devices[i], with one `cat`
    per value a channel-mixing op reads; `outline.outline_shards` can then make each chain a
    ShardGroup submodule. Shards read `split` views of the original parameters and buffers, so
    gradients accumulate into the original Parameters and `state_dict()` is unchanged.
    """
    devices = tuple(str(torch.device(d)) for d in devices)
    if not devices:
        raise ValueError("split_merge needs at least one device, e.g. devices=['cpu', 'cpu'].")
    values = value_infos(gm, example_inputs)
    chosen = choose(candidates(gm, values), layers, threshold, costs, len(devices))
    plan = propagate(gm, chosen, values, len(devices))
    where = torch.device(home) if home is not None else \
        next(iter(gm.parameters()), torch.empty(0)).device
    builder = Builder(gm, plan, values, devices, where)
    builder.run()
    builder.graph.lint()
    new = graph_module(gm, builder.graph)
    split = tuple(SplitLayer(layer.name, node.name, layer.kind, layer.channels, layer.groups,
                             plan.sharding[node].bounds) for node, layer in chosen.items())
    members: dict[int, list[fx.Node]] = {}
    for node, chain in builder.chain.items():
        members.setdefault(chain, []).append(node)
    chains = tuple(
        MergedChain(
            chain,
            tuple(n.name for n in nodes if n in chosen),
            tuple(n.name for n in nodes if n not in chosen),
            plan.sharding[nodes[0]].bounds,
            devices[: len(plan.sharding[nodes[0]].sizes)],
            tuple(builder.gathered.get(chain, ())),
        )
        for chain, nodes in sorted(members.items())
    )
    return SplitMergeResult(new, devices, split, chains, tuple(builder.gathers),
                            tuple(dict.fromkeys(builder.scatters)))
