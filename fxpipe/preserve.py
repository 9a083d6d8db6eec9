"""Running something on a module without a trace: gradients, buffers and RNGs kept."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["gradients_set_aside", "modes_kept", "preserved_state"]


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
    # every GPU the module computes on draws random numbers (dropout), not only its buffers'
    devices = sorted({t.device for t in [*module.parameters(), *module.buffers()]
                      if t.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


@contextlib.contextmanager
def modes_kept(module: torch.nn.Module) -> Iterator[None]:
    """Each submodule's train/eval mode put back after (module.train(was) would set them all
    to one mode, losing a submodule the user put in the other)."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
