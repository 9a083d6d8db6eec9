"""Schedules as data, their lowering and the event simulator: ALGORITHMS §1 and §6 properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fxpipe.cost import CostTable, Partition
from fxpipe.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    B,
    DeadlockError,
    F,
    Schedule,
    ScheduleError,
    W,
    add_communication,
    add_step,
    async_one_f_one_b,
    build,
    chain,
    check_communication,
    gpipe,
    one_f_one_b,
    peak_activations,
)
from fxpipe.simulate import simulate

K = ActionKind
STAGES = st.integers(1, 4)
MICRO_BATCHES = st.integers(1, 8)
MINIBATCHES = st.integers(1, 3)


@st.composite
def schedules(draw: st.DrawFn, names: tuple[str, ...] = tuple(SCHEDULES)) -> Schedule:
    name = draw(st.sampled_from(names))
    n, p = draw(STAGES), draw(MICRO_BATCHES)
    if name == "async-1f1b":
        return build(name, n, p, minibatches=draw(MINIBATCHES))
    return build(name, n, p)


@st.composite
def edge_sets(draw: st.DrawFn, stages: int) -> tuple[tuple[int, int], ...]:
    """The chain plus any skip edges (src, dst > src + 1)."""
    skips = [(a, b) for a in range(stages) for b in range(a + 2, stages)]
    chosen = draw(st.lists(st.sampled_from(skips), unique=True)) if skips else []
    return chain(stages) + tuple(chosen)


def micro_batch_count(schedule: Schedule) -> int:
    return schedule.micro_batches * schedule.minibatches


def random_times(seed: int, shape: tuple[int, ...], low: float = 0.1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, 5.0, shape)


# --- actions ----------------------------------------------------------------------------------


@st.composite
def actions(draw: st.DrawFn) -> Action:
    kind = draw(st.sampled_from(list(ActionKind)))
    if kind in (K.STEP, K.ALLREDUCE):
        return Action(draw(st.integers(0, 20)), kind, draw(st.none() | st.integers(0, 20)))
    mb = draw(st.integers(0, 200))
    if kind in (K.SEND_F, K.RECV_B):  # the peer is a later stage
        stage = draw(st.integers(0, 20))
        return Action(stage, kind, mb, draw(st.integers(stage + 1, 21)))
    if kind in (K.SEND_B, K.RECV_F):  # the peer is an earlier stage
        stage = draw(st.integers(1, 21))
        return Action(stage, kind, mb, draw(st.integers(0, stage - 1)))
    return Action(draw(st.integers(0, 20)), kind, mb)


def test_compact_form_examples():
    assert str(Action(1, F, 0)) == "1F0"
    assert Action.parse("1F0") == Action(1, F, 0)
    assert str(Action(0, K.SEND_F, 3, 1)) == "0SF3>1"
    assert str(Action(1, K.RECV_B, 12, 3)) == "1RB12<3"
    assert str(Action(0, K.STEP)) == "0STEP"
    assert Action(2, "B", 5) == Action(2, B, 5)  # kinds may be given by their code


@settings(max_examples=300)
@given(actions())
def test_compact_form_round_trips_for_every_kind(action: Action):
    text = str(action)
    assert Action.parse(text) == action
    assert hash(Action.parse(text)) == hash(action)
    assert repr(action) == text
    if action.kind.is_send or action.kind.is_recv:
        partner = action.partner  # the other end of the message, on the peer stage
        assert (partner.stage, partner.peer, partner.mb) == (action.peer, action.stage, action.mb)
        assert partner.kind.is_send != action.kind.is_send and partner.partner == action
    else:
        with pytest.raises(ValueError, match="not a send or a receive"):
            _ = action.partner


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "cannot parse"),
        ("F0", "cannot parse"),
        ("1X0", "cannot parse"),
        ("1F", "needs a micro-batch"),
        ("1SF3", "needs the peer"),
        ("1F0>2", "takes no peer"),
        ("1SF3<0", "'>' for sends"),
        ("1RF3>2", "'<' for receives"),
        ("1SF3>0", "later stage"),
        ("1RB3<0", "later stage"),
        ("1SB3>2", "earlier stage"),
    ],
)
def test_parse_rejects_malformed_actions(text: str, message: str):
    with pytest.raises(ValueError, match=message):
        Action.parse(text)


def test_constructor_rejects_bad_fields():
    with pytest.raises(ValueError, match="unknown action kind 'X'"):
        Action(0, "X", 0)
    with pytest.raises(ValueError, match="non-negative integer"):
        Action(-1, F, 0)
    with pytest.raises(ValueError, match="non-negative integer"):
        Action(0, F, 1.5)
    with pytest.raises(ValueError, match=r"Action\.stage must be a non-negative integer, not None"):
        Action(None, F, 0)
    assert Action(np.int64(2), F, np.int64(3)) == Action(2, F, 3)  # numpy indices are fine


# --- generators -------------------------------------------------------------------------------


@given(schedules())
def test_every_forward_and_backward_appears_once_per_stage(schedule: Schedule):
    every = list(range(micro_batch_count(schedule)))
    for s, stage in enumerate(schedule.actions):
        assert sorted(a.mb for a in stage if a.kind is F) == every
        assert sorted(a.mb for a in stage if a.kind is B) == every
        assert all(a.stage == s and (a.kind.is_compute or a.kind is K.STEP) for a in stage)
        position = {a: i for i, a in enumerate(stage)}
        assert all(position[Action(s, F, m)] < position[Action(s, B, m)] for m in every)


@given(schedules(("gpipe", "1f1b")))
def test_synchronous_schedules_hold_one_mini_batch_and_no_step(schedule: Schedule):
    assert schedule.minibatches == 1
    assert not any(a.kind is K.STEP for stage in schedule.actions for a in stage)


@given(STAGES, MICRO_BATCHES, MINIBATCHES)
def test_async_steps_once_per_mini_batch_right_after_its_last_backward(n: int, p: int, k: int):
    schedule = async_one_f_one_b(n, p, k)
    for s, stage in enumerate(schedule.actions):
        steps = [i for i, a in enumerate(stage) if a.kind is K.STEP]
        assert [stage[i].mb for i in steps] == list(range(k))
        assert [stage[i - 1] for i in steps] == [Action(s, B, j * p + p - 1) for j in range(k)]


@given(STAGES, MICRO_BATCHES)
def test_one_f_one_b_warms_up_with_n_minus_s_minus_1_forwards(n: int, p: int):
    for s, stage in enumerate(one_f_one_b(n, p).actions):
        kinds = "".join(a.kind.value for a in stage)
        warmup = min(n - s - 1, p)
        # warm-up forwards, then strictly alternating F B, then the draining backwards
        assert kinds == "F" * warmup + "FB" * (p - warmup) + "B" * warmup


def held_activations(stage: tuple[Action, ...]) -> int:
    held = peak = 0
    for a in stage:
        held += 1 if a.kind is F else -1 if a.kind is B else 0
        peak = max(peak, held)
    return peak


@given(schedules())
def test_in_flight_activations_meet_the_bounds(schedule: Schedule):
    n = schedule.stages
    peaks = [held_activations(stage) for stage in schedule.actions]
    assert peak_activations(schedule) == tuple(peaks)
    if schedule.name == "gpipe":
        assert peaks == [schedule.micro_batches] * n
    else:  # 1f1b and async-1f1b: at most N - s on stage s, however long the stream
        assert all(peak <= n - s for s, peak in enumerate(peaks))
        assert all(peak == min(n - s, micro_batch_count(schedule)) for s, peak in enumerate(peaks))


# --- weight versions (async) ------------------------------------------------------------------


@given(STAGES, MICRO_BATCHES, MINIBATCHES)
def test_async_backward_meets_its_own_mini_batch_version_and_forward_lags(n, p, k):
    schedule = async_one_f_one_b(n, p, k)
    for s in range(n):
        for m in range(p * k):
            fwd, bwd = Action(s, F, m), Action(s, B, m)
            assert schedule.minibatch(fwd) == schedule.minibatch(bwd) == m // p
            assert schedule.weight_version(bwd) == m // p
            lag = schedule.minibatch(fwd) - schedule.weight_version(fwd)
            # staleness of a forward: at most ceil((N-s-1)/p) updates, so one (PipeDream-2BW's
            # two weight versions) once p >= N - 1
            assert 0 <= lag <= math.ceil((n - s - 1) / p)


@given(STAGES, st.integers(1, 12))
def test_async_version_gap_is_pipeoptims_n_minus_rank_minus_1(n: int, count: int):
    schedule = async_one_f_one_b(n, 1, count)
    for s in range(n):
        for m in range(count):
            version = schedule.weight_version
            gap = version(Action(s, B, m)) - version(Action(s, F, m))
            assert gap == min(m, n - s - 1)


@given(schedules(("gpipe", "1f1b")))
def test_synchronous_schedules_see_one_weight_version(schedule: Schedule):
    stepped = add_step(schedule)
    for stage in stepped.actions:
        assert {stepped.weight_version(a) for a in stage} == {0}
    with pytest.raises(ValueError, match="not part of schedule"):
        stepped.weight_version(Action(0, F, 99))


# --- lowering ---------------------------------------------------------------------------------


@given(schedules(), st.data())
def test_lowered_schedules_pass_the_communication_check(schedule: Schedule, data):
    edges = data.draw(edge_sets(schedule.stages))
    lowered = add_step(add_communication(schedule, edges))
    check_communication(lowered)
    for s, stage in enumerate(lowered.actions):
        compute = [a for a in stage if a.kind.is_compute or a.kind is K.STEP]
        assert compute == [a for a in add_step(schedule).actions[s]]  # only comm was added
        consumers = {d for src, d in edges if src == s}
        producers = {src for src, d in edges if d == s}
        for kind, peers in ((K.SEND_F, consumers), (K.RECV_B, consumers),
                            (K.RECV_F, producers), (K.SEND_B, producers)):
            sent = sorted((a.mb, a.peer) for a in stage if a.kind is kind)
            assert sent == sorted((m, q) for m in range(micro_batch_count(schedule))
                                  for q in peers)


@given(schedules())
def test_add_step_closes_every_mini_batch_once(schedule: Schedule):
    stepped = add_step(schedule, allreduce=True)
    assert add_step(stepped, allreduce=True) == stepped  # idempotent
    for stage in stepped.actions:
        steps = [i for i, a in enumerate(stage) if a.kind is K.STEP]
        assert len(steps) == schedule.minibatches
        assert all(stage[i - 1].kind is K.ALLREDUCE for i in steps)
        assert stage[-1].kind is K.STEP
    if schedule.name == "async-1f1b":  # already closed: only the all-reduces are new
        assert add_step(schedule) == schedule


def lowered_gpipe(stages: int = 3, micro_batches: int = 2) -> list[list[Action]]:
    return [list(stage) for stage in add_communication(gpipe(stages, micro_batches)).actions]


def test_check_rejects_a_dropped_receive():
    lists = lowered_gpipe()
    lists[1].remove(Action.parse("1RF1<0"))
    with pytest.raises(ScheduleError, match=r"0SF1>1 on stage 0 has no matching 1RF1<0"):
        check_communication(Schedule.from_lists(lists))


def test_check_rejects_a_dropped_send_and_receive_pair():
    lists = lowered_gpipe()
    lists[0].remove(Action.parse("0SF1>1"))
    lists[1].remove(Action.parse("1RF1<0"))
    with pytest.raises(ScheduleError, match="not for micro-batches"):
        check_communication(Schedule.from_lists(lists))


def test_check_rejects_a_receive_after_its_forward():
    lists = lowered_gpipe()
    i = lists[1].index(Action.parse("1RF0<0"))
    lists[1][i], lists[1][i + 1] = lists[1][i + 1], lists[1][i]
    with pytest.raises(ScheduleError, match=r"1RF0<0 must come before 1F0"):
        check_communication(Schedule.from_lists(lists))


def test_check_rejects_receives_out_of_send_order():
    lists = lowered_gpipe()
    lists[1][0:6] = lists[1][3:6] + lists[1][0:3]  # stage 1 takes micro-batch 1 before 0
    with pytest.raises(ScheduleError, match="another order"):
        check_communication(Schedule.from_lists(lists))


def test_check_rejects_receives_that_wait_on_each_other():
    lists = [["0F0", "0RB0<1", "0B0", "0F1", "0SF1>1", "0SF0>1"],
             ["1RF1<0", "1F1", "1RF0<0", "1F0", "1B0", "1SB0>0"]]
    with pytest.raises(DeadlockError, match=r"stage 0 waits at 0RB0<1 .* for 1SB0>0"):
        check_communication(Schedule.from_lists(lists))


def test_lowering_rejects_bad_edges_and_lowered_input():
    with pytest.raises(ValueError, match=r"edge \(2, 1\) must satisfy"):
        add_communication(gpipe(3, 2), [(2, 1)])
    with pytest.raises(ValueError, match="not a \\(src, dst\\) pair"):
        add_communication(gpipe(3, 2), [(0,)])
    with pytest.raises(ValueError, match="already has SEND/RECV"):
        add_communication(add_communication(gpipe(3, 2)))


# --- the simulator ----------------------------------------------------------------------------


@given(schedules(), st.data(), st.integers(0, 2**32 - 1), st.booleans())
def test_simulated_times_respect_every_dependency(schedule: Schedule, data, seed: int, links):
    n, m = schedule.stages, micro_batch_count(schedule)
    edges = data.draw(edge_sets(n))
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    cf = random_times(seed + 2, (n,), 0.0) if links else 0.0
    cb = random_times(seed + 3, (n,), 0.0) if links else 0.0
    timeline = simulate(schedule, fwd, bwd, cf, cb, edges=edges)
    at = timeline.event
    for s in range(n):
        done = [e for e in timeline.events if e.stage == s]
        assert [e.action for e in done] == list(timeline.schedule.actions[s])  # every action ran
        assert all(a.end <= b.start for a, b in zip(done, done[1:]))  # one at a time, in order
        for mb in range(m):
            f, b = at(Action(s, F, mb)), at(Action(s, B, mb))
            assert f.duration == pytest.approx(fwd[s, mb])
            assert b.duration == pytest.approx(bwd[s, mb])
            assert b.start >= f.end
            for src, dst in edges:
                if dst == s:  # activations from every producer, plus the link time
                    link = cf[src] if links else 0.0
                    assert f.start >= at(Action(src, F, mb)).end + link - 1e-9
                if src == s:  # gradients from every consumer, plus the link time
                    link = cb[s] if links else 0.0
                    assert b.start >= at(Action(dst, B, mb)).end + link - 1e-9
    assert timeline.makespan == max(e.end for e in timeline.events)
    assert timeline.busy == pytest.approx([fwd[s].sum() + bwd[s].sum() for s in range(n)])


@given(STAGES, MICRO_BATCHES, st.integers(0, 2**32 - 1))
def test_gpipe_simulation_equals_the_closed_form(n: int, p: int, seed: int):
    f, b = random_times(seed, (n,)), random_times(seed + 1, (n,))
    cf, cb = random_times(seed + 2, (n,), 0.0), random_times(seed + 3, (n,), 0.0)
    # one unit per stage, so the cost table's units are the stages and cf/cb the links
    expected = Partition.evaluate(CostTable.from_arrays(f, b, cf, cb), range(1, n + 1), p)
    timeline = simulate(gpipe(n, p), f, b, cf, cb)
    assert timeline.makespan == pytest.approx(expected.predicted_time, rel=1e-12)
    assert timeline.bubble == pytest.approx(expected.bubble, rel=1e-9, abs=1e-12)


@given(schedules(), st.floats(0.1, 10), st.floats(0.1, 10))
def test_balanced_bubble_is_n_minus_1_over_p_plus_n_minus_1(schedule: Schedule, f, b):
    n, m = schedule.stages, micro_batch_count(schedule)
    timeline = simulate(schedule, f, b)
    assert timeline.makespan == pytest.approx((m + n - 1) * (f + b))
    assert timeline.bubble == pytest.approx((n - 1) / (m + n - 1))


@given(STAGES, MICRO_BATCHES, st.integers(2, 3), st.integers(0, 2**32 - 1))
def test_async_streams_mini_batches_without_a_flush(n: int, p: int, k: int, seed: int):
    fwd, bwd = random_times(seed, (n, p)), random_times(seed + 1, (n, p))
    stream = simulate(async_one_f_one_b(n, p, k), fwd, bwd, 0.5, 0.5)
    # the same run as one 1F1B pipeline over all k*p micro-batches (steps take no time) ...
    flat = simulate(one_f_one_b(n, p * k), np.tile(fwd, k), np.tile(bwd, k), 0.5, 0.5)
    assert stream.makespan == pytest.approx(flat.makespan)
    # ... and never slower than k flushed 1F1B mini-batches
    flushed = simulate(one_f_one_b(n, p), fwd, bwd, 0.5, 0.5)
    assert stream.makespan <= k * flushed.makespan + 1e-9


def test_step_and_allreduce_times_count_on_their_stage():
    schedule = add_step(gpipe(2, 2), allreduce=True)
    base = simulate(schedule, 1.0, 2.0)
    slow = simulate(schedule, 1.0, 2.0, step=[0.5, 0.25], allreduce=1.0)
    assert slow.event(Action(0, K.STEP)).duration == 0.5
    assert slow.event(Action(1, K.ALLREDUCE)).duration == 1.0
    assert slow.makespan == base.makespan + 1.5  # stage 0 ends last: 1 all-reduce + 0.5 step
    assert slow.busy == base.busy  # busy counts F, B and W only


def test_weight_gradients_run_after_their_backward_and_count_as_busy():
    # zero-bubble style: B computes the input gradient early, W the weight gradient later
    split = Schedule.from_lists([["0F0", "0F1", "0B0", "0B1", "0W0", "0W1"],
                                 ["1F0", "1B0", "1F1", "1B1", "1W0", "1W1"]])
    timeline = simulate(split, 1.0, 1.0, weight=0.5)
    for s in range(2):
        for m in range(2):
            assert timeline.event(Action(s, W, m)).start >= timeline.event(Action(s, B, m)).end
    assert timeline.busy == (5.0, 5.0)
    with pytest.raises(DeadlockError, match=r"waits at 0W0 \(action 1\) for 0B0"):
        simulate(Schedule.from_lists([["0F0", "0W0", "0B0"]]), 1.0, 1.0)


def test_links_are_full_duplex_and_serialise_each_direction():
    # 2 stages, 1F1B, links 3x slower than compute
    timeline = simulate(one_f_one_b(2, 3), 1.0, 1.0, 3.0, 3.0)
    wire = {str(e.action): e for e in timeline.transfers}
    # activation 1 is handed over at 2 but waits for activation 0 to clear the link at 4 ...
    assert [wire[f"0SF{m}>1"].start for m in range(3)] == [1.0, 4.0, 11.0]
    # ... while gradient 0 travels back over the same pair of stages at the same time
    forward, backward = wire["0SF1>1"], wire["1SB0>0"]
    assert (forward.start, forward.end, backward.start, backward.end) == (4.0, 7.0, 6.0, 9.0)


@given(schedules(), st.integers(0, 2**32 - 1), st.floats(0.0, 2.0), st.floats(0.0, 2.0))
def test_posting_takes_sender_and_receiver_time_and_never_speeds_a_step(
        schedule: Schedule, seed: int, post_f: float, post_b: float):
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    free = simulate(schedule, fwd, bwd, 0.5, 0.5)
    posted = simulate(schedule, fwd, bwd, 0.5, 0.5, post_f=post_f, post_b=post_b)
    for e in posted.events:
        post = post_f if e.action.kind in (K.SEND_F, K.RECV_F) else post_b
        if e.action.kind.is_send:
            assert e.duration == pytest.approx(post)
        elif e.action.kind.is_recv:  # posted, then waiting for the message
            assert e.duration >= post - 1e-9
            assert e.end >= posted.event(e.action.partner).end + 0.5 - 1e-9
    assert posted.makespan >= free.makespan - 1e-9
    assert posted.busy == pytest.approx(free.busy)  # posting is not compute


def test_posting_costs_by_edge_example():
    # 2 stages, one micro-batch: post 0.25 per SEND and RECV forward, 0.5 backward
    timeline = simulate(gpipe(2, 1), 1.0, 1.0, 0.0, 0.0, post_f=0.25, post_b={(0, 1): 0.5})
    at = {str(e.action): (e.start, e.end) for e in timeline.events}
    assert at["0SF0>1"] == (1.0, 1.25)  # posted after the forward; arrives at 1.25
    assert at["1RF0<0"] == (0.0, 1.25)  # the receive was posted at 0.25, waited until 1.25
    assert at["1SB0>0"] == (3.25, 3.75) and at["0RB0<1"] == (1.25, 3.75)
    assert timeline.makespan == 4.75


@given(schedules(), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0), st.floats(0.0, 1.0),
       st.floats(0.0, 2.0))
def test_resuming_after_a_wait_slows_exactly_the_next_compute(
        schedule: Schedule, seed: int, post: float, receiving: float, most: float):
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    resume = np.random.default_rng(seed + 2).uniform(0.0, most, n)  # one per stage
    posting = {"post_f": post, "post_b": post, "recv_post_f": receiving,
               "recv_post_b": receiving}
    plain = simulate(schedule, fwd, bwd, 0.5, 0.5, **posting)
    slowed = simulate(schedule, fwd, bwd, 0.5, 0.5, **posting, resume=resume)
    for stage in range(n):
        waited = True  # every stage starts from the step's shared wait
        for e in (e for e in slowed.events if e.stage == stage):
            if e.action.kind.is_recv:  # blocked: the message came after the receive was posted
                waited = waited or e.end > e.start + receiving
            elif e.action.kind.is_compute:
                times = {K.F: fwd, K.B: bwd}.get(e.action.kind)  # W: weight time 0 here
                compute = 0.0 if times is None else times[stage, e.action.mb]
                assert e.duration == pytest.approx(compute + resume[stage] * waited)
                waited = False
    assert slowed.makespan >= plain.makespan - 1e-9
    assert sum(slowed.busy) >= sum(plain.busy) - 1e-9


@given(schedules(), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0), st.floats(0.0, 1.0),
       st.floats(0.0, 2.0), st.floats(0.0, 2.0), st.floats(0.0, 2.0), st.floats(0.0, 2.0),
       st.floats(0.0, 2.0))
def test_sends_and_landed_messages_slow_the_next_compute_unless_it_waited_at_most_doubling_it(
        schedule: Schedule, seed: int, post: float, receiving: float, resume: float,
        after: float, landing: float, wake: float, after_post: float):
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    posting = {"post_f": post, "post_b": post, "recv_post_f": receiving,
               "recv_post_b": receiving, "resume": resume}
    slowdowns = {"after_send_f": after, "after_send_b": after, "after_receive_f": landing,
                 "after_receive_b": landing, "after_wake_f": wake, "after_wake_b": wake,
                 "after_post_f": after_post, "after_post_b": after_post}
    slowed = simulate(schedule, fwd, bwd, 0.5, 0.5, **posting, **slowdowns)
    for stage, actions in enumerate(slowed.schedule.actions):
        waited, owed = True, 0.0  # every stage starts from the step's shared wait
        receives = [i for i, a in enumerate(actions) if a.kind.is_recv]
        posted_early = set()  # receives posted before a compute, as the runtime does
        for i, action in enumerate(actions):
            e = slowed.event(action)
            if action.kind.is_recv:
                if e.end > e.start + receiving:
                    waited = True
                else:  # the message was there: it landed while the stage computed
                    owed += landing
            elif action.kind.is_send:  # its receiver blocked in the receive: woken by it
                posted = slowed.event(action.partner).start + receiving
                assume(abs(posted - e.end) > 1e-9)  # a tie: either is right
                owed += wake if posted < e.end else after
            elif action.kind.is_compute:
                times = {K.F: fwd, K.B: bwd}.get(action.kind)  # W: weight time 0 here
                compute = 0.0 if times is None else times[stage, action.mb]
                following = next((r for r in receives if r > i), None)
                beside = 0.0  # the next receive, if this is the first compute before it
                if following is not None and following not in posted_early:
                    posted_early.add(following)
                    beside = after_post
                extra = (resume + min(beside, compute) if waited
                         else min(owed + beside, compute))
                assert e.duration == pytest.approx(compute + extra)
                waited, owed = False, 0.0
    # Without the resume slowdown, the slowdowns only add time, so the step cannot get shorter.
    # With it, it can: a slower stage may find its next message already there instead of
    # waiting for it, and skip the resume slowdown the plain timeline paid.
    posting["resume"] = 0.0
    plain = simulate(schedule, fwd, bwd, 0.5, 0.5, **posting)
    slowed = simulate(schedule, fwd, bwd, 0.5, 0.5, **posting, **slowdowns)
    assert slowed.makespan >= plain.makespan - 1e-9


def test_after_receive_example():
    # 2 stages, 2 micro-batches, no links, stage 1's forward 1.5: F1's activations are there
    # before stage 1 posts their receive, so they landed during its F0 and its F1 runs 0.25
    # slower; F0's and B1's were waited for (their landing overlapped the wait): no slowdown
    timeline = simulate(gpipe(2, 2), [1.0, 1.5], 1.0, 0.0, 0.0, after_receive_f=0.25,
                        after_receive_b=0.25)
    at = {str(e.action): (e.start, e.end) for e in timeline.events}
    assert at["1F0"] == (1.0, 2.5) and at["1F1"] == (2.5, 4.25)
    assert at["1B1"] == (4.25, 5.25) and at["1B0"] == (5.25, 6.25)
    assert at["0B1"] == (5.25, 6.25) and at["0B0"] == (6.25, 7.5)  # B0's came as B1 ended


def test_after_send_example():
    # 2 stages, 2 micro-batches, no links: stage 0 sends F0 and runs F1 0.25 slower; after
    # sending F1 it waits for B1's gradient, so B1 is not slowed by that send
    timeline = simulate(gpipe(2, 2), 1.0, 1.0, 0.0, 0.0, after_send_f=0.25, after_send_b=0.25)
    at = {str(e.action): (e.start, e.end) for e in timeline.events}
    assert at["0F0"] == (0.0, 1.0) and at["0F1"] == (1.0, 2.25)
    assert at["1F0"] == (1.0, 2.0) and at["1F1"] == (2.25, 3.25)
    assert at["1B1"] == (3.25, 4.25) and at["1B0"] == (4.25, 5.5)  # after sending B1
    assert at["0B1"] == (4.25, 5.25) and at["0B0"] == (5.5, 6.5)


def test_after_wake_example():
    # 2 stages, 3 micro-batches, no links, stage 1's forward 1.75: F0 wakes stage 1, blocked
    # in its receive, and slows stage 0's F1 by after_wake_f; F1 reaches stage 1 as it
    # computes, and slows F2 by after_send_f; B2 wakes stage 0 and slows stage 1's B1 by
    # after_wake_b
    timeline = simulate(gpipe(2, 3), [1.0, 1.75], 1.0, 0.0, 0.0, after_send_f=0.25,
                        after_send_b=0.25, after_wake_f=0.5, after_wake_b=0.75)
    at = {str(e.action): (e.start, e.end) for e in timeline.events}
    assert at["0F1"] == (1.0, 2.5) and at["0F2"] == (2.5, 3.75)
    assert at["1B2"] == (6.25, 7.25) and at["1B1"] == (7.25, 9.0)
    # stage 1 posts the receive of F0 the moment F0 arrives: it did not wait for it, so
    # stage 0 did not wake it; B1 wakes stage 0, blocked in the receive of it since 2.25
    tie = simulate(gpipe(2, 2), 1.0, 1.0, 0.0, 0.0, recv_post_f=1.0, after_send_f=0.25,
                   after_send_b=0.25, after_wake_f=0.5, after_wake_b=0.5)
    at = {str(e.action): (e.start, e.end) for e in tie.events}
    assert at["1RF0<0"] == (0.0, 1.0) and at["1F0"] == (1.0, 2.0) and at["0F1"] == (1.0, 2.25)
    assert at["1B1"] == (4.0, 5.0) and at["1B0"] == (5.0, 6.5)
    # by default waking costs what any send does
    plain = simulate(gpipe(2, 3), [1.0, 1.75], 1.0, 0.0, 0.0, after_send_f=0.25,
                     after_send_b=0.25)
    assert plain.events == simulate(gpipe(2, 3), [1.0, 1.75], 1.0, 0.0, 0.0,
                                    after_send_f=0.25, after_send_b=0.25, after_wake_f=0.25,
                                    after_wake_b=0.25).events


def test_after_post_example():
    # 1F1B on 2 stages, 2 micro-batches, receives taking 0.125 to post: a stage posts each
    # receive before the first compute ahead of it, which runs 0.5 slower, waited or not:
    # stage 0's F0 (for B0's gradient) and B0 (for B1's), stage 1's F0 (for F1's
    # activations); the last compute of each stage posts nothing
    timeline = simulate(one_f_one_b(2, 2), 1.0, 1.0, 0.0, 0.0, recv_post_f=0.125,
                        recv_post_b=0.125, after_post_f=0.5, after_post_b=0.5)
    at = {str(e.action): (e.start, e.end) for e in timeline.events}
    assert at["0F0"] == (0.0, 1.5) and at["0F1"] == (1.5, 2.5)
    assert at["1F0"] == (1.5, 3.0) and at["1B0"] == (3.0, 4.0)
    assert at["1RF1<0"] == (4.0, 4.125) and at["1F1"] == (4.125, 5.125)
    assert at["0B0"] == (4.0, 5.5) and at["0B1"] == (6.125, 7.125)


def test_resume_example():
    # 2 stages, one micro-batch, resume 0.5: both stages' first compute, stage 0's backward
    # (it waited for the gradient); stage 1's backward follows its forward at once
    timeline = simulate(gpipe(2, 1), 1.0, 1.0, 0.0, 0.0, resume=0.5)
    at = {str(e.action): (e.start, e.end) for e in timeline.events}
    assert at["0F0"] == (0.0, 1.5) and at["1F0"] == (1.5, 3.0) and at["1B0"] == (3.0, 4.0)
    assert at["0B0"] == (4.0, 5.5) and timeline.makespan == 5.5


def test_receivers_post_their_own_time_when_given_example():
    # as test_posting_costs_by_edge_example, with slower receives: stage 1 posts until 2.0,
    # after its message came at 1.25; stage 0 until 4.25, and its message (sent from 4.0 on,
    # as stage 1 started at 2.0) comes at 4.5
    timeline = simulate(gpipe(2, 1), 1.0, 1.0, 0.0, 0.0, post_f=0.25, post_b=0.5,
                        recv_post_f=2.0, recv_post_b=3.0)
    at = {str(e.action): (e.start, e.end) for e in timeline.events}
    assert at["1RF0<0"] == (0.0, 2.0) and at["0RB0<1"] == (1.25, 4.5)


def test_deadlocked_schedules_raise_instead_of_hanging():
    # stage 0 waits for gradient 0 before sending activation 1, which stage 1 needs first
    crossed = Schedule.from_lists([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]])
    with pytest.raises(DeadlockError, match=r"'custom' deadlocks: stage 0 waits at 0RB0<1 "
                       r"\(action 2\) for 1SB0>0; stage 1 waits at 1RF1<0"):
        simulate(crossed, 1.0, 1.0)
    backwards_first = Schedule.from_lists([["0B0", "0F0"]])
    with pytest.raises(DeadlockError, match=r"stage 0 waits at 0B0 \(action 0\) for 0F0"):
        simulate(backwards_first, 1.0, 1.0)


def test_simulate_rejects_bad_inputs():
    schedule = gpipe(2, 3)
    with pytest.raises(ValueError, match=r"forward has shape \(3,\); give a scalar, \(2,\)"):
        simulate(schedule, [1.0, 1.0, 1.0], 1.0)
    with pytest.raises(ValueError, match="backward must hold finite non-negative times"):
        simulate(schedule, 1.0, -1.0)
    with pytest.raises(ValueError, match=r"send_f has no time for edge \(0, 1\)"):
        simulate(schedule, 1.0, 1.0, send_f={(1, 2): 1.0})
    with pytest.raises(ValueError, match="pass edges only with a compute-only schedule"):
        simulate(add_communication(schedule), 1.0, 1.0, edges=[(0, 1)])


def test_link_costs_by_edge():
    schedule = gpipe(3, 1)
    edges = [(0, 1), (1, 2), (0, 2)]
    times = {(0, 1): 1.0, (1, 2): 2.0, (0, 2): 10.0}
    timeline = simulate(schedule, 1.0, 1.0, times, times, edges=edges)
    # the skip edge is the slow one: stage 2 starts at 1 + 10, and stage 0's backward waits
    # for stage 2's gradient (done at 12 + 1 = 13) to come back: 13 + 10
    assert timeline.event(Action(2, F, 0)).start == 11.0
    assert timeline.event(Action(0, B, 0)).start == 23.0


# --- build and the ASCII timeline -------------------------------------------------------------


def test_build_by_name():
    assert build("1f1b", 2, 3) == one_f_one_b(2, 3)
    assert build("async-1f1b", 2, 3, minibatches=2) == async_one_f_one_b(2, 3, 2)
    with pytest.raises(ValueError, match="unknown schedule 'zb'; choose one of 'gpipe', '1f1b'"):
        build("zb", 2, 3)
    with pytest.raises(ValueError, match="stages must be a positive integer, not 0"):
        build("gpipe", 0, 3)


def test_schedule_prints_one_line_per_stage_in_compact_form():
    schedule = add_communication(one_f_one_b(2, 2))
    assert str(schedule).splitlines() == [
        "1f1b: 2 stages x 2 micro-batches",
        "0: 0F0 0SF0>1 0F1 0SF1>1 0RB0<1 0B0 0RB1<1 0B1",
        "1: 1RF0<0 1F0 1B0 1SB0>0 1RF1<0 1F1 1B1 1SB1>0",
    ]
    lists = [line.split(": ")[1].split() for line in str(schedule).splitlines()[1:]]
    assert Schedule.from_lists(lists, "1f1b") == schedule


def test_schedule_rejects_misplaced_actions():
    with pytest.raises(ValueError, match="stage 1's list holds 0F0"):
        Schedule.from_lists([["0F0"], ["0F0"]])
    with pytest.raises(ValueError, match=r"lists \['0F0'\] twice"):
        Schedule.from_lists([["0F0", "0F0"]])
    with pytest.raises(ValueError, match="0F2 is out of range"):
        Schedule("custom", 1, 2, [[Action(0, F, 2)]])


def test_gpipe_timeline_reads_like_the_paper_figure():
    text = simulate(gpipe(3, 4), 1.0, 2.0).ascii(width=40)
    # forwards then backwards in reverse order, the bubble a triangle at each end
    assert text.splitlines() == [
        "gpipe: 3 stages x 4 micro-batches",
        "0 |F0F1F2F3............B3  B2  B1  B0  |",
        "1 |..F0F1F2F3......B3  B2  B1  B0  ....|",
        "2 |....F0F1F2F3B3  B2  B1  B0  ........|",
        "step time 18, bubble 33.3%",
    ]


def test_one_f_one_b_timeline_alternates_after_warm_up():
    text = simulate(one_f_one_b(3, 4), 1.0, 2.0).ascii(width=40)
    assert text.splitlines()[1:4] == [
        "0 |F0F1F2........B0  F3B1  ..B2  ..B3  |",
        "1 |..F0F1....B0  F2B1  F3B2  ..B3  ....|",
        "2 |....F0B0  F1B1  F2B2  F3B3  ........|",
    ]


# --- stages sharing a host's cores -------------------------------------------------------------


def _spans(timeline) -> list[tuple[int, str, float, float]]:
    return sorted((e.stage, str(e.action), e.start, e.end) for e in timeline.events)


@given(schedules(), st.integers(0, 2**32 - 1), st.data())
def test_stages_with_a_core_each_run_as_if_they_shared_nothing(schedule: Schedule, seed: int,
                                                              data):
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    sharing = data.draw(st.sets(st.integers(0, n - 1)))
    cores = data.draw(st.floats(max(len(sharing), 1), 2.0 * n + 1))
    alone = simulate(schedule, fwd, bwd, 0.5, 0.5, post_f=0.1, post_b=0.1)
    shared = simulate(schedule, fwd, bwd, 0.5, 0.5, post_f=0.1, post_b=0.1, cores=cores,
                      sharing=sharing)
    assert _spans(shared) == _spans(alone)


@given(schedules(), st.integers(0, 2**32 - 1), st.floats(0.25, 4.0), st.booleans())
def test_sharing_cores_delays_every_action_and_keeps_to_the_cores(schedule: Schedule, seed: int,
                                                                cores: float, links: bool):
    """No action ends earlier than with a core per stage, and the cores do no more than their
    share: the step takes at least all the stages' work over the cores. (With resume or the
    slowdowns after messages, a later message can spare its receiver a resume, so actions
    may end earlier: none are given here.)"""
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    link = 0.3 if links else 0.0
    alone = simulate(schedule, fwd, bwd, link, link, post_f=0.05)
    shared = simulate(schedule, fwd, bwd, link, link, post_f=0.05, cores=cores)
    for a, b in zip(_spans(alone), _spans(shared)):
        assert b[3] >= a[3] - 1e-9
    posts = 0.05 * sum(e.action.kind in (ActionKind.SEND_F, ActionKind.RECV_F)
                       for e in shared.events)  # each side's, of a forward message
    work = fwd.sum() + bwd.sum() + posts
    assert shared.makespan >= work / min(cores, n) * (1 - 1e-9)


@given(schedules(), st.integers(0, 2**32 - 1))
def test_one_core_for_every_stage_is_never_idle_while_work_is_left(schedule: Schedule,
                                                                   seed: int):
    """With messages that take no time, some stage can always go on, so one shared core works
    the whole step through: the step is all the stages' work, one after another."""
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    timeline = simulate(schedule, fwd, bwd, cores=1.0)
    assert timeline.makespan == pytest.approx(fwd.sum() + bwd.sum())


