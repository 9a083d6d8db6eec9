"""GroPipe's delayed all-reduce against the naive one: the collectives each issues, and when."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fxpipe.runtime import hooks
from fxpipe.runtime.hooks import GradientSync


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

    def barrier(self, group=None) -> None:
        self.calls.append(("barrier", 0, self.moment))


class _Done:
    def wait(self) -> None:
        return None


def _step(mode: str, shapes, micro_batches: int, bucket_bytes: int):
    """One step of a stage under `mode`: its hook after each micro-batch's backward, then
    finish() before the optimizer step. Returns the collectives, the gradients before and
    after, and the number of buckets."""
    recorder = _Recorder()
    with mock.patch.object(hooks, "dist", recorder):
        return (recorder.calls, *_run(recorder, mode, shapes, micro_batches, bucket_bytes))


def _run(recorder: _Recorder, mode: str, shapes, micro_batches: int, bucket_bytes: int):
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    before = [p.grad.clone() for p in params]
    sync = GradientSync(0, params, group="data-parallel", mode=mode, pipeline="pipeline",
                        bucket_bytes=bucket_bytes)
    for m in range(micro_batches):
        recorder.moment = ("backward", m)
        sync.on_stage_backward(0, last=m == micro_batches - 1)
    recorder.moment = "finish"
    sync.finish()
    return before, [p.grad for p in params], len(sync.buckets)


@settings(max_examples=15)
@given(shapes=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3), min_size=1,
                       max_size=6),
       micro_batches=st.integers(1, 5), bucket_bytes=st.integers(4, 400))
def test_delayed_issues_the_naive_all_reduces_at_the_last_backward_and_no_barrier(
        shapes, micro_batches, bucket_bytes):
    """The delayed all-reduce can cost no more than the naive one: the same all-reduces (one
    per bucket, the same bytes), none before the stage's last backward, and no barrier; the
    naive order waits for the pipeline (a barrier) and launches them only in finish()."""
    shapes = [tuple(s) for s in shapes]
    delayed, before, after_delayed, buckets = _step("delayed", shapes, micro_batches,
                                                    bucket_bytes)
    naive, _, after_naive, _ = _step("naive", shapes, micro_batches, bucket_bytes)
    reduces = {mode: sorted(size for kind, size, _ in calls if kind == "all_reduce")
               for mode, calls in (("delayed", delayed), ("naive", naive))}
    assert reduces["delayed"] == reduces["naive"]
    assert len(reduces["delayed"]) == buckets
    assert sum(reduces["delayed"]) == sum(g.numel() * g.element_size() for g in before)
    assert [kind for kind, _, _ in delayed] == ["all_reduce"] * buckets
    assert [kind for kind, _, _ in naive] == ["barrier"] + ["all_reduce"] * buckets
    assert {moment for _, _, moment in delayed} == {("backward", micro_batches - 1)}
    assert {moment for _, _, moment in naive} == {"finish"}
    for got_delayed, got_naive, grad in zip(after_delayed, after_naive, before):
        torch.testing.assert_close(got_delayed, 2 * grad)  # each parameter its own share
        torch.testing.assert_close(got_naive, 2 * grad)


@pytest.mark.parametrize("mode", ["delayed", "naive"])
def test_a_parameter_without_a_gradient_is_reduced_as_zeros(mode, monkeypatch):
    """A parameter the step did not reach still takes part, so every group sends the same
    buckets (a group that skipped it would misalign the others' all-reduce)."""
    recorder = _Recorder()
    monkeypatch.setattr(hooks, "dist", recorder)
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    used.grad = torch.ones(3)
    sync = GradientSync(0, [used, unused], group="data-parallel", mode=mode)
    sync.on_stage_backward(0, last=True)
    sync.finish()
    assert [size for kind, size, _ in recorder.calls if kind == "all_reduce"] == [20]
    assert torch.equal(unused.grad, torch.zeros(2)) and torch.equal(used.grad, 2 * torch.ones(3))
