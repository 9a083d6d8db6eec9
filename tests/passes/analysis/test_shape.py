"""Shape pass: every node's shape, dtype and bytes, without side effects on the model."""

from __future__ import annotations

import torch

from fxpipe.meta import SHAPE, ValueInfo
from fxpipe.models import ResNet
from fxpipe.passes.analysis.shape import annotate_shapes


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
