"""Several stages per device: placement, device programs, their lowering, check and timing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxpipe.schedules import (
    VIRTUAL_SCHEDULES,
    Action,
    ActionKind,
    B,
    DeadlockError,
    F,
    Schedule,
    W,
    add_communication,
    add_step,
    build,
    chain,
    check_communication,
    device_peak_activations,
    gpipe,
    interleaved_one_f_one_b,
    looped_bfs,
    lower,
    one_f_one_b,
    peak_activations,
    zbv,
)
from fxpipe.simulate import simulate

K = ActionKind
DEVICES = st.integers(2, 4)
VIRTUAL = st.integers(1, 3)


@st.composite
def virtual_schedules(draw: st.DrawFn, names: tuple[str, ...] = tuple(VIRTUAL_SCHEDULES)
                      ) -> Schedule:
    """A generated schedule of N devices x v stages each, with a micro-batch count it takes."""
    name = draw(st.sampled_from(names))
    n, v = draw(DEVICES), 2 if name in ("zbv", "dualpipev") else draw(VIRTUAL)
    if name == "interleaved-1f1b" and v > 1:  # Megatron's groups of N micro-batches
        p = n * draw(st.integers(1, 3))
    elif name == "dualpipev":  # at least one micro-batch per stage
        p = draw(st.integers(2 * n, 4 * n))
    else:
        p = draw(st.integers(1, 3 * n))
    return build(name, n * v, p, devices=n)


def placed(schedule: Schedule, expected: list[int]) -> None:
    assert schedule.placement == tuple(expected)
    for d, program in enumerate(schedule.device_programs):
        assert {a.stage for a in program} == set(schedule.stages_on(d))


# --- generators -------------------------------------------------------------------------------


@given(virtual_schedules())
def test_every_stage_runs_each_forward_and_backward_once_in_its_program(schedule: Schedule):
    every = list(range(schedule.micro_batches))
    for s, stage in enumerate(schedule.actions):
        assert sorted(a.mb for a in stage if a.kind is F) == every
        assert sorted(a.mb for a in stage if a.kind is B) == every
        assert all(stage.index(Action(s, F, m)) < stage.index(Action(s, B, m)) for m in every)
        weights = [a.mb for a in stage if a.kind is W]  # ZB-V splits every backward, DualPipeV
        if schedule.name == "zbv":  # those of its warm-up and cool-down, the rest none
            assert sorted(weights) == every
        elif schedule.name != "dualpipev":
            assert weights == []
        assert len(set(weights)) == len(weights)
        assert all(stage.index(Action(s, B, m)) < stage.index(Action(s, W, m)) for m in weights)
    ran = sorted(map(str, (a for program in schedule.device_programs for a in program)))
    assert ran == sorted(map(str, (a for stage in schedule.actions for a in stage)))


@given(virtual_schedules(("interleaved-1f1b", "looped-bfs")))
def test_stages_are_placed_round_robin(schedule: Schedule):
    n = schedule.devices
    assert schedule.stages % n == 0
    placed(schedule, [s % n for s in range(schedule.stages)])


@given(DEVICES, st.integers(1, 10))
def test_zbv_places_its_stages_in_a_v(n: int, p: int):
    schedule = zbv(2 * n, p)
    assert schedule == zbv(2 * n, p, devices=n) == build("zbv", 2 * n, p, devices=n)
    placed(schedule, [*range(n), *reversed(range(n))])  # down the devices and back up


@given(DEVICES, st.integers(1, 8))
def test_one_stage_per_device_is_1f1b_and_gpipe(n: int, p: int):
    for virtual, plain in ((interleaved_one_f_one_b(n, p, devices=n), one_f_one_b(n, p)),
                           (looped_bfs(n, p, devices=n), gpipe(n, p))):
        assert virtual.actions == plain.actions
        assert virtual.device_programs == plain.device_programs
        timed = simulate(virtual, 1.0, 2.0, 0.5, 0.5), simulate(plain, 1.0, 2.0, 0.5, 0.5)
        assert [(e.action, e.start, e.end) for e in timed[0].events] == \
               [(e.action, e.start, e.end) for e in timed[1].events]


@given(DEVICES, VIRTUAL, st.integers(1, 8))
def test_looped_bfs_holds_every_micro_batch_on_every_stage(n: int, v: int, p: int):
    """Breadth-first runs all p micro-batches through a stage before its next one (Lamy-Poirier
    2022), so every stage holds all p at once, and a device v * p."""
    schedule = looped_bfs(n * v, p, devices=n)
    assert peak_activations(schedule) == (p,) * (n * v)
    assert device_peak_activations(schedule) == (v * p,) * n


@given(DEVICES, VIRTUAL, st.integers(1, 3))
def test_interleaved_holds_its_warm_up_plus_one_per_device(n: int, v: int, groups: int):
    """Device r warms up with (N-r-1)*2 + (v-1)*N forwards (Megatron-LM's
    forward_backward_pipelining_with_interleaving; N-r-1 when v = 1, as 1F1B), so it holds one
    more than that, capped by its v*p forwards."""
    p = n * groups
    schedule = interleaved_one_f_one_b(n * v, p, devices=n)
    warmups = [(n - r - 1) * (2 if v > 1 else 1) + (v - 1) * n for r in range(n)]
    assert device_peak_activations(schedule) == tuple(min(w + 1, v * p) for w in warmups)
    assert all(peak <= min(n * v, v * p) + n - 1 for peak in device_peak_activations(schedule))


@given(DEVICES, st.integers(1, 10))
def test_zbv_holds_no_more_than_1f1b_on_its_first_device(n: int, p: int):
    """ZB-V's claim (Qi et al. 2024, §6): the peak activation memory of 1F1B, N micro-batches
    through a whole stage, i.e. 2N through a half-size chunk, counted up to B and up to W."""
    schedule = zbv(2 * n, p)
    to_w = []
    for program in schedule.device_programs:
        held = [0]
        for a in program:
            held.append(held[-1] + (a.kind is F) - (a.kind is W))
        to_w.append(max(held))
    peaks = device_peak_activations(schedule)
    assert all(peak <= 2 * n for peak in (*peaks, *to_w))
    if p >= 2 * n - 1:
        assert peaks == tuple(to_w) == (2 * n,) * n


def test_interleaved_runs_chunks_in_groups_of_n_micro_batches():
    # device 1 (last) of 2 holds stages 1 and 3, warms up with (v-1)*N = 2 forwards, then runs
    # forward k+2 and backward k in turn: forwards 1F0 1F1 3F0 3F1 1F2 1F3 3F2 3F3 (groups of
    # N = 2 micro-batches per chunk), backwards the same with the chunks reversed
    schedule = interleaved_one_f_one_b(4, 4, devices=2)
    assert " ".join(map(str, schedule.device_programs[1])) == (
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3")
    assert " ".join(map(str, schedule.device_programs[0])) == (  # warm-up 2*1 + 2 = 4
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3")


# --- lowering and the check -------------------------------------------------------------------


@given(virtual_schedules(), st.booleans(), st.data())
def test_lowered_device_programs_pass_the_communication_check(schedule: Schedule, step: bool,
                                                              data: st.DataObject):
    n = schedule.stages  # the chain plus any skip edges
    skips = [(a, b) for a in range(n) for b in range(a + 2, n)]
    drawn = data.draw(st.lists(st.sampled_from(skips), unique=True, max_size=3)) if skips else []
    edges = chain(n) + tuple(drawn)
    lowered = add_communication(schedule, edges)
    if step:
        lowered = add_step(lowered, allreduce=True)
    check_communication(lowered)
    for d, program in enumerate(lowered.device_programs):
        compute = [a for a in program if a.kind.is_compute]
        assert compute == list(schedule.device_programs[d])  # only comm and steps were added
        for i, a in enumerate(program):  # receives right before their compute, sends right after
            if a.kind.is_recv:
                following = next(x for x in program[i:] if not x.kind.is_recv)
                assert following == Action(a.stage, F if a.kind is K.RECV_F else B, a.mb)
            if a.kind.is_send:
                leading = next(x for x in reversed(program[:i]) if not x.kind.is_send)
                assert leading == Action(a.stage, F if a.kind is K.SEND_F else B, a.mb)
        if step:
            last = max(i for i, a in enumerate(program) if a.kind.is_compute)
            assert all(a.kind in (K.ALLREDUCE, K.STEP) or a.kind.is_send
                       for a in program[last + 1:] if not a.kind.is_recv)
            assert sum(a.kind is K.STEP for a in program) == len(lowered.stages_on(d))


def test_lower_by_name_places_and_checks():
    lowered = lower("interleaved-1f1b", 6, 3, chain(6), devices=3)
    assert lowered.lowered and lowered.devices == 3
    assert lowered == add_communication(interleaved_one_f_one_b(6, 3, devices=3))


def test_a_device_program_that_runs_a_later_stage_first_deadlocks():
    # one device, two stages: stage 1's forward waits for stage 0's, which comes after it
    schedule = Schedule.from_lists([["0F0", "0B0"], ["1F0", "1B0"]], placement=(0, 0),
                                   programs=[["1F0", "0F0", "0B0", "1B0"]])
    with pytest.raises(DeadlockError, match=r"device 0 waits at 1RF0<0 \(action 0\) for 0SF0>1"):
        check_communication(add_communication(schedule))
    with pytest.raises(DeadlockError, match="device 0 waits at 1RF0<0"):
        simulate(schedule, 1.0, 1.0)


# --- the simulator ----------------------------------------------------------------------------


@given(virtual_schedules(), st.integers(0, 2**32 - 1), st.booleans())
def test_a_device_runs_one_action_at_a_time_in_program_order(schedule: Schedule, seed: int,
                                                             links: bool):
    rng = np.random.default_rng(seed)
    shape = (schedule.stages, schedule.micro_batches)
    fwd, bwd, wgt = (rng.uniform(0.1, 5.0, shape) for _ in range(3))
    if schedule.name not in ("zbv", "dualpipev"):
        wgt[:] = 0.0
    link = rng.uniform(0.0, 2.0, schedule.stages) if links else 0.0
    timeline = simulate(schedule, fwd, bwd, link, link, weight=wgt)
    for program in timeline.schedule.device_programs:
        events = [timeline.event(a) for a in program]
        assert all(x.end <= y.start + 1e-9 for x, y in zip(events, events[1:]))
    for s in range(schedule.stages):
        for m in range(schedule.micro_batches):
            f, b = timeline.event(Action(s, F, m)), timeline.event(Action(s, B, m))
            assert f.duration == pytest.approx(fwd[s, m]) and f.end <= b.start + 1e-9
            if s > 0:
                assert timeline.event(Action(s - 1, F, m)).end <= f.start + 1e-9
                assert b.end <= timeline.event(Action(s - 1, B, m)).start + 1e-9
            if Action(s, W, m) in schedule.actions[s]:
                assert b.end <= timeline.event(Action(s, W, m)).start + 1e-9
                assert b.duration == pytest.approx(bwd[s, m])
            else:  # a whole backward: the input and the weight gradients
                assert b.duration == pytest.approx(bwd[s, m] + wgt[s, m])
    assert sum(timeline.device_busy) == pytest.approx(fwd.sum() + bwd.sum() + wgt.sum())
    assert max(timeline.device_busy) <= timeline.makespan + 1e-9


@given(DEVICES, VIRTUAL, st.integers(1, 3), st.floats(0.1, 10), st.floats(0.1, 10))
def test_interleaved_bubble_is_megatrons(n: int, v: int, groups: int, tf: float, tb: float):
    """Narayanan et al. 2021 (Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM, §2.2.2): with v model chunks per device, each of forward time tf/v and
    backward time tb/v, the pipeline bubble takes (N-1)(tf+tb)/v, so with free links a step of
    m micro-batches takes (m + (N-1)/v)(tf+tb) and the bubble fraction of the step is
    (N-1)/(v*m + N-1) (their bubble time fraction (1/v)(N-1)/m is relative to the ideal
    m(tf+tb)); for v >= 2 it is below 1F1B's (N-1)/(m + N-1)."""
    m = n * groups
    schedule = interleaved_one_f_one_b(n * v, m, devices=n)
    timeline = simulate(schedule, tf / v, tb / v)
    assert timeline.makespan == pytest.approx((m + (n - 1) / v) * (tf + tb))
    assert timeline.bubble == pytest.approx((n - 1) / (v * m + n - 1))
    plain = simulate(one_f_one_b(n, m), tf, tb).bubble
    assert plain == pytest.approx((n - 1) / (m + n - 1))
    if v >= 2:
        assert timeline.bubble < plain - 1e-9


