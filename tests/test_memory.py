"""The memory model's walk over a schedule: activations, message buffers, workspace."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.memory import StageBytes, device_peaks, in_flight, stage_peak, workspace_bytes
from fxpipe.schedules import build


@settings(max_examples=30, deadline=None)
@given(stages=st.integers(1, 5), p=st.integers(1, 8), schedule=st.sampled_from(
    ["gpipe", "1f1b"]), saved=st.floats(1.0, 1e6))
def test_without_messages_the_peak_holds_the_schedules_micro_batches_in_flight(
        stages, p, schedule, saved):
    peaks = device_peaks(schedule, stages, p, [StageBytes(saved)] * stages)
    assert [peak.activations for peak in peaks] == pytest.approx(
        [held * saved for held in in_flight(schedule, stages, p)])
    assert all(peak.boundary == 0 and peak.workspace == 0 for peak in peaks)


def test_sends_stay_until_the_step_ends_and_the_last_stage_keeps_its_inputs():
    """1F1B's last stage holds one micro-batch's activations, but every gradient it sent back
    and (the outputs' graph keeps them) every input it received, by its last backward."""
    last = build("1f1b", 2, 4).actions[1]
    q = StageBytes(saved=100.0, received=10.0, sent_grads=1.0, workspace=5.0, inputs_kept=True)
    peak = stage_peak(last, {1: q})
    assert peak.activations == 100.0 and peak.workspace == 5.0
    assert peak.boundary == 4 * 10.0 + 3 * 1.0  # during the 4th backward: 3 gradients sent
    forgetting = stage_peak(last, {1: StageBytes(100.0, 10.0, sent_grads=1.0, workspace=5.0)})
    assert forgetting.total < peak.total


def test_gpipe_posts_every_receive_at_the_start():
    first = build("gpipe", 2, 3).actions[0]  # receives the outputs' gradients
    peak = stage_peak(first, {0: StageBytes(saved=100.0, sent=7.0, received_grads=2.0)})
    # as its backwards start: 3 micro-batches' activations and sent outputs, 3 gradients posted
    assert (peak.activations, peak.boundary) == (300.0, 3 * 7.0 + 3 * 2.0)


def test_workspace_is_the_largest_units_gradients_and_new_weight_gradient():
    assert workspace_bytes([8.0, 2.0], [1.0, 3.0], [3.0, 4.0], micro_batches=1) == 7.0
    assert workspace_bytes([8.0, 2.0], [1.0, 3.0], [3.0, 4.0], micro_batches=4) == 12.0
