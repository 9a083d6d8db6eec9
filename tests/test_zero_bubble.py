"""ZB-H1 and the runtime's B/W split: the plain model's loss and gradients, the schedule's
memory and bubble against 1F1B's, and the split against the unsplit backward."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.models import GPT
from fxpipe.report import step_time
from fxpipe.runtime.transport import MicroBatchKey
from fxpipe.schedules import (
    Action,
    ActionKind,
    B,
    W,
    add_communication,
    add_step,
    build,
    check_communication,
    one_f_one_b,
    peak_activations,
    zb_h1,
)
from fxpipe.simulate import simulate

K = ActionKind


class SkipNet(nn.Module):
    """Linear layers with a skip connection over the middle (a skip edge between stages)."""

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


def _tokens_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _case(name: str, batch: int, seed: int):
    """(model, inputs, target, loss_fn), float64."""
    gen = torch.Generator().manual_seed(seed)
    if name == "skipnet":
        x = torch.randn(batch, 5, generator=gen, dtype=torch.float64)
        return SkipNet().double(), x, torch.randint(0, 3, (batch,), generator=gen), \
            F.cross_entropy
    torch.manual_seed(seed)
    model = GPT(vocab=11, seq=4, dim=8, heads=2, layers=2).double()  # tied wte / lm_head
    x = torch.randint(0, 11, (batch, 4), generator=gen)
    return model, x, torch.randint(0, 11, (batch, 4), generator=gen), _tokens_loss


def _compile(model, x, loss_fn, stages, micro_batches, schedule="zb-h1"):
    plan = fxpipe.Plan(stages=stages, micro_batches=micro_batches, schedule=schedule,
                       loss_fn=loss_fn, costs="none", devices=["cpu"] * stages)
    return fxpipe.compile(model, plan, example_inputs=(x,))


# --- the runtime: the plain model's loss and gradients -----------------------------------------


@settings(max_examples=10, deadline=None)
@given(name=st.sampled_from(["skipnet", "gpt"]), stages=st.integers(2, 4),
       micro_batches=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_zb_h1_step_gives_the_plain_models_loss_and_gradients(name, stages, micro_batches,
                                                               seed):
    model, x, y, loss_fn = _case(name, 6, seed)
    reference = copy.deepcopy(model)
    pipe = _compile(model, x, loss_fn, stages, micro_batches)
    assert any(a.kind is W for a in pipe.executor.schedule.actions[0])
    loss = pipe.step(x, y)
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    names = dict(reference.named_parameters())
    for pname, param in pipe.named_parameters():  # tied weights: one Parameter, summed
        torch.testing.assert_close(param.grad, names[pname].grad, rtol=1e-10, atol=1e-12,
                                   msg=pname)
    assert pipe.executor.in_flight() == [0] * stages  # no graph or activation kept


def test_the_drop_in_backward_runs_the_split_too():
    model, x, y, loss_fn = _case("skipnet", 7, 3)
    reference = copy.deepcopy(model)
    pipe = _compile(model, x, loss_fn, 3, 4)
    weights = Counter()
    for runner in pipe.executor.runners.values():
        real = runner.weight_backward

        def counted(key, last=False, real=real, stage=runner.index):
            weights[stage] += 1
            return real(key, last)
        runner.weight_backward = counted
    loss_fn(pipe(x), y).backward()
    loss_fn(reference(x), y).backward()
    assert weights == {0: 4, 1: 4, 2: 4}  # every micro-batch's W ran on every stage
    for (pname, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=pname)
    assert pipe.executor.in_flight() == [0, 0, 0]


# --- the split against the unsplit backward, on one stage ---------------------------------------


@pytest.mark.parametrize("name", ["skipnet", "gpt"])
def test_the_split_backward_equals_the_unsplit_one_on_each_stage(name):
    """On every stage: B(split) then W give the unsplit backward's input and parameter
    gradients; the hook fires once, after W, with `finishing` as asked; nothing stays held."""
    model, x, _, loss_fn = _case(name, 4, 0)
    pipe = _compile(model, x, loss_fn, 3, 1, schedule="1f1b")
    values = _stage_values(pipe, x)
    gen = torch.Generator().manual_seed(1)
    for runner in pipe.executor.runners.values():
        fired: list[bool] = []
        runner.hook.register(lambda stage, hook=runner.hook, fired=fired:
                             fired.append(hook.finishing))
        feeds = {name: values[name] for name in runner.io.inputs}
        results = []
        for split in (False, True):
            for p in runner.stage.module.parameters():
                p.grad = None
            key = MicroBatchKey(("split", split), 0)
            outputs = runner.forward(key, feeds)
            grads = {name: torch.randn(outputs[name].shape, generator=gen.manual_seed(2),
                                       dtype=outputs[name].dtype)
                     for name in runner.io.outputs
                     if isinstance(outputs[name], torch.Tensor)
                     and outputs[name].is_floating_point()}
            inputs = runner.backward(key, grads, last=True, split=split)
            if split:
                assert fired == [True] and runner.in_flight == 1  # held until W
                runner.weight_backward(key, last=True)
            assert fired == [True] * (1 + split) and runner.in_flight == 0
            results.append((inputs, {n: p.grad for n, p in
                                     runner.stage.module.named_parameters()}))
        (plain_inputs, plain_params), (split_inputs, split_params) = results
        assert plain_inputs.keys() == split_inputs.keys()
        assert plain_inputs or runner.index == 0  # the first stage's input needs none
        for n in plain_inputs:
            torch.testing.assert_close(split_inputs[n], plain_inputs[n], rtol=1e-12, atol=0)
        assert any(g is not None for g in plain_params.values())
        for n, g in plain_params.items():
            torch.testing.assert_close(split_params[n], g, rtol=1e-12, atol=0, msg=n)


def test_a_stages_b_and_w_run_each_gradient_once():
    """On every stage of a compiled model: the gradients B and W compute together are the
    unsplit backward's, each once."""
    model, x, _, loss_fn = _case("skipnet", 4, 0)
    pipe = _compile(model, x, loss_fn, 3, 1, schedule="1f1b")
    values = _stage_values(pipe, x)
    for runner in pipe.executor.runners.values():
        feeds = {name: values[name] for name in runner.io.inputs}
        counts = []
        for split in (False, True):
            log: Counter = Counter()
            key = MicroBatchKey(("count", split), 0)
            outputs = runner.forward(key, feeds)
            _count_gradients([outputs[n] for n in runner.io.outputs], log)
            grads = {n: torch.ones_like(outputs[n]) for n in runner.io.outputs}
            runner.backward(key, grads, split=split)
            if split:
                runner.weight_backward(key)
            counts.append(log)
        assert counts[0] and counts[1] == counts[0], runner.index


