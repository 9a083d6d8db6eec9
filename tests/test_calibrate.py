"""Calibration: what a pipeline's actions take in real steps beyond its units' timed costs,
read from the runtime's timeline events."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.calibrate import calibration_from
from fxpipe.cost import CostTable, Partition
from fxpipe.ir import Event
from fxpipe.schedules import Action, ActionKind, lower
from fxpipe.simulate import simulate

K = ActionKind


def _partition(f, b, p=2):
    """Two stages of one unit each, with these per-micro-batch costs."""
    return Partition.evaluate(CostTable.from_arrays(f, b), (1, 2), p)


@given(f=st.lists(st.floats(1e-4, 1e-2), min_size=2, max_size=2),
       b=st.lists(st.floats(1e-4, 1e-2), min_size=2, max_size=2),
       took_f=st.lists(st.floats(1e-4, 1e-2), min_size=2, max_size=2),
       took_b=st.lists(st.floats(1e-4, 1e-2), min_size=2, max_size=2),
       send=st.floats(0, 1e-3), outside=st.floats(0, 1e-2))
def test_a_calibration_is_what_each_action_took_beyond_its_stages_predicted_cost(
        f, b, took_f, took_b, send, outside):
    """Steps whose every forward of stage s took took_f[s], backward took_b[s], send `send`,
    each step `outside` longer than its actions' span: the calibration is the differences,
    and the calibrated simulation then gives each action what it took."""
    partition = _partition(f, b)
    schedule = lower("1f1b", 2, 2, [(0, 1)])
    steps = []
    for _ in range(3):
        timeline = simulate(schedule, took_f, took_b,
                            overhead={(s, k): send for s in range(2) for k in (K.SEND_F,
                                                                               K.SEND_B)})
        steps.append(timeline.events)
    walls = [max(e.end for e in events) + outside for events in steps]
    calibration = calibration_from(steps, walls, partition, [3, 3])
    assert calibration.bounds == partition.bounds
    np.testing.assert_allclose(calibration.forward, np.array(took_f) - f, atol=1e-12)
    np.testing.assert_allclose(calibration.backward, np.array(took_b) - b, atol=1e-12)
    np.testing.assert_allclose(calibration.send, [send, send], atol=1e-12)
    assert calibration.step == pytest.approx(outside, abs=1e-12)
    assert (calibration.steps, calibration.sizes) == (3, (3, 3))
    calibrated = simulate(schedule, [s.f for s in partition.stages],
                          [s.b for s in partition.stages], overhead=calibration.overheads())
    for e in calibrated.events:
        if e.action.kind in (K.F, K.B):
            expected = (took_f if e.action.kind is K.F else took_b)[e.stage]
            assert e.duration == pytest.approx(expected, abs=1e-12)


@given(b=st.lists(st.floats(1e-4, 1e-2), min_size=2, max_size=2),
       took_b=st.lists(st.floats(0, 1e-2), min_size=2, max_size=2),
       took_w=st.lists(st.floats(1e-4, 1e-2), min_size=2, max_size=2))
def test_a_split_backward_is_calibrated_apart_for_b_and_w(b, took_b, took_w):
    """zb-h1: every B of stage s took took_b[s] and every W took_w[s] (a first stage's B
    computes no input gradient: near 0); the calibrated simulation gives each what it took,
    where one median of both would give neither."""
    partition = _partition([1e-3, 1e-3], b)
    schedule = lower("zb-h1", 2, 2, [(0, 1)])
    steps = [simulate(schedule, [1e-3, 1e-3], took_b, weight=took_w).events for _ in range(3)]
    walls = [max(e.end for e in events) for events in steps]
    calibration = calibration_from(steps, walls, partition, [3, 3])
    calibrated = simulate(schedule, [s.f for s in partition.stages],
                          [s.b for s in partition.stages], overhead=calibration.overheads())
    for e in calibrated.events:
        if e.action.kind in (K.B, K.W):
            expected = (took_b if e.action.kind is K.B else took_w)[e.stage]
            assert e.duration == pytest.approx(expected, abs=1e-12)


@given(b=st.lists(st.floats(1e-4, 1e-2), min_size=4, max_size=4),
       over_b=st.lists(st.floats(0, 1e-3), min_size=4, max_size=4),
       over_w=st.lists(st.floats(0, 1e-3), min_size=4, max_size=4))
def test_whole_and_split_backwards_of_one_stage_get_one_overhead(b, over_b, over_w):
    """dualpipev: a stage runs whole backwards (B alone) and split ones (B, then W). Steps where
    every B of stage s took over_b[s] beyond its predicted share (the whole backward, or half
    of it) and every W over_w[s]: the calibration finds both, so the calibrated simulation
    gives every B and W what it took."""
    partition = Partition.evaluate(CostTable.from_arrays([1e-3] * 4, b), (1, 2, 3, 4), 4)
    schedule = lower("dualpipev", 4, 4, [(0, 1), (1, 2), (2, 3)], devices=2)
    overhead = {**{(s, K.B): over_b[s] for s in range(4)},
                **{(s, K.W): over_w[s] for s in range(4)}}
    steps = [simulate(schedule, 1e-3, b, overhead=overhead).events for _ in range(3)]
    walls = [max(e.end for e in events) for events in steps]
    calibration = calibration_from(steps, walls, partition, [2] * 4)
    np.testing.assert_allclose(calibration.backward, over_b, atol=1e-12)
    np.testing.assert_allclose(calibration.weight, over_w, atol=1e-12)
    calibrated = simulate(schedule, [s.f for s in partition.stages],
                          [s.b for s in partition.stages], overhead=calibration.overheads())
    took = {e.action: e.duration for e in steps[0]}
    for e in calibrated.events:
        assert e.duration == pytest.approx(took[e.action], abs=1e-12)


def test_the_medians_of_the_actions_count():
    partition = _partition([1.0, 1.0], [1.0, 1.0], p=1)
    runs = [[Event(0, Action(0, K.F, 0), 0.0, seconds)] for seconds in (2.0, 9.0, 3.0)]
    calibration = calibration_from(runs, [10.0, 10.0, 10.0], partition, [4])
    assert calibration.forward == (2.0, 0.0)  # median 3 - 1; stage 1 ran nothing: nothing
    assert calibration.backward == (0.0, 0.0) and calibration.send == (0.0, 0.0)
    assert calibration.step == 7.0  # 10 - 3, 10 - 9 and 10 - 2 wall-clock beyond the span
    with pytest.raises(ValueError, match="one wall-clock time per run"):
        calibration_from(runs, [10.0], partition, [4])


@pytest.fixture
def pipe_and_batch():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(16, 4))
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    plan = fxpipe.Plan(stages=2, micro_batches=4, schedule="1f1b", loss_fn=F.mse_loss)
    return fxpipe.compile(model, plan, example_inputs=(x,), example_target=y), x, y


def test_calibrate_times_steps_on_the_clock_it_is_given(pipe_and_batch):
    """On a clock that moves a million seconds per read, each step's wall time is 1e6 s, all
    of it but its actions' span (which the runtime's own clock measured) outside them."""
    pipe, x, y = pipe_and_batch
    ticks = itertools.count()
    calibration = fxpipe.calibrate(pipe, x, target=y, steps=4, warmup=1,
                                   clock=lambda: 1e6 * next(ticks))
    assert next(ticks) == 2 * (4 + 1)  # two reads a step, the warm-up's too
    assert calibration.steps == 4 and calibration.sizes == (4, 4, 4, 4)
    assert 0.9e6 < calibration.step <= 1e6
    assert calibration.bounds == pipe.partition.bounds
    assert "calibration over 4 steps" in str(calibration)


def test_calibrate_leaves_no_gradient_buffer_random_state_or_last_run_behind(pipe_and_batch):
    pipe, x, y = pipe_and_batch
    pipe.step(x, y)  # gradients the user has accumulated so far, and the run a report shows
    last_run = pipe.last_trace()
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    buffers = copy.deepcopy(dict(pipe.named_buffers()))
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    fxpipe.calibrate(pipe, x, target=y, steps=2, warmup=0)
    assert torch.equal(torch.rand(3), expected)
    assert pipe.last_trace() == last_run
    for name, p in pipe.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    for name, buffer in pipe.named_buffers():
        assert torch.equal(buffer, buffers[name]), name


def test_calibrate_says_what_it_needs():
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), torch.randn(4, 4)
    no_loss = fxpipe.compile(model, fxpipe.Plan(stages=2), example_inputs=(x,))
    with pytest.raises(fxpipe.FxpipeError, match=r"which need Plan\(loss_fn=...\)"):
        fxpipe.calibrate(no_loss, x, target=torch.randn(4, 2))
    streamed = fxpipe.compile(model, fxpipe.Plan(stages=2, schedule="async-1f1b",
                                                 loss_fn=F.mse_loss), example_inputs=(x,))
    with pytest.raises(fxpipe.FxpipeError, match="calibrate a pipeline compiled with "
                                                 "schedule='1f1b'"):
        fxpipe.calibrate(streamed, x, target=torch.randn(4, 2))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, loss_fn=F.mse_loss), example_inputs=(x,))
    for steps, warmup in [(0, 1), (2, -1), (1.5, 0), (True, 0)]:
        with pytest.raises(fxpipe.FxpipeError, match="takes steps >= 1 and warmup >= 0"):
            fxpipe.calibrate(pipe, x, target=torch.randn(4, 2), steps=steps, warmup=warmup)
