"""The plan's loss, timed with the units: on the model's output and an example target."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.batching import input_dims, resize, rows
from fxpipe.compiler.inputs import output_names
from fxpipe.errors import FxpipeError, PlanError
from fxpipe.plan import Plan
from fxpipe.runtime.bridge import model_output_of

__all__ = ["check_loss_timing", "check_target", "traced_loss"]

Loss = Callable[[Mapping[str, Any], int], torch.Tensor]


def check_loss_timing(plan: Plan, target: Any, argument: str) -> None:
    """A target times the plan's loss, so the plan needs one, and the target rows of samples,
    as pipe.step cuts it: a tensor, or tensors in a tuple, list or dict (`argument` names the
    caller's); checked before any work."""
    if plan.loss_fn is None:
        raise FxpipeError(f"{argument} times the loss, which needs the plan's loss: give "
                          "Plan(loss_fn=...), or leave out the target.")
    if not rows([target]):
        kind = "a 0-d tensor" if isinstance(target, torch.Tensor) else type(target).__name__
        raise FxpipeError(f"{argument} needs a tensor (or a tuple, list or dict of them) with "
                          f"one row per sample of the inputs, got {kind}.")


def check_target(plan: Plan, target: Any) -> None:
    """compile's example_target: a loss to time, in a plan that times the units and does not
    split layers by their costs (which would then hold the loss, which cannot be split)."""
    argument = "compile(example_target=...)"
    if plan.costs == "none":
        raise PlanError(f"{argument} times the loss with the units, and Plan(costs='none') "
                        "times nothing: leave out the target, or measure the costs.")
    if plan.intra_layer is not None:
        raise PlanError(f"{argument} adds the loss to the last unit's costs, from which "
                        "Plan(intra_layer=...) picks the layers to split; leave out the target "
                        "with intra_layer.")
    check_loss_timing(plan, target, argument)


def traced_loss(traced: Any, plan: Plan, target: Any, flat: Any, whole: Any, device: str,
                argument: str = "compile(example_target=...)") -> Loss | None:
    """loss(outputs, size), timed with the units (None without a target): the plan's loss_fn
    on the model's output, built from the traced graph's output values by name (the graph
    the units are cut from: split layers rename the executor's outputs), and the target's
    first `size` rows, as the last stage computes it. The target has one row per sample of
    the inputs `flat`; `argument` names it in errors."""
    if target is None:
        return None
    check_loss_timing(plan, target, argument)
    batch, found = input_dims(flat, whole).batch, rows([target])  # as pipe.step cuts it
    if found != batch:
        raise FxpipeError(f"{argument} needs a tensor with one row per sample of the inputs "
                          f"({batch}), got {found} rows.")
    target = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                             target)
    dims = input_dims([target])
    loss_fn = plan.loss_fn
    model_output = model_output_of(output_names(traced.gm), traced.bind.unflatten)

    def loss(outputs: Mapping[str, Any], size: int) -> torch.Tensor:
        return loss_fn(model_output(outputs), resize([target], dims, size)[0])
    return loss