def _count_gradients(roots, log: Counter) -> None:
    """Count, per autograd node kind and edge, every gradient the graph below `roots` computes."""
    seen, stack = set(), [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        node.register_hook(lambda grads_in, _, node=node: log.update(
            (node.name(), i) for i, g in enumerate(grads_in) if g is not None))
        stack += [c for c, _ in node.next_functions if c is not None]


def _stage_values(pipe, x):
    """Every value the stages exchange, by name, from one forward through the runners."""
    values = {pipe.comm.graph_inputs[0]: x}
    with torch.no_grad():  # nothing kept in flight
        for s in sorted(pipe.executor.runners):
            runner = pipe.executor.runners[s]
            key = MicroBatchKey("values", 0)
            values.update(runner.forward(key, {n: values[n] for n in runner.io.inputs}))
    return values


# --- hooks, the all-reduce, a failed run ---------------------------------------------------------


def test_the_hook_fires_after_each_w_and_finishes_on_the_last():
    model, x, y, loss_fn = _case("skipnet", 6, 1)
    pipe = _compile(model, x, loss_fn, 3, 3)
    log = []
    for s in range(3):
        hook = pipe.stage_hook(s)
        pipe.register_stage_hook(s, lambda stage, hook=hook: log.append((stage, hook.finishing)))
    pipe.step(x, y)
    for s in range(3):
        assert [f for stage, f in log if stage == s] == [False, False, True]


def test_the_delayed_all_reduce_follows_the_last_w():
    for n in range(1, 5):
        for p in range(1, 6):
            lowered = add_step(add_communication(zb_h1(n, p)), allreduce=True, step=False)
            check_communication(lowered)
            for stage in lowered.actions:
                kinds = [a.kind for a in stage]
                assert kinds.count(K.ALLREDUCE) == 1
                last_w = max(i for i, k in enumerate(kinds) if k is W)
                last_send = max((i for i, k in enumerate(kinds) if k is K.SEND_B), default=-1)
                assert kinds.index(K.ALLREDUCE) == max(last_w, last_send) + 1


def test_a_failed_run_leaves_no_split_backward_behind():
    """The loss fails on micro-batch 2: stages already ran B of earlier micro-batches whose W
    never came; the run is discarded, and the next step trains as the plain model."""
    model, x, y, _ = _case("skipnet", 8, 2)
    reference = copy.deepcopy(model)
    bad = y[4:6].clone()  # micro-batch 2's target

    def failing(out, target):
        if target.shape == bad.shape and torch.equal(target, bad):
            raise ValueError("bad micro-batch")
        return F.cross_entropy(out, target)

    pipe = _compile(model, x, failing, 2, 4)
    held = []
    for runner in pipe.executor.runners.values():  # what the runners hold when it fails
        real = runner.discard
        runner.discard = lambda run, real=real, runner=runner: (
            held.append(runner.in_flight), real(run))
    with pytest.raises(RuntimeError, match="bad micro-batch"):
        pipe.step(x, y)
    assert held[-1] > 0  # the last stage ran B of micro-batch 1, and not its W yet
    assert pipe.executor.in_flight() == [0, 0]
    for p in pipe.parameters():
        p.grad = None
    y[4:6] = (y[4:6] + 1) % 3  # micro-batch 2 passes now
    pipe.step(x, y)
    F.cross_entropy(reference(x), y).backward()
    for (pname, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=pname)


# --- the schedule ------------------------------------------------------------------------------

STAGES, MICRO_BATCHES = st.integers(1, 8), st.integers(1, 12)


@given(STAGES, MICRO_BATCHES)
def test_zb_h1_runs_each_compute_once_w_after_b_and_sends_after_b(n, p):
    schedule = build("zb-h1", n, p)
    for s, stage in enumerate(schedule.actions):
        assert Counter(a.kind for a in stage) == {K.F: p, B: p, W: p}
        where = {a: i for i, a in enumerate(stage)}
        assert all(where[Action(s, W, m)] > where[Action(s, B, m)] for m in range(p))
        # B in 1F1B's order: the input gradients leave as 1F1B's do
        assert [a for a in stage if a.kind is B] == [a for a in one_f_one_b(n, p).actions[s]
                                                     if a.kind is B]
    lowered = add_communication(schedule)
    check_communication(lowered)
    for stage in lowered.actions:
        for i, a in enumerate(stage):
            if a.kind is K.SEND_B:  # the input gradient leaves right after its B
                assert stage[i - 1] == Action(a.stage, B, a.mb)


@given(STAGES, MICRO_BATCHES)
def test_zb_h1_holds_1f1bs_peak_activations(n, p):
    """Counted from F to W, every stage of ZB-H1 holds at most what 1F1B's first stage holds
    (the paper's "same peak memory as 1F1B"), which is min(N, p)."""
    peaks = peak_activations(zb_h1(n, p))
    ours = peak_activations(one_f_one_b(n, p))
    assert max(peaks) == max(ours) == min(n, p)
    assert peaks == (min(n, p),) * n


@given(st.integers(2, 8), MICRO_BATCHES, st.floats(0.1, 10))
def test_zb_h1s_bubble_is_below_1f1bs_with_equal_f_b_w(n, p, t):
    """F, B and W of t each (a backward of 2t, split half and half): 1F1B's bubble is
    (N-1)/(p+N-1), ZB-H1's below it, and a third of it in time for p >= N (the paper's
    (N-1)(F+B-W) against (N-1)(F+B+W)): 3pt + (N-1)t a step."""
    ours = simulate(one_f_one_b(n, p), t, 2 * t)
    zb = simulate(zb_h1(n, p), t, 2 * t)
    assert ours.bubble == pytest.approx((n - 1) / (p + n - 1))
    assert zb.bubble < ours.bubble - 1e-9
    assert zb.busy == pytest.approx(ours.busy)
    if p >= n:
        assert zb.makespan == pytest.approx((3 * p + n - 1) * t)
        assert zb.makespan - 3 * p * t == pytest.approx((ours.makespan - 3 * p * t) / 3)


def test_zb_h1_example():
    assert str(zb_h1(3, 4)) == "\n".join([
        "zb-h1: 3 stages x 4 micro-batches",
        "0: 0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
        "1: 1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3",
        "2: 2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3",
    ])


def test_plan_and_partition_know_zb_h1():
    plan = fxpipe.Plan(stages=2, schedule="zb-h1")
    assert plan.schedule == "zb-h1"
    with pytest.raises(fxpipe.PlanError, match="'zb-h1'"):
        fxpipe.Plan(stages=2, schedule="zb-h2")


def test_the_report_counts_b_and_w_as_one_backward_per_micro_batch():
    timeline = simulate(zb_h1(3, 4), 1.0, [2.0, 3.0, 4.0])
    assert [s.backward for s in step_time(timeline.events, 3).stages] == pytest.approx(
        [2.0, 3.0, 4.0])