@given(DEVICES, st.integers(0, 11), st.floats(0.1, 10))
def test_zbv_idles_only_while_the_first_micro_batch_comes_down(n: int, extra: int, t: float):
    """ZB-V with equal F, B and W times t per stage and free links (Qi et al. 2024, §6: no
    bubble when T_F = T_B = T_W): device N-1 can start no earlier than (N-1)t, after stages
    0..N-2 have run micro-batch 0 forward, and every device has 6pt of work, so no schedule
    takes less than (6p + N-1)t; ZB-V takes exactly that for p >= 2N-1 micro-batches, less
    than 1F1B's (p + N-1) * 6t for the same model on N stages."""
    p = 2 * n - 1 + extra
    timeline = simulate(zbv(2 * n, p), t, t, weight=t)
    assert timeline.makespan == pytest.approx((6 * p + n - 1) * t)
    assert timeline.device_busy == pytest.approx((6 * p * t,) * n)
    assert timeline.makespan < simulate(one_f_one_b(n, p), 2 * t, 4 * t).makespan


def test_identity_placement_times_like_no_placement():
    plain = add_communication(one_f_one_b(3, 4))
    placed_ = Schedule(plain.name, 3, 4, plain.actions, placement=(0, 1, 2),
                       programs=plain.actions)
    costs = (np.arange(1.0, 4.0), 2.0, {(0, 1): 0.5, (1, 2): 0.25}, 0.75)
    a, b = simulate(plain, *costs), simulate(placed_, *costs)
    assert a.events == b.events and a.transfers == b.transfers and a.bubble == b.bubble


