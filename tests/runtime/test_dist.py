"""The distributed transport's watchdog (its deadline and what it says when a wait fails) and
the dtypes its messages travel in."""

from __future__ import annotations

import datetime

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxpipe.errors import FxpipeError
from fxpipe.runtime.dist import ErrorBoard, Watchdog, _Slot, _wire_dtype
from fxpipe.runtime.transport import PipelineAborted


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Work:
    """A receive that fails after `after` seconds of the clock, with `message`."""

    def __init__(self, clock: Clock, after: float, message: str) -> None:
        self.clock, self.after, self.message = clock, after, message
        self.timeouts: list[float] = []

    def wait(self, timeout: datetime.timedelta) -> None:
        self.timeouts.append(timeout.total_seconds())
        self.clock.now += self.after
        raise RuntimeError(self.message)


class Board(ErrorBoard):
    def __init__(self, posted: str | None = None) -> None:
        self.store, self.posted = None, posted

    def read(self) -> str | None:
        return self.posted


@given(timeout=st.none() | st.floats(0.01, 100), steps=st.lists(st.floats(1e-3, 50), max_size=4))
def test_the_deadline_is_the_timeout_or_ten_times_the_longest_step(timeout, steps):
    clock = Clock()
    watchdog = Watchdog(timeout, 0, 0, Board(), clock)
    for seconds in steps:
        watchdog.started()
        clock.now += seconds
        watchdog.finished()
    longest = max(steps, default=0.0)
    default = 300.0 if not longest else 30.0
    expected = max(default if timeout is None else timeout, 10 * longest)
    assert watchdog.deadline() == pytest.approx(expected, rel=1e-9)


def test_a_wait_past_its_deadline_names_what_it_waited_for():
    clock = Clock()
    watchdog = Watchdog(2.0, 2, 2, Board(), clock)
    work = Work(clock, 2.0, "Timed out waiting 2000ms for recv operation to complete")
    with pytest.raises(FxpipeError, match=r"rank 2 \(stage 2\) waited 2\.0 s for forward "
                       r"micro-batch 0 from stage 1 \(rank 1\), its deadline") as caught:
        watchdog.wait(work, "forward micro-batch 0 from stage 1 (rank 1)")
    assert "give a larger Plan(timeout=seconds)" in str(caught.value)
    assert work.timeouts == [2.0]


def test_a_lost_peer_is_told_apart_from_a_deadline():
    clock = Clock()
    watchdog = Watchdog(None, 0, 0, Board(), clock)
    work = Work(clock, 1.3, "Connection closed by peer")
    with pytest.raises(FxpipeError, match=r"rank 0 \(stage 0\) lost its connection after 1\.3 s "
                       r"of waiting for backward micro-batch 1 from stage 1 \(rank 1\), and no "
                       r"rank reported an error: a rank exited or was killed \(RuntimeError: "
                       r"Connection closed by peer\)") as caught:
        watchdog.wait(work, "backward micro-batch 1 from stage 1 (rank 1)")
    assert "300" not in str(caught.value)


def test_a_failure_another_rank_posted_comes_first():
    clock = Clock()
    watchdog = Watchdog(2.0, 0, 0, Board("rank 1 failed: ValueError: bad"), clock)
    with pytest.raises(PipelineAborted, match="the pipeline stopped because rank 1 failed: "
                       "ValueError: bad"):
        watchdog.wait(Work(clock, 2.0, "Timed out"), "backward micro-batch 0 from stage 1")


_FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@given(st.sampled_from(_FLOATS), st.sampled_from(_FLOATS))
def test_a_value_travels_in_its_slots_dtype_only_without_loss(made, expected):
    """A value in its slot's dtype travels as it is; one the compiler left in the trace's
    (wider) dtype widens to it; one it would have to narrow stops with its name."""
    slot = _Slot("h", expected, lambda b, s: (2,), None)
    value = torch.tensor([1.0, 2.0], dtype=made)
    if torch.promote_types(made, expected) == expected:
        assert _wire_dtype(value, slot, 0, 1) == expected
    else:
        with pytest.raises(FxpipeError, match="'h' crossing from stage 0 to stage 1"):
            _wire_dtype(value, slot, 0, 1)


@given(st.sampled_from([torch.int32, torch.int64, torch.bool]), st.sampled_from(_FLOATS))
def test_an_integer_value_never_travels_in_a_float_slot(made, expected):
    """An integer may round in a float (2**24 + 1 in fp32): it stops with its name."""
    slot = _Slot("ids", expected, lambda b, s: (2,), None)
    with pytest.raises(FxpipeError, match="'ids' crossing from stage 0 to stage 1"):
        _wire_dtype(torch.tensor([2**24 + 1, 3]).to(made), slot, 0, 1)
