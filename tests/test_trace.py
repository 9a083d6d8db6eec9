"""Tracing frontends: fx, export, auto fallback and the user's own tracer."""

from __future__ import annotations

import copy
import dataclasses

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


class Switched(nn.Module):
    """A flag that steers control flow (torch.export fixes it at its example value) and a
    factor."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x, flag=False, scale=1.0):
        y = self.a(x)
        if flag:
            y = y * 2
        return self.b(y * scale)


def _left_out_scale(model, inputs):
    """A tracer that leaves `scale` out of the graph (as transformers' tracer does with the
    arguments it is not given): traced at 1.0, its placeholder and check dropped."""
    gm = torch.fx.symbolic_trace(model, concrete_args={"flag": False, "scale": 1.0})
    for node in reversed(gm.graph.nodes):
        if not node.users and node.op in ("placeholder", "call_function") and node.name != "x":
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _flag_fixed(model, inputs):
    """A tracer of the user's own that fixes `flag` with fx's concrete_args."""
    return torch.fx.symbolic_trace(model, concrete_args={"flag": True})


_EXPORT = fxpipe.Plan(stages=2, micro_batches=2, tracer="export", costs="none")


@pytest.mark.parametrize("plan, example, args, kwargs, message", [
    (_EXPORT, {}, (), {"flag": True}, r"argument 'flag' True, but the pipeline's graph holds it "
     r"at False: torch.export fixed it at its value in compile's example; for another value, "
     r"compile another pipeline with it in the example \(example_kwargs=\{'flag': ...\}\)"),
    (_EXPORT, {}, (True,), {}, r"argument 'flag' True, but the pipeline's graph holds it at "
     "False"),
    (_EXPORT, {}, (False, 2.0), {}, r"argument 'scale' 2.0, but the pipeline's graph holds it "
     "at 1.0"),
    (_EXPORT, {"flag": True}, (), {}, r"argument 'flag' False \(its default\), but the "
     "pipeline's graph holds it at True"),
    (_EXPORT, {"flag": True}, (), {"flag": False}, r"argument 'flag' False, but"),
    (fxpipe.Plan(stages=2, tracer="fx", concrete_args={"flag": True}, costs="none"), {}, (),
     {"flag": False}, r"argument 'flag' False, but the pipeline's graph holds it at True: "
     r"Plan\(concrete_args=...\) fixed it at True; compile another pipeline with "
     r"concrete_args=\{'flag': ...\} for that value"),
    (fxpipe.Plan(stages=2, tracer=_flag_fixed, costs="none"), {}, (), {"flag": False},
     r"argument 'flag' False, but the pipeline's graph holds it at True: your tracer's "
     r"concrete_args fixed it at True"),
    (fxpipe.Plan(stages=2, tracer=_left_out_scale, costs="none"), {}, (), {"scale": 3.0},
     r"argument 'scale' 3.0, but the pipeline's graph holds it at 1.0: the tracer left it out "
     r"of the graph; trace it as an input, or call with scale=1.0"),
])
def test_a_call_the_graph_would_ignore_part_of_is_refused(plan, example, args, kwargs,
                                                          message):
    """An argument the graph holds at one value is refused at another, naming it, before
    any work; the value it holds, given or left to its default, runs like the model."""
    model, x = Switched(), torch.randn(4, 4)
    pipe = fxpipe.compile(model, dataclasses.replace(plan, loss_fn=nn.MSELoss()),
                          example_inputs=(x,), example_kwargs=example)
    with pytest.raises(fxpipe.FxpipeError, match=message):
        pipe(x, *args, **kwargs)
    with pytest.raises(fxpipe.FxpipeError, match=message):
        pipe.step(x, *args, torch.zeros(4, 2), **kwargs)
    held = {**example, **pipe.traced.bind.concrete}
    torch.testing.assert_close(pipe(x, **held), model(x, **held))
    torch.testing.assert_close(pipe(x, *[held.get("flag", False)], **{
        k: v for k, v in held.items() if k != "flag"}), model(x, **held))


def test_an_argument_traced_as_an_input_takes_any_value():
    model, x = Switched(), torch.randn(4, 4)
    plan = fxpipe.Plan(stages=2, micro_batches=2, tracer="fx",
                       concrete_args={"flag": False}, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    for scale in (1.0, 2.0, -0.5):
        torch.testing.assert_close(pipe(x, scale=scale), model(x, scale=scale))
        torch.testing.assert_close(pipe(x, False, scale), model(x, scale=scale))


class Keywords(nn.Module):
    """A forward taking some of its tensors through **kwargs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, **kwargs):
        y = self.a(x)
        if "bias" in kwargs:  # fx cannot trace this; torch.export can
            y = y + kwargs["bias"]
        return self.b(y)


def test_a_tensor_passed_through_kwargs_is_split_into_micro_batches_like_the_others():
    model = Keywords().double()
    reference = copy.deepcopy(model)
    x, bias = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=3, costs="none"),
                          example_inputs=(x,), example_kwargs={"bias": bias})
    assert pipe.frontend == "export" and "forward" not in vars(model)  # as it was
    torch.testing.assert_close(pipe(x, bias=bias), reference(x, bias=bias))
    pipe(x, bias=bias).square().sum().backward()
    reference(x, bias=bias).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(fxpipe.FxpipeError, match="bias"):
        pipe(x)  # the graph adds a bias: a call without one is refused
