"""Models at the edges of what a pipeline must handle: inputs every micro-batch shares, values
that skip stages, in-place ops at a cut, forwards never backpropagated, autocast, non-tensor
outputs, mode-dependent graphs and reloaded weights."""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


class MaskedMixer(nn.Module):
    """Mixes tokens with a (T, T) mask that every sample shares."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x, mask):
        h = torch.tanh(self.a(x))  # (B, T, W)
        h = mask @ h  # the mask mixes the T positions of each sample
        return self.b(h)


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


def test_whole_input_reaches_every_micro_batch_even_when_its_size_equals_the_batch():
    model = MaskedMixer().double()
    reference = copy.deepcopy(model)
    batch = tokens = 4  # the mask's first dimension looks like the batch
    x = torch.randn(batch, tokens, 4, dtype=torch.float64)
    mask = torch.tril(torch.ones(tokens, tokens, dtype=torch.float64))
    plan = fxpipe.Plan(stages=2, micro_batches=2, costs="none", whole_inputs=["mask"])
    pipe = fxpipe.compile(model, plan, example_inputs=(x, mask))
    out = pipe(x, mask)
    torch.testing.assert_close(out, reference(x, mask))
    out.square().sum().backward()
    reference(x, mask).square().sum().backward()
    for got, want in zip(_grads(pipe), _grads(reference), strict=True):
        torch.testing.assert_close(got, want)


def test_a_shared_input_that_looks_batched_is_caught_at_compile_time():
    x = torch.randn(4, 4, 4)
    mask = torch.tril(torch.ones(4, 4))
    with pytest.raises(fxpipe.PlanError, match=r"x \(4, 4, 4\), mask \(4, 4\).*"
                                               r"Plan\(whole_inputs=\['mask'\]\)"):
        fxpipe.compile(MaskedMixer(), fxpipe.Plan(stages=2, micro_batches=2, costs="none"),
                       example_inputs=(x, mask))


def test_whole_inputs_that_forward_does_not_take():
    plan = fxpipe.Plan(stages=2, costs="none", whole_inputs=["attention_mask"])
    with pytest.raises(fxpipe.PlanError, match=r"names \['attention_mask'\], which "
                                               r"MaskedMixer.forward\(\) does not take; its "
                                               r"arguments are \['x', 'mask'\]"):
        fxpipe.compile(MaskedMixer(), plan, example_inputs=(torch.randn(4, 3, 4),
                                                            torch.ones(3, 3)))


class LateUse(nn.Module):
    """Its second input is used only by the last layer: it passes through the first stages."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x, late):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * late


def test_an_input_used_only_by_the_last_stage_gets_its_gradient():
    model = LateUse().double()
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    late = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, micro_batches=2, costs="none"),
                          example_inputs=(x.detach(), late.detach()))
    pipe(x, late).sum().backward()
    got = x.grad.clone(), late.grad.clone()
    x.grad = late.grad = None
    model(x, late).sum().backward()
    torch.testing.assert_close(got[0], x.grad)
    torch.testing.assert_close(got[1], late.grad)


def test_a_forward_that_is_never_backpropagated_is_released():
    model = LateUse()
    x = torch.randn(6, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, micro_batches=3, costs="none"),
                          example_inputs=(x, x))
    out = pipe(x, x)
    assert sum(pipe.executor.in_flight()) > 0
    del out
    gc.collect()
    assert sum(pipe.executor.in_flight()) == 0
    pipe(x, x).sum().backward()  # the pipeline keeps working
    assert sum(pipe.executor.in_flight()) == 0


def test_backward_through_a_pipelined_output_twice_says_it_runs_once():
    model = LateUse()
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, costs="none"),
                          example_inputs=(x, x))
    out = pipe(x, x).sum()
    out.backward(retain_graph=True)
    with pytest.raises(fxpipe.FxpipeError, match="backward runs once"):
        out.backward()


