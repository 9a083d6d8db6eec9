"""Schedules as data, their lowering and the event simulator: ALGORITHMS §1 and §6 properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
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
    delivered_sends,
    gpipe,
    lower,
    one_f_one_b,
    peak_activations,
)
from fxpipe.schedules.lowering import message_of
from fxpipe.simulate import WEIGHT_SHARE, simulate

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
    """Brute force: after each action, the micro-batches whose F ran and whose last gradient
    action (W where there is one, else B) has not."""
    where = {(a.kind, a.mb): i for i, a in enumerate(stage)}
    spans = [(i, where.get((W, a.mb), where.get((B, a.mb), len(stage))))
             for i, a in enumerate(stage) if a.kind is F]
    return max((sum(start <= i < end for start, end in spans) for i in range(len(stage))),
               default=0)


@given(schedules())
def test_in_flight_activations_meet_the_bounds(schedule: Schedule):
    n = schedule.stages
    peaks = [held_activations(stage) for stage in schedule.actions]
    assert peak_activations(schedule) == tuple(peaks)
    if schedule.name == "gpipe":
        assert peaks == [schedule.micro_batches] * n
    elif schedule.name == "zb-h1":  # every stage holds what 1F1B's first stage holds
        assert peaks == [max(peak_activations(one_f_one_b(n, schedule.micro_batches)))] * n
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


def _run_in_drawn_order(programs, found, rng) -> list[int]:
    """Run device programs in an order `rng` draws (any device whose next action can run), and
    check that each message `found` lists as delivered after an action was received by then;
    returns how far each program got."""
    pc, sent, received = [0] * len(programs), set(), set()
    while True:
        ready = [d for d, program in enumerate(programs) if pc[d] < len(program)
                 and (not program[pc[d]].kind.is_recv or message_of(program[pc[d]]) in sent)]
        if not ready:
            return pc
        d = rng.choice(ready)
        a = programs[d][pc[d]]
        if a.kind.is_send:
            sent.add(message_of(a))
        elif a.kind.is_recv:
            received.add(message_of(a))
        assert set(found[d].get(pc[d], ())) <= received, (d, pc[d], a)
        pc[d] += 1


@given(schedules(), st.data(), st.randoms(use_true_random=False))
def test_a_send_counts_as_delivered_only_after_its_receive(schedule: Schedule, data, rng):
    """Whatever order the devices run in, a message delivered_sends lists after an action of
    its sender has been received when that action is done; each is listed once, and only
    between two devices."""
    edges = data.draw(edge_sets(schedule.stages))
    programs = add_communication(schedule, edges).device_programs
    found = delivered_sends(programs)
    assert _run_in_drawn_order(programs, found, rng) == [len(p) for p in programs]
    listed = [m for device in found for messages in device.values() for m in messages]
    assert len(listed) == len(set(listed))
    assert all(m[0] != m[1] for m in listed)


@pytest.mark.parametrize("stages, p", [(2, 2), (3, 2), (4, 1)])
def test_async_sends_awaiting_delivery_do_not_grow_with_the_mini_batches(stages, p):
    """Past the warm-up, a device's sends not yet known delivered are about as many as its
    micro-batches in flight (at most N), however many mini-batches the run streams."""
    peaks = []
    for minibatches in (stages + 1, 4 * stages):
        programs = lower("async-1f1b", stages, p, chain(stages), minibatches).device_programs
        found = delivered_sends(programs)
        peak = []
        for d, program in enumerate(programs):
            pending, most = set(), 0
            for i, a in enumerate(program):
                if a.kind.is_send:
                    pending.add(message_of(a))
                most = max(most, len(pending))
                pending -= set(found[d].get(i, ()))
            peak.append(most)
        peaks.append(peak)
    assert peaks[0] == peaks[1]
    assert max(peaks[1]) <= stages


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
            assert b.start >= f.end
            if Action(s, W, mb) in schedule.actions[s]:  # split: half the backward each
                w = at(Action(s, W, mb))
                assert b.duration == pytest.approx(bwd[s, mb] * (1 - WEIGHT_SHARE))
                assert w.duration == pytest.approx(bwd[s, mb] * WEIGHT_SHARE)
                assert w.start >= b.end
            else:
                assert b.duration == pytest.approx(bwd[s, mb])
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


@given(schedules(("gpipe", "1f1b", "async-1f1b")), st.floats(0.1, 10), st.floats(0.1, 10))
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


def test_an_allreduce_and_an_optimizer_step_take_their_stages_time():
    schedule = add_step(add_communication(gpipe(2, 1)), allreduce=True)
    assert simulate(schedule, 1.0, 1.0, allreduce=2.0).makespan == 6.0
    assert simulate(schedule, 1.0, 1.0, step=1.0).makespan == 5.0


@given(schedules(), st.integers(0, 2**32 - 1), st.data())
def test_an_overhead_lengthens_every_action_of_its_kind_on_its_stage(schedule: Schedule,
                                                                   seed: int, data):
    """Each (stage, kind) in the table adds its seconds to every such action: to a compute's
    duration, to a SEND's time before its message leaves, to a RECV before it waits; no step
    gets faster for time added, and the busy time grows by the computes' overheads."""
    n, m = schedule.stages, micro_batch_count(schedule)
    fwd, bwd = random_times(seed, (n, m)), random_times(seed + 1, (n, m))
    kinds = [K.F, K.B, K.W, K.SEND_F, K.SEND_B, K.RECV_F, K.RECV_B]
    table = data.draw(st.dictionaries(
        st.tuples(st.integers(0, n - 1), st.sampled_from(kinds)), st.floats(0.0, 1.0),
        max_size=8))
    plain = simulate(schedule, fwd, bwd, 0.5, 0.5)
    slower = simulate(schedule, fwd, bwd, 0.5, 0.5, overhead=table)
    for e in slower.events:
        extra = table.get((e.stage, e.action.kind), 0.0)
        if e.action.kind.is_compute:
            times = fwd if e.action.kind is K.F else bwd * _share(schedule, e.action)
            assert e.duration == pytest.approx(times[e.stage, e.action.mb] + extra)
        elif e.action.kind.is_send:
            assert e.duration == pytest.approx(extra)
        elif e.action.kind.is_recv:  # its own time first, then the wait for the message
            assert e.duration >= extra - 1e-9
            assert e.end >= slower.transfers[[t.action for t in slower.transfers].index(
                e.action.partner)].end - 1e-9
    assert slower.makespan >= plain.makespan - 1e-9
    added = [sum(table.get((s, a.kind), 0.0) for a in schedule.actions[s]
                 if a.kind.is_compute) for s in range(n)]
    assert slower.busy == pytest.approx([b + a for b, a in zip(plain.busy, added)])


