"""The local transport: messages reach their receivers, waking only them (an abort, every one)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import FxpipeError
from fxpipe.runtime.transport import LocalTransport, PipelineAborted

STAGES = 4


class CountingCondition(threading.Condition):
    """A condition that counts how often a thread waited on it, and says when one first did."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.waits = 0
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        self.waiting.set()
        return super().wait(timeout)


def _receive_all(transport: LocalTransport, dst: int, keys: list, got: dict, failed: list
                 ) -> None:
    try:
        for src, direction, mb in keys:
            got[src, dst, direction, mb] = transport.recv(src, dst, direction, mb)["value"]
    except BaseException as error:  # reported by the test, not lost in the thread
        failed.append(error)


messages = st.lists(
    st.tuples(st.integers(0, STAGES - 1), st.integers(0, STAGES - 1),
              st.sampled_from(["F", "B"]), st.integers(0, 3)).filter(lambda k: k[0] != k[1]),
    min_size=1, max_size=12, unique=True)


@settings(max_examples=25, deadline=None)
@given(messages, st.randoms(use_true_random=False))
def test_every_receiver_gets_exactly_its_messages_in_any_order(keys, random):
    transport = LocalTransport(["cpu"] * STAGES, timeout=20.0)
    got: dict = {}
    failed: list = []
    receivers = []
    for dst in range(STAGES):
        mine = [(src, direction, mb) for src, d, direction, mb in keys if d == dst]
        random.shuffle(mine)
        receivers.append(threading.Thread(target=_receive_all, daemon=True,
                                          args=(transport, dst, mine, got, failed)))
    for receiver in receivers:
        receiver.start()
    sends = list(keys)
    random.shuffle(sends)
    for key in sends:
        transport.send(*key, {"value": torch.tensor(keys.index(key))})
    for receiver in receivers:
        receiver.join(30)
    assert not failed
    assert {key: int(value) for key, value in got.items()} == {
        key: i for i, key in enumerate(keys)}


@pytest.mark.timeout(60)
def test_a_send_wakes_only_the_stage_it_is_for():
    transport = LocalTransport(["cpu"] * STAGES, timeout=20.0)
    transport._ready = [CountingCondition(transport._lock) for _ in range(STAGES)]
    waiting = transport._ready[2]
    got: dict = {}
    failed: list = []
    receiver = threading.Thread(target=_receive_all, daemon=True,
                                args=(transport, 2, [(0, "F", 0)], got, failed))
    receiver.start()
    assert waiting.waiting.wait(20)
    for mb in range(20):  # messages for stage 1, which nobody receives: stage 2 sleeps on
        transport.send(0, 1, "F", mb, {"value": torch.tensor(mb)})
        time.sleep(0.005)  # time for a woken stage 2 to look and wait again
    transport.send(0, 2, "F", 0, {"value": torch.tensor(7)})
    receiver.join(20)
    assert not failed and int(got[0, 2, "F", 0]) == 7
    assert waiting.waits == 1  # it waited once, and its own message ended the wait


@pytest.mark.timeout(60)
def test_an_abort_wakes_every_waiting_stage_with_the_error():
    transport = LocalTransport(["cpu"] * STAGES, timeout=50.0)
    transport._ready = [CountingCondition(transport._lock) for _ in range(STAGES)]
    failed: list = []
    receivers = [threading.Thread(target=_receive_all, daemon=True,
                                  args=(transport, dst, [(0, "F", 0)], {}, failed))
                 for dst in range(1, STAGES)]
    for receiver in receivers:
        receiver.start()
    for dst in range(1, STAGES):
        assert transport._ready[dst].waiting.wait(20)
    transport.abort(RuntimeError("stage 0 failed"))
    for receiver in receivers:
        receiver.join(5)  # far less than their timeout: the abort woke them
        assert not receiver.is_alive()
    assert len(failed) == STAGES - 1
    assert all(isinstance(e, PipelineAborted) and "stage 0 failed" in str(e) for e in failed)


@given(rounds=st.integers(3, 30), per_round=st.integers(1, 10),
       computes=st.lists(st.floats(0, 1), min_size=1, max_size=3),
       slower=st.floats(1, 100))