def test_an_in_place_op_right_after_a_cut_stays_with_its_producer():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4),
                          nn.ReLU(inplace=True), nn.Linear(4, 2)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, micro_batches=2, costs="none",
                                             tracer="fx"),
                          example_inputs=(x,))
    for unit in pipe.units:
        assert not unit.name.endswith(("1", "3")), "an in-place ReLU became its own unit"
    pipe(x).sum().backward()
    reference(x).sum().backward()
    for got, want in zip(_grads(pipe), _grads(reference), strict=True):
        torch.testing.assert_close(got, want)


def test_asynchronous_pipeline_runs_as_a_drop_in_module():
    model = LateUse()
    x = torch.randn(4, 4)
    plan = fxpipe.Plan(stages=2, micro_batches=2, schedule="async-1f1b", costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x, x))
    torch.testing.assert_close(pipe(x, x), model(x, x))


class WithExtras(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return {"logits": self.b(torch.tanh(self.a(x))), "scale": 2.0, "name": "head"}


def test_outputs_that_are_not_tensors_come_back_unchanged():
    model = WithExtras()
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, costs="none"),
                          example_inputs=(x,))
    out = pipe(x)
    assert out["scale"] == 2.0 and out["name"] == "head"
    torch.testing.assert_close(out["logits"], model(x)["logits"])


def test_autocast_reaches_every_stage():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, micro_batches=2, costs="none"),
                          example_inputs=(x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(x)
        want = model(x)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want)


class ModeDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if self.training:
            h = h * 0.5
        return self.b(h)


def test_an_fx_graph_that_read_self_training_runs_the_other_mode_traced_in_it():
    model = ModeDependent()
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, costs="none", tracer="fx"),
                          example_inputs=(x,))
    torch.testing.assert_close(pipe(x), model(x))
    pipe.eval()
    torch.testing.assert_close(pipe(x), model.eval()(x))
    torch.testing.assert_close(pipe.train()(x), model.train()(x))


def test_the_other_mode_of_a_graph_with_split_layers_is_refused_with_the_fix():
    plan = fxpipe.Plan(stages=2, costs="none", tracer="fx", partitioner=[1, 1],
                       intra_layer={"layers": ["b"], "shards": 2})
    pipe = fxpipe.compile(ModeDependent(), plan, example_inputs=(torch.randn(4, 4),))
    with pytest.raises(fxpipe.FxpipeError, match=r"reads self\.training.*with intra_layer, "
                                                 r"compile a second pipeline"):
        pipe.eval()


def test_export_of_a_batch_of_one_runs_any_micro_batch_size():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, costs="none",
                                             tracer="export"),
                          example_inputs=(torch.randn(1, 4),))
    x = torch.randn(5, 4)
    torch.testing.assert_close(pipe(x), model(x))


def test_load_state_dict_with_assign_trains_the_new_parameters():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, costs="none",
                                             loss_fn=F.mse_loss),
                          example_inputs=(x,))
    fresh = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    pipe.load_state_dict(fresh, assign=True)
    torch.testing.assert_close(pipe(x), torch.func.functional_call(model, fresh, (x,)))
    pipe.step(x, torch.randn(4, 2))
    assert all(p.grad is not None for p in pipe.parameters())
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}


def test_a_stuck_stage_in_one_process_stops_the_step_at_the_plans_timeout():
    """Stage 1 blocks in its forward: stage 0 waits for its gradient no longer than
    Plan(timeout=...), and the step raises, naming what was waited for, once the stuck stage
    returns (a thread cannot be stopped; here it returns when the wait has given up)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    release = threading.Event()
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, timeout=0.5,
                                             loss_fn=nn.MSELoss(), costs="none"),
                          example_inputs=(torch.randn(4, 4),))
    model[2].register_forward_pre_hook(lambda module, inputs: release.wait(60))
    transport, recv = pipe.executor.transport, pipe.executor.transport.recv

    def recv_then_release(*args):
        try:
            return recv(*args)
        except fxpipe.FxpipeError:
            release.set()
            raise
    transport.recv = recv_then_release
    with pytest.raises(fxpipe.FxpipeError, match=r"stage 0 waited 0.5 s for B micro-batch \d "
                                                 r"from stage 1: a stage is stuck"):
        pipe.step(torch.randn(4, 4), torch.randn(4, 2))
