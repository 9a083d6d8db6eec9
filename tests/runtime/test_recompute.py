"""Recomputation changes nothing but memory: outputs, gradients, buffers and dropout masks are
those of the plain model (float64, dropout on, the same seed), on every schedule it runs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

import fxpipe


class DropNet(nn.Module):
    """Dropout (in its first two units, which stage 0 holds) and a BatchNorm near the end."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.drop = nn.Dropout(0.3)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.drop(self.inp(x)))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(self.norm(h))


UNITS = 7  # inp, drop, layers.0-2, norm, out
SCHEDULES = {  # name: (stages, stages_per_device, micro-batch counts it runs)
    "gpipe": (None, 1, (1, 2, 3, 4)),
    "1f1b": (None, 1, (1, 2, 3, 4)),
    "interleaved-1f1b": (4, 2, (2, 4)),
    "looped-bfs": (4, 2, (1, 2, 4)),
    "zb-h1": (None, 1, (1, 2, 3, 4)),  # split backward: B, then W later
    "zbv": (4, 2, (1, 2, 4)),
    "dualpipev": (4, 2, (4,)),  # one micro-batch per stage at least, of 2 samples (BatchNorm)
}


@st.composite
def plans(draw):
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    stages, per_device, counts = SCHEDULES[schedule]
    stages = stages or draw(st.integers(1, 3))
    rest = draw(st.lists(st.integers(1, 2), min_size=stages - 1, max_size=stages - 1))
    sizes = [UNITS - sum(rest), *rest]  # stage 0 holds inp and drop
    recompute = draw(st.one_of(st.just(True), st.lists(
        st.booleans(), min_size=stages, max_size=stages).filter(any)))
    return fxpipe.Plan(stages=stages, stages_per_device=per_device, schedule=schedule,
                       partitioner=sizes, micro_batches=draw(st.sampled_from(counts)),
                       recompute=recompute, loss_fn=F.cross_entropy, costs="none")


@settings(max_examples=12, deadline=None)
@given(plan=plans(), path=st.sampled_from(["step", "drop-in"]), seed=st.integers(0, 2**16))
def test_recomputing_trains_like_the_plain_model(plan, path, seed):
    """The reference runs the plain model on each micro-batch in turn (GPipe's BatchNorm
    semantics), drawing the dropout masks in the order stage 0 does."""
    model = DropNet().double()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=gen)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    torch.manual_seed(seed)
    if path == "step":
        loss = pipe.step(x, y)
    else:
        output = pipe(x)
        loss = F.cross_entropy(output, y)
        loss.backward()
    torch.manual_seed(seed)
    chunks = list(zip(x.tensor_split(plan.micro_batches), y.tensor_split(plan.micro_batches)))
    outputs = [reference(xm) for xm, _ in chunks]
    expected = sum(F.cross_entropy(out, ym) * len(ym) / 8 for out, (_, ym) in zip(outputs, chunks))
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-10, atol=1e-12)
    if path == "drop-in":
        torch.testing.assert_close(output.detach(), torch.cat(outputs).detach())
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
    for (name, a), b in zip(pipe.state_dict().items(), reference.state_dict().values(),
                            strict=True):  # BatchNorm's running statistics updated once
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert all(n == 0 for n in pipe.executor.in_flight())


