"""Rewrite pass: split Conv/Linear layers into channel shards, merge the per-channel ops after them.

ALGORITHMS §9 (Akintoye et al., Alg. 1). Four phases, each a function:

1. `_candidates`: every Conv1d/2d/3d and Linear call the pass can split, by layer name;
2. `_propagate`: which values are held as channel pieces. A split layer's output is; so is the
   output of every op that acts on each channel alone (BatchNorm, activations, dropout, pooling,
   per-channel affine, elementwise ops between identically split values). Any other consumer
   mixes channels and reads the gathered tensor;
3. `_emit`: a new graph in which shard `i` of each merged chain computes its slice of channels
   on `devices[i]`, with one `cat` (a gather) per value that a channel-mixing op reads;
4. `outline_shards` (optional): each merged chain becomes a `ShardGroup` submodule holding one
   GraphModule per shard, which can run its shards on a thread pool.

Parameters stay the user's: shards read `split` views of the original parameters and buffers
inside the graph, so autograd accumulates every shard's gradient into the original Parameter,
BatchNorm running statistics update the original buffers in place, and `state_dict()` is
unchanged.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.tools_common import stable_topological_sort
from torch.fx.passes.utils.fuser_utils import fuse_as_graphmodule, validate_partition

from fxpipe.meta import SHAPE, UNIT, TensorInfo, ValueInfo
from fxpipe.passes.analysis.shape import record_values

__all__ = [
    "GATHER",
    "SHARD",
    "MergedChain",
    "OverlapCost",
    "ShardGroup",
    "ShardTag",
    "SplitLayer",
    "SplitMergeResult",
    "outline_shards",
    "overlap_cost",
    "split_merge",
    "splittable_layers",
]

SHARD = "fxpipe.shard"  # ShardTag: the merged chain and shard a node computes, and its device
GATHER = "fxpipe.gather"  # int: the merged chain whose pieces this `cat` node gathers

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class ShardTag:
    """Where a node of a merged chain runs: shard `shard` of chain `chain`, on `device`."""

    chain: int
    shard: int
    device: str


@dataclasses.dataclass(frozen=True)
class SplitLayer:
    """One split Conv/Linear call: output channels [bounds[i], bounds[i+1]) go to shard i."""

    name: str  # layer name (module path, or node name for a functional call)
    node: str  # the node it replaced
    kind: str  # e.g. "Conv2d", "conv3d", "Linear"
    channels: int
    groups: int
    bounds: tuple[int, ...]

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1


@dataclasses.dataclass(frozen=True)
class MergedChain:
    """Split layers and the per-channel ops merged after them; each shard runs them all."""

    index: int
    layers: tuple[str, ...]  # nodes of the split layers in the chain
    ops: tuple[str, ...]  # nodes of the merged per-channel ops, in graph order
    bounds: tuple[int, ...]
    devices: tuple[str, ...]
    gathers: tuple[str, ...]  # values of the chain read whole by a channel-mixing op


@dataclasses.dataclass(frozen=True)
class OverlapCost:
    """The paper's cost model (eqs. 11-13) for `n` devices, modules and micro-batches."""

    n: int
    t_f: float
    t_b: float
    t_c: float
    t_no: float  # eq. 11: forward and backward passes not overlapped
    t_o: float  # eq. 12: overlapped

    @property
    def speedup(self) -> float:  # eq. 13
        return self.t_no / self.t_o


def overlap_cost(n: int, t_f: float, t_b: float, t_c: float) -> OverlapCost:
    """Eqs. 11-13: T_NO = n²(T_F+T_B+2T_C), T_O = n(T_F+T_B+2T_C) + 2(n-1)·max(T_F, T_B).

    T_F, T_B are the forward/backward times of one sub-module on one micro-batch, T_C one
    transfer between devices.
    """
    if n < 1 or min(t_f, t_b, t_c) < 0:
        raise ValueError(f"overlap_cost needs n >= 1 and times >= 0, got n={n}, "
                         f"t_f={t_f}, t_b={t_b}, t_c={t_c}")
    step = t_f + t_b + 2 * t_c
    return OverlapCost(n, t_f, t_b, t_c, n * n * step, n * step + 2 * (n - 1) * max(t_f, t_b))


