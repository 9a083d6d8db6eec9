"""Shape pass: every node gets the shape, dtype and bytes of what it produces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx

from fxpipe.materialize import has_meta_tensors, meta_twin, on_meta
from fxpipe.meta import SHAPE, ValueInfo
from fxpipe.preserve import preserved_state

__all__ = ["annotate_shapes", "record_values"]


class _ShapeRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, ValueInfo] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.values[n.name] = ValueInfo.of(result)
        return result


def record_values(gm: fx.GraphModule, flat_inputs: Sequence[Any]) -> dict[str, ValueInfo]:
    """Run `gm` on placeholder values (without side effects) and return every node's ValueInfo.
    A graph with weights on the meta device runs on meta inputs (shapes and dtypes only)."""
    if has_meta_tensors(gm):
        gm, flat_inputs = meta_twin(gm), on_meta(list(flat_inputs))
    recorder = _ShapeRecorder(gm)
    with preserved_state(gm):
        recorder.run(*flat_inputs, enable_io_processing=False)
    return recorder.values


def annotate_shapes(gm: fx.GraphModule, flat_inputs: Sequence[Any]) -> None:
    """Run `gm` on example placeholder values and write a ValueInfo under node.meta[SHAPE].

    The run leaves the model as it found it: buffers (BatchNorm statistics) and the random
    number generators are restored afterwards.
    """
    values = record_values(gm, flat_inputs)
    for node in gm.graph.nodes:
        node.meta[SHAPE] = values[node.name]