def test_a_hand_off_within_a_device_takes_no_link_time():
    # stages 0 and 1 share device 0; stage 2 is on device 1
    schedule = Schedule.from_lists(
        [["0F0", "0B0"], ["1F0", "1B0"], ["2F0", "2B0"]], placement=(0, 0, 1),
        programs=[["0F0", "1F0", "1B0", "0B0"], ["2F0", "2B0"]])
    timeline = simulate(schedule, 1.0, 1.0, 10.0, 10.0)
    # 0F0 at 0, 1F0 at 1 at once, 2F0 after the link: 2 + 10, 2B0 at 13, 1B0 at 14 + 10
    starts = {a: timeline.event(Action.parse(a)).start for a in ("1F0", "2F0", "1B0", "0B0")}
    assert starts == {"1F0": 1.0, "2F0": 12.0, "1B0": 24.0, "0B0": 25.0}
    assert timeline.makespan == 26.0
    assert timeline.device_busy == (4.0, 2.0)
    assert timeline.bubble == pytest.approx(1 - 6.0 / (2 * 26.0))


def test_stage_pairs_on_the_same_devices_share_one_link():
    # round-robin on 2 devices: edges (0, 1) and (2, 3) both cross from device 0 to device 1
    schedule = Schedule.from_lists(
        [["0F0", "0F1"], ["1F0", "1F1"], ["2F0", "2F1"], ["3F0", "3F1"]], placement=(0, 1, 0, 1),
        programs=[["0F0", "2F0", "0F1", "2F1"], ["1F0", "3F0", "1F1", "3F1"]])
    timeline = simulate(schedule, 1.0, 1.0, 4.0, 4.0)
    wire = {str(e.action): (e.start, e.end) for e in timeline.transfers}
    # 0F0 [0, 1] sends [1, 5]; 1F0 [5, 6] sends [6, 10]; 2F0 [10, 11] sends [11, 15]; 0F1
    # [11, 12] finds the device link busy until 15, though stage pair (0, 1) is idle
    assert wire["2SF0>3"] == (11.0, 15.0)
    assert wire["0SF1>1"] == (15.0, 19.0)
    assert timeline.makespan == 30.0