@dataclasses.dataclass(frozen=True)
class SplitMergeResult:
    """The rewritten graph and what the pass did to it."""

    gm: fx.GraphModule
    devices: tuple[str, ...]
    layers: tuple[SplitLayer, ...]
    chains: tuple[MergedChain, ...]
    gathers: tuple[str, ...]  # names of the inserted `cat` nodes
    scatters: tuple[str, ...]  # activations split into pieces to meet a chain (no parameters)

    def predict(self, t_f: float, t_b: float, t_c: float) -> OverlapCost:
        """Eqs. 11-13 for as many devices as the widest split uses."""
        return overlap_cost(max((layer.shards for layer in self.layers), default=1),
                            t_f, t_b, t_c)

    def format(self) -> str:
        lines = [f"split-and-merge over {len(self.devices)} device(s): "
                 f"{len(self.layers)} layer(s) split, {len(self.chains)} merged chain(s), "
                 f"{len(self.gathers)} gather(s), {len(self.scatters)} scatter(s)"]
        for layer in self.layers:
            sizes = [b - a for a, b in zip(layer.bounds, layer.bounds[1:])]
            grouped = f", groups={layer.groups}" if layer.groups > 1 else ""
            lines.append(f"  split {layer.name} ({layer.kind}, {layer.channels} channels"
                         f"{grouped}) -> {layer.shards} shards of {sizes}")
        for chain in self.chains:
            lines.append(f"  chain {chain.index} on {', '.join(chain.devices)}: "
                         f"{' -> '.join(chain.layers + chain.ops)}; "
                         f"gathered: {', '.join(chain.gathers) or 'none'}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Which ops act per channel.

_UNARY = {
    "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "mish", "sigmoid",
    "tanh", "hardtanh", "hardswish", "hardsigmoid", "softplus", "softsign", "tanhshrink",
    "logsigmoid", "log_sigmoid", "threshold", "hardshrink", "softshrink", "dropout",
    "alpha_dropout", "exp", "abs", "neg", "square", "sqrt", "rsqrt", "clamp", "clip",
    "clamp_min", "clamp_max", "contiguous", "clone",
}
_CHANNEL_DROPOUT = {"dropout1d", "dropout2d", "dropout3d", "feature_dropout",
                    "feature_alpha_dropout"}  # drop whole channels: per channel along dim 1
_BINARY = {"add", "sub", "mul", "div", "true_divide", "truediv", "maximum", "minimum", "pow",
           "rsub", "iadd", "isub", "imul", "itruediv"}
_POOLS = {f"{kind}_pool{k}d": k for k in (1, 2, 3)
          for kind in ("max", "avg", "adaptive_avg", "adaptive_max", "lp", "_adaptive_avg")}
_BATCH_NORM = {"batch_norm"}
_FUNCTION_NAMES: dict[Any, str] = {
    getattr(namespace, name): name
    for name in (*_UNARY, *_CHANNEL_DROPOUT, *_BINARY, *_POOLS, *_BATCH_NORM, "flatten")
    for namespace in (torch, F)
    if callable(getattr(namespace, name, None))
}
_FUNCTION_NAMES.update({operator.add: "add", operator.sub: "sub", operator.mul: "mul",
                        operator.truediv: "div", operator.pow: "pow", operator.iadd: "iadd",
                        operator.isub: "isub", operator.imul: "imul",
                        operator.itruediv: "itruediv"})

_UNARY_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.LogSigmoid, nn.Threshold, nn.Hardshrink, nn.Softshrink, nn.Identity,
    nn.Dropout, nn.AlphaDropout,
)
_CHANNEL_MODULES = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout)
_POOL_MODULES = {
    nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool1d: 1, nn.AvgPool2d: 2,
    nn.AvgPool3d: 3, nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3,
    nn.AdaptiveMaxPool1d: 1, nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3, nn.LPPool1d: 1,
    nn.LPPool2d: 2,
}
_BN_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_CONV_MODULES = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
_CONV_FUNCTIONS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3, aten.conv1d.default: 1,
                   aten.conv2d.default: 2, aten.conv3d.default: 3, aten.convolution.default: 0}
_LINEAR_FUNCTIONS = (F.linear, aten.linear.default)
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONVOLUTION_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed",
                     "output_padding", "groups")


