"""Shape pass: every node gets the shape, dtype and bytes of what it produces."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from fxpipe.materialize import has_meta_tensors, meta_twin, on_meta
from fxpipe.meta import AUTOCAST, SHAPE, ValueInfo
from fxpipe.precision import autocast
from fxpipe.preserve import preserved_state

__all__ = ["annotate_autocast", "annotate_shapes", "autocast_values", "record_values"]


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


def autocast_values(gm: fx.GraphModule, flat_inputs: Sequence[Any], device: str,
                    precision: str) -> dict[str, ValueInfo]:
    """Every node's ValueInfo when `gm` runs under `precision`'s autocast on `device` (a
    Linear's output in bf16, say), as a stage there makes it. The run is on fake tensors of
    the weights' and inputs' shapes and dtypes on `device` (no memory, no compute, the model's
    own tensors untouched), so a model on the meta device, or a GPU's autocast, is run alike."""
    named = itertools.chain(gm.named_parameters(remove_duplicate=False),
                            gm.named_buffers(remove_duplicate=False))
    with preserved_state(gm), FakeTensorMode(allow_non_fake_inputs=True):
        def fake(tensor: torch.Tensor) -> torch.Tensor:
            made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                       device=device)
            return made.requires_grad_(tensor.requires_grad)

        state = {name: fake(tensor) for name, tensor in named}
        inputs = pytree.tree_map_only(torch.Tensor, fake, list(flat_inputs))
        recorder = _ShapeRecorder(gm)
        with _reparametrize_module(gm, state), autocast(device, precision):
            recorder.run(*inputs, enable_io_processing=False)
    return recorder.values


def annotate_autocast(gm: fx.GraphModule, flat_inputs: Sequence[Any], device: str,
                      precision: str | None) -> str | None:
    """Write each node's ValueInfo under `precision`'s autocast on `device` under
    node.meta[AUTOCAST] (nothing in full precision): the dtypes its value crosses between
    processes in, which both ends must know ahead. A graph fake tensors cannot run (a
    data-dependent shape, say) is left without: its values then cross in the trace's dtypes,
    a lossless cast; the return says why."""
    if precision is None:
        return None
    try:
        values = autocast_values(gm, flat_inputs, device, precision)
    except Exception as error:  # any failure leaves the trace's dtypes
        return (f"the dtypes under {precision} autocast could not be derived "
                f"({type(error).__name__}: {error}); values cross processes in the trace's "
                "dtypes")
    for node in gm.graph.nodes:
        if node.name in values:
            node.meta[AUTOCAST] = values[node.name]
    return None
