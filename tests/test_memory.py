"""The memory model's walk over a schedule: activations, message buffers, workspace."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.cost import CostTable, Partition
from fxpipe.memory import (
    FIELDS,
    StageBytes,
    device_peaks,
    in_flight,
    stage_peak,
    stage_terms,
    workspace_bytes,
)
from fxpipe.policy_copies import stage_copies, weight_copies
from fxpipe.schedules import async_one_f_one_b, build, gradients_let_go


@settings(max_examples=30, deadline=None)
@given(stages=st.integers(1, 5), p=st.integers(1, 8), schedule=st.sampled_from(
    ["gpipe", "1f1b"]), saved=st.floats(1.0, 1e6))
def test_without_messages_the_peak_holds_the_schedules_micro_batches_in_flight(
        stages, p, schedule, saved):
    peaks = device_peaks(schedule, stages, p, [StageBytes(saved)] * stages)
    assert [peak.activations for peak in peaks] == pytest.approx(
        [held * saved for held in in_flight(schedule, stages, p)])
    assert all(peak.boundary == 0 and peak.workspace == 0 for peak in peaks)


def test_gradients_sent_back_stay_until_the_step_ends_and_inputs_until_their_backward():
    """1F1B's last stage holds one micro-batch's activations and input (and the next input,
    posted ahead), and every gradient it sent back."""
    last = build("1f1b", 2, 4).actions[1]
    peak = stage_peak(last, {1: StageBytes(saved=100.0, received=10.0, sent_grads=1.0,
                                           workspace=5.0)})
    assert peak.activations == 100.0 and peak.workspace == 5.0
    # during the 3rd backward: its input, the 4th posted, 2 gradients sent back
    assert peak.boundary == 2 * 10.0 + 2 * 1.0


def test_an_output_sent_on_is_let_go_at_its_micro_batchs_backward():
    """Its gradient came back, so the receiver has it: 1F1B's first stage of two holds two
    micro-batches' sends at its first backward, and one after (the other's backward ran)."""
    first = build("1f1b", 2, 4).actions[0]
    peak = stage_peak(first, {0: StageBytes(saved=100.0, sent=7.0, sent_saved=3.0)})
    # the peak is the second forward: two micro-batches' activations, their sends' unsaved part
    assert (peak.activations, peak.boundary) == (200.0, 2 * (7.0 - 3.0))
    assert [str(a) for a in first if a.kind.is_compute] == [
        "0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    held = stage_terms([a for a in first if a.kind.is_compute])[:, 1, FIELDS.index("sent")]
    assert list(held) == [1, 2, 1, 2, 1, 2, 1, 0]  # sends held as each action runs


def test_gpipe_posts_every_receive_at_the_start():
    first = build("gpipe", 2, 3).actions[0]  # receives the outputs' gradients
    peak = stage_peak(first, {0: StageBytes(saved=100.0, sent=7.0, received_grads=2.0)})
    # as its backwards start: 3 micro-batches' activations and sent outputs, 3 gradients posted
    assert (peak.activations, peak.boundary) == (300.0, 3 * 7.0 + 3 * 2.0)


def test_workspace_is_the_largest_units_gradients_and_new_weight_gradient():
    assert workspace_bytes([8.0, 2.0], [1.0, 3.0], [3.0, 4.0], micro_batches=1) == 7.0
    assert workspace_bytes([8.0, 2.0], [1.0, 3.0], [3.0, 4.0], micro_batches=4) == 12.0


# --- the weight copies of a consistency policy (async-1f1b) ---------------------------------


@settings(max_examples=20, deadline=None)
@given(stages=st.integers(1, 4), p=st.integers(1, 4))
def test_stash_adds_a_copy_of_the_weights_per_version_in_flight(stages, p):
    """PipeDream's count: with one micro-batch per update, stage s holds N - s versions; with
    p >= N - s micro-batches per update, two at most (one where no step lands in between)."""
    copies = [stage_copies("stash", "async-1f1b", stages, p, s) for s in range(stages)]
    if p == 1:
        assert copies == [stages - s for s in range(stages)]
    assert copies[-1] == 1 and all(1 <= c <= 2 for c, s in zip(copies, range(stages))
                                   if p >= stages - s)
    cost = CostTable.from_arrays(np.ones(stages), np.ones(stages),
                                 param_bytes=np.arange(1, stages + 1) * 100.0)
    bounds = tuple(range(1, stages + 1))
    plain, stashed = (Partition.evaluate(cost, bounds, p, schedule="async-1f1b",
                                         consistency=c) for c in ("none", "stash"))
    for s, (a, b) in enumerate(zip(plain.stages, stashed.stages)):
        assert b.memory - a.memory == pytest.approx(copies[s] * cost.param_bytes[s])


@settings(max_examples=20, deadline=None)
@given(stages=st.integers(1, 4), p=st.integers(1, 4))
def test_only_predict_counts_the_last_gradients_beside_its_weight_copies(stages, p):
    """The stage's count is its policy's weight copies, and under predict the copy of the last
    gradients it keeps from a step on (its rule for SGD reads them); no policy keeps copies
    without a step inside the run."""
    streamed = async_one_f_one_b(stages, p, 2 * stages + 2).actions
    own = [[a for a in actions if a.stage == s] for s, actions in enumerate(streamed)]
    for policy in ("none", "stash", "2bw", "predict"):
        counted = [stage_copies(policy, "async-1f1b", stages, p, s) for s in range(stages)]
        assert counted == [weight_copies(policy, mine) + (policy == "predict")
                           for mine in own]
        assert [stage_copies(policy, "1f1b", stages, p, s) for s in range(stages)] == [
            weight_copies(policy, mine) for mine in build("1f1b", stages, p).actions]
    assert [stage_copies("none", "async-1f1b", stages, p, s) for s in range(stages)] == \
        [0] * stages


def test_the_copies_counted_follow_each_policys_rules():
    steps = build("async-1f1b", 2, 1, minibatches=6)
    own = [[a for a in actions if a.stage == s] for s, actions in enumerate(steps.actions)]
    assert [weight_copies("none", mine) for mine in own] == [0, 0]
    assert [weight_copies("stash", mine) for mine in own] == [2, 1]
    assert [weight_copies("2bw", mine) for mine in own] == [2, 1]  # the shadow: one more
    assert [weight_copies("predict", mine) for mine in own] == [1, 0]  # stage 1: no step between
    synchronous = [a for a in build("1f1b", 2, 4).actions[0]]
    assert weight_copies("stash", synchronous) == 1  # one version: its one copy
    assert weight_copies("2bw", synchronous) == 1


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs", "zbv", "dualpipev"])
def test_no_policy_keeps_no_copies_where_the_schedule_is_not_built_by_name(schedule):
    assert [stage_copies("none", schedule, 4, p, s) for p in (1, 4) for s in range(4)] == [0] * 8


def test_a_gradient_sent_back_is_let_go_once_the_sender_hears_from_its_receiver():
    # 1F1B's last stage of two: the earlier stage sends F2 only after its B0, so receiving F2
    # tells the last stage that its gradient of micro-batch 0 arrived; 2 and 3 wait for the end
    last = build("1f1b", 2, 4)
    assert gradients_let_go(last) == {1: {0: 4, 1: 6}}
    held = stage_terms([a for a in last.actions[1] if a.kind.is_compute], let_go={0: 4, 1: 6})
    assert list(held[:, 1, FIELDS.index("sent_grads")]) == [0, 0, 1, 1, 1, 1, 1, 1]


@settings(max_examples=30, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1"]), stages=st.integers(2, 5),
       p=st.integers(1, 8))
def test_a_gradient_is_let_go_after_the_backward_that_sent_it(schedule, stages, p):
    built = build(schedule, stages, p)
    for s, released in gradients_let_go(built).items():
        compute = [a for a in built.actions[s] if a.kind.is_compute]
        assert s > 0  # the first stage sends no gradient back
        for mb, at in released.items():
            sent = next(i for i, a in enumerate(compute) if a.kind.name == "B" and a.mb == mb)
            assert sent < at <= len(compute)
