"""Plan(precision=...): stages under autocast, fp16 loss scaling, and what the cost model sees."""

from __future__ import annotations

import copy
import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.compiler.partitioning import evaluate_for_plan
from fxpipe.errors import PlanError
from fxpipe.models import GPT, MLP
from fxpipe.passes.analysis import profile_cache
from fxpipe.precision import autocast, autocast_args, check_autocast_runs, is_weight_cast

BF16 = {"rtol": 1.6e-2, "atol": 2e-2}  # bf16 keeps 8 bits of mantissa


def _plan(**kw) -> fxpipe.Plan:
    return fxpipe.Plan(**{"stages": 2, "micro_batches": 2, "devices": ["cpu", "cpu"],
                          "loss_fn": F.cross_entropy, **kw})


# --- Plan ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, words", [
    ("fp32", "Plan(precision='fp32') is not known; choose 'bf16', 'fp16' or None"),
    ("bfloat16", "Plan(precision='bfloat16') is not known"),
    (torch.bfloat16, "takes a name, not a dtype; give precision='bf16'"),
    (torch.float32, "takes a name, not a dtype; choose 'bf16', 'fp16' or None"),
])
def test_unknown_precision_is_refused(value, words):
    with pytest.raises(PlanError, match=words.replace("(", r"\(").replace(")", r"\)")):
        fxpipe.Plan(stages=2, precision=value)


def test_a_device_autocast_does_not_run_on_is_refused():
    with pytest.raises(PlanError, match="does not run on 'meta' devices"):
        fxpipe.Plan(stages=2, devices=["cpu", "meta"], precision="bf16")


def test_fp16_with_async_steps_is_refused():
    with pytest.raises(PlanError, match=r"use precision=.bf16.*or a synchronous schedule"):
        fxpipe.Plan(stages=2, schedule="async-1f1b", precision="fp16")
    fxpipe.Plan(stages=2, schedule="async-1f1b", precision="bf16")  # no scaler: fine


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_autocast_that_cannot_run_here_is_refused_before_work():
    with pytest.raises(PlanError, match=r"cannot run on cuda:0: CUDA is not available"):
        check_autocast_runs("bf16", ["cpu", "cuda:0"])
    check_autocast_runs("fp16", ["cpu"])


@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_plan_round_trips_its_precision(tmp_path, precision):
    plan = fxpipe.Plan(stages=2, precision=precision)
    plan.save(tmp_path / "plan.json")
    assert fxpipe.Plan.load(tmp_path / "plan.json") == plan


@given(device=st.sampled_from(["cpu", "cuda", "cuda:1", "xpu:0", "mps"]),
       precision=st.sampled_from([None, "bf16", "fp16"]))
def test_autocast_is_per_device_type(device, precision):
    args = autocast_args(device, precision)
    if precision is None:
        assert args is None
    else:
        assert args == (device.split(":")[0], {"bf16": torch.bfloat16,
                                                 "fp16": torch.float16}[precision])


def test_profile_cache_key_holds_the_precision():
    pipe = fxpipe.compile(MLP(), _plan(costs="none"), (torch.randn(4, 32),))
    keys = {profile_cache.cache_key(pipe.graph, [torch.randn(4, 32)], (2,), "cpu", 1, 5, 0.0,
                                    (), None, precision)[0] for precision in (None, "bf16")}
    assert len(keys) == 2


# --- autocast per stage --------------------------------------------------------------------


@settings(max_examples=4, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b"]), p=st.sampled_from([1, 2, 4]),
       precision=st.sampled_from(["bf16", "fp16"]))
def test_outputs_and_gradients_equal_the_plain_model_under_autocast(schedule, p, precision):
    model = MLP()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    pipe = fxpipe.compile(model, _plan(schedule=schedule, micro_batches=p,
                                       precision=precision, costs="none"), (x,))
    with autocast("cpu", precision):
        expected = plain(x)
        F.cross_entropy(expected, y).backward()
    out = pipe(x)
    assert out.dtype == expected.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[
        precision]
    torch.testing.assert_close(out, expected, **BF16)
    with torch.no_grad():  # evaluation runs under the stages' autocast too
        torch.testing.assert_close(pipe.eval()(x), expected, **BF16)
    pipe.train()
    pipe.scaler.update(1.0)  # unscaled, to compare the gradients as they are
    pipe.step(x, y)
    for (name, mine), theirs in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=5e-2, atol=5e-3, msg=name)


