"""The profile pass leaves its record on the graph, under its node.meta key."""

from __future__ import annotations

import torch

import fxpipe
from fxpipe.meta import PROFILE
from fxpipe.models import ResNet


def test_every_unit_node_carries_its_units_measured_timing():
    model = ResNet(widths=(4, 8), blocks=1)
    x = torch.randn(8, 3, 16, 16)
    plan = fxpipe.Plan(stages=2, micro_batches=2)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), cache=False)
    nodes = {n.name: n for n in pipe.traced.gm.graph.nodes}
    timed = set()
    for unit in pipe.units:
        for name in unit.nodes:
            timing = nodes[name].meta[PROFILE]
            assert timing.unit == unit.index and timing.sizes == (4,)
            assert timing.forward[0] == pipe.cost.f[0, unit.index]
            assert timing.backward[0] == pipe.cost.b[0, unit.index]
            timed.add(name)
    assert all(PROFILE not in n.meta for name, n in nodes.items() if name not in timed)
