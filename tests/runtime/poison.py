"""A layer that, armed, makes every gradient through it inf: an overflow injected on purpose."""

from __future__ import annotations

import torch
from torch import nn


class _Inf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf"))


class Poison(nn.Module):
    """Identity; while `Poison.armed`, its backward returns inf (trace it as a leaf module)."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Inf.apply(x) if Poison.armed else x


def poisoned_net() -> nn.Sequential:
    """Six units: the Poison is in the first three, so only the first Linear's gradient
    turns inf; a [3, 3] partition puts it on stage 0 and the rest on stage 1."""
    return nn.Sequential(nn.Linear(8, 16), Poison(), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))
