"""The local runtime trains exactly like the plain model: every schedule, micro-batch count and
optimizer, through the drop-in forward/backward and through step()."""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.models import GPT, ResNet
from fxpipe.runtime.stage import StageRunner


class Net(nn.Module):
    """Linear layers with a skip connection over the middle of the network."""

    def __init__(self, width: int = 6, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        skip = h
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h + skip)


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _reference_steps(model, batches, optimizer_kind):
    optimizer = _optimizer(optimizer_kind, model.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


@settings(max_examples=20)
@given(stages=st.integers(1, 4), micro_batches=st.integers(1, 4), batch=st.integers(4, 7),
       schedule=st.sampled_from(["gpipe", "1f1b"]), optimizer=st.sampled_from(["sgd", "adam"]),
       path=st.sampled_from(["step", "drop-in"]))
def test_training_matches_the_plain_model(stages, micro_batches, batch, schedule, optimizer,
                                          path):
    model = Net().double()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(batch, 5, generator=gen, dtype=torch.float64),
                torch.randint(0, 3, (batch,), generator=gen)) for _ in range(3)]
    plan = fxpipe.Plan(stages=stages, micro_batches=micro_batches, schedule=schedule,
                       devices=["cpu"] * stages, loss_fn=F.cross_entropy, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(batches[0][0],))
    opt = _optimizer(optimizer, pipe.parameters())
    for x, y in batches:
        opt.zero_grad()
        if path == "step":
            loss = pipe.step(x, y)
        else:
            loss = F.cross_entropy(pipe(x), y)
            loss.backward()
        opt.step()
    _reference_steps(reference, batches, optimizer)
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=name)
    assert all(n == 0 for n in pipe.executor.in_flight())  # nothing left behind


def test_step_returns_the_mini_batch_mean_loss_with_uneven_micro_batches():
    model = Net().double()
    x = torch.randn(7, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (7,))
    plan = fxpipe.Plan(stages=3, micro_batches=3, loss_fn=F.cross_entropy, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    torch.testing.assert_close(pipe.step(x, y), F.cross_entropy(model(x), y))


_LOSSES = {  # per-sample means and sums, as pipe.step must combine them
    "mse mean": (nn.MSELoss(), "float"),
    "mse sum": (nn.MSELoss(reduction="sum"), "float"),
    "cross-entropy mean": (F.cross_entropy, "class"),
    "cross-entropy sum": (lambda out, t: F.cross_entropy(out, t, reduction="sum"), "class"),
    "sum of per-sample means": (lambda out, t: (out - t).square().mean(1).sum(), "float"),
}


@settings(max_examples=16)
@given(loss=st.sampled_from(sorted(_LOSSES)), stages=st.integers(1, 3),
       micro_batches=st.integers(1, 4), batch=st.integers(4, 7),
       schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_step_gives_the_plain_loss_and_gradients_for_mean_and_sum_losses(
        loss, stages, micro_batches, batch, schedule):
    """Micro-batches of any sizes (uneven, and of one sample): a mean loss counts with its
    share of the samples, a sum as it is, so pipe.step equals the loss on the whole batch."""
    loss_fn, kind = _LOSSES[loss]
    model = Net().double()
    reference = copy.deepcopy(model)
    x = torch.randn(batch, 5, dtype=torch.float64)
    y = (torch.randn(batch, 3, dtype=torch.float64) if kind == "float"
         else torch.randint(0, 3, (batch,)))
    plan = fxpipe.Plan(stages=stages, micro_batches=micro_batches, schedule=schedule,
                       loss_fn=loss_fn, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    value = pipe.step(x, y)
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(value, expected.detach(), rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def _token_loss(out, t):
    return F.cross_entropy(out.flatten(0, 1), t.flatten())  # a mean over the counted tokens


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.hidden, self.head = nn.Embedding(7, 6), nn.Linear(6, 6), nn.Linear(6, 7)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(self.embed(x))))


@settings(max_examples=12)
@given(micro_batches=st.integers(2, 4), data=st.data())
def test_a_token_mean_with_ignored_entries_counts_by_counted_tokens(micro_batches, data):
    """cross_entropy's mean over the targets other than ignore_index (-100, padding): each
    micro-batch counts with its share of the counted tokens on every step, also when the
    first step, which finds the reduction, had no padding at all, and one of nothing but."""
    model = _Tokens().double()
    reference = copy.deepcopy(model)
    x = torch.randint(0, 7, (6, 5))
    plan = fxpipe.Plan(stages=2, micro_batches=micro_batches, loss_fn=_token_loss,
                       costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    drawn = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))  # replayable
    for padded in (0, data.draw(st.integers(1, 29)), "first micro-batch"):
        y = torch.randint(0, 7, (6, 5), generator=drawn)
        if padded == "first micro-batch":  # nothing counted there: its mean is nan
            y[:-(-6 // micro_batches)] = -100
        else:
            y.view(-1)[torch.randperm(30, generator=drawn)[:padded]] = -100
        model.zero_grad()
        reference.zero_grad()
        value = pipe.step(x, y)
        expected = _token_loss(reference(x), y)
        expected.backward()
        torch.testing.assert_close(value, expected.detach(), rtol=1e-12, atol=1e-12)
        for p, q in zip(pipe.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


def test_a_loss_whose_reduction_changes_is_checked_again():
    model = Net().double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    loss_fn = nn.MSELoss()
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, loss_fn=loss_fn,
                                             costs="none"), example_inputs=(x,))
    pipe.step(x, y)
    loss_fn.reduction = "sum"
    torch.testing.assert_close(pipe.step(x, y), loss_fn(model(x), y).detach(), rtol=1e-12,
                               atol=1e-12)


def test_any_loss_counts_as_it_is_on_a_whole_batch():
    """One micro-batch: nothing to combine, so a loss that is neither a mean nor a sum over
    samples is fine."""
    model = Net().double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)

    def worst(out, t):
        return (out - t).square().sum(1).max()

    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=1, loss_fn=worst,
                                             costs="none"),
                          example_inputs=(x,))
    torch.testing.assert_close(pipe.step(x, y), worst(model(x), y))


