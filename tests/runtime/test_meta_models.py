"""Models built on the meta device: stages made real where they run, weights loaded after."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.compiler import PASSES, passes
from fxpipe.compiler.state import Compilation, run_passes
from fxpipe.errors import PlanError
from fxpipe.materialize import kept_from, materialize, materialized_copy
from fxpipe.models import GPT, ResNet
from fxpipe.passes.analysis import profile as profile_module
from fxpipe.passes.analysis.profile import profile_units, real_bytes


def _tokens_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@settings(max_examples=6, deadline=None)
@given(stages=st.integers(1, 3), micro_batches=st.integers(1, 3),
       schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_a_meta_model_with_loaded_weights_trains_like_the_plain_model(stages, micro_batches,
                                                                       schedule):
    torch.manual_seed(0)
    reference = GPT(layers=2).double()
    with torch.device("meta"):
        model = GPT(layers=2).double()
    idx, target = torch.randint(0, 128, (4, 12)), torch.randint(0, 128, (4, 12))
    plan = fxpipe.Plan(stages=stages, micro_batches=micro_batches, schedule=schedule,
                       loss_fn=_tokens_loss, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(idx,))
    assert not any(t.is_meta for t in [*pipe.parameters(), *pipe.buffers()])
    pipe.load_state_dict(reference.state_dict())
    torch.testing.assert_close(pipe.step(idx, target), _tokens_loss(reference(idx), target))
    _tokens_loss(reference(idx), target).backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_materialize_keeps_ties_reaches_every_holder_and_runs_reset_parameters():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.BatchNorm1d(4), nn.Linear(4, 10))
    model[2].weight = model[0].weight
    other = nn.Module()  # another tree naming the same tensor, as a GraphModule does
    other.register_parameter("w", model[0].weight)
    made = materialize(model, "cpu", holders=[other])
    assert model[2].weight is model[0].weight is other.w  # still one tensor
    assert not model[0].weight.is_meta and isinstance(model[2].weight, nn.Parameter)
    assert torch.equal(model[1].running_var, torch.ones(4))  # BatchNorm's own reset
    assert model[1].num_batches_tracked.item() == 0
    assert made == sum(t.numel() * t.element_size()
                       for t in [*model.parameters(), *model.buffers()])
    assert materialize(model, "cpu") == 0  # nothing left on meta


def test_materialize_only_touches_meta_tensors():
    linear = nn.Linear(3, 3)
    before = linear.weight.detach().clone()
    with torch.device("meta"):
        linear.bias = nn.Parameter(torch.empty(3))
    materialize(linear, "cpu")
    assert torch.equal(linear.weight, before) and not linear.bias.is_meta


def test_a_materialized_copy_leaves_the_module_on_meta_and_frees_its_copy():
    with torch.device("meta"):
        linear = nn.Linear(64, 64)
    with materialized_copy(linear, "cpu") as twin:
        out = twin(torch.randn(2, 64))
        out.sum().backward()
        assert twin.weight.untyped_storage().nbytes() == 64 * 64 * 4
    assert linear.weight.is_meta and twin.weight.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_meta_model_is_timed_unit_by_unit_on_real_copies(tracer):
    with torch.device("meta"):
        model = ResNet()
    real = ResNet()
    x = torch.randn(8, 3, 32, 32)
    plan = fxpipe.Plan(stages=2, micro_batches=2, partitioner="balanced", tracer=tracer)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), cache=False)
    twin = fxpipe.compile(real, plan, example_inputs=(x,), cache=False)
    assert (pipe.cost.f > 0).all()  # every unit timed on a real copy
    np.testing.assert_array_equal(pipe.cost.params, twin.cost.params)
    np.testing.assert_array_equal(pipe.cost.activation_bytes, twin.cost.activation_bytes)
    pipe.load_state_dict(real.state_dict())
    torch.testing.assert_close(pipe.run_sequential(x), real(x))  # the whole batch, in training


def test_a_non_persistent_meta_buffer_is_refused():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("mask", torch.ones(4), persistent=False)

        def forward(self, x):
            return self.linear(x) * self.mask

    with torch.device("meta"):
        model = Masked()
    with pytest.raises(PlanError, match=r"non-persistent buffers \['mask'\] have no values"):
        fxpipe.compile(model, fxpipe.Plan(stages=1, costs="none"),
                       example_inputs=(torch.randn(2, 4),))


def test_intra_layer_splits_need_a_real_model():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(PlanError, match="intra_layer"):
        fxpipe.compile(model, fxpipe.Plan(stages=2, devices=["cpu", "cpu"],
                                          intra_layer=["0"], costs="none"),
                       example_inputs=(torch.randn(2, 4),))


class Positions(nn.Module):
    """Its output is a view of its weight (`self.pos[:T]`, as GPT-2's positions)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1024, 1024))  # big: freed memory is unmapped

    def forward(self, x):
        return self.pos[: x.shape[1]]


class PositionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.positions = Positions()
        self.proj = nn.Linear(1024, 3)

    def forward(self, x):
        return self.proj(torch.tanh(x + self.positions(x)))


def test_what_is_kept_from_a_copy_outlives_it_even_a_view_of_its_weight():
    with torch.device("meta"):
        unit = Positions()
    x = torch.randn(2, 10, 1024)
    with materialized_copy(unit, "cpu") as twin:
        out = twin(x)
        kept, plain = kept_from(twin, out), out.detach()
        other = kept_from(twin, out * 2)  # not a view: kept as it is, no copy
        expected = twin.pos[:10].detach().clone()
    assert plain.untyped_storage().nbytes() == 0  # the copy's weights are gone ...
    assert torch.equal(kept, expected)  # ... but what was kept from it is intact
    assert torch.equal(other, 2 * expected)


def test_a_unit_whose_output_views_its_weight_is_timed_on_a_copy_without_reading_freed_memory():
    torch.manual_seed(0)
    real = PositionNet().double()
    with torch.device("meta"):
        model = PositionNet().double()
    x = torch.randn(4, 10, 1024, dtype=torch.float64)
    plan = fxpipe.Plan(stages=2, micro_batches=2, leaf_modules=[Positions])  # a unit of its own
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), cache=False)
    assert (pipe.cost.f > 0).all()
    pipe.load_state_dict(real.state_dict())
    torch.testing.assert_close(pipe(x), real(x))


