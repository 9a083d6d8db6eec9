"""Micro-batches: split a mini-batch's inputs along the batch dimension, merge outputs back."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxpipe.errors import FxpipeError

__all__ = ["batch_size", "merge", "rows", "split", "split_sizes"]


def batch_size(flat_inputs: Sequence[Any], whole: Collection[int] = ()) -> int:
    """Dimension 0 of the first tensor among the inputs (tensors nested in tuples/dicts too),
    those at positions in `whole` aside."""
    batched = [x for i, x in enumerate(flat_inputs) if i not in whole]
    for leaf in pytree.tree_leaves(batched):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise FxpipeError("the inputs hold no tensor with a batch dimension to split into "
                      "micro-batches; pass tensors whose dimension 0 is the batch.")


def rows(tree: Any) -> int:
    """Dimension 0 of the first tensor in `tree` with one, else 0."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return 0


def split_sizes(batch: int, chunks: int) -> list[int]:
    """Sizes of `chunks` micro-batches of a batch of `batch` samples: the first ones one larger
    when it does not divide (torch.tensor_split's rule). Uneven splits are allowed."""
    if chunks > batch:
        raise FxpipeError(f"cannot split a batch of {batch} samples into {chunks} micro-batches; "
                          f"use micro_batches <= {batch} or a larger batch.")
    base, extra = divmod(batch, chunks)
    return [base + (i < extra) for i in range(chunks)]


def split(flat_inputs: Sequence[Any], chunks: int, whole: Collection[int] = ()
          ) -> list[list[Any]]:
    """One list of inputs per micro-batch: every tensor whose dimension 0 is the batch is split
    along it (inside tuples, lists and dicts too); anything else, and the inputs at positions in
    `whole`, is passed to every micro-batch."""
    batch = batch_size(flat_inputs, whole)
    ends = list(itertools.accumulate(split_sizes(batch, chunks)))[:-1]

    def pieces(leaf: Any) -> list[Any]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch:
            return list(torch.tensor_split(leaf, ends))
        return [leaf] * chunks

    whole_leaves = {id(leaf) for i in whole if i < len(flat_inputs)
                    for leaf in pytree.tree_leaves(flat_inputs[i])}
    leaves, spec = pytree.tree_flatten(list(flat_inputs))
    split_leaves = [[leaf] * chunks if id(leaf) in whole_leaves else pieces(leaf)
                    for leaf in leaves]
    return [pytree.tree_unflatten([parts[i] for parts in split_leaves], spec)
            for i in range(chunks)]


def merge(per_micro_batch: Sequence[Any], sizes: Sequence[int]) -> Any:
    """The mini-batch's output from the micro-batches' outputs (same structure), concatenating
    every tensor along dimension 0. An output that is not per-sample cannot be merged."""
    if len(per_micro_batch) == 1:
        return per_micro_batch[0]
    flat = [pytree.tree_flatten(out) for out in per_micro_batch]
    spec = flat[0][1]
    merged = []
    for position, leaves in enumerate(zip(*(leaves for leaves, _ in flat))):
        first = leaves[0]
        if not isinstance(first, torch.Tensor):
            merged.append(first)
            continue
        if any(t.dim() == 0 or t.shape[0] != n for t, n in zip(leaves, sizes)):
            raise FxpipeError(
                f"model output #{position} (shape {list(first.shape)} for a micro-batch of "
                f"{sizes[0]}) is not per-sample, so micro-batches cannot be concatenated; "
                "return per-sample values and reduce after the pipeline, or use "
                "micro_batches=1."
            )
        merged.append(torch.cat(leaves))
    return pytree.tree_unflatten(merged, spec)
