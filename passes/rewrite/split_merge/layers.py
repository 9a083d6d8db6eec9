"""Phase 1: the Conv/Linear calls the pass can split, the ones it splits, and their shard bounds."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxpipe.meta import ValueInfo
from fxpipe.passes.rewrite.split_merge.values import shape_of, value_infos

__all__ = ["Layer", "bind", "candidates", "choose", "shard_bounds", "splittable_layers"]

aten = torch.ops.aten

_CONV_MODULES = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
_CONV_FUNCTIONS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3, aten.conv1d.default: 1,
                   aten.conv2d.default: 2, aten.conv3d.default: 3, aten.convolution.default: 0}
_LINEAR_FUNCTIONS = (F.linear, aten.linear.default)
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONVOLUTION_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed",
                     "output_padding", "groups")


@dataclasses.dataclass(frozen=True)
class Layer:
    """A splittable Conv/Linear call: its output channels, groups and inputs per group."""

    node: fx.Node
    name: str
    kind: str
    spatial: int  # 0 for Linear
    channels: int
    groups: int
    in_per_group: int


def splittable_layers(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None
                      ) -> tuple[str, ...]:
    """Names of the Conv1d/2d/3d and Linear calls in `gm` that `split_merge` can split."""
    return tuple(dict.fromkeys(layer.name for layer in
                               candidates(gm, value_infos(gm, example_inputs))))


def candidates(gm: fx.GraphModule, values: Mapping[fx.Node, ValueInfo]) -> list[Layer]:
    """Every Conv1d/2d/3d and Linear call of `gm` the pass can split, in graph order."""
    layers = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if type(module) in _CONV_MODULES and not module.transposed:
                layers.append(Layer(node, node.target, type(module).__name__,
                                    _CONV_MODULES[type(module)], module.out_channels,
                                    module.groups, module.in_channels // module.groups))
            elif isinstance(module, nn.Linear):
                layers.append(Layer(node, node.target, type(module).__name__, 0,
                                    module.out_features, 1, module.in_features))
        elif node.op == "call_function" and (node.target in _CONV_FUNCTIONS
                                             or node.target in _LINEAR_FUNCTIONS):
            args = bind(node)
            weight = args["weight"]
            if not isinstance(weight, fx.Node) or args.get("transposed", False):
                continue
            shape = shape_of(values, weight)
            spatial = len(shape) - 2 if node.target in _CONV_FUNCTIONS else 0
            groups = int(args.get("groups", 1)) if spatial else 1
            kind = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            layers.append(Layer(node, _layer_name(node), kind, spatial, shape[0], groups,
                                shape[1] if spatial else shape[-1]))
    return layers


def _layer_name(node: fx.Node) -> str:
    """The module path a functional call ran in (torch.export records it), else its node."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    return paths[-1] if paths else node.name


def bind(node: fx.Node) -> dict[str, Any]:
    """The arguments of a functional conv/linear call, by name."""
    if node.target in _LINEAR_FUNCTIONS:
        names: tuple[str, ...] = ("input", "weight", "bias")
    elif node.target is aten.convolution.default:
        names = _CONVOLUTION_ARGS
    else:
        names = _CONV_ARGS
    return {**dict(zip(names, node.args)), **node.kwargs}


def choose(layers: Sequence[Layer], names: Sequence[str] | None, threshold: float | None,
           costs: Mapping[str, float] | None, n: int) -> dict[fx.Node, Layer]:
    """The layers to split (named, above the cost threshold, or all) that get two shards or more."""
    known = dict.fromkeys(layer.name for layer in layers)
    if names is not None and threshold is not None:
        raise ValueError("split_merge: pass either layers=[...] or threshold=..., not both.")
    if threshold is not None:
        if costs is None or not 0 < threshold < 1:
            raise ValueError(
                f"split_merge(threshold={threshold!r}) needs 0 < threshold < 1 and costs= "
                "mapping layer names to times, e.g. costs={'features.0': 3.1, 'features.2': 0.4}.")
        total = sum(costs.values())
        if total <= 0:
            raise ValueError("split_merge: the costs must add up to a positive time.")
        names = [name for name in known
                 if costs.get(name, 0.0) / total > threshold]
    elif names is not None:
        if isinstance(names, str):
            raise ValueError(f"split_merge(layers={names!r}) takes a list of names, "
                             f"e.g. layers=[{names!r}].")
        by_node = {layer.node.name: layer.name for layer in layers}
        unknown = [name for name in names if name not in known and name not in by_node]
        if unknown:
            raise ValueError(
                f"split_merge(layers=...) names {unknown}, which are not splittable layers of "
                f"this graph (Conv1d/2d/3d or Linear calls); splittable layers: "
                f"{', '.join(known) or 'none'}.")
        names = [by_node.get(name, name) for name in names]
    chosen = {}
    for layer in layers:
        if (names is None or layer.name in names) and min(layer.groups if layer.groups > 1
                                                          else layer.channels, n) > 1:
            chosen[layer.node] = layer
    return chosen


def shard_bounds(layer: Layer, n: int) -> tuple[int, ...]:
    """Contiguous output-channel slices: n_l = min(out_channels, n), whole groups per shard."""
    per_group = layer.channels // layer.groups
    units = layer.groups if layer.groups > 1 else layer.channels
    shards = min(units, n)
    sizes = [units // shards + (1 if i < units % shards else 0) for i in range(shards)]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size * (per_group if layer.groups > 1 else 1))
    return tuple(bounds)