def test_a_stage_holding_only_a_tied_weight_runs_on_the_real_one():
    torch.manual_seed(0)
    reference = GPT(layers=2).double()
    with torch.device("meta"):
        model = GPT(layers=2).double()
    idx = torch.randint(0, 128, (4, 12))
    plan = fxpipe.Plan(stages=2, partitioner=[17, 1], costs="none")  # stage 1: lm_head only
    pipe = fxpipe.compile(model, plan, example_inputs=(idx,))
    pipe.load_state_dict(reference.state_dict())
    out = pipe.run_sequential(idx)  # through the stage hooks, gradients on
    torch.testing.assert_close(out, reference(idx))
    out.sum().backward()
    reference(idx).sum().backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_stages_start_from_the_modules_own_reset_parameters(tracer):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.LayerNorm(8),
                              nn.Linear(8, 2))
    plan = fxpipe.Plan(stages=2, costs="none", tracer=tracer)
    fxpipe.compile(model, plan, example_inputs=(torch.randn(6, 4),))
    assert torch.equal(model[1].running_var, torch.ones(8))
    assert torch.equal(model[2].weight, torch.ones(8)) and torch.equal(model[2].bias,
                                                                        torch.zeros(8))
    bound = 1 / 4 ** 0.5  # nn.Linear's own init: U(-1/sqrt(in), 1/sqrt(in))
    assert model[0].weight.abs().max() <= bound and model[0].weight.std() > 0.1


def _traced(model, x, plan) -> Compilation:
    """The model checked, traced and cut into units, as compile's first passes do."""
    compilation = Compilation(model, plan, (x,), {})
    run_passes(PASSES[:4], compilation)
    return compilation


def _unit_graph(model, x, stages=1):
    return passes._units_as_stages(_traced(model, x, fxpipe.Plan(stages=stages)))


@contextlib.contextmanager
def _copies_made() -> Iterator[list[tuple[threading.Thread, int]]]:
    """Meanwhile, every real copy the profile makes: the thread making it, and its bytes of
    parameters and buffers."""
    made, log = profile_module.materialized_copy, []

    @contextlib.contextmanager
    def counted(module, device):
        with made(module, device) as copy:
            log.append((threading.current_thread(), real_bytes(copy)))
            yield copy

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_module, "materialized_copy", counted)
        yield log


@settings(max_examples=8, deadline=None)
@given(share=st.sampled_from([0.0, 0.2, 0.5, 1.0]))
def test_a_meta_model_is_timed_with_no_more_weights_real_at_once_than_its_window(share):
    """Each run of units gets one real copy for all its repetitions, holding at most the
    window's bytes of weights, a weight tied between units of the run once (or one heavier
    unit's); every unit is timed, and the model stays on meta."""
    with torch.device("meta"):
        model = GPT(layers=2)  # its first and last units share the token embedding
    x = torch.randint(0, 128, (4, 12))
    graph, table = _unit_graph(model, x)
    tensors = profile_module._tensor_bytes([graph.get_submodule(f"stage{io.stage}").module
                                            for io in table.stages])
    window = share * real_bytes(model)
    with _copies_made() as copies:
        prof = profile_units(graph, table, [x], [4], warmup=1, repeats=3, window=window)
    runs = profile_module._runs(tensors, window)
    assert len(copies) == len(runs)  # one copy a run, for all its repetitions
    assert max(n for _, n in copies) <= max(window, max(sum(u.values()) for u in tensors))
    assert (prof.forward > 0).all() and all(p.is_meta for p in model.parameters())


def test_a_tied_weight_is_one_weight_in_the_copy_of_a_run():
    with torch.device("meta"):
        model = GPT(layers=1)
    graph, table = _unit_graph(model, torch.randint(0, 128, (4, 12)))
    with _copies_made() as copies:
        profile_units(graph, table, [torch.randint(0, 128, (4, 12))], [4], warmup=0,
                      repeats=1, window=float("inf"))
    assert [n for _, n in copies] == [real_bytes(model)]  # the tied embedding once


@pytest.mark.parametrize("devices, floor, share", [
    (["cpu", "cpu"], 0, 1.0),  # one device holds every stage
    (["cpu", "cpu:0"], 0, 0.5),  # each device half of them
    (["cpu", "cpu:0"], 2**40, None),  # below the floor, all of them at once anyway
])
def test_the_profile_pass_makes_real_at_once_its_devices_share_of_a_meta_model(
        monkeypatch, devices, floor, share):
    with torch.device("meta"):
        model = GPT(layers=2)
    x = torch.randint(0, 128, (4, 12))
    c = _traced(model, x, fxpipe.Plan(stages=2, micro_batches=2))
    c.devices = devices
    windows = []

    class Stop(Exception):
        """What the profile pass hands the profile is all this test needs."""

    def profiled(*args, window, **kwargs):
        windows.append(window)
        raise Stop

    monkeypatch.setattr(passes, "profile_units", profiled)
    monkeypatch.setattr(passes, "ALL_REAL_BELOW", floor)
    with pytest.raises(Stop):
        passes.profile(c)
    assert windows == [floor if share is None else share * real_bytes(model)]
