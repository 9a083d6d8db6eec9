"""The typed records fxpipe passes write under `node.meta`, one documented key each."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["AUTOCAST", "GATHER", "PROFILE", "SEGMENT", "SHAPE", "SHARD", "STAGE", "SYMBOLIC",
           "UNIT", "TensorInfo", "ValueInfo"]

SHAPE = "fxpipe.shape"  # ValueInfo: what the node produces (shape pass)
UNIT = "fxpipe.unit"  # int: index of the partitionable unit the node belongs to
STAGE = "fxpipe.stage"  # int: pipeline stage the node runs on (rewrite pass)
# ValueInfo: what the node produces under the plan's autocast (torchrun's shapes pass)
AUTOCAST = "fxpipe.autocast"
SYMBOLIC = "fxpipe.symbolic"  # SymbolicCost: FLOPs, bytes and shapes in b, s (symbolic pass)
SHARD = "fxpipe.shard"  # ShardTag: merged chain, shard and device a node runs on (split_merge pass)
GATHER = "fxpipe.gather"  # int: merged chain whose pieces a `cat` node gathers (split_merge pass)
PROFILE = "fxpipe.profile"  # UnitTiming: measured times of the node's unit (profile pass)
# int: a recomputing stage's node: the first unit of its checkpointed segment (rewrite pass)
SEGMENT = "fxpipe.segment"

_DTYPE_ABBREVIATIONS = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool",
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Shape, dtype and size of one tensor, as the example inputs produced it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorInfo:
        return cls(tuple(int(s) for s in tensor.shape), tensor.dtype, tensor.requires_grad)

    def __str__(self) -> str:
        dtype = _DTYPE_ABBREVIATIONS.get(self.dtype, str(self.dtype).removeprefix("torch."))
        return f"{dtype}[{', '.join(map(str, self.shape))}]"


@dataclasses.dataclass(frozen=True)
class ValueInfo:
    """What one graph node produces: its tensors (pytree leaves, in order) and its Python type."""

    type_name: str
    tensors: tuple[TensorInfo, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def is_tensor(self) -> bool:
        return self.type_name in ("Tensor", "Parameter")

    @classmethod
    def of(cls, value: Any) -> ValueInfo:
        leaves = pytree.tree_leaves(value)
        tensors = tuple(TensorInfo.of(t) for t in leaves if isinstance(t, torch.Tensor))
        return cls(type(value).__name__, tensors)

    def __str__(self) -> str:
        if self.is_tensor:
            return str(self.tensors[0])
        if self.tensors:
            return f"{self.type_name}({', '.join(map(str, self.tensors))})"
        return self.type_name
