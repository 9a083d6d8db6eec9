"""GroPipe's delayed all-reduce against the naive one: the collectives each issues, and when;
the delayed one as a schedule action after each stage's last gradient sent back."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe import Plan
from fxpipe.compiler import passes
from fxpipe.runtime import gradient_sync
from fxpipe.runtime.coordinator import Coordinator
from fxpipe.runtime.gradient_sync import GradientSync
from fxpipe.schedules import ActionKind as K
from fxpipe.schedules import add_step


class _Recorder:
    """Stands in for torch.distributed: records each collective with the moment of the step
    it was issued in; an all-reduce adds the other pipeline group's equal gradients (x2)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, object]] = []
        self.moment: object = None

    def all_reduce(self, tensor: torch.Tensor, group=None, async_op: bool = False):
        self.calls.append(("all_reduce", tensor.numel() * tensor.element_size(), self.moment))
        tensor.mul_(2)
        return _Done()

    def barrier(self, group=None, async_op: bool = False):
        self.calls.append(("barrier", 0, self.moment))
        return _Done()


class _Done:
    def wait(self, timeout=None) -> None:
        return None


def _step(mode: str, shapes, bucket_bytes: int):
    """One step of a stage under `mode`: the schedule's ALLREDUCE action (delayed only), then
    finish() before the optimizer step. Returns the collectives, the gradients before and
    after, and the number of buckets."""
    recorder = _Recorder()
    with mock.patch.object(gradient_sync, "dist", recorder):
        return (recorder.calls, *_run(recorder, mode, shapes, bucket_bytes))


def _run(recorder: _Recorder, mode: str, shapes, bucket_bytes: int):
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    before = [p.grad.clone() for p in params]
    sync = GradientSync(0, params, group="data-parallel", mode=mode, pipeline="pipeline",
                        bucket_bytes=bucket_bytes)
    if mode == "delayed":  # the runtime's ALLREDUCE action
        recorder.moment = "action"
        sync.launch()
    recorder.moment = "finish"
    sync.finish()
    return before, [p.grad for p in params], len(sync.buckets)


@settings(max_examples=15)
@given(shapes=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3), min_size=1,
                       max_size=6),
       bucket_bytes=st.integers(4, 400))
def test_delayed_issues_the_naive_all_reduces_at_its_action_and_no_barrier(shapes,
                                                                          bucket_bytes):
    """The delayed all-reduce can cost no more than the naive one: the same all-reduces (one
    per bucket, the same bytes), all at the schedule's ALLREDUCE action, and no barrier; the
    naive order waits for the pipeline (a barrier) and launches them only in finish()."""
    shapes = [tuple(s) for s in shapes]
    delayed, before, after_delayed, buckets = _step("delayed", shapes, bucket_bytes)
    naive, _, after_naive, _ = _step("naive", shapes, bucket_bytes)
    reduces = {mode: sorted(size for kind, size, _ in calls if kind == "all_reduce")
               for mode, calls in (("delayed", delayed), ("naive", naive))}
    assert reduces["delayed"] == reduces["naive"]
    assert len(reduces["delayed"]) == buckets
    assert sum(reduces["delayed"]) == sum(g.numel() * g.element_size() for g in before)
    assert [kind for kind, _, _ in delayed] == ["all_reduce"] * buckets
    assert [kind for kind, _, _ in naive] == ["barrier"] + ["all_reduce"] * buckets
    assert {moment for _, _, moment in delayed} == {"action"}
    assert {moment for _, _, moment in naive} == {"finish"}
    for got_delayed, got_naive, grad in zip(after_delayed, after_naive, before):
        torch.testing.assert_close(got_delayed, 2 * grad)  # each parameter its own share
        torch.testing.assert_close(got_naive, 2 * grad)


@pytest.mark.parametrize("mode, launched", [("delayed", True), ("delayed", False),
                                             ("naive", False)])