def _share(schedule: Schedule, action: Action) -> float:
    """The part of its micro-batch's backward a B or W takes: half each where W splits it."""
    if action.kind is W:
        return WEIGHT_SHARE
    split = Action(action.stage, W, action.mb) in schedule.actions[action.stage]
    return 1 - WEIGHT_SHARE if split else 1.0


def test_overhead_example():
    # 2 stages, one micro-batch: every send takes its sender 0.25 before the message leaves,
    # and stage 1's forward runs 0.5 longer
    table = {(0, K.SEND_F): 0.25, (1, K.SEND_B): 0.25, (1, K.F): 0.5}
    timeline = simulate(gpipe(2, 1), 1.0, 1.0, 0.0, 0.0, overhead=table)
    at = {str(e.action): (e.start, e.end) for e in timeline.events}
    assert at["0SF0>1"] == (1.0, 1.25)  # the message leaves at 1.25
    assert at["1RF0<0"] == (0.0, 1.25) and at["1F0"] == (1.25, 2.75)
    assert at["1SB0>0"] == (3.75, 4.0) and at["0B0"] == (4.0, 5.0)
    assert timeline.makespan == 5.0
    with pytest.raises(ValueError, match=r"overhead has an entry for \(2, <ActionKind.F"):
        simulate(gpipe(2, 1), 1.0, 1.0, overhead={(2, K.F): 1.0})
    with pytest.raises(ValueError, match=r"overhead\[\(0, F\)\] must be finite seconds"):
        simulate(gpipe(2, 1), 1.0, 1.0, overhead={(0, K.F): float("nan")})
