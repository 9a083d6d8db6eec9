"""Shape pass: every node's shape, dtype and bytes, without side effects on the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxpipe.meta import AUTOCAST, SHAPE, ValueInfo
from fxpipe.models import GPT, ResNet
from fxpipe.passes.analysis.shape import annotate_autocast, annotate_shapes
from fxpipe.passes.rewrite.stages import split_stages
from fxpipe.precision import DTYPES, autocast
from fxpipe.units import cut_units


def test_every_node_gets_shape_dtype_and_bytes():
    model = ResNet()
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(4, 3, 32, 32)
    annotate_shapes(gm, [x])
    for node in gm.graph.nodes:
        assert isinstance(node.meta[SHAPE], ValueInfo), node.name
    conv = next(n for n in gm.graph.nodes if n.target == "stem.0")
    info = node_info = conv.meta[SHAPE]
    assert info.is_tensor and node_info.tensors[0].shape == (4, 16, 32, 32)
    assert info.nbytes == 4 * 16 * 32 * 32 * 4
    assert str(info) == "f32[4, 16, 32, 32]"
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.meta[SHAPE].nbytes == 4 * 10 * 4


def test_batchnorm_statistics_are_restored():
    model = ResNet()
    gm = torch.fx.symbolic_trace(model)
    before = [b.clone() for b in model.buffers()]
    annotate_shapes(gm, [torch.randn(4, 3, 32, 32)])
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


def _autocast_run(gm, inputs, precision):
    """Every node's dtypes in a real run under `precision`'s CPU autocast."""
    from fxpipe.passes.analysis.shape import _ShapeRecorder
    recorder = _ShapeRecorder(gm)
    with torch.no_grad(), autocast("cpu", precision):
        recorder.run(*inputs, enable_io_processing=False)
    return {name: [t.dtype for t in info.tensors] for name, info in recorder.values.items()}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["resnet", "gpt", "gpt-meta"])
def test_autocast_dtypes_are_those_a_real_autocast_run_makes(name, precision):
    """Fake tensors give every node the dtypes a real run under autocast gives it (a model on
    the meta device too), and leave the model as it was."""
    def build():
        torch.manual_seed(0)
        if name == "resnet":
            return ResNet(widths=(8, 8)), (torch.randn(2, 3, 8, 8),)
        return GPT(vocab=64, layers=1, dim=32, heads=2, seq=8), (torch.randint(0, 64, (2, 8)),)

    real, inputs = build()
    if name.endswith("-meta"):
        with torch.device("meta"):
            model = build()[0]
    else:
        model = real
    gm, expected_gm = torch.fx.symbolic_trace(model), torch.fx.symbolic_trace(real)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    assert annotate_autocast(gm, list(inputs), "cpu", precision) is None
    for key, tensor in model.state_dict().items():  # batch norm statistics untouched
        assert tensor.is_meta if name.endswith("-meta") else torch.equal(tensor, before[key])
    expected = _autocast_run(expected_gm, inputs, precision)
    found = {n.name: [t.dtype for t in n.meta[AUTOCAST].tensors] for n in gm.graph.nodes}
    assert found == expected
    lower = DTYPES[precision]
    assert any(lower in dtypes for dtypes in found.values())  # autocast did cast


def test_a_graph_fake_tensors_cannot_run_keeps_the_traces_dtypes():
    class Picks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            return h[h > 0].sum()  # a data-dependent shape

    gm = torch.fx.symbolic_trace(Picks())
    problem = annotate_autocast(gm, [torch.randn(3, 4)], "cpu", "bf16")
    assert problem is not None and "trace's dtypes" in problem
    assert not any(AUTOCAST in n.meta for n in gm.graph.nodes)
    assert annotate_autocast(gm, [torch.randn(3, 4)], "cpu", None) is None  # full precision
    assert not any(AUTOCAST in n.meta for n in gm.graph.nodes)


def test_values_cross_stages_in_their_autocast_dtypes():
    """The split's edges (what torchrun's messages carry) take the autocast dtypes, the
    trace's shapes and whether they need a gradient."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(3, 4)
    annotate_shapes(gm, [x])
    annotate_autocast(gm, [x], "cpu", "bf16")
    units = cut_units(gm)
    _, table = split_stages(gm, units, range(1, len(units) + 1), ["cpu"] * len(units))
    assert table.edges
    for edge in table.edges:
        traced = next(n for n in gm.graph.nodes if n.name == edge.value).meta[SHAPE]
        assert edge.info.tensors[0].dtype == torch.bfloat16
        assert edge.info.tensors[0].shape == traced.tensors[0].shape
        assert edge.info.tensors[0].requires_grad == traced.tensors[0].requires_grad