def test_two_stages_on_one_core_split_it_while_both_compute():
    # gpipe(2, 2), every compute 1: alone, stage 1's F0 runs beside stage 0's F1, and its B1
    # beside stage 0's B0 (step 6); on one core each pair takes 2 where they overlap (step 8)
    assert simulate(gpipe(2, 2), 1.0, 1.0).makespan == 6.0
    timeline = simulate(gpipe(2, 2), 1.0, 1.0, cores=1.0)
    at = {str(e.action): (e.start, e.end) for e in timeline.events}
    assert at["0F1"] == (1.0, 3.0) and at["1F0"] == (1.0, 3.0)
    assert timeline.makespan == 8.0
    # a stage that does not share (a GPU's) keeps its pace beside them
    assert simulate(gpipe(2, 2), 1.0, 1.0, cores=1.0, sharing=[0]).makespan == 6.0
    # three stages on two cores: while all three compute, each goes at 2/3 of its pace
    three = simulate(gpipe(3, 3), 1.0, 1.0, cores=2.0)
    assert three.event(Action(0, F, 1)).end == 2.0  # beside one other: a core each
    assert three.event(Action(0, F, 2)).end == pytest.approx(3.5)  # from 2, beside two
    assert three.event(Action(2, F, 0)).end == pytest.approx(3.5)


