"""Tracing frontends: fx, export, auto fallback and the user's own tracer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.models import GPT, MLP


class ShapeBranch(nn.Module):
    """Branches on a shape: fx cannot trace it, torch.export specialises it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        if x.shape[0] > 1:
            x = x * 2
        return self.b(x)


def test_auto_falls_back_to_export_and_records_it():
    model = ShapeBranch()
    x = torch.randn(3, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2), example_inputs=(x,))
    assert pipe.frontend == "export"
    torch.testing.assert_close(pipe(x), model(x))
    assert "traced with export" in repr(pipe)


def test_auto_prefers_fx():
    pipe = fxpipe.compile(MLP(), fxpipe.Plan(stages=2), example_inputs=(torch.randn(2, 32),))
    assert pipe.frontend == "fx"


def test_custom_tracer_callable():
    calls = []

    def my_tracer(model, inputs):
        calls.append(tuple(x.shape for x in inputs))
        return torch.fx.symbolic_trace(model)

    model = MLP()
    x = torch.randn(2, 32)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, tracer=my_tracer), example_inputs=(x,))
    assert pipe.frontend == "custom" and calls == [(torch.Size([2, 32]),)]
    torch.testing.assert_close(pipe(x), model(x))


def test_custom_tracer_returning_the_wrong_type():
    plan = fxpipe.Plan(stages=2, tracer=lambda model, inputs: model)
    with pytest.raises(fxpipe.FxpipeTraceError, match=r"returned MLP; a tracer callable must "
                                                      r"return a torch.fx.GraphModule"):
        fxpipe.compile(MLP(), plan, example_inputs=(torch.randn(2, 32),))


def test_concrete_args_fix_a_flag():
    class Flagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, double=False):
            y = self.fc(x)
            return y * 2 if double else y

    model = Flagged()
    x = torch.randn(2, 4)
    plan = fxpipe.Plan(stages=1, tracer="fx", concrete_args={"double": True})
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    torch.testing.assert_close(pipe(x), model(x, double=True))  # the traced value applies
    torch.testing.assert_close(pipe(x, double=True), model(x, double=True))


def test_unknown_leaf_module_name():
    plan = fxpipe.Plan(stages=2, leaf_modules=["blocks.9"])
    with pytest.raises(fxpipe.FxpipeTraceError, match=r"names \['blocks.9'\], which match no "
                                                      r"submodule of GPT"):
        fxpipe.compile(GPT(), plan, example_inputs=(torch.randint(0, 128, (2, 8)),))


def test_keyword_inputs():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x, y):
            return self.b(self.a(x) + y)

    model = Pair()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    for tracer in ("fx", "export"):
        pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, tracer=tracer), example_inputs=(x,),
                              example_kwargs={"y": y})
        torch.testing.assert_close(pipe(x, y=y), model(x, y=y))