def test_a_stage_casts_each_weight_once_per_step():
    """Its micro-batches share autocast's copy of a weight instead of each holding one."""
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((t.untyped_storage().data_ptr(), is_weight_cast(t, [layer.weight])))
        return t
    from fxpipe.precision import weight_casts_kept
    with weight_casts_kept(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(2):
            with autocast("cpu", "bf16"):
                layer(x)
    casts = {ptr for ptr, cast in saved if cast}
    assert len(casts) == 1 and sum(cast for _, cast in saved) == 2
    assert not any(cast for ptr, cast in saved if ptr not in casts)  # the input's copies


def _train_tiny_gpt(precision, steps=50):
    torch.manual_seed(0)
    model = GPT(vocab=32, seq=8, dim=32, heads=2, layers=2)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 32, (8, 9), generator=gen) for _ in range(2)]

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())
    plan = _plan(schedule="1f1b", loss_fn=loss_fn, precision=precision, costs="none")
    pipe = fxpipe.compile(model, plan, (tokens[0][:, :-1],))
    optimizer = torch.optim.Adam(pipe.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        t = tokens[step % 2]
        losses.append(pipe.step(t[:, :-1], t[:, 1:]).item())
        pipe.scaler.step(optimizer)
        pipe.scaler.update()
        optimizer.zero_grad()
    return losses


def test_bf16_training_follows_the_fp32_loss_curve():
    """benchmarks/precision.py runs the bundled GPT's default size the same way."""
    full, half = _train_tiny_gpt(None), _train_tiny_gpt("bf16")
    assert full[-1] < 0.5 * full[0]  # it learns
    assert half != full  # in another precision
    assert abs(half[-1] - full[-1]) <= 0.02 * full[-1], (half[-1], full[-1])
    assert all(abs(h - f) <= 0.05 * f for h, f in zip(half, full))  # all along the way


# --- the cost and memory model -------------------------------------------------------------


def _costs(precision, model=None):
    pipe = fxpipe.compile(model or MLP(), _plan(precision=precision, partitioner=[3, 6]),
                          (torch.randn(64, 32),), cache=False)
    return pipe


def test_bf16_plan_predicts_fewer_activation_bytes():
    full, half = (_costs(precision).cost for precision in (None, "bf16"))
    assert half.saved_bytes(2).sum() < 0.6 * full.saved_bytes(2).sum()  # and a little fp32


def test_the_weights_casts_are_counted_as_autocast_keeps_them():
    """The profile's bytes of autocast's weight copies are what a stage's forwards leave
    allocated while the casts are kept (measured with the profiler's memory events): one copy
    per weight, shared by its micro-batches, biases included; the stage's memory counts them
    and their gradients (CAST_COPIES)."""
    from torch.profiler import ProfilerActivity, profile

    from fxpipe.memory import CAST_COPIES
    from fxpipe.precision import weight_casts_kept
    pipe, full = _costs("bf16"), _costs(None)
    assert not full.cost.weight_cast_bytes.any()  # full precision: no copies
    for s, stage in enumerate(pipe.stages):
        # not a leaf needing a gradient, whose cast autocast would keep as well
        x = torch.randn(8, 32 if s == 0 else 64)
        with weight_casts_kept():
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as session:
                for _ in range(2):  # two micro-batches: one copy
                    with autocast("cpu", "bf16"):
                        out = stage.module(x)
                    del out  # its graph and activations go; the cached copies stay
            events = session.profiler.kineto_results.events()  # the copies still kept
            resident = sum(e.nbytes() for e in events if e.name() == "[memory]")
        start, end = pipe.partition.stages[s].units
        counted = pipe.cost.weight_cast_bytes[start:end].sum()
        assert counted == resident == sum(w.nbytes for w in stage.module.parameters()) / 2
        uncast = evaluate_for_plan(dataclasses.replace(pipe.cost, weight_cast_bytes=None),
                                   pipe.partition.bounds, 2, "given", pipe.plan)
        extra = pipe.partition.stages[s].memory - uncast.stages[s].memory
        assert extra == CAST_COPIES * counted


def test_values_crossing_ranks_are_counted_as_they_travel():
    """A bf16 value crosses as autocast made it, in one process and under torchrun alike: its
    messages, their gradients and the backward's inside a stage count as bf16, half the
    full-precision plan's, with no copy in another dtype besides."""
    full, half = (_costs(precision).cost for precision in (None, "bf16"))
    # the MLP's cuts (a Linear's ReLU'd output: bf16 under autocast)
    assert full.boundary_bytes[:, :-1].all()  # every cut but after the last unit
    np.testing.assert_array_equal(half.boundary_bytes, 0.5 * full.boundary_bytes)
    np.testing.assert_array_equal(half.boundary_grad_bytes, 0.5 * full.boundary_grad_bytes)
    np.testing.assert_array_equal(half.inner_grad_bytes, half.boundary_grad_bytes)
    # what autograd saves of them (a ReLU's output) is the value that travels
    assert half.boundary_saved_bytes.any()
    np.testing.assert_array_equal(half.boundary_saved_bytes, 0.5 * full.boundary_saved_bytes)


def test_a_stage_that_steps_inside_the_run_casts_its_new_weights():
    """async-1f1b steps inside the run, where the stage's weight casts are kept: each step
    drops them, so the next forward casts the updated weights (one stage: a plain loop)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    plain = copy.deepcopy(model)
    data = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(3)]
    plan = fxpipe.Plan(stages=1, schedule="async-1f1b", micro_batches=1, costs="none",
                       loss_fn=F.cross_entropy, precision="bf16")
    pipe = fxpipe.compile(model, plan, (data[0][0],))
    pipe.attach_optimizer(lambda params: torch.optim.SGD(params, lr=0.5))
    losses = [loss.item() for loss in pipe.step_many(data)]
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    expected = []
    for x, y in data:
        with autocast("cpu", "bf16"):
            loss = F.cross_entropy(plain(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-6)
    for mine, theirs in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(mine, theirs)


def test_predict_under_autocast_is_refused_before_any_work():
    with pytest.raises(fxpipe.PlanError, match=re.escape(
            "Plan(consistency='predict') cannot run with precision='bf16'")):
        fxpipe.Plan(stages=2, schedule="async-1f1b", consistency="predict", precision="bf16")