def _op(node: fx.Node, gm: fx.GraphModule) -> tuple[str, int] | None:
    """(kind, spatial dims) of a node that may act per channel; None for any other node."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, _BN_MODULES):
            return "batch_norm", 0
        if isinstance(module, _CHANNEL_MODULES):
            return "channel", 0
        if isinstance(module, _UNARY_MODULES):
            return "unary", 0
        if type(module) in _POOL_MODULES:
            return "pool", _POOL_MODULES[type(module)]
        if isinstance(module, nn.Flatten):
            return "flatten", 0
        return None
    if node.op == "call_method":
        name = node.target.removesuffix("_") if node.target != "size" else "size"
    elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        name = node.target.overloadpacket.__name__.removesuffix("_")
        if name == "sym_size":
            name = "size"
    elif node.op == "call_function":
        name = _FUNCTION_NAMES.get(node.target)
    else:
        return None
    if name in _UNARY:
        return "unary", 0
    if name in _CHANNEL_DROPOUT:
        return "channel", 0
    if name in _BINARY:
        return "binary", 0
    if name in _POOLS:
        return "pool", _POOLS[name]
    if name in ("batch_norm", "flatten", "size"):
        return name, 0
    return None


# ---------------------------------------------------------------------------------------------
# Phase 1: the layers that can be split.

@dataclasses.dataclass(frozen=True)
class _Layer:
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
                               _candidates(gm, _values(gm, example_inputs))))


def _candidates(gm: fx.GraphModule, values: Mapping[fx.Node, ValueInfo]) -> list[_Layer]:
    layers = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if type(module) in _CONV_MODULES and not module.transposed:
                layers.append(_Layer(node, node.target, type(module).__name__,
                                     _CONV_MODULES[type(module)], module.out_channels,
                                     module.groups, module.in_channels // module.groups))
            elif isinstance(module, nn.Linear):
                layers.append(_Layer(node, node.target, type(module).__name__, 0,
                                     module.out_features, 1, module.in_features))
        elif node.op == "call_function" and (node.target in _CONV_FUNCTIONS
                                             or node.target in _LINEAR_FUNCTIONS):
            args = _bind(node)
            weight = args["weight"]
            if not isinstance(weight, fx.Node) or args.get("transposed", False):
                continue
            shape = _shape(values, weight)
            spatial = len(shape) - 2 if node.target in _CONV_FUNCTIONS else 0
            groups = int(args.get("groups", 1)) if spatial else 1
            kind = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            layers.append(_Layer(node, _layer_name(node), kind, spatial, shape[0], groups,
                                 shape[1] if spatial else shape[-1]))
    return layers


def _layer_name(node: fx.Node) -> str:
    """The module path a functional call ran in (torch.export records it), else its node."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    return paths[-1] if paths else node.name


def _bind(node: fx.Node) -> dict[str, Any]:
    if node.target in _LINEAR_FUNCTIONS:
        names: tuple[str, ...] = ("input", "weight", "bias")
    elif node.target is aten.convolution.default:
        names = _CONVOLUTION_ARGS
    else:
        names = _CONV_ARGS
    return {**dict(zip(names, node.args)), **node.kwargs}


def _choose(layers: Sequence[_Layer], names: Sequence[str] | None, threshold: float | None,
            costs: Mapping[str, float] | None, n: int) -> dict[fx.Node, _Layer]:
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


def _bounds(layer: _Layer, n: int) -> tuple[int, ...]:
    """Contiguous output-channel slices: n_l = min(out_channels, n), whole groups per shard."""
    per_group = layer.channels // layer.groups
    units = layer.groups if layer.groups > 1 else layer.channels
    shards = min(units, n)
    sizes = [units // shards + (1 if i < units % shards else 0) for i in range(shards)]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size * (per_group if layer.groups > 1 else 1))
    return tuple(bounds)


# ---------------------------------------------------------------------------------------------
# Phase 2: which values are held as pieces, and how each merged op reads its inputs.

@dataclasses.dataclass(frozen=True)
class _Sharding:
    dim: int
    bounds: tuple[int, ...]

    @property
    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]


@dataclasses.dataclass(frozen=True)
class _Read:
    """How shard i reads one input: its own piece, a slice of a whole value, or the whole."""

    how: str  # "piece" | "scatter" | "whole"
    dim: int = 0
    bounds: tuple[int, ...] = ()  # "scatter": the slices, along `dim`


@dataclasses.dataclass
class _Plan:
    sharding: dict[fx.Node, _Sharding]
    reads: dict[fx.Node, dict[fx.Node, _Read]]  # merged op (or split layer) -> its inputs
    layers: dict[fx.Node, _Layer]
    probes: set[fx.Node]  # shape queries answered by piece 0


