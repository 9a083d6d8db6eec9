"""Which input dimensions are the batch (and sequence), and example inputs resized along them.

The batch is dimension 0 of every tensor input whose dimension 0 equals the first tensor input's.
A sequence dimension exists when an input is a rank-2 integer tensor (token ids): dimension 1.
Inputs may nest tensors in tuples, lists and dicts (an fx graph takes forward()'s arguments as
they are): the dimensions are found among the tensors inside, in pytree order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["InputDims", "input_dims", "resize"]


@dataclasses.dataclass(frozen=True)
class InputDims:
    """The example's batch size and sequence length, and which inputs carry them."""

    batch: int
    batched: tuple[int, ...]  # pytree-leaf indices of inputs whose dim 0 is the batch
    seq: int | None = None
    sequenced: tuple[int, ...] = ()  # pytree-leaf indices of inputs whose dim 1 is the sequence


def input_dims(flat_inputs: Sequence[Any], whole: Collection[int] = ()) -> InputDims:
    """Which inputs carry the batch (and a token sequence); those at positions in `whole` never
    do (e.g. an attention mask of shape (T, T) when T happens to equal the batch size)."""
    leaves, whole_leaves = [], set()
    for position, value in enumerate(flat_inputs):
        for leaf in pytree.tree_leaves(value):
            if position in whole:
                whole_leaves.add(len(leaves))
            leaves.append(leaf)
    tensors = [(i, x) for i, x in enumerate(leaves)
               if isinstance(x, torch.Tensor) and i not in whole_leaves]
    if not tensors or tensors[0][1].dim() == 0:
        raise ValueError("the example inputs hold no tensor with a batch dimension")
    batch = tensors[0][1].shape[0]
    batched = tuple(i for i, x in tensors if x.dim() > 0 and x.shape[0] == batch)
    tokens = [(i, x) for i, x in tensors if x.dim() == 2 and not x.is_floating_point()
              and not x.is_complex() and i in batched]
    if not tokens:
        return InputDims(batch, batched)
    seq = tokens[0][1].shape[1]
    sequenced = tuple(i for i, x in tokens if x.shape[1] == seq)
    return InputDims(batch, batched, seq, sequenced)


def resize(flat_inputs: Sequence[Any], dims: InputDims, batch: int | None = None,
           seq: int | None = None) -> list[Any]:
    """The example inputs with `batch` rows (repeated cyclically if more) and `seq` tokens."""
    resized, spec = pytree.tree_flatten(list(flat_inputs))
    if batch is not None and batch != dims.batch:
        rows = torch.arange(batch) % dims.batch
        for i in dims.batched:
            resized[i] = resized[i].index_select(0, rows.to(resized[i].device))
    if seq is not None and dims.seq is not None and seq != dims.seq:
        if seq > dims.seq:
            raise ValueError(f"cannot lengthen sequences of {dims.seq} tokens to {seq}")
        for i in dims.sequenced:
            resized[i] = resized[i][:, :seq]
    return pytree.tree_unflatten(resized, spec)