@given(schedules(), st.integers(0, 2**32 - 1), st.integers(1, 4), st.data())
def test_stages_bound_to_a_core_share_only_that_core(schedule: Schedule, seed: int,
                                                      cores: int, data):
    """Bound, each core works its own stages' actions as one core shared by them alone: no
    action ends earlier than with a core per stage, and the step takes at least the work of
    the busiest core. Each on a core of its own, the stages run as if alone; all on one core,
    the step is the one a single shared core gives."""
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    bound = {s: data.draw(st.integers(0, cores - 1)) for s in range(n)}
    alone = simulate(schedule, fwd, bwd, 0.3, 0.3, post_f=0.05)
    timeline = simulate(schedule, fwd, bwd, 0.3, 0.3, post_f=0.05, cores=cores, bound=bound)
    for a, b in zip(_spans(alone), _spans(timeline)):
        assert b[3] >= a[3] - 1e-9
    busiest = max(sum(e.duration for e in alone.events if bound[e.stage] == core
                      and not e.action.kind.is_recv) for core in range(cores))
    assert timeline.makespan >= busiest * (1 - 1e-9)
    own = simulate(schedule, fwd, bwd, 0.3, 0.3, post_f=0.05, cores=n,
                   bound={s: s for s in range(n)})
    assert _spans(own) == _spans(alone)
    one = simulate(schedule, fwd, bwd, 0.3, 0.3, post_f=0.05, cores=cores,
                   bound=dict.fromkeys(range(n), 0))
    shared = simulate(schedule, fwd, bwd, 0.3, 0.3, post_f=0.05, cores=1.0)
    assert [t for s in _spans(one) for t in s[2:]] == pytest.approx(
        [t for s in _spans(shared) for t in s[2:]])