def test_timeline_draws_one_row_per_device():
    lines = simulate(zbv(4, 3), 1.0, 1.0, weight=1.0).ascii(100).splitlines()
    assert lines[0] == "zbv: 4 stages x 3 micro-batches on 2 devices"
    assert len(lines) == 4 and lines[3].startswith("step time 19,")
    assert lines[1].startswith("0 |0F0") and "3W2" in lines[1] and "1F0" not in lines[1]
    assert lines[2].startswith("1 |.") and "2F0" in lines[2] and "0F0" not in lines[2]


# --- errors -----------------------------------------------------------------------------------


def test_generators_refuse_shapes_they_cannot_run():
    with pytest.raises(ValueError, match=r"micro_batches=6 must be a multiple of devices=4; "
                                         r"use 4 or 8"):
        interleaved_one_f_one_b(8, 6, devices=4)
    with pytest.raises(ValueError, match=r"micro_batches=3 must be a multiple of devices=4; "
                                         r"use 4$"):
        interleaved_one_f_one_b(8, 3, devices=4)
    with pytest.raises(ValueError, match=r"stages=6 do not split evenly over devices=4"):
        looped_bfs(6, 4, devices=4)
    with pytest.raises(ValueError, match="devices must be a positive integer, not 0"):
        looped_bfs(4, 4, devices=0)
    with pytest.raises(ValueError, match="stages=5 must be even"):
        zbv(5, 4)
    with pytest.raises(ValueError, match="4 stages need devices=2, not 4; use 8 stages"):
        zbv(4, 4, devices=4)
    with pytest.raises(ValueError, match=r"say how many devices: build\('looped-bfs', 4, 2, "
                                         r"devices=N\)"):
        build("looped-bfs", 4, 2)
    with pytest.raises(ValueError, match=r"unknown schedule 'zb'; choose one of 'gpipe'.*"
                                         r"'interleaved-1f1b', 'looped-bfs', 'zbv'"):
        build("zb", 2, 3)
    assert build("interleaved-1f1b", 4, 2, devices=2) == interleaved_one_f_one_b(4, 2, devices=2)


