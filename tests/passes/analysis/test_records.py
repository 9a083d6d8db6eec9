"""The profile and comm passes leave their records on the graph, one node.meta key each."""

from __future__ import annotations

import torch

import fxpipe
from fxpipe.meta import COMM, PROFILE, SHAPE, UNIT
from fxpipe.models import ResNet


def test_every_unit_node_carries_its_timing_and_every_crossing_value_its_transfer():
    model = ResNet(widths=(4, 8), blocks=1)
    x = torch.randn(8, 3, 16, 16)
    plan = fxpipe.Plan(stages=2, micro_batches=2, link=(1e-4, 1e9))
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), cache=False)
    nodes = {n.name: n for n in pipe.traced.gm.graph.nodes}
    for unit in pipe.units:
        for name in unit.nodes:
            timing = nodes[name].meta[PROFILE]
            assert timing.unit == unit.index and timing.sizes == (4,)
            assert timing.forward[0] == pipe.cost.f[0, unit.index]
    crossing = [n for n in nodes.values() if n.meta.get(UNIT) is not None
                and any(u.meta.get(UNIT, n.meta[UNIT]) > n.meta[UNIT] for u in n.users)]
    assert crossing
    for node in nodes.values():
        transfer = node.meta.get(COMM)
        assert (transfer is not None) == (node in crossing), node.name
        if transfer is not None:
            assert transfer.nbytes == node.meta[SHAPE].nbytes
            assert transfer.forward == 1e-4 + transfer.nbytes / 1e9
