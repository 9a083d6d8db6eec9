"""What the benchmark scripts share: medians with their spread, and the ResNet as a Sequential."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.models import ResNet


def spread(values: list[float], fmt: str = ".2f") -> str:
    """The median of `values` and their range: "1.00 (0.95-1.10)"."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """The median of `repeats` timed calls of `fn`, in milliseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class PoolFlatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


def sequential_resnet() -> nn.Sequential:
    """The bundled ResNet as an nn.Sequential of its blocks (what torchgpipe and
    torch.distributed.pipelining take)."""
    net = ResNet()
    return nn.Sequential(net.stem, *net.layers, PoolFlatten(), net.fc)