def test_schedule_rejects_bad_placements_and_programs():
    lists = [["0F0", "0B0"], ["1F0", "1B0"]]
    good = ["0F0", "1F0", "1B0", "0B0"]
    cases = [
        (dict(placement=(0,)), r"must give one device \(an integer >= 0\) for each of its 2"),
        (dict(placement=(0, -1)), r"must give one device"),
        (dict(placement=(1, 1), programs=[[], good]), r"leaves devices \[0\] without a stage"),
        (dict(placement=(0, 0)), r"devices \[0\] of schedule 'custom' hold several stages; "
                                 "give programs"),
        (dict(placement=(0, 0), programs=[good, []]), "has 2 programs for 1 devices"),
        (dict(placement=(0, 1), programs=[good[:1], good[1:]]),
         "device 1's program holds 0B0, but stage 0 is on device 0"),
        (dict(placement=(0, 0), programs=[["0F0", "1F0", "0B0", "1B0", "0B0"]]),
         "device 0's program runs 0B0 as stage 0's action 2, but stage 0's list has nothing "
         "more there"),
        (dict(placement=(0, 0), programs=[["0F0", "1F0", "1B0"]]),
         "runs nothing more as stage 0's action 1, but stage 0's list has 0B0 there"),
        (dict(placement=(0, 0), programs=[["0B0", "1F0", "1B0", "0F0"]]),
         "runs 0B0 as stage 0's action 0, but stage 0's list has 0F0 there"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            Schedule.from_lists(lists, **fields)


def test_schedule_prints_its_device_programs():
    schedule = add_communication(looped_bfs(4, 1, devices=2))
    lines = str(schedule).splitlines()
    assert lines[0] == "looped-bfs: 4 stages x 1 micro-batches on 2 devices"
    assert lines[5:] == [
        "device 0: 0F0 0SF0>1 2RF0<1 2F0 2SF0>3 2RB0<3 2B0 2SB0>1 0RB0<1 0B0",
        "device 1: 1RF0<0 1F0 1SF0>2 3RF0<2 3F0 3B0 3SB0>2 1RB0<2 1B0 1SB0>0",
    ]