def test_tied_gpt_trains_like_the_plain_model():
    model = GPT(layers=2).double()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 128, (4, 16))
    target = torch.randint(0, 128, (4, 16))

    def loss_fn(logits, t):
        return F.cross_entropy(logits.flatten(0, 1), t.flatten())

    plan = fxpipe.Plan(stages=3, micro_batches=2, schedule="1f1b", loss_fn=loss_fn,
                       costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(idx,))
    pipe.step(idx, target)
    loss_fn(reference(idx), target).backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_batchnorm_uses_per_micro_batch_statistics():
    """GPipe's semantics: each micro-batch normalises with its own statistics and updates the
    running statistics once, in micro-batch order; the reference runs the plain model on each
    micro-batch in turn."""
    model = ResNet(widths=(4, 8), blocks=1).double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 3, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 10, (6,))
    plan = fxpipe.Plan(stages=2, micro_batches=3, loss_fn=F.cross_entropy, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    loss = pipe.step(x, y)
    expected = sum(F.cross_entropy(reference(xm), ym) * len(xm) / 6
                   for xm, ym in zip(x.chunk(3), y.chunk(3)))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, a), b in zip(pipe.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("schedule, bound", [("gpipe", lambda n, s, p: p),
                                             ("1f1b", lambda n, s, p: min(n - s, p)),
                                             ("zb-h1", lambda n, s, p: min(n, p))])
def test_in_flight_activations_meet_the_schedule_bound(schedule, bound):
    n, p = 4, 6
    model = Net(depth=6).double()
    x = torch.randn(12, 5, dtype=torch.float64)
    plan = fxpipe.Plan(stages=n, micro_batches=p, schedule=schedule, loss_fn=F.cross_entropy,
                       costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    pipe.step(x, torch.randint(0, 3, (12,)))
    peaks = [runner.peak_in_flight for runner in pipe.executor.runners.values()]
    assert peaks == [bound(n, s, p) for s in range(n)]


def outputs_alive_after_backward(monkeypatch) -> list[tuple[int, int, int]]:
    """Record, as a step runs, (stage, micro-batch, how many of its stage outputs are still
    alive) right after each micro-batch's backward (its weight gradient, where split off):
    nothing should keep them, and so the graph they hold, once it has run."""
    made: dict[tuple[int, int], list[weakref.ref]] = {}
    alive: list[tuple[int, int, int]] = []
    forward, backward = StageRunner.forward, StageRunner.backward
    weight_backward = StageRunner.weight_backward

    def recording(self, key, values, split=False):
        out = forward(self, key, values, split)
        made[self.index, key.mb] = [weakref.ref(out[name]) for name in self.io.outputs
                                    if isinstance(out[name], torch.Tensor)]
        return out

    def check(self, key):
        if key not in self._awaiting_weights:  # its graph is done with
            gc.collect()
            alive.append((self.index, key.mb,
                          sum(ref() is not None for ref in made[self.index, key.mb])))

    def checked_backward(self, key, *args, **kwargs):
        result = backward(self, key, *args, **kwargs)
        check(self, key)
        return result

    def checked_weight_backward(self, key, *args, **kwargs):
        weight_backward(self, key, *args, **kwargs)
        check(self, key)

    monkeypatch.setattr(StageRunner, "forward", recording)
    monkeypatch.setattr(StageRunner, "backward", checked_backward)
    monkeypatch.setattr(StageRunner, "weight_backward", checked_weight_backward)
    return alive


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_micro_batch_graph_is_freed_once_its_backward_ran(schedule, monkeypatch):
    n, p = 3, 4
    model = Net(depth=2).double()
    x = torch.randn(8, 5, dtype=torch.float64)
    plan = fxpipe.Plan(stages=n, micro_batches=p, schedule=schedule, loss_fn=F.cross_entropy,
                       costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    alive = outputs_alive_after_backward(monkeypatch)
    pipe.step(x, torch.randint(0, 3, (8,)))
    assert sorted((s, mb) for s, mb, _ in alive) == [(s, mb) for s in range(n) for mb in range(p)]
    assert [entry for entry in alive if entry[2]] == []


def test_backward_runs_in_schedule_order_across_stages():
    """Log each stage's backward as it finishes (torchgpipe's test): a stage finishes the
    backward of its k-th micro-batch only after the next stage finished its k-th."""
    import threading

    n, p = 3, 4
    model = Net(depth=4).double()
    x = torch.randn(8, 5, dtype=torch.float64)
    plan = fxpipe.Plan(stages=n, micro_batches=p, schedule="1f1b", loss_fn=F.cross_entropy,
                       costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    log, lock = [], threading.Lock()

    def record(stage):
        with lock:
            log.append(stage)

    for s in range(n):
        pipe.register_stage_hook(s, record)
    pipe.step(x, torch.randint(0, 3, (8,)))
    assert sorted(log) == sorted(list(range(n)) * p)
    for s in range(n - 1):
        mine = [i for i, stage in enumerate(log) if stage == s]
        theirs = [i for i, stage in enumerate(log) if stage == s + 1]
        assert all(a > b for a, b in zip(mine, theirs)), log
    order = {s: [str(e.action) for e in pipe.last_trace() if e.stage == s
                 and e.action.kind.name == "B"] for s in range(n)}
    expected = {s: [str(a) for a in pipe.executor.schedule.actions[s] if a.kind.name == "B"]
                for s in range(n)}
    assert order == expected


@pytest.mark.parametrize("costs", ["none", "measure"])
def test_inputs_of_every_shape_are_micro_batched(costs):
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, pair, scale, extra):
            x, y = pair
            return self.b(self.a(x) * scale + y + extra["bias"])

    model = Mixed().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    bias = torch.randn(4, dtype=torch.float64)  # not batched: every micro-batch gets it
    args = ((x, y), 2.0, {"bias": bias})
    plan = fxpipe.Plan(stages=2, micro_batches=2, tracer="fx", costs=costs)
    pipe = fxpipe.compile(model, plan, example_inputs=args, cache=False)
    torch.testing.assert_close(pipe(*args), model(*args))


def test_input_gradients_flow_back_through_the_pipeline():
    model = Net().double()
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, micro_batches=3, costs="none"),
                          example_inputs=(x.detach(),))
    pipe(x).square().sum().backward()
    model(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_eval_and_no_grad_run_a_forward_only():
    model = Net().double()
    x = torch.randn(6, 5, dtype=torch.float64)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=3, costs="none"),
                          example_inputs=(x,))
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, model(x))
    assert pipe.executor.in_flight() == [0, 0]
    kinds = {e.action.kind.name for e in pipe.last_trace()}
    assert kinds <= {"F", "SEND_F", "RECV_F"}


