"""Batch dimensions: which inputs carry the batch; micro-batches cut from it and merged back."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Mapping, Sequence
from math import prod
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import FxpipeError
from fxpipe.meta import SHAPE

__all__ = ["IGNORE_INDEX", "InputDims", "ScalarJoin", "batch_norm_of_one", "check_batch_norm",
           "check_loss", "input_dims", "loss_reduction", "loss_weight", "merge", "resize", "rows",
           "scalar_shares", "scaled", "split", "split_sizes"]

IGNORE_INDEX = -100  # the target entries cross_entropy, nll_loss and HuggingFace losses skip


def rows(tree: Any) -> int:
    """Dimension 0 of the first tensor in `tree` that has one, else 0."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return 0


@dataclasses.dataclass(frozen=True)
class InputDims:
    """The batch size and sequence length of some inputs, and which leaves carry them."""

    batch: int
    batched: tuple[int, ...]  # pytree-leaf indices of inputs whose dim 0 is the batch
    seq: int | None = None
    sequenced: tuple[int, ...] = ()  # pytree-leaf indices of inputs whose dim 1 is the sequence


def input_dims(flat_inputs: Sequence[Any], whole: Collection[int] = ()) -> InputDims:
    """Which inputs carry the batch (and a token sequence); those at positions in `whole` never
    do (e.g. an attention mask of shape (T, T) when T happens to equal the batch size).

    The batch is dimension 0 of the first tensor input with a dimension (tensors nested in
    tuples, lists and dicts count, in pytree order); every tensor whose dimension 0 equals it is
    batched. A sequence dimension exists when a batched input is a rank-2 integer tensor.
    """
    leaves, whole_leaves = [], set()
    for position, value in enumerate(flat_inputs):
        for leaf in pytree.tree_leaves(value):
            if position in whole:
                whole_leaves.add(len(leaves))
            leaves.append(leaf)
    tensors = [(i, x) for i, x in enumerate(leaves)
               if isinstance(x, torch.Tensor) and x.dim() > 0 and i not in whole_leaves]
    if not tensors:
        raise FxpipeError("the inputs hold no tensor with a batch dimension to split into "
                          "micro-batches; pass tensors whose dimension 0 is the batch.")
    batch = tensors[0][1].shape[0]
    batched = tuple(i for i, x in tensors if x.shape[0] == batch)
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
        indices = torch.arange(batch) % dims.batch
        for i in dims.batched:
            resized[i] = resized[i].index_select(0, indices.to(resized[i].device))
    if seq is not None and dims.seq is not None and seq != dims.seq:
        if seq > dims.seq:
            raise ValueError(f"cannot lengthen sequences of {dims.seq} tokens to {seq}")
        for i in dims.sequenced:
            resized[i] = resized[i][:, :seq]
    return pytree.tree_unflatten(resized, spec)


def split_sizes(batch: int, chunks: int) -> list[int]:
    """Sizes of `chunks` micro-batches of a batch of `batch` samples: the first ones one larger
    when it does not divide (torch.tensor_split's rule). Uneven splits are allowed."""
    if batch == 0:
        raise FxpipeError("the batch is empty (its inputs have 0 rows); pass at least one sample.")
    if chunks > batch:
        raise FxpipeError(f"cannot split a batch of {batch} samples into {chunks} micro-batches; "
                          f"pass at least {chunks} samples, or compile with "
                          f"Plan(micro_batches={batch}) (the plan's count, by default one per "
                          "stage, splits every batch).")
    base, extra = divmod(batch, chunks)
    return [base + (i < extra) for i in range(chunks)]


def split(flat_inputs: Sequence[Any], chunks: int, whole: Collection[int] = (),
          batch: int | None = None) -> list[list[Any]]:
    """One list of inputs per micro-batch: every tensor whose dimension 0 is the batch is split
    along it (inside tuples, lists and dicts too); anything else, and the inputs at positions in
    `whole`, is passed to every micro-batch. `batch`: the inputs' batch size, if known."""
    batch = input_dims(flat_inputs, whole).batch if batch is None else batch
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


@dataclasses.dataclass(frozen=True)
class ScalarJoin:
    """How a one-number model output (a loss it computes from labels=) joins over micro-batches:
    a 'sum', or a mean over 'samples', over the `labels` input's 'tokens' other than
    IGNORE_INDEX, or over those 'shifted' by one (a causal LM's, whose first label predicts
    nothing)."""

    rule: str
    labels: str | None = None  # the graph input holding the labels, for 'tokens' and 'shifted'

    def describe(self, position: int) -> str:
        how = {"sum": "the sum of the micro-batches' values",
               "samples": "a mean over samples",
               "tokens": f"a mean over the entries of {self.labels} other than {IGNORE_INDEX}",
               "shifted": f"a mean over the entries of {self.labels} other than {IGNORE_INDEX} "
                          "after each row's first (a causal LM's shifted labels)"}[self.rule]
        return f"model output #{position} (one number) joins over micro-batches as {how}"

    def weight(self, feed: Mapping[str, Any], size: int) -> torch.Tensor | int:
        """What a micro-batch's mean averages over (a tensor when counted: no device sync)."""
        if self.rule == "samples":
            return size
        labels = feed[self.labels]
        return ((labels[:, 1:] if self.rule == "shifted" else labels) != IGNORE_INDEX).sum()


