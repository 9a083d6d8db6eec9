"""The rewritten PipelineGraph computes exactly what the traced model computes."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from nets import flat_outputs, networks, scalar_loss

import fxpipe
from fxpipe.ir import recv, send


@st.composite
def compiled_networks(draw, frontends=("fx", "export")):
    model, inputs = draw(networks())
    frontend = draw(st.sampled_from(frontends))
    units = len(fxpipe.units_of(model, inputs, fxpipe.Plan(stages=1, tracer=frontend,
                                                           costs="none")))
    stages = draw(st.integers(1, min(4, units)))
    cuts = sorted(draw(st.sets(st.integers(1, units - 1), min_size=stages - 1,
                               max_size=stages - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, units])]
    reference = copy.deepcopy(model)
    plan = fxpipe.Plan(stages=stages, partitioner=sizes, tracer=frontend, costs="none",
                       micro_batches=1)  # a network returns a scalar, which only one gives
    return fxpipe.compile(model, plan, example_inputs=inputs), reference, inputs


def _grad_inputs(inputs):
    return tuple(x.clone().requires_grad_(x.is_floating_point()) for x in inputs)


@given(compiled_networks(), st.sampled_from(["pipelined", "graph"]))
def test_pipeline_graph_matches_model_outputs_and_gradients(case, path):
    """Both the runtime (pipe(...)) and the PipelineGraph run as a plain module."""
    pipe, reference, inputs = case
    ours, theirs = _grad_inputs(inputs), _grad_inputs(inputs)
    run = pipe if path == "pipelined" else pipe.run_sequential
    out, expected = run(*ours), reference(*theirs)
    for a, b in zip(flat_outputs(out), flat_outputs(expected), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    scalar_loss(out).backward()
    scalar_loss(expected).backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    for a, b in zip(pipe.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)  # BatchNorm statistics


@given(compiled_networks())
def test_every_crossing_value_has_one_send_and_one_recv(case):
    pipe, _, _ = case
    nodes = list(pipe.graph.graph.nodes)
    sends = [n for n in nodes if n.target is send]
    recvs = [n for n in nodes if n.target is recv]
    assert len(sends) == len(recvs) == len(pipe.comm.edges)
    for edge in pipe.comm.edges:
        assert edge.src < edge.dst
        recv_node = next(n for n in recvs if n.name == f"{edge.value}_at_s{edge.dst}")
        assert recv_node.args[0].target is send
        assert (recv_node.kwargs["src"], recv_node.kwargs["dst"]) == (edge.src, edge.dst)
    for io in pipe.comm.stages:
        received = {e.value for e in pipe.comm.recvs(io.stage)}
        own_inputs = set(pipe.comm.graph_inputs) if io.stage == 0 else set()
        assert set(io.inputs) == received | (own_inputs & set(io.inputs))


@given(compiled_networks(frontends=("fx",)), st.sampled_from(["pipelined", "graph"]))
def test_hooks_fire_once_per_stage_in_reverse_order(case, path):
    pipe, _, inputs = case
    run = pipe if path == "pipelined" else pipe.run_sequential
    fired = []
    handles = [pipe.register_stage_hook(s, fired.append) for s in range(pipe.plan.stages)]
    scalar_loss(run(*inputs)).backward()
    assert fired == list(reversed(range(pipe.plan.stages)))
    for handle in handles:
        handle.remove()
    scalar_loss(run(*inputs)).backward()
    assert len(fired) == pipe.plan.stages


def test_model_input_used_by_a_late_stage_is_sent_from_stage_0():
    from nets import ResidualNet

    model = ResidualNet(4, 3).double()
    x = torch.randn(3, 6, dtype=torch.float64)
    # units by count, not by time: the skip layer must land in the last stage, after stage 1
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, partitioner="even", micro_batches=1),
                          example_inputs=(x,))  # one micro-batch: the model returns a scalar
    skips = [e for e in pipe.comm.edges if e.value == "x"]
    assert skips and all(e.src == 0 for e in skips)
    assert any(e.dst == 2 for e in skips)  # past stage 1, which does not use it
    torch.testing.assert_close(pipe(x), model(x))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_stages_own_their_parameters_under_original_names(frontend):
    model = fxpipe.models.MLP()
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, tracer=frontend),
                          example_inputs=(torch.randn(2, 32),))
    original = dict(model.named_parameters())
    for stage in pipe.stages:
        for name, param in stage.module.named_parameters():
            assert param is original[name]


@pytest.mark.parametrize("bounds", [(3, 2, 7), (3, 2, 8), (5, 3, 8), (3, 7), (0, 8), ()])
def test_split_stages_refuses_bounds_that_do_not_cut_the_units_in_order(bounds):
    from fxpipe.passes.rewrite.stages import split_stages
    from fxpipe.trace import trace
    from fxpipe.units import cut_units

    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(8)))
    traced = trace(model, (torch.randn(2, 4),), {}, fxpipe.Plan(stages=1))
    units = cut_units(traced.gm, None, traced.leaf_paths)
    assert len(units) == 8
    with pytest.raises(ValueError, match="are not increasing stage ends covering 8 units"):
        split_stages(traced.gm, units, bounds, ["cpu"] * max(len(bounds), 1))
