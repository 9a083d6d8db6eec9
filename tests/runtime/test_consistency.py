"""Asynchronous 1F1B: weight consistency policies and PipeOptim's weight prediction."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.peak_memory import peak_rise
from fxpipe.runtime.consistency import PredictPolicy, StashPolicy, make_policy, predicted_update
from fxpipe.runtime.stage import StageRunner
from fxpipe.runtime.transport import MicroBatchKey
from fxpipe.schedules import Action, ActionKind, build, chain, lower


def _optimizer_after_steps(kind, steps, grad, **options):
    """A one-parameter optimizer stepped `steps` times with a constant gradient."""
    param = nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    optimizer = kind([param], **options)
    for _ in range(steps):
        param.grad = grad.clone()
        optimizer.step()
    return param, optimizer


@given(s=st.integers(1, 5), lr=st.floats(0.001, 0.5), warm=st.integers(1, 4))
def test_plain_sgd_prediction_equals_the_weights_s_steps_later(s, lr, warm):
    grad = torch.tensor([0.3, -0.1, 0.7], dtype=torch.float64)
    param, optimizer = _optimizer_after_steps(torch.optim.SGD, warm, grad, lr=lr)
    predicted = param.detach() - lr * s * predicted_update(optimizer, param, grad)
    for _ in range(s):
        param.grad = grad.clone()
        optimizer.step()
    torch.testing.assert_close(predicted, param.detach(), rtol=1e-12, atol=1e-12)


def test_momentum_prediction_uses_the_momentum_buffer():
    grad = torch.tensor([0.3, -0.1, 0.7], dtype=torch.float64)
    param, optimizer = _optimizer_after_steps(torch.optim.SGD, 3, grad, lr=0.1, momentum=0.9,
                                              dampening=0.1, weight_decay=0.01)
    buffer = optimizer.state[param]["momentum_buffer"]
    assert torch.equal(predicted_update(optimizer, param, grad), buffer)


@pytest.mark.parametrize("kind, options", [
    (torch.optim.SGD, {"lr": 0.1, "maximize": True, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "maximize": True}),
    (torch.optim.Adam, {"lr": 0.01, "maximize": True}),
])
def test_maximize_predicts_the_step_the_optimizer_takes(kind, options):
    """Under a constant gradient the optimizer's state settles; ΔW is then its next step
    (exactly so without momentum), in the direction `maximize` gives it."""
    grad = torch.tensor([0.3, -0.1, 0.7], dtype=torch.float64)
    param, optimizer = _optimizer_after_steps(kind, 2000, grad, **options)
    update = predicted_update(optimizer, param, grad)
    before = param.detach().clone()
    param.grad = grad.clone()
    optimizer.step()
    torch.testing.assert_close(update, (before - param.detach()) / options["lr"], rtol=1e-3,
                               atol=1e-9)


def test_nesterov_prediction_adds_the_gradient_to_the_momentum_buffer():
    grad = torch.tensor([0.3, -0.1, 0.7], dtype=torch.float64)
    param, optimizer = _optimizer_after_steps(torch.optim.SGD, 3, grad, lr=0.1, momentum=0.9,
                                              nesterov=True, weight_decay=0.01)
    buffer = optimizer.state[param]["momentum_buffer"]
    expected = grad + 0.01 * param.detach() + 0.9 * buffer  # PyTorch's nesterov step
    torch.testing.assert_close(predicted_update(optimizer, param, grad), expected)


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_amsgrad_prediction_reads_the_running_maximum(kind):
    param = nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    optimizer = kind([param], lr=0.01, betas=(0.9, 0.5), amsgrad=True)
    for scale in (1.0, 0.5, 0.1, 0.05):  # shrinking gradients: the maximum outlives them
        param.grad = scale * torch.tensor([0.3, -0.1, 0.7], dtype=torch.float64)
        optimizer.step()
    state, (beta1, beta2) = optimizer.state[param], optimizer.param_groups[0]["betas"]
    m_hat = state["exp_avg"] / (1 - beta1 ** 4)
    eps = optimizer.param_groups[0]["eps"]
    expected = m_hat / ((state["max_exp_avg_sq"] / (1 - beta2 ** 4)).sqrt() + eps)
    without_max = m_hat / ((state["exp_avg_sq"] / (1 - beta2 ** 4)).sqrt() + eps)
    assert not torch.allclose(expected, without_max)
    if kind is torch.optim.AdamW:  # decoupled weight decay (0.01 by default)
        expected = expected + optimizer.param_groups[0]["weight_decay"] * param.detach()
    torch.testing.assert_close(predicted_update(optimizer, param, param.grad), expected)


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_prediction_follows_the_bias_corrected_moments(kind):
    grad = torch.tensor([0.3, -0.1, 0.7], dtype=torch.float64)
    param, optimizer = _optimizer_after_steps(kind, 4, grad, lr=0.01, weight_decay=0.1)
    state = optimizer.state[param]
    beta1, beta2 = optimizer.param_groups[0]["betas"]
    m_hat = state["exp_avg"] / (1 - beta1 ** 4)
    v_hat = state["exp_avg_sq"] / (1 - beta2 ** 4)
    expected = m_hat / (v_hat.sqrt() + optimizer.param_groups[0]["eps"])
    if kind is torch.optim.AdamW:
        expected = expected + 0.1 * param.detach()
    torch.testing.assert_close(predicted_update(optimizer, param, grad), expected)


def test_unknown_optimizer_falls_back_to_the_last_gradient_with_one_warning():
    grad = torch.tensor([0.3, -0.1, 0.7], dtype=torch.float64)
    param, optimizer = _optimizer_after_steps(torch.optim.Adagrad, 1, grad, lr=0.1)
    with pytest.warns(UserWarning, match="no rule for Adagrad"):
        update = predicted_update(optimizer, param, grad)
    assert torch.equal(update, grad)


def _net(stages):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(stages)],
                         nn.Linear(6, 3)).double()


def _data(count, rows=6):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 6, generator=gen, dtype=torch.float64),
             torch.randint(0, 3, (rows,), generator=gen)) for _ in range(count)]


def _async_pipe(policy, stages=3, micro_batches=2, lr=0.1):
    model = _net(stages)
    plan = fxpipe.Plan(stages=stages, schedule="async-1f1b", consistency=policy,
                       micro_batches=micro_batches, loss_fn=F.cross_entropy, costs="none",
                       partitioner=[1] * (stages - 1) + [2], tracer="fx",
                       leaf_modules=[nn.Sequential])
    pipe = fxpipe.compile(model, plan, example_inputs=(_data(1)[0][0],))
    pipe.attach_optimizer(lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9))
    return pipe, model


@pytest.mark.parametrize("policy", ["none", "stash", "2bw", "predict"])
def test_every_policy_runs_the_async_schedule_completely(policy):
    pipe, _ = _async_pipe(policy)
    losses = pipe.step_many(_data(5))
    assert len(losses) == 5 and all(torch.isfinite(loss) for loss in losses)
    for stage in range(3):
        events = [e.action for e in pipe.last_trace() if e.stage == stage]
        forwards = [a.mb for a in events if a.kind is ActionKind.F]
        backwards = [a.mb for a in events if a.kind is ActionKind.B]
        assert sorted(forwards) == sorted(backwards) == list(range(10))
        assert sum(a.kind is ActionKind.STEP for a in events) == 5
    assert pipe.executor.in_flight() == [0, 0, 0]


def test_stash_holds_a_copy_per_version_in_flight():
    pipe, _ = _async_pipe("stash")
    assert "no optimizer attached yet" not in repr(pipe)
    pipe.step_many(_data(6))
    copies = pipe.weight_copies()
    assert copies[0] >= copies[-1] >= 1  # earlier stages hold more versions in flight
    assert f"stage 0: {copies[0]} (" in repr(pipe)
    for runner in pipe.executor.runners.values():
        policy = runner.policy
        assert len(policy.history) == 12 and not policy.forward_versions  # none left in flight
    stale = [forward for _, forward, _ in pipe.executor.runners[0].policy.history]
    assert max(stale) < 6 and len(set(stale)) > 1  # forwards did see several versions


@pytest.mark.parametrize("policy", ["stash", "2bw"])
def test_a_weight_copy_goes_once_the_backwards_that_used_it_ran(policy, monkeypatch):
    """Right after each micro-batch's backward, the only weight copies alive on a stage are
    those the policy still keeps (a version an in-flight micro-batch uses, 2bw's shadow):
    nothing else (a step's outputs, say) keeps a graph that reaches them."""
    pipe, _ = _async_pipe(policy)
    made: list[tuple[int, weakref.ref]] = []
    snapshot, backward = StashPolicy._snapshot, StageRunner.backward

    def recording(self):
        copies = snapshot(self)
        made.extend((self.stage, weakref.ref(t)) for t in copies.values())
        return copies

    extra = []

    def checked(self, key, *args, **kwargs):
        result = backward(self, key, *args, **kwargs)
        gc.collect()
        kept = [*self.policy._copies.values(), getattr(self.policy, "_shadow", None) or {}]
        kept_ids = {id(t) for copies in kept for t in copies.values()}
        extra.append(sum(ref() is not None and id(ref()) not in kept_ids
                         for stage, ref in made if stage == self.index))
        return result

    monkeypatch.setattr(StashPolicy, "_snapshot", recording)
    monkeypatch.setattr(StageRunner, "backward", checked)
    pipe.step_many(_data(4))
    assert len(extra) == 3 * 8 and made
    assert extra == [0] * len(extra)


def _stash_reference(model, data, micro_batches, lr):
    """Asynchronous 1F1B with weight stashing, written out sequentially: each stage runs its
    F, B and STEP actions in the schedule's order; F(mb) runs on a copy of the stage's weights
    of that moment and B(mb) differentiates that same copy, adding into the stage's .grad."""
    parts = [model[0], model[1], nn.Sequential(model[2], model[3])]
    optimizers = [torch.optim.SGD(part.parameters(), lr=lr, momentum=0.9) for part in parts]
    schedule = build("async-1f1b", 3, micro_batches, minibatches=len(data))
    programs = [[a for a in actions if a.kind in (ActionKind.F, ActionKind.B, ActionKind.STEP)]
                for actions in schedule.actions]
    inputs = {}
    for i, (x, y) in enumerate(data):
        for m, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            inputs[0, i * micro_batches + m] = xm
            inputs["target", i * micro_batches + m] = (ym, len(ym) / len(y))
    saved, grads = {}, {}
    while any(programs):
        for s, program in enumerate(programs):
            if not program:
                continue
            action = program[0]
            if action.kind is ActionKind.F and (s, action.mb) in inputs:
                copy_ = {n: w.detach().clone().requires_grad_() for n, w in
                         parts[s].named_parameters()}
                x = inputs[s, action.mb].detach().requires_grad_(s > 0)
                out = torch.func.functional_call(parts[s], copy_, (x,))
                if s == 2:
                    target, share = inputs["target", action.mb]
                    out = F.cross_entropy(out, target) * share
                else:
                    inputs[s + 1, action.mb] = out
                saved[s, action.mb] = (copy_, x, out)
            elif action.kind is ActionKind.B and (s == 2 or (s + 1, action.mb) in grads):
                copy_, x, out = saved.pop((s, action.mb))
                out.backward(None if s == 2 else grads.pop((s + 1, action.mb)))
                for name, w in parts[s].named_parameters():
                    w.grad = copy_[name].grad if w.grad is None else w.grad + copy_[name].grad
                if s > 0:
                    grads[s, action.mb] = x.grad
            elif action.kind is ActionKind.STEP:
                optimizers[s].step()
                optimizers[s].zero_grad()
            else:
                continue
            program.pop(0)


def test_stash_trains_like_its_sequential_definition():
    pipe, model = _async_pipe("stash")
    reference = copy.deepcopy(model)
    data = _data(5)
    pipe.step_many(data)
    _stash_reference(reference, data, 2, lr=0.1)
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=name)
    unstashed, model_none = _async_pipe("none")
    unstashed.step_many(data)
    assert any(not torch.allclose(a, b) for a, b in zip(model_none.parameters(),
                                                       reference.parameters()))


def test_without_stashing_the_first_stage_backward_sees_newer_weights():
    pipe, _ = _async_pipe("none")
    pipe.step_many(_data(6))
    first = pipe.executor.runners[0].policy
    newer = [mb for mb, forward, backward in first.history if backward > forward]
    assert newer  # weights were stepped between a forward and its backward
    last = pipe.executor.runners[2].policy  # the last stage runs F and B back to back
    assert all(forward == backward for _, forward, backward in last.history)


def test_predicted_weights_are_computed_beside_the_parameters_not_in_them():
    pipe, model = _async_pipe("predict")
    pipe.step_many(_data(3))
    runner = pipe.executor.runners[0]
    assert isinstance(runner.policy, PredictPolicy)
    ahead = [mb for mb in range(6) if runner.policy.updates_ahead(mb) > 0]
    assert ahead  # some forward on stage 0 meets a step before its backward
    before = [p.detach().clone() for p in model.parameters()]
    predicted = runner.policy.forward_weights(MicroBatchKey("probe", ahead[0]))
    assert predicted is not None
    assert any(not torch.equal(predicted[n], w) for n, w in runner.policy.weights.items())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@settings(max_examples=30)
@given(stages=st.integers(1, 6), micro_batches=st.integers(1, 5), updates=st.integers(1, 5))
def test_prediction_looks_as_many_updates_ahead_as_the_schedule_lands(stages, micro_batches,
                                                                       updates):
    """Each stage's policy, walked through its list of the streamed schedule (F, B, STEP as the
    runtime runs them), predicts F(mb) exactly weight_version(B(mb)) - weight_version(F(mb))
    updates ahead: with ΔW = 1 and lr = 1, Ŵ = W - s."""
    schedule = lower("async-1f1b", stages, micro_batches, chain(stages), minibatches=updates)
    version = schedule.weight_version
    for s in range(stages):
        weight = nn.Parameter(torch.zeros(1, dtype=torch.float64))
        policy = PredictPolicy({"w": weight}, s, stages,
                               predictor=lambda opt, param, grad: torch.ones_like(param))
        policy.optimizer = torch.optim.SGD([weight], lr=1.0)
        policy.step()  # an earlier run's step: there is optimizer state to predict from
        policy.follow(schedule)
        for a in schedule[s]:
            key = MicroBatchKey("run", a.mb)
            if a.kind is ActionKind.F:
                gap = version(Action(s, ActionKind.B, a.mb)) - version(a)
                assert policy.updates_ahead(a.mb) == gap
                predicted = policy.forward_weights(key)
                used = 0.0 if predicted is None else (weight - predicted["w"]).item()
                assert used == gap, (s, a)
            elif a.kind is ActionKind.B:
                policy.after_backward(key)
            elif a.kind is ActionKind.STEP:
                policy.step()
        # the versions the policy met at run time are the schedule's (one step before it ran)
        assert all(1 + version(Action(s, ActionKind.F, mb)) == forward
                   and 1 + version(Action(s, ActionKind.B, mb)) == backward
                   for (_, mb), forward, backward in policy.history)


def test_streamed_run_predicts_the_updates_that_land_before_each_backward():
    """In a real run, every micro-batch's prediction looked exactly as far ahead as the stage's
    own history says the weights moved between its forward and its backward."""
    pipe, _ = _async_pipe("predict", stages=3, micro_batches=3)
    pipe.step_many(_data(2))
    pipe.step_many(_data(4))
    gaps = set()
    for runner in pipe.executor.runners.values():
        policy = runner.policy
        for (_, mb), forward, backward in list(policy.history)[-12:]:  # the second run's
            assert policy.updates_ahead(mb) == backward - forward
            gaps.add(backward - forward)
    assert gaps == {0, 1}  # 3 micro-batches per update: never N - stage - 1 = 2 ahead


def _regression_losses(schedule, consistency, stages, micro_batches, momentum, steps=8):
    """Per-step losses of a linear chain fitting one fixed batch (the loss falls every step)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(stages)]).double()
    gen = torch.Generator().manual_seed(3)
    x, y = (torch.randn(2 * micro_batches, 4, generator=gen, dtype=torch.float64)
            for _ in range(2))
    plan = fxpipe.Plan(stages=stages, schedule=schedule, consistency=consistency,
                       micro_batches=micro_batches, loss_fn=F.mse_loss, costs="none",
                       partitioner="even")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    pipe.attach_optimizer(lambda params: torch.optim.SGD(params, lr=0.1, momentum=momentum))
    return [loss.item() for loss in pipe.step_many([(x, y)] * steps)]


@pytest.mark.parametrize("stages, micro_batches, momentum", [(4, 3, 0.0), (3, 4, 0.9)])
def test_predict_with_several_micro_batches_per_update_does_not_overshoot(stages, micro_batches,
                                                                          momentum):
    """With p >= N - 1 micro-batches per update the forwards are 0-1 updates stale. Predicting
    N - stage - 1 updates ahead ran the forwards on weights past GPipe's, so the loss fell
    below GPipe's curve at every step; predicting what the schedule lands tracks GPipe closer
    than no prediction does, from neither side."""
    gpipe = _regression_losses("gpipe", "none", stages, micro_batches, momentum)
    stale = _regression_losses("async-1f1b", "none", stages, micro_batches, momentum)
    predict = _regression_losses("async-1f1b", "predict", stages, micro_batches, momentum)
    gap = [a - b for a, b in zip(predict, gpipe)]
    stale_gap = sum(abs(a - b) for a, b in zip(stale, gpipe)) / len(gpipe)
    assert sum(abs(g) for g in gap) / len(gap) < stale_gap
    assert sum(gap) / len(gap) > -0.25 * stale_gap  # not below GPipe's curve


@settings(max_examples=6)
@given(policy=st.sampled_from(["none", "stash", "predict"]), micro_batches=st.integers(1, 3))
def test_one_stage_async_is_plain_sgd(policy, micro_batches):
    """With a single stage nothing is stale: these policies train exactly like plain SGD."""
    model = _net(1)
    reference = copy.deepcopy(model)
    plan = fxpipe.Plan(stages=1, schedule="async-1f1b", consistency=policy,
                       micro_batches=micro_batches, loss_fn=F.cross_entropy, costs="none")
    data = _data(4)
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
    pipe.attach_optimizer(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    pipe.step_many(data)
    _assert_trained_like_plainly(model, reference, data,
                                 torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))


def _assert_trained_like_plainly(model, reference, data, optimizer):
    """`reference` trained on `data` without a pipeline ends with `model`'s parameters."""
    for x, y in data:
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_2bw_applies_gradients_one_version_late():
    """PipeDream-2BW's update rule, W(t+1) = W(t) - lr * grad f(W(t-1)), even with one stage."""
    model = _net(1)
    reference = copy.deepcopy(model)
    data = _data(4)
    plan = fxpipe.Plan(stages=1, schedule="async-1f1b", consistency="2bw",
                       loss_fn=F.cross_entropy, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
    pipe.attach_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    pipe.step_many(data)
    previous = copy.deepcopy(reference)
    for x, y in data:
        grads = torch.autograd.grad(F.cross_entropy(previous(x), y),
                                    list(previous.parameters()))
        previous.load_state_dict(reference.state_dict())
        with torch.no_grad():
            for p, g in zip(reference.parameters(), grads):
                p -= 0.1 * g
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_sync_step_many_equals_step_then_optimizer():
    model = _net(2)
    reference = copy.deepcopy(model)
    data = _data(3)
    plan = fxpipe.Plan(stages=2, schedule="1f1b", micro_batches=2, loss_fn=F.cross_entropy,
                       costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
    pipe.attach_optimizer(lambda params: torch.optim.Adam(params, lr=0.01))
    pipe.step_many(data)
    _assert_trained_like_plainly(model, reference, data,
                                 torch.optim.Adam(reference.parameters(), lr=0.01))


def test_async_needs_an_optimizer_and_step_many():
    pipe = fxpipe.compile(_net(2), fxpipe.Plan(stages=2, schedule="async-1f1b",
                                                loss_fn=F.cross_entropy, costs="none"),
                          example_inputs=(_data(1)[0][0],))
    with pytest.raises(fxpipe.FxpipeError, match=r"have no optimizer: call "
                                                  r"pipe.attach_optimizer"):
        pipe.step_many(_data(2))
    with pytest.raises(fxpipe.FxpipeError, match=r"overlaps mini-batches and steps each stage"):
        pipe.step(*_data(1)[0])


@pytest.mark.parametrize("policy", ["stash", "2bw", "predict"])
def test_the_memory_model_counts_the_copies_the_policy_keeps(policy):
    """fxpipe.memory's count of each stage's weight copies is what the runtime keeps at most,
    over enough mini-batches to reach the steady state (2bw's shadow copy included)."""
    from fxpipe.policy_copies import stage_copies, weight_copies
    pipe, _ = _async_pipe(policy)
    pipe.step_many(_data(8))
    streamed = build("async-1f1b", 3, 2, minibatches=8).actions
    assert pipe.weight_copies() == [weight_copies(policy, streamed[s]) for s in range(3)]
    # only predict keeps the last gradients (its rule for SGD reads them), and the count adds
    # them there only
    keeps = policy == "predict"
    assert [len(r.policy.last_grads) == (len(list(r.stage.module.parameters())) if keeps else 0)
            for r in pipe.executor.runners.values()] == [True] * 3
    assert [stage_copies(policy, "async-1f1b", 3, 2, s) for s in range(3)] == [
        weight_copies(policy, streamed[s]) + keeps for s in range(3)]


def _one_stage_rise(policy: str) -> tuple[float, float]:
    """The most a one-stage async-1f1b pipeline's step_many allocates above its start (it runs
    on this thread, so torch.profiler's memory events see it), after a first step_many, and
    its weights' bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 3))
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 16, generator=gen), torch.randint(0, 3, (8,), generator=gen))
            for _ in range(3)]
    plan = fxpipe.Plan(stages=1, schedule="async-1f1b", consistency=policy, micro_batches=2,
                       loss_fn=F.cross_entropy, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],), cache=False)
    pipe.attach_optimizer(lambda params: torch.optim.SGD(params, lr=0.0))
    pipe.step_many(data)
    with peak_rise([torch.device("cpu")]) as rise:
        pipe.step_many(data)
    return rise[torch.device("cpu")], float(sum(p.nbytes for p in model.parameters()))


@pytest.mark.parametrize("policy", ["stash", "2bw", "predict"])
def test_a_policy_holds_beyond_no_policy_only_the_copies_the_model_counts(policy):
    """Measured: what a stage holds at its peak under a policy, beyond what it holds without
    one, is the weight-sized copies `stage_copies` counts (stash, 2bw: the weights' copy; its
    gradients are the parameters' .grad, accumulated in place, not a second set; predict: the
    last gradients, as no step lands between a forward and its backward on one stage)."""
    from fxpipe.policy_copies import stage_copies
    plain, weights = _one_stage_rise("none")
    held, _ = _one_stage_rise(policy)
    counted = stage_copies(policy, "async-1f1b", 1, 2, 0) * weights
    assert held - plain == pytest.approx(counted, abs=0.05 * weights)


@pytest.mark.parametrize("policy", ["2bw", "predict"])
def test_a_step_lets_go_of_what_the_last_step_kept_before_keeping_its_own(policy):
    """2bw's shadow copy and predict's last gradients are replaced at each step, never held
    twice: the step allocates nothing beyond what it frees first."""
    layer = nn.Linear(64, 64)
    chosen = make_policy(policy, dict(layer.named_parameters()), 0, 1)
    chosen.optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    weights = sum(p.nbytes for p in layer.parameters())
    for _ in range(2):  # the second step has the first's copy to replace
        for param in layer.parameters():
            param.grad = torch.ones_like(param)
        with peak_rise([torch.device("cpu")]) as rise:
            chosen.step()
    assert rise[torch.device("cpu")] < 0.5 * weights


def test_a_weight_saved_as_a_view_is_read_back_from_the_current_weights():
    """predict's backward reads the current W, also where autograd saves a view of the weight
    (a Linear saves it transposed): the predicted weights are not kept past the forward."""
    from fxpipe.runtime.consistency import _reading_current
    layer = nn.Linear(4, 3)
    params = dict(layer.named_parameters())
    predicted = {name: param - 0.5 for name, param in params.items()}  # differentiable in W
    x = torch.randn(2, 4, requires_grad=True)
    with _reading_current(predicted, params):
        out = F.linear(x, predicted["weight"], predicted["bias"])
    gone = weakref.ref(predicted["weight"])
    predicted.clear()
    gc.collect()
    assert gone() is None  # nothing the backward needs holds Ŵ
    with torch.no_grad():
        layer.weight.add_(1.0)  # a step between the forward and the backward
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, torch.ones(2, 3) @ layer.weight.detach())
