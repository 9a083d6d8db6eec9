"""Pieces the timing probes share, in the cost model's passes and in the runtime: a fixed
burst of compute, two ranks swapping the figures they measured, and a module's gradients,
buffers and random number generators kept from what its timed compute does to them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ComputeBurst", "gradients_set_aside", "preserved_state", "swap_figures"]


class ComputeBurst:
    """A fixed piece of compute: `depth` matmul + tanh layers on `size` x `size` tensors, and
    their backward when `backward`. Calling it runs it and returns its seconds (a GPU's
    kernels waited for)."""

    def __init__(self, device: str | torch.device = "cpu", size: int = 128, depth: int = 4,
                 backward: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, size, generator=generator).to(device)
        self.w = (torch.randn(size, size, generator=generator) / size ** 0.5).to(device)
        self.w.requires_grad_(backward)
        self.depth, self.backward = depth, backward

    def __call__(self) -> float:
        began = time.perf_counter()
        with torch.set_grad_enabled(self.backward):
            h = self.x
            for _ in range(self.depth):
                h = torch.tanh(h @ self.w)
            if self.backward:
                h.sum().backward()
        if h.device.type == "cuda":
            torch.cuda.synchronize(h.device)
        return time.perf_counter() - began


def swap_figures(mine: Sequence[float], peer: int, first: bool, outbound: Any = None,
                 inbound: Any = None, device: str | torch.device = "cpu") -> list[float]:
    """Send the figures `mine` to `peer` and return the peer's (as many). The `first` of the
    two sends in `outbound` and then receives in `inbound`; the other receives in the first's
    `outbound` and answers in its `inbound` (one-way groups, as a pipeline's messages travel)."""
    sent = torch.tensor(list(mine), dtype=torch.float64, device=device)  # NCCL: device tensors
    theirs = torch.empty_like(sent)
    if first:
        dist.send(sent, peer, outbound)
        dist.recv(theirs, peer, inbound)
    else:
        dist.recv(theirs, peer, outbound)
        dist.send(sent, peer, inbound)
    return theirs.tolist()


@contextlib.contextmanager
def gradients_set_aside(module: torch.nn.Module) -> Iterator[None]:
    """The module's parameters accumulate into zeroed .grad meanwhile, as in a step; their own
    .grad comes back after."""
    saved = [(p, p.grad) for p in module.parameters() if p.requires_grad]
    for param, _ in saved:
        param.grad = torch.zeros_like(param)
    try:
        yield
    finally:
        for param, grad in saved:
            param.grad = grad


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Run something on `module` without a trace: buffers and RNG state are put back after."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({b.device for b, _ in buffers if b.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