def _counting(module: nn.Module) -> list[int]:
    calls: list[int] = []  # on entry: a recompute stops once it has what backward needs
    module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_recomputing_stage_runs_its_forward_once_more_in_backward_and_not_without_grad(
        schedule):
    """Once per micro-batch, also where the backward is split in two (B and W, several
    autograd calls); a stage that does not recompute runs its forward once."""
    model = DropNet().double()
    counts = [_counting(module) for module in (model.inp, model.layers[1], model.layers[2])]
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    plan = fxpipe.Plan(stages=3, partitioner=[3, 1, 3], micro_batches=4, schedule=schedule,
                       recompute=[True, True, False], loss_fn=F.cross_entropy, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    for calls in counts:
        calls.clear()
    pipe.step(x, y)
    assert [len(calls) for calls in counts] == [8, 8, 4]  # forward, and recompute
    for calls in counts:
        calls.clear()
    with torch.no_grad():
        pipe(x)
    assert [len(calls) for calls in counts] == [4, 4, 4]  # nothing to recompute for
    assert "0 rc" in repr(pipe) and "1 rc" in repr(pipe) and "2 rc" not in repr(pipe)


class PassThrough(nn.Module):
    """Returns a value of stage 0 beside the logits: the loss reaches the last stage's input
    directly, not only through the stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(torch.tanh(self.b(h))), h


def _both_outputs_loss(output, target):
    return F.cross_entropy(output[0], target) + output[1].square().mean()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_loss_on_a_value_passed_through_the_last_stage_backpropagates_once(schedule):
    model = PassThrough().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    plan = fxpipe.Plan(stages=2, micro_batches=2, schedule=schedule, recompute=True,
                       loss_fn=_both_outputs_loss, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    loss = pipe.step(x, y)
    expected = sum(_both_outputs_loss(reference(xm), ym) / 2
                   for xm, ym in zip(x.chunk(2), y.chunk(2)))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_async_pipelines_recompute_with_the_weights_their_forward_used():
    """stash and 2bw keep each micro-batch's weight version: the recompute sees it again, so
    training equals the same pipeline without recomputation, step after step."""
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 5, generator=gen, dtype=torch.float64),
             torch.randint(0, 3, (8,), generator=gen)) for _ in range(3)]
    for policy in ("stash", "2bw"):
        results = []
        for recompute in (False, True):
            model = DropNet().double()
            torch.manual_seed(0)
            model.load_state_dict(DropNet().double().state_dict())
            plan = fxpipe.Plan(stages=3, partitioner=[3, 2, 2], micro_batches=2,
                               schedule="async-1f1b", consistency=policy, recompute=recompute,
                               loss_fn=F.cross_entropy, costs="none")
            pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
            pipe.attach_optimizer(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
            torch.manual_seed(7)
            losses = [loss.item() for loss in pipe.step_many(data)]
            results.append((losses, pipe.state_dict()))
        (losses, state), (again, state_again) = results
        assert again == losses, policy
        for key, value in state.items():
            torch.testing.assert_close(state_again[key], value, rtol=1e-12, atol=0, msg=key)


def test_stages_on_several_threads_recompute_the_dropout_masks_their_forward_drew():
    """One process, every stage with dropout, each on its own worker thread sharing the CPU's
    random generator: each recompute draws the masks of its own forward, whatever the other
    threads draw meanwhile (a mask is keyed by the dropout's input, which the forward and its
    recompute share)."""
    width = 64
    model = nn.Sequential(*(m for _ in range(4) for m in (
        nn.Linear(width, width), nn.Dropout(0.5), nn.Tanh()))).double()
    masks: dict[tuple[int, bytes], list[torch.Tensor]] = {}

    def record(module, inputs, output):
        key = (id(module), inputs[0].detach().numpy().tobytes())
        masks.setdefault(key, []).append(output.detach() == 0)

    for layer in model:
        if isinstance(layer, nn.Dropout):
            layer.register_forward_hook(record)
    batches = torch.randn(3, 32, width, dtype=torch.float64)
    plan = fxpipe.Plan(stages=4, micro_batches=8, schedule="1f1b", recompute=True,
                       loss_fn=lambda out, target: out.square().mean(), costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(batches[0],))
    masks.clear()
    with set_checkpoint_early_stop(False):  # each recompute runs to its dropout's hook
        for x in batches:
            pipe.step(x, x)
    assert len(masks) == 3 * 8 * 4
    for drawn in masks.values():
        assert len(drawn) == 2 and torch.equal(drawn[0], drawn[1])


def test_a_recomputing_stage_recomputes_its_segments_one_at_a_time_last_first():
    """Three blocks wide inside (one segment each, tests/test_unit_chain.py): the backward
    runs each block's forward again just before its backward, so the last block first."""
    model = nn.Sequential(*(m for _ in range(3) for m in (
        nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8))), nn.Linear(8, 3)).double()
    order: list[int] = []
    for block in range(3):
        model[3 * block].register_forward_pre_hook(lambda *_, b=block: order.append(b))
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 3, (16,))
    plan = fxpipe.Plan(stages=2, partitioner=[9, 1], micro_batches=1, recompute=[True, False],
                       loss_fn=F.cross_entropy, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    order.clear()
    pipe.step(x, y)
    assert order == [0, 1, 2, 2, 1, 0]