def test_the_posting_measure_fits_its_rounds_in_its_budget(rounds, per_round, computes, slower):
    from fxpipe.runtime.dist import (
        _COMPUTES_PER_MESSAGE,
        _POSTING_BUDGET,
        _ROUND_KINDS,
        _rounds_within,
    )

    fitted = _rounds_within(rounds, per_round, computes)
    assert len(_ROUND_KINDS) <= fitted <= rounds  # a round of each kind, never more than asked
    # its rounds, and the untimed one before them
    took = (fitted + 1) * per_round * _COMPUTES_PER_MESSAGE * max(computes)
    assert took <= _POSTING_BUDGET or fitted == len(_ROUND_KINDS)  # over it: the fewest
    assert fitted == rounds or fitted % len(_ROUND_KINDS) == 0  # cut: whole cycles of kinds
    assert _rounds_within(rounds, per_round, [c * slower for c in computes]) <= fitted


def test_the_posting_measure_runs_every_round_for_fast_computes_and_fewer_for_slow():
    from fxpipe.runtime.dist import _rounds_within

    assert _rounds_within(9, 5, [1e-4, 2e-4, 1e-4]) == 9  # a small model's stages
    assert _rounds_within(9, 5, [0.002, 0.003, 0.002]) == 6  # 0.12 s a round: 7 fit, in cycles 6
    assert _rounds_within(9, 5, [0.004, 0.0045, 0.0037]) == 3  # a VGG's: 0.18 s a round
    assert _rounds_within(9, 5, [0.0, 0.0]) == 9  # nothing timed: as asked
    assert _rounds_within(9, 1, [5e-324]) == 9  # however small, no overflow


def test_both_peers_pace_the_posting_measure_by_the_same_figures():
    from fxpipe.runtime.dist import _paced_by

    sender, receiver = [0.001, 0.003], [0.002, 0.0]  # forward, backward (the receiver's: 0)
    both = _paced_by(True, sender, receiver)
    assert both == _paced_by(False, receiver, sender) == [0.001, 0.003, 0.002]


def _wait_for_any(transport: LocalTransport, keys: list, failed: list) -> None:
    try:
        transport.wait_for_any(keys)
    except BaseException as error:  # reported by the test, not lost in the thread
        failed.append(error)


@pytest.mark.timeout(60)
def test_a_thread_running_several_stages_wakes_for_a_message_to_any_of_them():
    """Stages 1 and 3 share a thread's wake-ups: a message to stage 3 ends its wait for
    either stage's next message, and only then is that message there."""
    transport = LocalTransport(["cpu"] * STAGES, timeout=20.0)
    transport.share_wakeups([(3, 1), (0,), (2,)])
    assert transport._ready[1] is transport._ready[3] is not transport._ready[0]
    failed: list = []
    keys = [(0, 1, "F", 5), (2, 3, "F", 5)]
    waiter = threading.Thread(target=_wait_for_any, args=(transport, keys, failed), daemon=True)
    waiter.start()
    assert not any(transport.arrived(*key) for key in keys)
    waiter.join(0.2)
    assert waiter.is_alive()  # nothing for either stage yet
    transport.send(0, 2, "F", 5, {"value": torch.tensor(1)})  # to stage 2: not awaited
    waiter.join(0.2)
    assert waiter.is_alive()
    transport.send(2, 3, "F", 5, {"value": torch.tensor(2)})
    waiter.join(20)
    assert not waiter.is_alive() and not failed
    assert transport.arrived(2, 3, "F", 5) and not transport.arrived(0, 1, "F", 5)
    assert int(transport.recv(2, 3, "F", 5)["value"]) == 2
    assert not transport.arrived(2, 3, "F", 5)  # taken


@pytest.mark.timeout(60)
def test_a_thread_waiting_for_several_stages_is_woken_by_an_abort_and_times_out_clearly():
    transport = LocalTransport(["cpu"] * STAGES, timeout=20.0)
    transport.share_wakeups([(3, 1)])
    failed: list = []
    keys = [(0, 1, "F", 0), (2, 3, "B", 0)]
    waiter = threading.Thread(target=_wait_for_any, args=(transport, keys, failed), daemon=True)
    waiter.start()
    waiter.join(0.2)
    transport.abort(RuntimeError("stage 0 failed"))
    waiter.join(5)
    assert not waiter.is_alive()
    [error] = failed
    assert isinstance(error, PipelineAborted)
    assert "the thread running stages 1, 3 stopped: stage 0 failed" in str(error)
    quick = LocalTransport(["cpu"] * STAGES, timeout=0.05)
    with pytest.raises(FxpipeError, match=r"the thread running stages 1, 3 waited 0 s for F "
                                          r"micro-batch 0 from stage 0 to stage 1 or B "
                                          r"micro-batch 0 from stage 2 to stage 3; the"):
        quick.wait_for_any(keys)
    with pytest.raises(FxpipeError, match=r"^stage 1 waited 0 s for F micro-batch 0 from stage "
                                          r"0; the schedule's sends and receives do not match"):
        quick.recv(0, 1, "F", 0)
