"""Units: both frontends cut a model the same way; leaf modules and depth group units."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from nets import networks

import fxpipe
from fxpipe.meta import UNIT
from fxpipe.models import GPT, MLP, ResNet
from fxpipe.trace import trace
from fxpipe.units import cut_units


def _names(model, x, **plan):
    return [u.name for u in fxpipe.units_of(model, (x,), fxpipe.Plan(stages=1, **plan))]


@pytest.mark.parametrize("model, x", [
    (MLP(), torch.randn(2, 32)),
    (ResNet(), torch.randn(2, 3, 32, 32)),
    (GPT(), torch.randint(0, 128, (2, 8))),
])
def test_fx_and_export_cut_the_same_units(model, x):
    assert _names(model, x, tracer="fx") == _names(model, x, tracer="export")


@given(networks())
def test_units_are_contiguous_and_cover_every_compute_node(case):
    model, inputs = case
    for frontend in ("fx", "export"):
        units = fxpipe.units_of(model, inputs, fxpipe.Plan(stages=1, tracer=frontend))
        seen = [name for unit in units for name in unit.nodes]
        assert len(seen) == len(set(seen))
        assert [u.index for u in units] == list(range(len(units)))
        traced = trace(model, inputs, {}, fxpipe.Plan(stages=1, tracer=frontend))
        cut = cut_units(traced.gm, None, traced.leaf_paths)
        order = [n.name for n in traced.gm.graph.nodes]
        compute = {n.name for n in traced.gm.graph.nodes
                   if n.op in ("call_module", "call_function", "call_method")}
        assert compute <= set(seen)  # every compute node is in a unit
        position = {name: i for i, name in enumerate(order)}
        for unit in cut:  # in graph order, one unit after another
            assert [position[n] for n in unit.nodes] == sorted(position[n] for n in unit.nodes)
        firsts = [min(position[n] for n in u.nodes) for u in cut]
        lasts = [max(position[n] for n in u.nodes) for u in cut]
        assert all(a < b for a, b in zip(lasts, firsts[1:]))


def test_leaf_modules_are_one_unit_each():
    model, x = GPT(layers=2), torch.randint(0, 128, (2, 8))
    from fxpipe.models import DecoderBlock

    names = _names(model, x, tracer="fx", leaf_modules=[DecoderBlock])
    assert names == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head"]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_unit_depth_groups_by_module_path(frontend):
    model, x = GPT(layers=3), torch.randint(0, 128, (2, 8))
    names = _names(model, x, tracer=frontend, unit_depth=2)
    assert names == ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "ln_f", "lm_head"]


def test_glue_joins_the_unit_before_it():
    units = fxpipe.units_of(ResNet(), (torch.randn(2, 3, 32, 32),))
    block = [u for u in units if u.name.startswith("layers.0.")]
    assert [u.name for u in block] == ["layers.0.conv1", "layers.0.bn1", "layers.0.conv2",
                                       "layers.0.bn2"]
    assert any("relu" in n for n in block[1].nodes)  # F.relu after bn1 rides with bn1
    assert any(n.startswith("add") for n in block[3].nodes)  # the residual add with bn2


def test_every_compute_node_is_marked_with_its_unit():
    model = MLP()
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2), example_inputs=(torch.randn(2, 32),))
    for node in pipe.traced.gm.graph.nodes:
        if node.op not in ("placeholder", "get_attr", "output"):
            assert isinstance(node.meta[UNIT], int)
