"""Shape pass: every node gets the shape, dtype and bytes of what it produces."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx

from fxpipe.meta import SHAPE, ValueInfo

__all__ = ["annotate_shapes", "preserved_state"]


class _ShapeRecorder(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        n.meta[SHAPE] = ValueInfo.of(result)
        return result


def annotate_shapes(gm: fx.GraphModule, flat_inputs: Sequence[Any]) -> Any:
    """Run `gm` on example placeholder values and write a ValueInfo under node.meta[SHAPE].

    The run leaves the model as it found it: buffers (BatchNorm statistics) and the random
    number generators are restored afterwards. Returns the graph's output for checks.
    """
    flat = list(flat_inputs)
    with preserved_state(gm):
        output = _ShapeRecorder(gm).run(*flat, enable_io_processing=False)
    return output


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