def test_step_without_loss_fn():
    pipe = fxpipe.compile(Net(), fxpipe.Plan(stages=2, costs="none"),
                          example_inputs=(torch.randn(4, 5),))
    with pytest.raises(fxpipe.FxpipeError, match=r"needs Plan\(loss_fn=\.\.\.\)"):
        pipe.step(torch.randn(4, 5), torch.zeros(4, dtype=torch.long))


def test_more_micro_batches_than_samples():
    pipe = fxpipe.compile(Net(), fxpipe.Plan(stages=2, micro_batches=4, costs="none"),
                          example_inputs=(torch.randn(8, 5),))
    with pytest.raises(fxpipe.FxpipeError, match=r"cannot split a batch of 3 samples into 4 "
                                                  r"micro-batches"):
        pipe(torch.randn(3, 5))


def test_output_that_is_not_per_sample_cannot_be_micro_batched():
    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)).mean(0)  # one row for the batch: not joinable

    with pytest.raises(fxpipe.PlanError, match=r"output #0 \(shape \[4\]\) has no row per "
                                              r"sample.*cannot be joined: return a row per "
                                              r"sample, or one number"):
        fxpipe.compile(Pooled(), fxpipe.Plan(stages=2, micro_batches=2, costs="none"),
                       example_inputs=(torch.randn(6, 4),))


