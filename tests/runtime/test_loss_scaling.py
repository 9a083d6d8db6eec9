"""Mixed precision across ranks: fp16 loss scaling (an inf or nan gradient anywhere skips the
optimizer step everywhere), and values crossing ranks in their autocast dtype."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import scaler_worker
import torch
import torch.nn.functional as F
from poison import Poison, poisoned_net
from torch import nn

import fxpipe
from fxpipe.precision import autocast
from fxpipe.runtime.loss_scaling import PipelineScaler


@pytest.fixture(autouse=True)
def _disarmed():
    Poison.armed = False
    yield
    Poison.armed = False


def _optimizers(inf_in: set[int]) -> tuple[list[nn.Linear], list[torch.optim.Optimizer]]:
    layers = [nn.Linear(3, 3) for _ in range(3)]
    for i, layer in enumerate(layers):
        layer.weight.grad = torch.ones(3, 3)
        layer.bias.grad = torch.ones(3)
        if i in inf_in:
            layer.weight.grad[1, 2] = float("inf" if i % 2 else "nan")
    return layers, [torch.optim.SGD(layer.parameters(), lr=0.1) for layer in layers]


@pytest.mark.parametrize("inf_in", [set(), {0}, {2}, {0, 1}])
def test_one_decision_for_every_stage(inf_in):
    layers, optimizers = _optimizers(inf_in)
    before = [layer.weight.detach().clone() for layer in layers]
    scaler = PipelineScaler("cpu", init_scale=4.0)
    assert scaler.step_all(optimizers) == (not inf_in)
    scaler.update()
    for layer, old in zip(layers, before):
        assert torch.equal(layer.weight, old) == bool(inf_in)
    assert scaler.get_scale() == (2.0 if inf_in else 4.0)
    if not inf_in:  # unscaled by 4 before the step
        torch.testing.assert_close(layers[0].weight, before[0] - 0.1 * 0.25)


def test_a_disabled_scaler_just_steps():
    layers, optimizers = _optimizers({1})
    scaler = PipelineScaler("cpu", enabled=False)
    assert scaler.step_all(optimizers)
    assert not torch.isfinite(layers[1].weight).all()  # what a plain fp32 loop does


def _pipe(schedule: str = "1f1b") -> tuple[fxpipe.CompiledPipeline, torch.Tensor, torch.Tensor]:
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    plan = fxpipe.Plan(stages=2, micro_batches=2, partitioner=[3, 3], costs="none",
                       devices=["cpu", "cpu"], loss_fn=F.cross_entropy, precision="fp16",
                       leaf_modules=[Poison], schedule=schedule)
    return fxpipe.compile(poisoned_net(), plan, (x,)), x, y


def _stage_params(pipe) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in stage.module.parameters()] for stage in pipe.stages]


def _stepped(before, pipe) -> list[bool]:
    return [any(not torch.equal(b, p) for b, p in zip(held, stage.module.parameters()))
            for held, stage in zip(before, pipe.stages)]


@pytest.mark.parametrize("way", ["step", "drop-in"])
def test_fp16_never_steps_on_an_inf_gradient(way):
    pipe, x, y = _pipe()
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    scale = pipe.scaler.get_scale()
    for armed in (True, False):
        Poison.armed = armed
        if way == "step":
            loss = pipe.step(x, y)
        else:
            out = pipe(x)
            with autocast("cpu", "fp16"):  # as torch.amp's recipe: the loss in fp32, not fp16
                loss = F.cross_entropy(out, y)
            pipe.scaler.scale(loss).backward()
        assert torch.isfinite(loss)  # the overflow is in the gradients only
        infs = [any(not torch.isfinite(p.grad).all() for p in stage.module.parameters())
                for stage in pipe.stages]
        assert infs == [armed, False]  # stage 1's gradients are fine
        before = _stage_params(pipe)
        pipe.scaler.step(optimizer)
        pipe.scaler.update()
        optimizer.zero_grad()
        assert _stepped(before, pipe) == [not armed, not armed]
        assert pipe.scaler.get_scale() == scale / 2  # backed off once, on the inf


def test_step_many_skips_every_stage_on_an_inf_gradient():
    pipe, x, y = _pipe("gpipe")
    pipe.attach_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    Poison.armed = True
    before = _stage_params(pipe)
    pipe.step_many([(x, y)])
    assert _stepped(before, pipe) == [False, False]
    assert all(p.grad is None or not p.grad.any() for p in pipe.parameters())  # zeroed
    Poison.armed = False
    pipe.step_many([(x, y)])
    assert _stepped(before, pipe) == [True, True]


def test_fp16_loss_is_scaled_and_gradients_unscaled():
    """pipe.step backpropagates the scaled loss; scaler.unscale_ returns the true gradients,
    ready for clipping, as in a plain torch.amp loop."""
    pipe, x, y = _pipe()
    reference, *_ = _pipe()
    reference.load_state_dict(pipe.state_dict())
    reference.scaler.update(1.0)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loss = pipe.step(x, y)
    torch.testing.assert_close(loss, reference.step(x, y))  # the loss returned is unscaled
    pipe.scaler.unscale_(optimizer)
    for mine, plain in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, plain.grad, rtol=1e-2, atol=1e-4)


@pytest.fixture(scope="module")
def precision_run(tmp_path_factory) -> pathlib.Path:
    """One torchrun of the precision scenario (2 ranks) for the tests below: the prefix of
    the files its ranks wrote."""
    out = tmp_path_factory.mktemp("precision") / "result"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(pathlib.Path(scaler_worker.__file__)), str(out)],
        capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(precision_run):
    out = precision_run
    ranks = [json.loads(pathlib.Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    poisoned, clean = ranks[0]["steps"][0], ranks[1]["steps"][0]
    assert poisoned["local_inf"] and not clean["local_inf"]  # the inf is on rank 0 only
    for rank in ranks:
        first, *later = rank["steps"]
        assert not first["stepped"] and first["next_scale"] == first["scale"] / 2
        assert all(step["stepped"] and not step["local_inf"] for step in later)
    assert [s["next_scale"] for s in ranks[0]["steps"]] == [s["next_scale"]
                                                            for s in ranks[1]["steps"]]
    # the same training in one process: the same losses and weights
    pipe, x, y = scaler_worker.pipeline(["cpu", "cpu"])
    alone = scaler_worker.train(pipe, x, y)
    assert ranks[1]["losses"] == pytest.approx(alone["losses"], rel=1e-6)
    state = torch.load(f"{out}.state")
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=key)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_values_cross_ranks_in_their_autocast_dtype(precision_run):
    """bf16: the values crossing ranks (and their gradients) travel in bf16, as one process
    hands them over, so the receiving stage adds and squashes in bf16 there as here: the same
    loss and gradients as one process, bit for bit."""
    bf16 = [torch.load(f"{precision_run}.bf16.{r}") for r in (0, 1)]
    assert bf16[0]["wire"] == bf16[1]["wire"] == {"a": "torch.bfloat16",
                                                  "tanh": "torch.bfloat16"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks compute
    try:
        alone = scaler_worker.bf16_step(*scaler_worker.bf16_pipeline(["cpu", "cpu"]))
    finally:
        torch.set_num_threads(threads)
    assert alone["wire"] == {}  # one process: nothing crosses a process
    assert bf16[0]["loss"] == bf16[1]["loss"] == alone["loss"]
    grads = {**bf16[0]["grads"], **bf16[1]["grads"]}
    assert grads.keys() == alone["grads"].keys()
    for name, grad in alone["grads"].items():
        assert torch.equal(grads[name], grad), name


def _fp16_pipe():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = fxpipe.Plan(stages=2, micro_batches=2, partitioner=[2, 1], costs="none",
                       loss_fn=F.cross_entropy, precision="fp16")
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    return fxpipe.compile(model, plan, example_inputs=(x,)), x, y


def test_an_optimizer_stepped_on_scaled_gradients_is_refused_at_the_next_step():
    pipe, x, y = _fp16_pipe()
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(x, y)
    optimizer.step()  # as with bf16 or fp32: but these gradients are scaled by 2^16
    optimizer.zero_grad()
    with pytest.raises(fxpipe.FxpipeError, match=r"an optimizer stepped on scaled gradients"):
        pipe.step(x, y)


def test_accumulating_several_steps_then_stepping_through_the_scaler_is_allowed():
    pipe, x, y = _fp16_pipe()
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(2):
        for _ in range(2):  # gradients of two mini-batches, no weight changed between
            pipe.step(x, y)
        pipe.scaler.step(optimizer)
        pipe.scaler.update()
        optimizer.zero_grad()
    with torch.no_grad():  # evaluation: nothing is scaled, nothing to check
        pipe.step(x, y)
