"""Torch's layer stacks are cut into their layers, and pipelined they compute what they did."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe import stacks


class RNNNet(nn.Module):
    """An RNN whose forward reads its attributes and uses h_n (and c_n), then a head."""

    def __init__(self, kind: type[nn.RNNBase], layers: int, **options) -> None:
        super().__init__()
        self.rnn = kind(6, 8, num_layers=layers, batch_first=True, **options)
        directions = 2 if options.get("bidirectional") else 1
        self.head = nn.Linear(directions * (options.get("proj_size") or 8), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, state = self.rnn(x)
        lstm = isinstance(self.rnn, nn.LSTM)
        h = state[0] if lstm else state
        last = h[-self.rnn.num_layers:].sum(0)  # per sample
        out = self.head(y[:, -1]) + last[:, :3]
        return out + state[1].sum(0)[:, :3] if lstm else out


class EncoderNet(nn.Module):
    def __init__(self, layers: int, whole: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        if whole:  # nn.Transformer: kept whole, but holds an encoder that would be opened
            self.body = nn.Transformer(8, 2, layers, layers, 16, dropout=0.0, batch_first=True)
        else:
            layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.body = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(8),
                                              enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.body(h, h) if isinstance(self.body, nn.Transformer) else self.body(h)
        return self.head(h[:, -1])


def _units(model, x, **plan):
    return [u.name for u in fxpipe.units_of(model, (x,), fxpipe.Plan(stages=1, **plan))]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_stacks_are_cut_into_their_layers(frontend):
    x = torch.randn(2, 5, 6)
    assert _units(RNNNet(nn.LSTM, 3), x, tracer=frontend) == [
        "rnn.layers.0", "rnn.layers.1", "rnn.layers.2", "head"]
    assert _units(EncoderNet(3), x, tracer=frontend) == [
        "embed", "body.layers.0", "body.layers.1", "body.layers.2", "body.norm", "head"]


@pytest.mark.parametrize("leaf", [nn.LSTM, "rnn", "LSTM"])
def test_a_stack_named_a_leaf_module_stays_whole(leaf):
    assert _units(RNNNet(nn.LSTM, 3), torch.randn(2, 5, 6), leaf_modules=[leaf]) == ["rnn", "head"]


def test_modules_called_whole_keep_what_they_hold_as_it_is():
    hooked = RNNNet(nn.LSTM, 3)
    hooked.rnn.register_forward_hook(lambda module, args, out: None)
    x = torch.randn(2, 5, 6)
    for model in (hooked, EncoderNet(2, whole=True)):
        pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, costs="none"), example_inputs=(x,))
        assert [u.name for u in pipe.units] == [*["embed"] * (model is not hooked),
                                                 list(model.named_children())[-2][0], "head"]
        stand_ins = {v for v in vars(stacks).values() if isinstance(v, type)}
        assert stand_ins.isdisjoint(type(m) for m in pipe.graph.modules())
        torch.testing.assert_close(pipe(x), model(x))


def _check_pipelined(model: nn.Module, stages: int, frontend: str = "fx") -> None:
    """Outputs, gradients and state dict of the pipeline are the plain model's (float64)."""
    model = model.double()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=stages, micro_batches=2, costs="none",
                                             tracer=frontend), example_inputs=(x,))
    out, expected = pipe(x), plain(x)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, param), twin in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(param.grad, twin.grad, msg=name)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    names = dict(model.named_parameters())
    for stage in pipe.stages:  # the stages hold the model's Parameters under its names
        assert all(names[n] is p for n, p in stage.module.named_parameters())
    plain.load_state_dict(pipe.state_dict())


@settings(max_examples=6)
@given(kind=st.sampled_from([nn.LSTM, nn.GRU, nn.RNN]), layers=st.integers(3, 4),
       stages=st.sampled_from([2, 4]), bidirectional=st.booleans(), bias=st.booleans(),
       proj=st.booleans(), frontend=st.sampled_from(["fx", "export"]))
def test_pipelined_rnns_compute_what_the_plain_model_does(kind, layers, stages, bidirectional,
                                                         bias, proj, frontend):
    options = {"bidirectional": bidirectional, "bias": bias}
    if kind is nn.LSTM and proj:
        options["proj_size"] = 4
    _check_pipelined(RNNNet(kind, layers, **options), stages, frontend)


@pytest.mark.parametrize("stages", [2, 4])
def test_pipelined_transformer_encoders_compute_what_the_plain_model_does(stages):
    _check_pipelined(EncoderNet(3), stages)


def test_rnn_dropout_follows_the_rnn_mode_at_run_time():
    model = RNNNet(nn.LSTM, 3, dropout=1.0).double()  # p=1: deterministic, and visible
    plain = copy.deepcopy(model)
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, costs="none"), example_inputs=(x,))
    assert not pipe.traced.mode_fixed
    for mode in (True, False, True):
        pipe.train(mode)
        plain.train(mode)
        torch.testing.assert_close(pipe(x), plain(x))
    assert not torch.allclose(pipe.eval()(x), pipe.train()(x))


def test_rnn_given_its_initial_state():
    class WithState(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(6, 8, num_layers=3, batch_first=True)

        def forward(self, x, h0):
            y, (h, c) = self.rnn(x, (h0.transpose(0, 1), 2 * h0.transpose(0, 1)))
            return y[:, -1] + h[-1] + c[0]

    model = WithState().double()
    x, h0 = torch.randn(4, 5, 6).double(), torch.randn(4, 3, 8).double()
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, costs="none"), example_inputs=(x, h0))
    torch.testing.assert_close(pipe(x, h0), model(x, h0))