def test_stages_bound_to_cores_split_only_their_own():
    # gpipe(2, 2), every compute 1: bound to one of 2 cores the two stages share it (step 8,
    # as with cores=1, where the even split of 2 cores gives each one: step 6)
    assert simulate(gpipe(2, 2), 1.0, 1.0, cores=2, bound={0: 1, 1: 1}).makespan == 8.0
    assert simulate(gpipe(2, 2), 1.0, 1.0, cores=2).makespan == 6.0
    # gpipe(3, 3) on 2 cores, stages 0 and 2 on core 0: from 2, 0F2 and 2F0 split core 0
    # (both end at 4) while 1F1 has core 1 to itself (ends at 3); split evenly, all three go
    # at 2/3 and end at 3.5
    three = simulate(gpipe(3, 3), 1.0, 1.0, cores=2, bound={0: 0, 1: 1, 2: 0})
    assert three.event(Action(0, F, 2)).end == 4.0 and three.event(Action(2, F, 0)).end == 4.0
    assert three.event(Action(1, F, 1)).end == 3.0
    assert three.event(Action(0, B, 2)).end == 10.0 and three.event(Action(2, B, 0)).end == 10.0
    # four stages, 0 and 1 on core 0: stage 0's F1 and stage 1's F0 split it (both end at 3,
    # where 2 cores split evenly give each a core: 2)
    blocks = simulate(gpipe(4, 2), 1.0, 1.0, cores=2, bound={0: 0, 1: 0, 2: 1, 3: 1})
    assert blocks.event(Action(0, F, 1)).end == 3.0 and blocks.event(Action(1, F, 0)).end == 3.0
    assert simulate(gpipe(4, 2), 1.0, 1.0, cores=2).event(Action(0, F, 1)).end == 2.0