def test_a_failing_stage_stops_the_pipeline_with_its_error():
    class Fails(nn.Module):
        def forward(self, x):
            if x.shape[0] == 1:  # the last, smaller micro-batch
                raise ValueError("boom on a micro-batch of one")
            return x

    model = nn.Sequential(nn.Linear(4, 4), Fails(), nn.Linear(4, 4))
    plan = fxpipe.Plan(stages=3, micro_batches=3, tracer="fx", leaf_modules=[Fails],
                       loss_fn=F.mse_loss, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(torch.randn(6, 4),))
    with pytest.raises(RuntimeError, match="stage 1 failed: ValueError: boom on a micro-batch"):
        pipe.step(torch.randn(5, 4), torch.randn(5, 4))
    pipe.step(torch.randn(6, 4), torch.randn(6, 4))  # the pipeline still works afterwards


def test_a_stage_stuck_in_its_own_code_fails_the_step_and_the_pipeline_says_so_after():
    """Stage 1's forward does not return (it waits on an event the test sets at the end):
    stage 2 gives up on its message at Plan(timeout=1), stage 1 gets as long again, then the
    step fails naming it; the pipeline refuses to run again (its worker is still inside)."""
    stick, release = threading.Event(), threading.Event()

    class Stuck(nn.Module):
        def forward(self, x):
            if stick.is_set():  # once compiled: a forward that does not return
                release.wait(60)
            return x

    model = nn.Sequential(nn.Linear(4, 4), Stuck(), nn.Linear(4, 4))
    plan = fxpipe.Plan(stages=3, micro_batches=2, tracer="fx", leaf_modules=[Stuck],
                       loss_fn=F.mse_loss, costs="none", timeout=1)
    pipe = fxpipe.compile(model, plan, example_inputs=(torch.randn(4, 4),))
    stick.set()
    try:
        with pytest.raises(fxpipe.FxpipeError, match=r"stage\(s\) \[1\] did not stop after the "
                           r"step failed .* stuck in the stage's own code .*compile the model "
                           r"again.*exits only once that code returns"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 4))
        with pytest.raises(fxpipe.FxpipeError, match=r"the worker of stage\(s\) \[1\] is still "
                           r"running that stage's own code .* cannot run again"):
            pipe(torch.randn(4, 4))
    finally:
        release.set()


def test_an_output_made_by_an_early_stage_gets_its_gradient_back():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.c = nn.Linear(4, 2)

        def forward(self, x):
            early = self.a(x)
            return self.c(torch.relu(self.b(early))), early  # `early` leaves from stage 0

    model = TwoHeads().double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.float64)

    def loss_fn(out, target):
        return F.mse_loss(out[0], target) + out[1].square().mean()

    plan = fxpipe.Plan(stages=3, micro_batches=2, loss_fn=loss_fn, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    assert any(e.src == 0 and e.dst == 2 for e in pipe.comm.edges)
    target = torch.randn(6, 2, dtype=torch.float64)
    pipe.step(x, target)
    loss_fn(reference(x), target).backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    for p in pipe.parameters():
        p.grad = None
    out, early = pipe(x)
    loss_fn((out, early), target).backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
