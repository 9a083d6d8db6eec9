"""DualPipeV: PyTorch's action order, its V placement, its activations and its simulated step."""

from __future__ import annotations

import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxpipe import Plan, PlanError
from fxpipe.schedules import (
    Action,
    B,
    F,
    Schedule,
    W,
    add_communication,
    add_step,
    build,
    check_communication,
    device_peak_activations,
    dualpipev,
    one_f_one_b,
    peak_activations,
    zbv,
)
from fxpipe.simulate import simulate

DEVICES = st.integers(1, 5)


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, int]:
    """(N devices, p micro-batches), p >= 2N as DualPipeV needs."""
    n = draw(DEVICES)
    return n, draw(st.integers(2 * n, 5 * n))


def _pytorch_order(n: int, p: int) -> list[list[tuple[int, str, int]]]:
    """PyTorch's ScheduleDualPipeV order per rank as (stage, F/I/B/W, mb), each OVERLAP_F_B
    unrolled into its sub-actions as its runtime runs them, computed without stages or a
    process group."""
    from torch.distributed.pipelining import schedules as pts

    generate = getattr(getattr(pts, "ScheduleDualPipeV", None),
                       "_calculate_single_rank_operations", None)
    if generate is None:
        pytest.fail("torch.distributed.pipelining.schedules.ScheduleDualPipeV."
                    "_calculate_single_rank_operations (private API) moved or was renamed; "
                    "update this test to its new form")
    owner = types.SimpleNamespace(pp_group_size=n, _n_microbatches=p)
    order = []
    for rank in range(n):
        leaves = [leaf for a in generate(owner, rank) if a is not None
                  for leaf in (a.sub_actions or (a,))]
        order.append([(a.stage_index, a.computation_type.value, a.microbatch_index)
                      for a in leaves])
    return order


def _as_pytorch(schedule: Schedule) -> list[list[tuple[int, str, int]]]:
    """fxpipe's programs in PyTorch's kinds: a B whose W comes later is its I (input
    gradient), one without a W its B (full backward)."""
    order = []
    for program in schedule.device_programs:
        split = {(a.stage, a.mb) for a in program if a.kind is W}
        order.append([(a.stage, "I" if a.kind is B and (a.stage, a.mb) in split
                       else a.kind.value, a.mb) for a in program])
    return order


@given(shapes())
def test_each_device_runs_pytorchs_dualpipev_order(shape: tuple[int, int]):
    n, p = shape
    assert _as_pytorch(dualpipev(2 * n, p)) == _pytorch_order(n, p)


@given(shapes())
def test_lowered_it_cannot_hang_and_runs_every_micro_batch_once(shape: tuple[int, int]):
    n, p = shape
    schedule = dualpipev(2 * n, p)
    assert schedule == dualpipev(2 * n, p, devices=n) == build("dualpipev", 2 * n, p, devices=n)
    assert schedule.placement == (*range(n), *reversed(range(n)))  # down and back up
    check_communication(add_communication(schedule))
    check_communication(add_step(add_communication(schedule)))
    for s, stage in enumerate(schedule.actions):
        for kind in (F, B):
            assert sorted(a.mb for a in stage if a.kind is kind) == list(range(p))
        for a in stage:
            if a.kind is W:
                assert stage.index(Action(s, B, a.mb)) < stage.index(a)


@given(shapes())
def test_it_holds_1f1bs_activations_per_stage_and_pp_plus_one_per_device(shape):
    """Stage s holds at most 2N - s micro-batches (from F to B, or to W where the backward is
    split), 1F1B's on the same 2N stages; a device, its two stages' 2N + 1 at once: the
    activation memory per device of DualPipeV's comparison table (DeepSeek's DualPipe README,
    'PP + 1' for PP = 2N stages, counted with the paired F ahead of its B)."""
    n, p = shape
    schedule = dualpipev(2 * n, p)
    assert peak_activations(schedule) == peak_activations(one_f_one_b(2 * n, p)) \
        == tuple(2 * n - s for s in range(2 * n))
    assert device_peak_activations(schedule) == (2 * n + 1,) * n


@given(shapes(), st.floats(0.1, 10))
def test_with_equal_f_b_w_it_idles_only_while_micro_batch_0_comes_down(shape, t: float):
    """With F, B (input gradient) and W each t, a whole backward 2t, and free links, device
    N-1 starts no earlier than (N-1)t and every device has 6pt of work, so no schedule takes
    less than (6p + N-1)t: run one action at a time (each F&B pair as F then B), DualPipeV
    takes exactly that, as ZB-V does. (DeepSeek's bubble, (PP/2-1)(F&B + B - 3W), times
    overlapped F&B pairs, which one worker per device does not run.)"""
    n, p = shape
    timeline = simulate(dualpipev(2 * n, p), t, t, weight=t)
    assert timeline.makespan == pytest.approx((6 * p + n - 1) * t)
    assert timeline.device_busy == pytest.approx((6 * p * t,) * n)
    assert timeline.makespan == pytest.approx(simulate(zbv(2 * n, p), t, t, weight=t).makespan)
    assert timeline.bubble == pytest.approx((n - 1) / (6 * p + n - 1))


def test_a_whole_backward_takes_the_input_and_weight_gradients_time():
    schedule = dualpipev(4, 4)
    timeline = simulate(schedule, 1.0, 2.0, weight=0.5)
    split = {(a.stage, a.mb) for stage in schedule.actions for a in stage if a.kind is W}
    whole = {(s, m) for s in range(4) for m in range(4)} - split
    assert split and whole
    for s, m in whole:
        assert timeline.event(Action(s, B, m)).duration == 2.5
    for s, m in split:
        assert timeline.event(Action(s, B, m)).duration == 2.0


def test_it_refuses_shapes_it_cannot_run():
    with pytest.raises(ValueError, match=r"needs micro_batches >= stages: give "
                                         r"micro_batches >= 4, not 3"):
        dualpipev(4, 3)
    with pytest.raises(ValueError, match="dualpipev places two stages on each device, so "
                                         "stages=5 must be even"):
        dualpipev(5, 6)
    with pytest.raises(ValueError, match="4 stages need devices=2, not 4; use 8 stages"):
        dualpipev(4, 4, devices=4)


@pytest.mark.parametrize(("fields", "message"), [
    ({"stages": 4, "stages_per_device": 2, "micro_batches": 3},
     r"needs at least one micro-batch per stage: give micro_batches >= 4 \(got 3\)"),
    ({"stages": 4, "micro_batches": 4}, r"dualpipev places exactly two stages on each device"),
    ({"stages": 6, "stages_per_device": 3, "micro_batches": 6},
     r"dualpipev places exactly two stages .* give stages_per_device=2"),
    ({"stages": 4, "stages_per_device": 2, "micro_batches": "auto"},
     r"cannot be chosen \(micro_batches='auto'"),
])
def test_plan_refuses_what_dualpipev_cannot_run(fields, message):
    with pytest.raises(PlanError, match=message):
        Plan(schedule="dualpipev", **fields)
    plan = Plan(stages=4, stages_per_device=2, schedule="dualpipev", micro_batches=4,
                costs="none")
    assert plan.placement == (0, 1, 1, 0) and plan.device_count == 2


def test_a_default_count_too_small_for_dualpipev_names_the_batch():
    plan = Plan(stages=4, stages_per_device=2, schedule="dualpipev", costs="none")
    with pytest.raises(PlanError, match=r"a batch of at least 4 samples; the example batch has "
                                        r"2: give a larger batch or fewer stages"):
        plan.for_batch(2)
    assert plan.for_batch(8).micro_batches == 4