def test_bound_takes_whole_cores_and_every_sharing_stage():
    with pytest.raises(ValueError, match="bound= places stages on cores: give cores="):
        simulate(gpipe(2, 2), 1.0, 1.0, bound={0: 0, 1: 0})
    with pytest.raises(ValueError, match=r"cores=1.5 with bound=: .* a whole number"):
        simulate(gpipe(2, 2), 1.0, 1.0, cores=1.5, bound={0: 0, 1: 0})
    with pytest.raises(ValueError, match=r"places stages \[0\], but the sharing stages are "
                                         r"\[0, 1\]"):
        simulate(gpipe(2, 2), 1.0, 1.0, cores=2, bound={0: 0})
    with pytest.raises(ValueError, match=r"names cores outside 0..1"):
        simulate(gpipe(2, 2), 1.0, 1.0, cores=2, bound={0: 0, 1: 2})


def test_an_allreduce_waits_on_its_peers_and_an_optimizer_step_computes():
    """Sharing one core, two stages' optimizer steps run one after the other; their
    all-reduces, which wait on their peers, do not."""
    schedule = add_step(add_communication(gpipe(2, 1)), allreduce=True)
    assert simulate(schedule, 1.0, 1.0, allreduce=2.0).makespan == 6.0
    assert simulate(schedule, 1.0, 1.0, allreduce=2.0, cores=1.0).makespan == 6.0
    assert simulate(schedule, 1.0, 1.0, step=1.0).makespan == 5.0
    assert simulate(schedule, 1.0, 1.0, step=1.0, cores=1.0).makespan == 6.0


