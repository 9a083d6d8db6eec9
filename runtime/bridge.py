"""The drop-in module's autograd bridge, and the `Call` record of one trip through the pipeline."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxpipe.batching import scaled
from fxpipe.errors import FxpipeError
from fxpipe.ir import ValueRef
from fxpipe.runtime.driver import Run

__all__ = ["Call", "Pipelined", "inputs_wanting_grad", "model_output_of", "output_values"]


class Call:
    """One mini-batch's trip through the pipeline: its micro-batches and what comes back."""

    def __init__(self, key: int, chunks: list[list[Any]], names: Sequence[str],
                 sizes: list[int]) -> None:
        self.key = key
        self.feeds = [dict(zip(names, chunk)) for chunk in chunks]
        self.sizes = sizes
        self.seq: int | None = None
        self.total = sum(self.sizes)  # samples in the global mini-batch (all pipeline groups)
        self.merged: list[Any] = []
        self.shares: dict[int, list[Any]] = {}  # micro-batches' shares of one-number outputs
        self.wanted: list[int] = []  # positions of inputs whose gradient autograd asks for
        self.backward_done = False

    @classmethod
    def joined(cls, key: int, calls: Sequence[Call]) -> Call:
        """Several mini-batches as one run: micro-batch m of mini-batch i is i * p + m."""
        joined = cls(key, [], [], [size for call in calls for size in call.sizes])
        joined.feeds = [feed for call in calls for feed in call.feeds]
        joined.seq = calls[0].seq
        return joined


def output_values(leaves: Sequence[Any], values: dict[str, Any]) -> list[Any]:
    """The model's flat output: each ValueRef leaf filled from `values`, constants as they are."""
    return [values[leaf.name] if isinstance(leaf, ValueRef) else leaf for leaf in leaves]


def model_output_of(outputs: Any, unflatten: Callable[[Any], Any]
                    ) -> Callable[[Mapping[str, Any]], Any]:
    """The model's output, as its forward returns it, from a graph's output values by name;
    `outputs` is the graph's output structure of value references (output_names)."""
    leaves, spec = pytree.tree_flatten(outputs)
    return lambda values: unflatten(pytree.tree_unflatten(output_values(leaves, values), spec))


class Pipelined(torch.autograd.Function):
    """Autograd's view of a pipelined forward: its backward runs the pipeline's backward.

    `run_forward(call)` and `run_backward(call, output_grads)` run the schedule's forward and
    backward actions; `release(call)` drops what a forward kept when its outputs are freed
    without a backward (an evaluation with gradients enabled, a forward only logged)."""

    @staticmethod
    def forward(ctx, executor: Any, call: Call, phony: torch.Tensor,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.executor, ctx.call = executor, call
        ctx.set_materialize_grads(False)
        # detached: kept on ctx beside the caller's graph, they must not keep the stages'
        # graphs (and their activations) once the pipeline's backward ran
        call.merged = [x.detach() if isinstance(x, torch.Tensor) else x for x in
                       pytree.tree_leaves(executor.joined_outputs(executor.run_forward(call),
                                                                  call))]
        outputs = tuple(x.detach() for x in call.merged if isinstance(x, torch.Tensor))
        ctx.mark_non_differentiable(*(o for o in outputs if not o.is_floating_point()))
        # the graph holding ctx may be freed without a backward: then free the stages' state
        ctx.release = weakref.finalize(ctx, executor.release, call.key)
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        executor, call = ctx.executor, ctx.call
        if call.backward_done:
            raise FxpipeError("a pipelined forward's backward runs once: the stages free their "
                              "activations after it (backward(retain_graph=True) twice, or "
                              "through two losses, is not supported); run the forward again.")
        call.backward_done = True
        outputs = [(position, leaf.name) for position, (leaf, x)
                   in enumerate(zip(executor.output_leaves, call.merged))
                   if isinstance(x, torch.Tensor) and isinstance(leaf, ValueRef)]
        ends = torch.tensor(call.sizes).cumsum(0)[:-1].tolist()
        output_grads: list[dict[str, Any]] = [{} for _ in call.sizes]
        for (position, name), grad in zip(outputs, grads):
            if grad is None:
                continue
            if position in call.shares:  # one number, its micro-batches' added by their shares
                # none for a micro-batch that counts nothing: its own loss may be 0/0, and a
                # zero gradient through it nan
                pieces = [None if float(share) == 0 else scaled(grad, share)
                          for share in call.shares[position]]
            else:
                pieces = torch.tensor_split(grad, ends) if grad.dim() > 0 else [grad]
            for mb, piece in enumerate(pieces):
                if piece is None:
                    continue
                previous = output_grads[mb].get(name)
                output_grads[mb][name] = piece if previous is None else previous + piece
        run = executor.run_backward(call, output_grads)
        ctx.release.detach()  # nothing left to free
        return (None, None, None, *_input_grads(call, run))


def inputs_wanting_grad(flat_inputs: Sequence[Any]) -> list[int]:
    """Positions of the tensor inputs that require grad (nested ones are refused)."""
    wanted = []
    for i, value in enumerate(flat_inputs):
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                wanted.append(i)
        elif any(isinstance(x, torch.Tensor) and x.requires_grad
                 for x in pytree.tree_leaves(value)):
            raise FxpipeError(
                f"input #{i} nests a tensor that requires grad inside a "
                f"{type(value).__name__}; fxpipe computes input gradients only for tensor "
                "arguments: pass that tensor as an argument of its own."
            )
    return wanted


def _input_grads(call: Call, run: Run) -> list[torch.Tensor | None]:
    """Gradients of the mini-batch inputs that wanted one, joined from the micro-batches':
    concatenated for inputs split along the batch, summed for inputs every micro-batch saw."""
    names = list(call.feeds[0])
    grads: list[torch.Tensor | None] = []
    for position in call.wanted:
        name = names[position]
        pieces = [run.input_grads.get(mb, {}).get(name) for mb in range(len(call.sizes))]
        if any(piece is None for piece in pieces):
            grads.append(None)  # this input does not influence the outputs
        elif call.feeds[0][name] is not call.feeds[-1][name]:  # split along the batch
            grads.append(torch.cat(pieces))
        else:
            grads.append(torch.stack(pieces).sum(0))
        if grads[-1] is not None:  # autograd wants it where the input is, not the stage
            grads[-1] = grads[-1].to(call.feeds[0][name].device)
    return grads