def test_a_parameter_without_a_gradient_is_reduced_as_zeros(mode, launched, monkeypatch):
    """A parameter the step did not reach still takes part, so every group sends the same
    buckets (a group that skipped it would misalign the others' all-reduce); gradients are
    reduced once, by finish() where no ALLREDUCE action launched them."""
    recorder = _Recorder()
    monkeypatch.setattr(gradient_sync, "dist", recorder)
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    used.grad = torch.ones(3)
    sync = GradientSync(0, [used, unused], group="data-parallel", mode=mode)
    if launched:
        sync.launch()
    sync.finish()
    assert [size for kind, size, _ in recorder.calls if kind == "all_reduce"] == [20]
    assert torch.equal(unused.grad, torch.zeros(2)) and torch.equal(used.grad, 2 * torch.ones(3))


@settings(max_examples=20)
@given(stages=st.integers(1, 4), micro_batches=st.integers(1, 5),
       schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1"]), groups=st.integers(1, 3),
       mode=st.sampled_from(["delayed", "naive"]))
def test_the_delayed_all_reduce_is_each_stages_last_action(stages, micro_batches, schedule,
                                                           groups, mode):
    """The schedule pass puts the delayed all-reduce after the stage's last B and its last
    gradient sent back (so no stage waits for its launch), once a stage, and adds no STEP (the
    optimizer step stays the user's); the naive one and a single group have none."""
    plan = Plan(stages=stages, micro_batches=micro_batches, schedule=schedule, groups=groups,
                dp_sync=mode, costs="none")
    edges = [SimpleNamespace(src=s, dst=s + 1) for s in range(stages - 1)]
    c = SimpleNamespace(plan=plan, partition=SimpleNamespace(micro_batches=micro_batches),
                        comm=SimpleNamespace(edges=edges))
    passes.schedule(c)
    passes._schedule_made(c)
    delayed = groups > 1 and mode == "delayed"
    for stage in c.schedule.actions:
        kinds = [a.kind for a in stage]
        assert K.STEP not in kinds
        assert kinds.count(K.ALLREDUCE) == delayed
        if delayed:  # after every B, W and SEND_B of the stage
            assert kinds[-1] is K.ALLREDUCE and K.B in kinds
    assert c.forward_schedule is c.schedule


class _Reducing(Coordinator):
    """One process's coordinator that logs each all-reduce the schedule starts."""

    def __init__(self, log: list) -> None:
        self.log = log

    def start_allreduce(self, stage: int) -> None:
        self.log.append(("allreduce", stage))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_the_runtime_starts_each_stages_all_reduce_after_its_last_gradient_sent(schedule):
    """The driver routes each stage's ALLREDUCE action to the coordinator once, after the
    stage's every B and gradient send (a worker thread per stage: each stage's entries in the
    log are in the order it ran them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
                          nn.Linear(4, 2))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    plan = Plan(stages=3, micro_batches=3, schedule=schedule, loss_fn=F.mse_loss,
                costs="none", devices=["cpu"] * 3)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    executor, log = pipe.executor, []
    executor.schedule = add_step(executor.schedule, allreduce=True, step=False)
    executor.coordinator = _Reducing(log)
    send = executor.transport.send

    def logged(src, dst, direction, key, values):
        log.append((f"send {direction}", src))
        return send(src, dst, direction, key, values)

    executor.transport.send = logged
    for runner in executor.runners.values():  # a split backward's weight gradients
        def weights(key, last=False, real=runner.weight_backward, stage=runner.index):
            log.append(("W", stage))
            return real(key, last)
        runner.weight_backward = weights
    pipe.step(x, y)
    for stage in range(3):
        mine = [kind for kind, s in log if s == stage]
        assert mine.count("allreduce") == 1
        assert mine.index("allreduce") > max((i for i, kind in enumerate(mine)
                                              if kind in ("send B", "W")), default=-1)
        assert mine.count("W") == 3 * (schedule == "zb-h1")
        assert ("send B" in mine) == (stage > 0)