def test_a_message_there_the_moment_its_receive_is_posted_did_not_wait():
    # stage 1's F0 ends at 0.1 + 0.2 + 0.1 (resume) + 0.1 = 0.5 + 0.1, exactly when F1's
    # message lands (0.2 + 0.2 + 0.2): a list scheduler's sums in its order make the tie,
    # so F1 pays no resume and the step is 3.9
    assert simulate(gpipe(2, 2), 0.1, 1.0, 0.2, 0.0, resume=0.1).makespan == 3.9


def test_sharing_takes_a_positive_core_count_and_stages_of_the_schedule():
    for cores in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=rf"cores={cores}: give the cores the sharing"):
            simulate(gpipe(2, 2), 1.0, 1.0, cores=cores)
    with pytest.raises(ValueError, match=r"sharing=\[0, 2\] names stages a schedule of 2"):
        simulate(gpipe(2, 2), 1.0, 1.0, cores=1.0, sharing=[0, 2])


@given(schedules(), st.integers(0, 2**32 - 1), st.data(), st.booleans())
def test_a_thread_running_several_stages_runs_one_action_at_a_time(schedule: Schedule,
                                                                    seed: int, data, links):
    """Stages dealt to threads at random, each thread listing its stages in a random order:
    no schedule deadlocks, a thread's actions never overlap, every action runs in its
    stage's order after what it needs, and one thread running every stage works the whole
    step through where messages take no time."""
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    thread = [data.draw(st.integers(0, n - 1)) for _ in range(n)]
    groups = [data.draw(st.permutations([s for s in range(n) if thread[s] == t]))
              for t in set(thread)]
    link = 0.3 if links else 0.0
    timeline = simulate(schedule, fwd, bwd, link, link, post_f=0.05, workers=groups)
    at = timeline.event
    for group in groups:
        done = sorted((e for e in timeline.events if e.stage in group),
                      key=lambda e: (e.start, e.end))
        assert all(a.end <= b.start + 1e-12 for a, b in zip(done, done[1:]))
    for s in range(n):
        done = [e for e in timeline.events if e.stage == s]
        assert [e.action for e in done] == list(timeline.schedule.actions[s])
        for mb in range(m):
            f, b = at(Action(s, F, mb)), at(Action(s, B, mb))
            assert f.duration == pytest.approx(fwd[s, mb])
            assert b.start >= f.end
            if s > 0:
                assert f.start >= at(Action(s - 1, F, mb)).end + link - 1e-9
    one = simulate(schedule, fwd, bwd, workers=[list(range(n))[::-1]])
    assert one.makespan == pytest.approx(fwd.sum() + bwd.sum())


