"""The plan's loss, timed with the units: on the model's output and an example target."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.batching import check_loss, input_dims, resize, rows
from fxpipe.compiler.inputs import output_names
from fxpipe.errors import FxpipeError, PlanError
from fxpipe.plan import Plan
from fxpipe.runtime.bridge import model_output_of

__all__ = ["check_target", "traced_loss"]

Loss = Callable[[Mapping[str, Any], int], torch.Tensor]


_ARGUMENT = "compile(example_target=...)"


def check_target(plan: Plan, target: Any) -> None:
    """compile's example_target, checked before any work: a loss to time (the plan needs one),
    in a plan that times the units and does not split layers by their costs (which would then
    hold the loss, which cannot be split), with rows of samples as pipe.step cuts a target (a
    tensor, or tensors in a tuple, list or dict)."""
    if plan.costs == "none":
        raise PlanError(f"{_ARGUMENT} times the loss with the units, and Plan(costs='none') "
                        "times nothing: leave out the target, or measure the costs.")
    if plan.intra_layer is not None:
        raise PlanError(f"{_ARGUMENT} adds the loss to the last unit's costs, from which "
                        "Plan(intra_layer=...) picks the layers to split; leave out the target "
                        "with intra_layer.")
    if plan.loss_fn is None:
        raise FxpipeError(f"{_ARGUMENT} times the loss, which needs the plan's loss: give "
                          "Plan(loss_fn=...), or leave out the target.")
    if not rows([target]):
        kind = "a 0-d tensor" if isinstance(target, torch.Tensor) else type(target).__name__
        raise FxpipeError(f"{_ARGUMENT} needs a tensor (or a tuple, list or dict of them) with "
                          f"one row per sample of the inputs, got {kind}.")


def traced_loss(traced: Any, plan: Plan, target: Any, flat: Any, whole: Any, device: str
                ) -> Loss | None:
    """loss(outputs, size), timed with the units (None without a target): the plan's loss_fn
    on the model's output, built from the traced graph's output values by name, and the
    target's first `size` rows, as the last stage computes it. The target must have one row
    per sample of the inputs `flat`."""
    if target is None:
        return None
    batch, found = input_dims(flat, whole).batch, rows([target])  # as pipe.step cuts it
    if found != batch:
        raise FxpipeError(f"{_ARGUMENT} needs a tensor with one row per sample of the inputs "
                          f"({batch}), got {found} rows.")
    target = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                             target)
    dims = input_dims([target])
    loss_fn = plan.loss_fn
    model_output = model_output_of(output_names(traced.gm), traced.bind.unflatten)

    def loss(outputs: Mapping[str, Any], size: int) -> torch.Tensor:
        return check_loss(loss_fn(model_output(outputs), resize([target], dims, size)[0]))
    return loss
