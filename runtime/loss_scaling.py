"""fp16 loss scaling for a pipeline: torch.amp.GradScaler whose inf/nan check spans every stage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from fxpipe.devices import collective_device
from fxpipe.errors import FxpipeError

__all__ = ["PipelineScaler"]


class PipelineScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler, used as in a plain loop (`scale`, `unscale_`, `step`, `update`),
    whose inf/nan check is one for the whole pipeline: a stage's gradients are only part of
    the model's, and a step taken on some stages and skipped on others would leave the model
    inconsistent. So `unscale_` (and `step`, which calls it) shares what it found with every
    rank of the job under torchrun (an all-reduce: every rank must call it, for as many
    optimizers, as with FSDP's ShardedGradScaler), and `unscale_all_` makes one decision for
    several optimizers (one per stage). Every rank keeps the same scale: they start equal and
    update on the same findings. Disabled (`enabled=False`), every method is a no-op but
    `step`, which steps the optimizer, so one training loop serves every precision.
    """

    def __init__(self, device: str | torch.device, distributed: bool = False,
                 enabled: bool = True, **kwargs: Any) -> None:
        device = torch.device(device)
        super().__init__(device.type, enabled=enabled, **kwargs)
        self.home = device  # where the scale lives and ranks exchange their findings
        self.distributed = distributed
        self._deferred: list[dict[torch.device, torch.Tensor]] | None = None
        self._versions: int | None = None  # the weights' versions when pipe.step last scaled
        if self.is_enabled():  # ranks without the loss never call scale(), yet unscale
            self.scale(torch.zeros((), device=device))

    def scaling(self, parameters: Sequence[torch.Tensor]) -> None:
        """Before pipe.step scales a loss: refuse when the weights changed since the last
        scaled step without `step` or `update` of this scaler, i.e. an optimizer stepped on
        gradients still scaled (steps that only accumulate gradients change no weight)."""
        versions = sum(p._version for p in parameters)
        if self._versions is not None and versions != self._versions:
            self._versions = None
            raise FxpipeError(
                f"Plan(precision='fp16'): pipe.step scales the loss by pipe.scaler (now "
                f"{self.get_scale():g}), so its gradients are scaled; the weights changed since "
                "without pipe.scaler.step(optimizer), so an optimizer stepped on scaled "
                "gradients. After each pipe.step call pipe.scaler.step(optimizer) and "
                "pipe.scaler.update() instead of optimizer.step() (docs/precision.md).")
        self._versions = versions

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._versions = None
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._versions = None
        super().update(new_scale)

    def unscale_all_(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Unscale every optimizer's gradients (those not unscaled yet) and decide once for
        all of them, over every rank: True if any gradient anywhere is inf or nan, in which
        case `step` skips each of them (and `update` lowers the scale)."""
        if not self.is_enabled():
            return False
        states = [self._per_optimizer_states[id(optimizer)] for optimizer in optimizers]
        self._deferred = []  # one agreement for all, below, not one each
        try:
            for optimizer, state in zip(optimizers, states):
                if state["stage"] is OptState.READY:
                    self.unscale_(optimizer)
        finally:
            self._deferred = None
        return bool(self._agree([state["found_inf_per_device"] for state in states]) > 0)

    def step_all(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """`step` every optimizer on one decision (`unscale_all_`); True if they stepped."""
        skipped = self.unscale_all_(optimizers)
        for optimizer in optimizers:
            self.step(optimizer)
        return not skipped

    # GradScaler's one place that checks gradients for inf/nan (for unscale_, and for an
    # optimizer that unscales itself): what it found is agreed on before step reads it
    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any
                        ) -> dict[torch.device, torch.Tensor]:
        found = super()._unscale_grads_(optimizer, *args, **kwargs)
        if self._deferred is not None:
            self._deferred.append(found)
        else:
            self._agree([found])
        return found

    def _agree(self, found: list[dict[torch.device, torch.Tensor]]) -> torch.Tensor:
        """Sum the findings of every optimizer and device here, take the largest over the ranks,
        and write it into each finding (in place: step and update read them). A finding with
        no gradients at all gets one, so that step and update have something to read."""
        total = torch.zeros((), dtype=torch.float32, device=self.home)
        for per_device in found:
            for flag in per_device.values():
                total += flag.to(self.home)
        if self.distributed and dist.is_initialized() and dist.get_world_size() > 1:
            reduced = total.to(collective_device(self.home, dist.get_backend()))
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
            total = reduced.to(self.home)
        for per_device in found:
            if not per_device:
                per_device[self.home] = total.clone()
            for flag in per_device.values():
                flag.copy_(total)
        return total