def test_a_thread_starts_the_first_of_its_stages_that_need_not_wait():
    # gpipe(2, 2), every compute 1, one thread preferring stage 1: once 1's message is there
    # it goes first (1F0 before 0F1, 1B0 before 0B1), and the step is all the work, 8
    at = {str(e.action): (e.start, e.end)
          for e in simulate(gpipe(2, 2), 1.0, 1.0, workers=[(1, 0)]).events}
    assert at["1F0"] == (1.0, 2.0) and at["0F1"] == (2.0, 3.0)
    assert at["1B0"] == (5.0, 6.0) and at["0B1"] == (6.0, 7.0)
    # preferring stage 0, it runs both forwards of stage 0 first
    at = {str(e.action): (e.start, e.end)
          for e in simulate(gpipe(2, 2), 1.0, 1.0, workers=[(0, 1)]).events}
    assert at["0F1"] == (1.0, 2.0) and at["1F0"] == (2.0, 3.0)
    # messages that take 2 on the link (one at a time): the thread idles until each arrives
    # (2 to 3, 4 to 5, 8 to 9, 10 to 11) and starts at once when it does
    at = {str(e.action): (e.start, e.end)
          for e in simulate(gpipe(2, 2), 1.0, 1.0, 2.0, 2.0, workers=[(1, 0)]).events}
    assert at["0F1"] == (1.0, 2.0) and at["1F0"] == (3.0, 4.0) and at["1F1"] == (5.0, 6.0)
    assert at["1B0"] == (7.0, 8.0) and at["0B1"] == (9.0, 10.0) and at["0B0"] == (11.0, 12.0)
    # a stage in no group keeps a thread of its own
    assert simulate(gpipe(2, 2), 1.0, 1.0, workers=[(1,)]).makespan == 6.0
    with pytest.raises(ValueError, match="in one group at most"):
        simulate(gpipe(2, 2), 1.0, 1.0, workers=[(0, 1), (1,)])
    with pytest.raises(ValueError, match="in one group at most"):
        simulate(gpipe(2, 2), 1.0, 1.0, workers=[(0, 2)])