def scalar_shares(joins: Mapping[int, ScalarJoin], feeds: Sequence[Mapping[str, Any]],
                  sizes: Sequence[int]) -> dict[int, list[Any]]:
    """For each output position in `joins`, each micro-batch's share of the mini-batch's value:
    1 in a sum, its weight over the total in a mean."""
    shares = {}
    for position, join in joins.items():
        if join.rule == "sum":
            shares[position] = [1] * len(sizes)
            continue
        weights = [join.weight(feed, size) for feed, size in zip(feeds, sizes)]
        total = sum(weights)  # the shares in float64: a float32 share rounds a float64 loss
        shares[position] = [torch.as_tensor(w, dtype=torch.float64) / total for w in weights]
    return shares


def scaled(value: torch.Tensor, share: Any) -> torch.Tensor:
    """`value` times its `share`; 0 for a share of 0, where a mean with nothing counted (all
    padding) is nan."""
    share = torch.as_tensor(share, dtype=value.dtype, device=value.device)
    return torch.where(share != 0, value * share, 0.0)


def merge(per_micro_batch: Sequence[Any], sizes: Sequence[int],
          shares: Mapping[int, Sequence[Any]] | None = None) -> Any:
    """The mini-batch's output from the micro-batches' outputs (same structure), concatenating
    every tensor along dimension 0, and adding the one-number outputs at positions in `shares`
    by their shares. Any other output that is not per-sample cannot be merged."""
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
        if shares and position in shares:
            merged.append(sum(scaled(value, share)
                              for value, share in zip(leaves, shares[position])))
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


def batch_norm_of_one(gm: torch.fx.GraphModule) -> str | None:
    """A batch norm layer of `gm` that gets one value per channel from a sample (an input of
    shape (N, C) or (N, C, 1...)), described; it cannot train on a micro-batch of one sample."""
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) or (
                node.op == "call_function" and "batch_norm" in str(node.target)):
            try:
                shape = node.args[0].meta[SHAPE].tensors[0].shape
            except (AttributeError, IndexError, KeyError):  # not a recorded tensor
                continue
            if len(shape) >= 2 and prod(shape[2:]) == 1:
                return f"the batch norm layer {node.target if module else node.name!r}"
    return None


def check_batch_norm(layer: str | None, smallest: int, batch: str, most: int) -> None:
    """Refuse micro-batches of one sample (`smallest`) to batch norm `layer` in training."""
    if layer is not None and smallest == 1:
        raise FxpipeError(
            f"{layer} cannot train on a micro-batch of one sample: it normalises each channel "
            f"over the micro-batch, and gets one value per channel from a sample; {batch} "
            f"makes micro-batches of 1: use micro_batches <= {most}, a larger batch, or eval "
            "mode.")


def check_loss(value: Any) -> torch.Tensor:
    """A loss_fn's value, refused unless it is one number (a tensor of 0 dimensions)."""
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        got = (f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise FxpipeError(f"Plan(loss_fn=...) must return one number, a 0-d tensor, and returned "
                          f"{got}; reduce it over the samples: a mean (e.g. "
                          "nn.MSELoss(reduction='mean')) or a sum (reduction='sum').")
    return value


def loss_weight(loss_fn: Any, target: Any) -> torch.Tensor | int:
    """What a micro-batch's mean loss averages over: its samples, or, for an integer target
    holding entries the loss ignores (ignore_index: the loss's own, or -100, the default of
    cross_entropy and nll_loss), its counted entries (a tensor: no device sync)."""
    ignore = getattr(loss_fn, "ignore_index", None)
    if ignore is None:
        ignore = getattr(loss_fn, "keywords", {}).get("ignore_index", IGNORE_INDEX)  # partial's
    if isinstance(target, torch.Tensor) and not target.is_floating_point() and target.dim():
        return (target != ignore).sum()
    return rows([target])


def loss_reduction(loss_fn: Any, output: Any, target: Any, value: torch.Tensor) -> str | None:
    """How `loss_fn` reduces over samples, 'mean' or 'sum', from `value`, its loss on (output,
    target), against its losses on two halves of them (one sample: `value` is the half of the
    sample twice); a mean averages over loss_weight(). None when they cannot tell (all 0).
    Refuses a loss that is neither, whose micro-batch losses cannot make the mini-batch's."""
    n = rows([target])
    with torch.no_grad():
        if n > 1:
            halves = split([output, target], 2, batch=n)
            whole = float(value)
            a, b = (float(loss_fn(*half)) for half in halves)
            weights = [float(loss_weight(loss_fn, half[1])) for half in halves]
        else:  # a mean gives the loss of the sample, a sum twice that
            weights, a, b = [1, 1], float(value), float(value)
            whole = float(loss_fn(*pytree.tree_map(
                lambda t: torch.cat([t, t]) if isinstance(t, torch.Tensor) and t.dim() > 0
                and t.shape[0] == 1 else t, [output, target])))
    if 0 in weights:  # a half with nothing counted has no mean to compare
        return None
    mean = (weights[0] * a + weights[1] * b) / sum(weights)
    total = a + b
    tolerance = (3e-2 if value.dtype in (torch.float16, torch.bfloat16) else 1e-3) * max(
        abs(whole), abs(a), abs(b))
    is_mean, is_sum = abs(whole - mean) <= tolerance, abs(whole - total) <= tolerance
    if is_mean != is_sum:
        return "mean" if is_mean else "sum"
    if is_mean:
        return None
    sizes = [rows([half[1]]) for half in halves] if n > 1 else [1, 1]
    raise FxpipeError(
        f"Plan(loss_fn=...) is neither a mean nor a sum over samples: on {sum(sizes)} samples "
        f"it gives {whole:.6g}, on {sizes[0]} and {sizes[1]} of them {a:.6g} and {b:.6g}, so "
        "micro-batches' losses cannot make the mini-batch's. Make it one (a mean over an "
        "integer target's entries other than ignore_index counts too), or use micro_batches=1 "
        "and groups=1.")
