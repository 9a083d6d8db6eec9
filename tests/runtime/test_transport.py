"""The local transport: messages reach their receivers, waking only them (an abort, every one)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import FxpipeError
from fxpipe.runtime.transport import LocalTransport, MicroBatchKey, PipelineAborted

STAGES = 4


class CountingCondition(threading.Condition):
    """A condition that counts how often a thread waited on it and how often it was notified
    (notify_all notifies through notify), and says when a thread first waited."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.waits = 0
        self.notified = 0
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        self.waiting.set()
        return super().wait(timeout)

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def _receive_all(transport: LocalTransport, dst: int, keys: list, got: dict, failed: list
                 ) -> None:
    try:
        for src, direction, mb in keys:
            got[src, dst, direction, mb] = transport.recv(src, dst, direction, mb)["value"]
    except BaseException as error:  # reported by the test, not lost in the thread
        failed.append(error)


messages = st.lists(
    st.tuples(st.integers(0, STAGES - 1), st.integers(0, STAGES - 1),
              st.sampled_from(["F", "B"]), st.integers(0, 3).map(lambda mb: MicroBatchKey(0, mb)),
              ).filter(lambda k: k[0] != k[1]),
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
                                args=(transport, 2, [(0, "F", MicroBatchKey(0, 0))], got, failed))
    receiver.start()
    assert waiting.waiting.wait(20)
    for mb in range(20):  # messages for stage 1, which nobody receives: stage 2 sleeps on
        transport.send(0, 1, "F", MicroBatchKey(0, mb), {"value": torch.tensor(mb)})
    assert waiting.notified == 0 and receiver.is_alive()  # no send was for stage 2
    transport.send(0, 2, "F", MicroBatchKey(0, 0), {"value": torch.tensor(7)})
    receiver.join(20)
    assert not failed and int(got[0, 2, "F", MicroBatchKey(0, 0)]) == 7
    assert waiting.notified == 1 and waiting.waits == 1  # its own message ended its one wait


@pytest.mark.timeout(60)
def test_an_abort_wakes_every_waiting_stage_with_the_error():
    transport = LocalTransport(["cpu"] * STAGES, timeout=50.0)
    transport._ready = [CountingCondition(transport._lock) for _ in range(STAGES)]
    failed: list = []
    receivers = [threading.Thread(target=_receive_all, daemon=True,
                                  args=(transport, dst, [(0, "F", MicroBatchKey(0, 0))], {},
                                        failed))
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


@pytest.mark.timeout(30)
def test_a_receive_that_times_out_names_the_message_it_waited_for():
    transport = LocalTransport(["cpu"] * 2, timeout=0.05)
    with pytest.raises(FxpipeError, match=r"stage 1 waited 0.05 s for F micro-batch 3 from stage "
                                          r"0: a stage is stuck, or the schedule's sends and "
                                          r"receives do not match \(Plan\(timeout=...\)"):
        transport.recv(0, 1, "F", MicroBatchKey(0, 3))