def _switched(order: list[Action]) -> list[Action]:
    """The computes of `order` (one thread's, in the order it ran them) that follow a compute
    of the other kind, forward against backward; the first follows the last step's backward."""
    forward_last, switched = False, []
    for a in order:
        if a.kind.is_compute:
            if (a.kind is F) != forward_last:
                switched.append(a)
            forward_last = a.kind is F
    return switched


@given(schedules(("gpipe", "1f1b")), st.integers(0, 2**32 - 1), st.booleans())
def test_a_compute_after_the_other_kind_on_its_stage_takes_the_switch_longer(
        schedule: Schedule, seed: int, links: bool):
    """With a thread per stage, switch_f / switch_b are the same as adding them to the given
    times of the computes that follow the other kind in their stage's list."""
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    switch_f, switch_b = random_times(seed + 2, (n,), low=0.0), random_times(seed + 3, (n,))
    link = 0.3 if links else 0.0
    folded = {F: fwd.copy(), B: bwd.copy()}
    for s in range(n):
        for a in _switched(list(schedule.actions[s])):
            folded[a.kind][s, a.mb] += (switch_f if a.kind is F else switch_b)[s]
    switching = simulate(schedule, fwd, bwd, link, link, post_f=0.05, switch_f=switch_f,
                         switch_b=switch_b)
    plain = simulate(schedule, folded[F], folded[B], link, link, post_f=0.05)
    assert [e.action for e in switching.events] == [e.action for e in plain.events]
    assert [t for e in switching.events for t in (e.start, e.end)] == pytest.approx(
        [t for e in plain.events for t in (e.start, e.end)])
    assert switching.makespan == pytest.approx(plain.makespan)


@given(schedules(("gpipe", "1f1b")), st.integers(0, 2**32 - 1), st.data())
def test_a_thread_of_several_stages_switches_with_its_own_last_compute(schedule: Schedule,
                                                                      seed: int, data):
    """One thread running every stage (messages taking no time): its order does not depend on
    the times, and the step is all the work plus each switch of the thread between forwards
    and backwards, whichever stages they are of."""
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    switch_f, switch_b = random_times(seed + 2, (n,), low=0.0), random_times(seed + 3, (n,))
    group = [data.draw(st.permutations(range(n)))]
    plain = simulate(schedule, fwd, bwd, workers=group)
    switching = simulate(schedule, fwd, bwd, workers=group, switch_f=switch_f,
                         switch_b=switch_b)
    order = [e.action for e in sorted(plain.events, key=lambda e: (e.start, e.end))]
    assert [e.action for e in sorted(switching.events, key=lambda e: (e.start, e.end))] == order
    extra = sum((switch_f if a.kind is F else switch_b)[a.stage] for a in _switched(order))
    assert switching.makespan == pytest.approx(fwd.sum() + bwd.sum() + extra)


def test_switch_example():
    # gpipe(1, 2), forwards 1, backwards 2: F0 after the last step's backward (+0.5), F1,
    # B1 after a forward (+0.25), B0
    at = {str(e.action): (e.start, e.end)
          for e in simulate(gpipe(1, 2), 1.0, 2.0, switch_f=0.5, switch_b=0.25).events}
    assert at == {"0F0": (0.0, 1.5), "0F1": (1.5, 2.5), "0B1": (2.5, 4.75),
                  "0B0": (4.75, 6.75)}
    with pytest.raises(ValueError, match="switch_f must hold finite non-negative"):
        simulate(gpipe(1, 2), 1.0, 2.0, switch_f=-0.1)