def _propagate(gm: fx.GraphModule, layers: dict[fx.Node, _Layer],
               values: Mapping[fx.Node, ValueInfo], n: int) -> _Plan:
    plan = _Plan({}, {}, layers, set())
    for node in gm.graph.nodes:
        if node in layers:
            layer = layers[node]
            bounds = _bounds(layer, n)
            out_rank = len(_shape(values, node))
            plan.sharding[node] = _Sharding(out_rank - 1 - layer.spatial, bounds)
            plan.reads[node] = _layer_reads(node, layer, bounds, plan, values)
            continue
        if not any(value in plan.sharding for value in node.all_input_nodes):
            continue
        op = _op(node, gm)
        if op is not None and op[0] == "size":
            source = node.args[0]
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            rank = len(_shape(values, source))
            if isinstance(dim, int) and dim % rank != plan.sharding[source].dim:
                plan.probes.add(node)
            continue
        merged = _merge(node, op, plan.sharding, values, gm) if op else None
        if merged is not None:
            plan.sharding[node], plan.reads[node] = merged
    return plan


def _layer_reads(node: fx.Node, layer: _Layer, bounds: tuple[int, ...], plan: _Plan,
                 values: Mapping[fx.Node, ValueInfo]) -> dict[fx.Node, _Read]:
    """A grouped conv reads input pieces that line up with its groups; others read the whole."""
    x = node.args[0] if node.args else node.kwargs["input"]
    if layer.groups == 1:
        return {x: _Read("whole")}
    in_dim = len(_shape(values, x)) - 1 - layer.spatial
    per_out = layer.channels // layer.groups
    in_bounds = tuple(b // per_out * layer.in_per_group for b in bounds)
    if plan.sharding.get(x) == _Sharding(in_dim, in_bounds):
        return {x: _Read("piece")}
    return {x: _Read("scatter", in_dim, in_bounds)}


def _merge(node: fx.Node, op: tuple[str, int], sharding: Mapping[fx.Node, _Sharding],
           values: Mapping[fx.Node, ValueInfo], gm: fx.GraphModule
           ) -> tuple[_Sharding, dict[fx.Node, _Read]] | None:
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
    dim, in_rank = source.dim, len(_shape(values, first))
    reads = {v: _Read("whole") for v in node.all_input_nodes}
    reads[first] = _Read("piece")
    if kind == "batch_norm":
        if dim != 1 or not _batch_norm_mergeable(node, gm):
            return None
        channels = source.bounds[-1]
        for v in tensors:
            if v is not first:
                if _shape(values, v) != (channels,):
                    return None
                reads[v] = _Read("scatter", 0, source.bounds)
    elif (len(tensors) > 1  # an op we treat as unary, given a tensor besides its input
          or (kind == "channel" and dim != 1) or (kind == "pool" and dim >= in_rank - spatial)):
        return None
    elif kind == "flatten":
        start, end = _flatten_dims(node, gm)
        start, end = start % in_rank, end % in_rank
        if start <= dim <= end and start != end:
            return None
        dim = dim if dim < start else dim - (end - start)
    return _Sharding(dim, source.bounds), reads


def _merge_binary(node: fx.Node, tensors: Sequence[fx.Node],
                  sharding: Mapping[fx.Node, _Sharding], values: Mapping[fx.Node, ValueInfo],
                  out_rank: int) -> tuple[_Sharding, dict[fx.Node, _Read]] | None:
    """Elementwise ops: split operands must line up; whole ones broadcast or are sliced."""
    aligned = {sharding[v].dim + out_rank - len(_shape(values, v)) for v in tensors
               if v in sharding}
    bounds = {sharding[v].bounds for v in tensors if v in sharding}
    if len(aligned) != 1 or len(bounds) != 1:
        return None
    dim, (bounds_,) = aligned.pop(), bounds
    if _inplace(node) and node.args[0] not in sharding:
        return None  # writing into a slice of an unsplit tensor: read it whole instead
    reads = {v: _Read("whole") for v in node.all_input_nodes}
    for v in tensors:
        if v in sharding:
            reads[v] = _Read("piece")
            continue
        shape = _shape(values, v)
        own = dim - (out_rank - len(shape))
        if own >= 0 and shape[own] == bounds_[-1] and bounds_[-1] > 1:
            reads[v] = _Read("scatter", own, bounds_)
        elif own >= 0 and shape[own] != 1:
            return None
    return _Sharding(dim, bounds_), reads


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


# ---------------------------------------------------------------------------------------------
# Phase 3: the rewritten graph.

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


def _chains(plan: _Plan, nodes: Sequence[fx.Node]) -> dict[fx.Node, int]:
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


class _Builder:
    """The emit phase's state: the new graph, and where each old value lives in it."""

    def __init__(self, gm: fx.GraphModule, plan: _Plan, values: Mapping[fx.Node, ValueInfo],
                 devices: Sequence[str], home: torch.device) -> None:
        self.gm, self.plan, self.values, self.devices = gm, plan, values, list(devices)
        self.graph = fx.Graph()
        self.graph.set_codegen(gm.graph._codegen)  # how inputs/outputs are (un)flattened
        self.aten = any(isinstance(n.target, torch._ops.OpOverload) for n in gm.graph.nodes)
        self.home = home
        self.chain = _chains(plan, list(gm.graph.nodes))
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
            cat.meta = _meta(value, self.values[value])
            cat.meta[GATHER] = chain
            self.cache[key] = cat
            self.gathers.append(cat.name)
            self.gathered.setdefault(chain, []).append(value.name)
        return self.cache[key]

    def read(self, value: fx.Node, how: _Read, tag: ShardTag, consumer: fx.Node) -> fx.Node:
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
            split.meta = _meta(consumer, None)
            parts = []
            for i, size in enumerate(sizes):
                part = self.graph.call_function(operator.getitem, (split, i))
                part.name = self._name(f"{whole.name}_part{i}")
                part.meta = _meta(consumer, _piece_info(whole.meta.get(SHAPE), dim, size))
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
            value = _fetch(self.gm, target)
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
        args = {v: self.read(v, reads.get(v, _Read("whole")), tag, node)
                for v in node.all_input_nodes}
        if node in self.plan.layers:
            piece = self.layer_shard(node, self.plan.layers[node], sharding, tag, args)
        elif node.op == "call_module" and isinstance(_fetch(self.gm, node.target), _BN_MODULES):
            piece = self.batch_norm_shard(node, sharding, tag, args)
        else:
            piece = self.graph.node_copy(node, args.__getitem__)
            if _op(node, self.gm) == ("batch_norm", 0):
                for value, how in reads.items():
                    if how.how == "scatter" and _is_buffer(self.gm, value):
                        home = self.scatter(self.full(value), 0, how.bounds, value, node)
                        self.write_back(home[shard], args[value], piece, tag)
        piece.name = self._name(f"{node.name}_s{shard}")
        piece.meta = _meta(node, _piece_info(self.values[node], sharding.dim,
                                             sharding.sizes[shard]))
        piece.meta[SHARD] = tag
        return piece

    def param(self, whole: fx.Node, bounds: tuple[int, ...], tag: ShardTag, consumer: fx.Node
              ) -> fx.Node:
        """Slice `tag.shard` of a parameter or buffer (dim 0), on the shard's device."""
        return self.move(self.scatter(whole, 0, bounds, whole, consumer)[tag.shard],
                         torch.device(tag.device), tag)

    def layer_shard(self, node: fx.Node, layer: _Layer, sharding: _Sharding, tag: ShardTag,
                    args: Mapping[fx.Node, fx.Node]) -> fx.Node:
        if node.op == "call_module":
            module = _fetch(self.gm, node.target)
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
                    x.meta = {**_meta(node, None), SHARD: tag}
                    kwargs["padding"] = 0
            else:
                target, kwargs = F.linear, {}
        else:
            bound = _bind(node)
            target, x = node.target, args[bound["input"]]
            weight = self.full(bound["weight"])
            bias = self.full(bound["bias"]) if isinstance(bound.get("bias"), fx.Node) else None
            kwargs = {k: v for k, v in bound.items() if k not in ("input", "weight", "bias")}
        if layer.spatial:
            kwargs["groups"] = max(1, sharding.sizes[tag.shard] * layer.groups // layer.channels)
        w = self.param(weight, sharding.bounds, tag, node)
        b = None if bias is None else self.param(bias, sharding.bounds, tag, node)
        return self.graph.call_function(target, (x, w, b), kwargs)

    def batch_norm_shard(self, node: fx.Node, sharding: _Sharding, tag: ShardTag,
                         args: Mapping[fx.Node, fx.Node]) -> fx.Node:
        bn = _fetch(self.gm, node.target)
        key = ("bn", node)
        if key not in self.cache:
            state = self.graph.call_function(_batch_norm_state, (self.attr(node.target),))
            state.meta = _meta(node, None)
            items = [self.graph.call_function(operator.getitem, (state, i)) for i in (0, 1)]
            for item in items:
                item.meta = _meta(node, None)
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
        done.meta = {**_meta(after, None), SHARD: tag}


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
    value = _fetch(gm, node.target)
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)


def _meta(origin: fx.Node, info: ValueInfo | None) -> dict[str, Any]:
    """What a new node inherits from the node it comes from (its unit, its module stack)."""
    meta = {key: origin.meta[key] for key in (UNIT, "nn_module_stack", "stack_trace")
            if key in origin.meta}
    if info is not None:
        meta[SHAPE] = info
    return meta


def _piece_info(info: ValueInfo | None, dim: int, size: int) -> ValueInfo | None:
    if info is None or not info.is_tensor:
        return None
    tensor = info.tensors[0]
    shape = (*tensor.shape[:dim], size, *tensor.shape[dim + 1:])
    return ValueInfo(info.type_name, (TensorInfo(shape, tensor.dtype, tensor.requires_grad),))


def _fetch(gm: nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _values(gm: fx.GraphModule, example_inputs: Sequence[Any] | None
            ) -> dict[fx.Node, ValueInfo]:
    """What each node produces: from a run on `example_inputs`, else from the shape pass."""
    if example_inputs is not None:
        recorded = record_values(gm, list(example_inputs))
        return {node: recorded[node.name] for node in gm.graph.nodes}
    values, missing = {}, []
    for node in gm.graph.nodes:
        info = node.meta.get(SHAPE)
        if info is None and node.op == "get_attr":
            info = ValueInfo.of(_fetch(gm, node.target))
        val = node.meta.get("val")
        if info is None and isinstance(val, torch.Tensor) and all(
                isinstance(s, int) for s in val.shape):
            info = ValueInfo.of(val)
        if info is None and node.op != "output":
            missing.append(node.name)
        values[node] = info
    if missing:
        raise ValueError(
            f"split_merge needs the shape of every value, and {', '.join(missing[:5])} "
            f"{'have' if len(missing) > 1 else 'has'} none: pass example_inputs=(x, ...) (the "
            "graph's flat inputs) or run fxpipe.passes.analysis.shape.annotate_shapes first.")
    return values


def _shape(values: Mapping[fx.Node, ValueInfo], node: fx.Node) -> tuple[int, ...]:
    info = values.get(node)
    return info.tensors[0].shape if info is not None and info.is_tensor else ()


def _graph_module(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule running `graph` that holds gm's own modules, parameters and buffers."""
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    # GraphModule copies only what the graph names, under fresh parents: share gm's instead,
    # in gm's order, so state_dict() and the user's optimizer see the same objects.
    new._modules = dict(gm._modules)
    new._parameters = dict(gm._parameters)
    new._buffers = dict(gm._buffers)
    new._non_persistent_buffers_set = set(gm._non_persistent_buffers_set)
    new.meta = dict(getattr(gm, "meta", {}))
    new.train(gm.training)
    return new


# ---------------------------------------------------------------------------------------------
# The pass.

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
    """
    devices = tuple(str(torch.device(d)) for d in devices)
    if not devices:
        raise ValueError("split_merge needs at least one device, e.g. devices=['cpu', 'cpu'].")
    values = _values(gm, example_inputs)
    chosen = _choose(_candidates(gm, values), layers, threshold, costs, len(devices))
    plan = _propagate(gm, chosen, values, len(devices))
    where = torch.device(home) if home is not None else \
        next(iter(gm.parameters()), torch.empty(0)).device
    builder = _Builder(gm, plan, values, devices, where)
    builder.run()
    builder.graph.lint()
    new = _graph_module(gm, builder.graph)
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


# ---------------------------------------------------------------------------------------------
# Phase 4 (optional): one submodule per merged chain, shards on a thread pool.

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
    out = _graph_module(gm, _copy_graph(gm.graph))
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


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    copied = fx.Graph()
    copied.set_codegen(graph._codegen)
    value, output = copied.graph_copy(graph, {}, return_output_node=True)
    copied.output(value, type_expr=output.type).meta = dict(output.meta)
    return copied


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
    call.meta = _meta(shards[0][0], None)
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
