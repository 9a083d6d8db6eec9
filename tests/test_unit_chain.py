"""UnitChain: a graph run segment by segment computes what the graph does; cuts fall where
the fewest bytes are kept; a segment can run again from the inputs it was given."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nets import networks
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxpipe
from fxpipe.meta import UNIT
from fxpipe.passes.analysis.shape import annotate_shapes
from fxpipe.trace import trace
from fxpipe.unit_chain import UnitChain, mark_segments
from fxpipe.units import cut_units


def _traced(model: nn.Module, x: torch.Tensor, tracer: str = "fx"):
    gm = trace(model, (x,), {}, fxpipe.Plan(stages=1, tracer=tracer)).gm
    units = cut_units(gm)
    annotate_shapes(gm, [x])
    return gm, units


@settings(max_examples=15, deadline=None)
@given(networks(), st.booleans())
def test_running_the_segments_in_turn_computes_what_the_graph_does(case, per_unit):
    model, (x,) = case
    gm, units = _traced(model, x)
    chain = UnitChain(gm, per_unit=per_unit)
    torch.testing.assert_close(chain.run([x]), gm(x), rtol=0, atol=0)
    covered = [u for segment in chain.segments for u in segment.units]
    assert covered == list(range(len(units)))  # whole units, in order, each once
    if per_unit:
        assert [segment.units for segment in chain.segments] == [(u.index,) for u in units]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_cuts_fall_where_the_narrowest_values_cross(tracer):
    """Blocks wide inside (8 -> 64 -> 8): keeping a block's 8-wide input costs less than
    keeping its 64-wide middle, or holding all three blocks' activations at once."""
    model = nn.Sequential(*(m for _ in range(3) for m in (
        nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8))))
    gm, _ = _traced(model, torch.randn(16, 8), tracer)
    chain = UnitChain(gm)
    assert [segment.units for segment in chain.segments] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]


class InPlace(nn.Module):
    """The write runs in b's unit and writes into a value of a's unit (directly or through a
    view), which exp then reads (and saves): b's segment must not write again into its
    already updated input."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.write = write

    def forward(self, x):
        h = self.a(x)
        k = self.b(h * 2.0)
        if self.write == "add_":
            h.add_(1.0)
        else:
            h.view(-1).mul_(3.0)
        return self.c(k + h.exp())


@pytest.mark.parametrize("write", ["add_", "view"])
def test_a_segment_that_writes_into_an_earlier_value_joins_the_segment_that_made_it(write):
    model = InPlace(write).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    gm, _ = _traced(model, x)
    unit_of = {n.name: n.meta[UNIT] for n in gm.graph.nodes if UNIT in n.meta}
    assert unit_of["b"] != unit_of["a"]
    chain = UnitChain(gm, per_unit=True)
    assert chain.segments[0].units == (unit_of["a"], unit_of["b"])
    expected = torch.autograd.grad(model(x).sum(), list(model.parameters()))

    def checkpointed(segment, values):
        return checkpoint(segment.code, *values, use_reentrant=False)

    found = torch.autograd.grad(chain.run([x], checkpointed).sum(), list(gm.parameters()))
    for got, want in zip(found, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_segments_use_the_stage_modules_parameters_as_they_are_now():
    """A parameter replaced after the chain was built (load_state_dict(assign=True)) is the
    one a segment reads, and functional_call substitutes weights as for the whole module."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    x = torch.randn(5, 3)
    gm, _ = _traced(model, x)
    chain = UnitChain(gm, per_unit=True)
    new = {k: torch.randn_like(v) for k, v in gm.state_dict().items()}
    gm.load_state_dict(new, assign=True)
    torch.testing.assert_close(chain.run([x]), gm(x), rtol=0, atol=0)
    zeros = {f"stage.{k}": torch.zeros_like(v) for k, v in new.items()}
    substituted = chain.run([x], lambda segment, values: torch.func.functional_call(
        segment.code, zeros, tuple(values)))
    assert torch.equal(substituted, torch.zeros(5, 2))


@pytest.mark.parametrize("per_unit", [False, True])
def test_a_segment_reports_the_buffers_it_can_update(per_unit):
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    gm, _ = _traced(model, torch.randn(5, 3))
    chain = UnitChain(gm, per_unit=per_unit)
    found = [b for segment in chain.segments for b in chain.buffers(segment)]
    assert sorted(map(id, found)) == sorted(map(id, gm.buffers()))


@pytest.mark.parametrize("write", ["add_", "view"])
def test_the_chain_cuts_where_the_compiler_marked_but_never_inside_a_joined_run(write):
    """Marked (fxpipe.unit_chain.mark_segments) a segment per unit: the chain follows the
    marks, but b's in-place write into a's value still joins a and b."""
    model = InPlace(write).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    gm, units = _traced(model, x)
    mark_segments(gm, [u.index for u in units])
    chain = UnitChain(gm)
    unit_of = {n.name: n.meta[UNIT] for n in gm.graph.nodes if UNIT in n.meta}
    assert chain.segments[0].units == (unit_of["a"], unit_of["b"])
    assert [s.units for s in chain.segments[1:]] == [(u.index,) for u in units[2:]]
    mark_segments(gm, [0])  # one segment: the whole graph
    assert [s.units for s in UnitChain(gm).segments] == [tuple(u.index for u in units)]
    torch.testing.assert_close(UnitChain(gm).run([x]), gm(x), rtol=0, atol=0)
