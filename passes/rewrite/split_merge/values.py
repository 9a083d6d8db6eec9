"""What each value of the graph is: shapes from a run or the shape pass, attributes by name."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from fxpipe.meta import SHAPE, TensorInfo, ValueInfo
from fxpipe.passes.analysis.shape import record_values

__all__ = ["piece_info", "shape_of", "value_infos"]


def value_infos(gm: fx.GraphModule, example_inputs: Sequence[Any] | None
                ) -> dict[fx.Node, ValueInfo]:
    """What each node produces: from a run on `example_inputs`, else from the shape pass."""
    if example_inputs is not None:
        recorded = record_values(gm, list(example_inputs))
        return {node: recorded[node.name] for node in gm.graph.nodes}
    values, missing = {}, []
    for node in gm.graph.nodes:
        info = node.meta.get(SHAPE)
        if info is None and node.op == "get_attr":
            info = ValueInfo.of(operator.attrgetter(node.target)(gm))
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


def shape_of(values: Mapping[fx.Node, ValueInfo], node: fx.Node) -> tuple[int, ...]:
    """The shape of a tensor value; () for anything else."""
    info = values.get(node)
    return info.tensors[0].shape if info is not None and info.is_tensor else ()


def piece_info(info: ValueInfo | None, dim: int, size: int) -> ValueInfo | None:
    """What one piece of a tensor value is: `info` with `size` along `dim`."""
    if info is None or not info.is_tensor:
        return None
    tensor = info.tensors[0]
    shape = (*tensor.shape[:dim], size, *tensor.shape[dim + 1:])
    return ValueInfo(info.type_name, (TensorInfo(shape, tensor.dtype, tensor.requires_grad),))
