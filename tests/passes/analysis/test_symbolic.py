"""Symbolic pass: FLOPs and bytes as expressions of the batch size (and sequence length)."""

from __future__ import annotations

import pytest
import sympy
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.meta import SHAPE
from fxpipe.models import GPT, ResNet
from fxpipe.passes.analysis.shape import annotate_shapes, record_values
from fxpipe.passes.analysis.symbolic import BATCH, SEQ, SYMBOLIC, annotate_symbolic
from fxpipe.units import cut_units


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.target == target)


@given(c_in=st.integers(1, 6), c_out=st.integers(1, 6), k=st.integers(1, 3),
       stride=st.integers(1, 2), size=st.integers(5, 9), batch=st.integers(2, 5),
       features=st.integers(1, 7))
def test_conv_and_linear_flops_equal_hand_computed(c_in, c_out, k, stride, size, batch,
                                                   features):
    model = nn.Sequential(nn.Conv2d(c_in, c_out, k, stride), nn.Flatten())
    out_side = (size - k) // stride + 1
    model.append(nn.Linear(c_out * out_side ** 2, features))
    gm = torch.fx.symbolic_trace(model)
    annotate_symbolic(gm, [torch.randn(batch, c_in, size, size)])
    conv, linear = gm.graph.find_nodes(op="call_module", target="0")[0], _node(gm, "2")
    expected_conv = 2 * BATCH * c_out * out_side ** 2 * c_in * k * k
    expected_linear = 2 * BATCH * c_out * out_side ** 2 * features
    assert sympy.simplify(conv.meta[SYMBOLIC].flops - expected_conv) == 0
    assert sympy.simplify(linear.meta[SYMBOLIC].flops - expected_linear) == 0


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_output_bytes_match_the_shape_pass_at_the_example_and_at_other_batches(frontend):
    model = ResNet()
    x = torch.randn(8, 3, 32, 32)
    if frontend == "fx":
        gm = torch.fx.symbolic_trace(model)
    else:
        dims = ({0: torch.export.Dim.AUTO},)
        gm = torch.export.export(model, (x,), dynamic_shapes=dims, strict=False).module()
    annotate_shapes(gm, [x])
    annotate_symbolic(gm, [x])
    other = record_values(gm, [torch.randn(3, 3, 32, 32)])  # a size never probed
    for node in gm.graph.nodes:
        cost = node.meta[SYMBOLIC]
        assert cost.out_bytes.subs(BATCH, 8) == node.meta[SHAPE].nbytes, node.name
        assert cost.out_bytes.subs(BATCH, 3) == other[node.name].nbytes, node.name


def test_attention_is_quadratic_in_sequence_length_and_both_frontends_agree():
    model = GPT(layers=1)
    idx = torch.randint(0, 128, (4, 16))
    totals = []
    for frontend in ("fx", "export"):
        if frontend == "fx":
            gm = torch.fx.symbolic_trace(model)
        else:
            dims = ({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
            gm = torch.export.export(model, (idx,), dynamic_shapes=dims, strict=False).module()
        assert annotate_symbolic(gm, [idx]) == []
        totals.append(sympy.expand(sum(n.meta[SYMBOLIC].flops for n in gm.graph.nodes)))
    assert totals[0] == totals[1]
    assert sympy.Poly(totals[0], BATCH, SEQ).degree(SEQ) == 2


def test_matmul_and_conv_flops_agree_with_torch_flop_counter():
    model = ResNet()
    x = torch.randn(4, 3, 32, 32)
    gm = torch.fx.symbolic_trace(model)
    annotate_symbolic(gm, [x])
    ours = sum(n.meta[SYMBOLIC].flops for n in gm.graph.nodes
               if n.meta[SYMBOLIC].op in ("conv", "linear"))
    with FlopCounterMode(display=False) as counter:
        model(x)
    assert ours.subs(BATCH, 4) == counter.get_total_flops()


def test_unknown_operator_counts_zero_and_warns_without_failing():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.cumsum(x, 1) + 1

    gm = torch.fx.symbolic_trace(Odd())
    warnings = annotate_symbolic(gm, [torch.randn(4, 5)])
    cumsum = next(n for n in gm.graph.nodes if n.target is torch.cumsum)
    assert cumsum.meta[SYMBOLIC].flops == 0
    assert warnings == [cumsum.meta[SYMBOLIC].warning]
    assert "no FLOP rule for 'cumsum'" in warnings[0]


def test_unit_flops_add_up_over_the_units():
    from fxpipe.passes.analysis.symbolic import unit_flops

    model = ResNet()
    gm = torch.fx.symbolic_trace(model)
    annotate_symbolic(gm, [torch.randn(4, 3, 32, 32)])
    units = cut_units(gm)
    total = sum(n.meta[SYMBOLIC].flops for n in gm.graph.nodes)
    assert sympy.expand(sum(unit_flops(gm, units)) - total) == 0
