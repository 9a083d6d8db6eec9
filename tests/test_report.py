"""Plan versus reality: the report, the trace JSON, the timeline picture, re-planning."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fxpipe
from fxpipe.cost import Partition
from fxpipe.errors import FxpipeError
from fxpipe.models import MLP, VGG
from fxpipe.report import (
    LATE_AFTER,
    format_report,
    interference,
    late_messages,
    shared_cores_lines,
    step_time,
    unlike_prediction_lines,
)
from fxpipe.schedules import Action, ActionKind
from fxpipe.simulate import Event


@pytest.fixture(scope="module")
def trained():
    model = VGG()
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    # unbound whatever thread capacity compile measures, so that the tests that set the usable
    # cores get the even split of them (binding would fix each stage's core instead)
    plan = fxpipe.Plan(stages=3, micro_batches=4, schedule="1f1b", loss_fn=F.cross_entropy,
                       cpu_affinity="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    pipe.step(x, y)
    return pipe


def test_report_compares_measured_and_predicted(trained, capsys):
    text = trained.report()
    assert capsys.readouterr().out.strip() == text.strip()
    assert text.startswith("step (1f1b): measured ")
    assert "bounding stage:" in text and "bubble: measured" in text
    measured = step_time(trained.last_trace(), 3)
    assert measured.makespan > 0
    for stage in measured.stages:
        parts = stage.compute + stage.communication + stage.reduction + stage.idle
        assert parts == pytest.approx(measured.makespan, rel=1e-6)  # a stage does one thing
        assert stage.compute > 0


def test_report_names_the_slowdown_beside_other_stages_when_it_can_measure_it(trained):
    text = trained.report()
    found = interference(trained.last_trace())
    assert ("beside another stage's compute" in text) == bool(found)
    for slowdown in found:
        assert slowdown.ratio > 0 and slowdown.beside > 0 and slowdown.without > 0


@settings(max_examples=50, deadline=None)
@given(base=st.floats(1e-4, 1e-2), slow=st.floats(0.5, 5.0), beside=st.integers(1, 5),
       without=st.integers(1, 5))
def test_interference_is_the_slowdown_of_actions_beside_another_stages_compute(
        base, slow, beside, without):
    """Stage 0 runs `beside` forwards, each `slow` times `base`, inside one backward of stage 1,
    then `without` forwards of `base` alone: its forwards slowed by `slow`. Stage 1's only
    backward has nothing to compare with, so no backward slowdown is reported."""
    events, t = [], 0.0
    for mb in range(beside + without):
        duration = base * slow if mb < beside else base
        events.append(Event(0, Action(0, ActionKind.F, mb), t, t + duration))
        t += duration
    events.append(Event(1, Action(1, ActionKind.B, 0), 0.0, beside * base * slow))
    (found,) = interference(events)
    assert found.kind is ActionKind.F
    assert found.ratio == pytest.approx(slow)
    assert (found.beside, found.without) == (beside, without)


def test_interference_counts_time_beside_several_stages_once():
    """Stage 0's first forward has two other stages computing over the same 30% of it: beside
    them for 30% of its time, not 60%, so it counts as without."""
    events = [Event(0, Action(0, ActionKind.F, 0), 0.0, 1.0),
              Event(0, Action(0, ActionKind.F, 1), 1.0, 3.0),
              Event(1, Action(1, ActionKind.F, 0), 0.0, 0.3),
              Event(2, Action(2, ActionKind.F, 0), 0.0, 0.3),
              Event(1, Action(1, ActionKind.B, 0), 1.0, 3.0)]
    (found,) = interference(events)
    assert (found.kind, found.ratio, found.beside, found.without) == (ActionKind.F, 2.0, 1, 1)


def _message(send_end: float, receive: tuple[float, float], mb: int = 0) -> list[Event]:
    """Stage 0 computes micro-batch `mb` and sends it, ending at `send_end`; stage 1 waits in
    its receive over `receive` (start, end)."""
    return [Event(0, Action(0, ActionKind.F, mb), 0.0, send_end / 2),
            Event(0, Action(0, ActionKind.SEND_F, mb, 1), send_end / 2, send_end),
            Event(1, Action(1, ActionKind.RECV_F, mb, 0), *receive)]


@settings(max_examples=60, deadline=None)
@given(send_end=st.floats(1e-4, 1e-2), transfer=st.floats(0.0, 1e-3),
       receiver_busy=st.floats(0.0, 5e-3), delay=st.floats(0.0, 2e-2))
def test_a_message_is_late_by_its_wait_after_the_send_beyond_the_predicted_one(
        send_end, transfer, receiver_busy, delay):
    """The prediction: the receive starts at 0 and ends `transfer` after the send. Measured: the
    receiver starts its receive `receiver_busy` later and it ends `delay` later than it would
    have had the transfer taken its predicted time. A receiver that came late to a message that
    had already arrived does not make it late; the send takes its predicted time, so only the
    wait after it counts here (a send held up: the test below)."""
    assume(abs(delay - LATE_AFTER) > 1e-9)  # clear of rounding at the threshold
    predicted = _message(send_end, (0.0, send_end + transfer))
    start = receiver_busy
    end = max(start, send_end) + transfer + delay
    found = late_messages(_message(send_end, (start, end)), predicted)
    assert found.receives == 1
    assert found.late == (delay > LATE_AFTER)
    assert found.excess == pytest.approx(delay if delay > LATE_AFTER else 0.0, abs=1e-12)
    assert found.worst == ("1RF0<0" if found.late else "")
    assert late_messages(predicted, predicted).late == 0


@settings(max_examples=60, deadline=None)
@given(send_end=st.floats(1e-4, 1e-2), transfer=st.floats(0.0, 1e-3),
       held=st.floats(0.0, 2e-2), waited=st.floats(0.0, 2e-2))
def test_a_message_is_late_by_its_send_held_up_and_the_wait_after_it_together(
        send_end, transfer, held, waited):
    """The send takes `held` longer than predicted (the transport held the sender), and the
    receive, waiting from the start, ends `waited` later after the send than predicted: the
    message reached its receiver `held + waited` later after its send began."""
    assume(abs(held + waited - LATE_AFTER) > 1e-9)  # clear of rounding at the threshold
    predicted = _message(send_end, (0.0, send_end + transfer))
    compute, send, receive = _message(send_end, (0.0, send_end + held + transfer + waited))
    measured = [compute, Event(send.stage, send.action, send.start, send.end + held), receive]
    found = late_messages(measured, predicted)
    assert found.receives == 1
    assert found.late == (held + waited > LATE_AFTER)
    assert found.excess == pytest.approx(held + waited if found.late else 0.0, abs=1e-12)


def test_late_messages_sum_over_receives_and_name_the_longest():
    predicted = _message(1e-3, (0.0, 1.1e-3)) + _message(2e-3, (1.1e-3, 2.1e-3), mb=1)
    measured = _message(1e-3, (0.0, 4.1e-3)) + _message(2e-3, (4.1e-3, 4.15e-3), mb=1)
    found = late_messages(measured, predicted)
    # micro-batch 0 waited 3 ms beyond its prediction; 1's receive began after it arrived
    assert (found.late, found.receives, found.worst) == (1, 2, "1RF0<0")
    assert found.excess == found.longest == pytest.approx(3e-3)
    line = format_report(step_time(measured, 2), step_time(predicted, 2), "gpipe", late=found)
    assert "late messages: 1 of 2 were delayed over 0.50 ms longer than predicted" in line
    assert "1RF0<0" in line
    quiet = late_messages(predicted, predicted)
    assert "late messages" not in format_report(step_time(predicted, 2),
                                                step_time(predicted, 2), "gpipe", late=quiet)


def test_a_receive_is_paired_with_the_same_occurrence_of_its_send():
    """Two runs in one trace (a drop-in forward and backward appended): the first receive waits
    3 ms after the first send; the second send, 10 s later, is not the one it waited for."""
    predicted = _message(1e-3, (0.0, 1.1e-3))
    measured = _message(1e-3, (0.0, 4.1e-3)) + [
        Event(e.stage, e.action, e.start + 10.0, e.end + 10.0)
        for e in _message(1e-3, (0.0, 1.1e-3))]
    found = late_messages(measured, predicted)
    assert (found.late, found.receives) == (1, 1)  # the second run has no prediction to meet
    assert found.excess == pytest.approx(3e-3)


def test_report_predicts_with_the_partition_it_is_given(trained, monkeypatch):
    """E.g. one re-timed beside the run: here the compiled costs doubled, so the stages' predicted
    compute doubles (the runtime's own time per forward stays) and the measured times stay."""
    part = trained.partition
    for name in ("forward_switch", "backward_switch"):  # each forward at its figures alone
        monkeypatch.setattr(trained, name, (0.0,) * len(part.sizes))
    doubled = dataclasses.replace(trained.cost, f=trained.cost.f * 2, b=trained.cost.b * 2)
    slower = Partition.evaluate(doubled, part.bounds, part.micro_batches, part.partitioner,
                                schedule="1f1b")

    def forward_ms(text):  # stage 0's "fwd ms meas/pred" cell
        row = next(line for line in text.splitlines() if line.startswith("0 "))
        measured, predicted = row.split()[1], row.split()[3]
        return float(measured), float(predicted)

    plain, given = forward_ms(trained.report()), forward_ms(trained.report(partition=slower))
    assert given[0] == plain[0]
    own = trained.forward_overhead[0] * 1e3  # per forward, as the cell is
    assert given[1] == pytest.approx(2 * plain[1] - own, rel=0.02, abs=0.01)


def test_step_time_of_a_simulated_timeline_matches_the_simulator(trained):
    timeline = trained.predicted_timeline()
    breakdown = step_time(timeline.events, 3)
    assert breakdown.makespan == pytest.approx(timeline.makespan)
    assert breakdown.bubble == pytest.approx(timeline.bubble)


def test_trace_json_holds_measured_and_predicted_tracks(trained, tmp_path):
    path = tmp_path / "trace.json"
    trained.save_trace(path)
    trace = json.loads(path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"measured", "predicted"}
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    kinds = {e["cat"] for e in slices}
    assert {"F", "B", "SEND_F", "RECV_F"} <= kinds
    assert sum(e["pid"] == 0 and e["cat"] == "F" for e in slices) == 3 * 4


def test_the_trace_and_the_picture_predict_with_the_partition_they_are_given(trained,
                                                                              tmp_path,
                                                                              monkeypatch):
    part = trained.partition
    for name in ("forward_switch", "backward_switch"):  # each forward at its figures alone
        monkeypatch.setattr(trained, name, (0.0,) * len(part.sizes))
    doubled = dataclasses.replace(trained.cost, f=trained.cost.f * 2, b=trained.cost.b * 2)
    slower = Partition.evaluate(doubled, part.bounds, part.micro_batches, part.partitioner,
                                schedule="1f1b")

    def predicted_forwards(partition):  # microseconds the predicted track spends in F
        path = tmp_path / "trace.json"
        trained.save_trace(path, partition=partition)
        events = json.loads(path.read_text())["traceEvents"]
        pid = next(e["pid"] for e in events
                   if e["name"] == "process_name" and e["args"]["name"] == "predicted")
        return sum(e["dur"] for e in events if e["ph"] == "X" and e["pid"] == pid
                   and e["cat"] == "F")

    own = sum(trained.forward_overhead) * part.micro_batches * 1e6  # the runtime's, as is
    assert predicted_forwards(slower) == pytest.approx(
        2 * predicted_forwards(None) - own, rel=0.02)
    drawn: list = []  # the predicted forwards' microseconds of each picture drawn

    def draw(path, timelines, stages, title):
        drawn.append(sum(e.duration for e in timelines["predicted"]
                         if e.action.kind is ActionKind.F) * 1e6)

    monkeypatch.setattr("fxpipe.pipeline.save_timeline", draw)
    trained.save_timeline(tmp_path / "t.png")
    trained.save_timeline(tmp_path / "t.png", partition=slower)
    assert drawn[1] == pytest.approx(2 * drawn[0] - own, rel=0.02)
    assert drawn[1] == pytest.approx(predicted_forwards(slower), rel=1e-6)
    with pytest.raises(FxpipeError, match=re.escape("save_timeline(partition=...) takes a "
                                                    "Partition")):
        trained.save_timeline(tmp_path / "t.png", partition="balanced")


def test_timeline_picture_is_written(trained, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    trained.save_timeline(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replan_never_proposes_a_worse_partition(trained):
    result = fxpipe.replan(trained, threshold=0.0)
    assert result.proposed.predicted_time <= result.current.predicted_time
    assert sum(result.plan_sizes) == len(trained.units)
    # balancing parameters instead of time finds a slower partition of VGG (its parameters sit
    # in the late layers, its time in the early ones): replan must keep the one that ran
    by_params = fxpipe.replan(trained, threshold=0.0, partitioner="params")
    assert not by_params.changed
    assert by_params.proposed is by_params.current
    assert "keep the current partition" in str(by_params)


def test_replan_prints_where_the_report_would_and_refuses_an_unknown_partitioner(trained,
                                                                                  capsys):
    fxpipe.replan(trained, threshold=0.0)
    assert "measured stage imbalance" in capsys.readouterr().out
    vars(trained)["rank"] = 1  # another rank than 0 of a torchrun job: it stays quiet
    try:
        result = fxpipe.replan(trained, threshold=0.0)
    finally:
        del vars(trained)["rank"]
    assert capsys.readouterr().out == "" and "measured stage imbalance" in str(result)
    with pytest.raises(FxpipeError, match=r"replan\(partitioner='foo'\) is not known; "
                                          r"choose one of even, params, balanced"):
        fxpipe.replan(trained, partitioner="foo")


def test_the_pipeline_calls_say_what_they_take_when_given_something_else(trained, tmp_path):
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(FxpipeError, match=re.escape(
            "replan() takes the pipeline fxpipe.compile returned, not Linear")):
        fxpipe.replan(torch.nn.Linear(2, 2))
    with pytest.raises(FxpipeError, match=re.escape(
            "retime() takes the pipeline fxpipe.compile returned, not Linear")):
        fxpipe.retime(torch.nn.Linear(2, 2), x)
    with pytest.raises(FxpipeError, match=re.escape("report(partition=...) takes a Partition")):
        trained.report(partition="balanced")
    with pytest.raises(FxpipeError, match=re.escape("report(file=...) takes an open text file")):
        trained.report(file=str(tmp_path / "report.txt"))


def test_replan_moves_work_away_from_a_stage_measured_slower():
    model = MLP((32, 64, 64, 64, 64, 64, 64, 10))
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    plan = fxpipe.Plan(stages=2, partitioner="even", micro_batches=4, loss_fn=F.cross_entropy)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    pipe.step(x, y)
    # pretend stage 0 ran ten times slower than measured at compile time
    slow = [type(e)(e.stage, e.action, e.start, e.start + e.duration * (10 if e.stage == 0
                                                                          else 1))
            for e in pipe.last_trace()]
    pipe.executor._trace = slow
    result = fxpipe.replan(pipe)
    assert result.changed and result.dispersion > 0.05
    assert result.proposed.sizes[0] < result.current.sizes[0]


@given(stages=st.integers(1, 16), cores=st.integers(1, 16), ranks=st.booleans(),
       bound=st.booleans())
def test_stages_sharing_cores_are_named_exactly_when_there_are_more_than_cores(stages, cores,
                                                                              ranks, bound):
    lines = shared_cores_lines(stages, cores, ranks=ranks, bound=bound and not ranks)
    assert bool(lines) == (stages > cores)
    who = "ranks" if ranks else "stages"
    for line in lines:
        assert f"{stages} {who} compute on this host's {cores} CPU core" in line
        assert ("timed on all the ranks at once" in line) == ranks
        assert ("splits each core among the stages on it" in line) == (bound and not ranks)
        assert ("splits the cores evenly" in line) == (not bound and not ranks)


@pytest.mark.parametrize("cores, device", [(2, "cpu"), (3, "cpu"), (2, "cuda:0")])
def test_report_says_when_its_stage_threads_share_cores(trained, monkeypatch, cores, device):
    """The 3 stage threads of `trained` on 2 cores, then on 3; stages on GPUs share none."""
    import fxpipe.pipeline
    from fxpipe.passes.analysis.capacity import ThreadCapacity

    monkeypatch.setattr(fxpipe.pipeline, "usable_cores", lambda: cores)
    for runner in trained.executor.runners.values():
        monkeypatch.setattr(runner, "device", torch.device(device))
    # as compile measured it on 2 cores
    monkeypatch.setitem(vars(trained), "thread_capacity", ThreadCapacity(2, 3, 1.5, 0.75))
    text = trained.report()
    shared = cores == 2 and device == "cpu"
    assert ("shared cores: 3 stages compute on this host's 2 CPU cores" in text) == shared
    assert ("shared cores" in text) == shared
    assert ("thread capacity: 3 threads, each running all the model's units, got through "
            "0.75x the work of one thread at once, 2 threads 1.50x" in text) == shared
    # within the cores too, where the stages compute on the CPU
    assert ("interpreter lock: 3 threads got through 0.750x, under one thread's work" in text) \
        == (device == "cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_stage_threads_on_fewer_cores_are_predicted_to_share_them(trained, monkeypatch, device):
    """The 3 stage threads of `trained` on 1 core take the compute of all three one after
    another at best; on 3 cores, or on GPUs, each runs at its own pace."""
    import fxpipe.pipeline

    for runner in trained.executor.runners.values():
        monkeypatch.setattr(runner, "device", torch.device(device))
    monkeypatch.setattr(fxpipe.pipeline, "usable_cores", lambda: 3)
    own = trained.predicted_timeline()
    monkeypatch.setattr(fxpipe.pipeline, "usable_cores", lambda: 1)
    one = trained.predicted_timeline()
    work = sum(e.duration for e in own.events if e.action.kind.is_compute)
    if device == "cpu":
        assert one.makespan >= work * (1 - 1e-9) > own.makespan
    else:
        assert one.makespan == own.makespan


def test_report_says_when_the_last_run_is_not_the_step_it_predicts():
    model = MLP((16, 32, 32, 10))
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    plan = fxpipe.Plan(stages=2, micro_batches=4, loss_fn=F.cross_entropy)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    pipe.step(x, y)  # compile's example: micro-batches of 2
    assert "not the predicted run" not in pipe.report(file=io.StringIO())
    pipe.step(torch.randn(14, 16), torch.randint(0, 10, (14,)))
    text = pipe.report(file=io.StringIO())
    assert ("not the predicted run: its micro-batches held 4, 4, 3, 3 samples, the "
            "prediction's (compile's example) 2 samples each") in text
    assert text.splitlines()[1].startswith("not the predicted run")  # right below the totals
    with torch.no_grad():
        pipe(x)
    text = pipe.report(file=io.StringIO())
    assert "not the predicted run: it ran forwards only" in text
    assert "micro-batches held" not in text  # compile's sizes again


def test_report_sets_the_last_steps_like_the_last_run_beside_it():
    model = MLP((16, 32, 32, 10))
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    plan = fxpipe.Plan(stages=2, micro_batches=4, loss_fn=F.cross_entropy)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))

    def recent_line() -> str | None:
        lines = [line for line in pipe.report(file=io.StringIO()).splitlines()
                 if line.startswith("the last ")]
        return lines[0] if lines else None

    pipe.step(x, y)
    assert recent_line() is None  # one step: nothing beside it
    for _ in range(11):
        pipe.step(x, y)
        pipe.measure_runtime_overhead(x)  # rehearsals neither count nor end the series
    kept = pipe.executor.recent_steps()
    assert len(kept) == 10 and kept[-1] == (pipe.last_trace(), pipe.executor.trace_origin)
    spans = [step_time(events, 2).makespan for events in pipe.executor.full_traces(kept)]
    predicted = step_time(pipe.predicted_timeline().events, 2).makespan
    assert recent_line() == (
        f"the last 10 steps like it: {min(spans) * 1e3:.2f} to {max(spans) * 1e3:.2f} ms, "
        f"median {statistics.median(spans) * 1e3:.2f} ms (measured / predicted = "
        f"{statistics.median(spans) / predicted:.2f}); one step moves with the machine's "
        f"speed, their median less")
    pipe.step(torch.randn(14, 16), torch.randint(0, 10, (14,)))  # other sizes: a new series
    assert recent_line() is None and len(pipe.executor.recent_steps()) == 1
    pipe.step(torch.randn(14, 16), torch.randint(0, 10, (14,)))
    assert recent_line().startswith("the last 2 steps like it: ")
    with torch.no_grad():
        pipe(x)  # not a training step: the series ends
    assert recent_line() is None and pipe.executor.recent_steps() == []


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(1, 3),
       st.lists(st.integers(1, 5), min_size=1, max_size=12))
def test_a_run_differs_from_the_prediction_unless_each_mini_batch_splits_as_predicted(
        predicted, mini_batches, other):
    as_predicted = predicted * mini_batches  # pipe.step_many: one mini-batch after another
    assert unlike_prediction_lines(predicted, as_predicted, backward=True) == []
    lines = unlike_prediction_lines(predicted, other, backward=True)
    assert bool(lines) == (other != predicted * max(len(other) // len(predicted), 1))
    assert unlike_prediction_lines(None, other, backward=True) == []  # not known: not told
    assert unlike_prediction_lines(predicted, [], backward=True) == []  # no run's sizes
    assert "forwards only" in unlike_prediction_lines(None, other, backward=False)[0]


def test_report_before_any_run():
    pipe = fxpipe.compile(MLP(), fxpipe.Plan(stages=2, costs="none"),
                          example_inputs=(torch.randn(2, 32),))
    with pytest.raises(fxpipe.FxpipeError, match=r"nothing has run yet"):
        pipe.report()
    with pytest.raises(fxpipe.FxpipeError, match=r"nothing has run yet"):
        pipe.save_trace("unused.json")


def test_compile_measures_the_runtimes_own_time_per_step_without_touching_gradients():
    torch.manual_seed(0)
    model = fxpipe.models.GPT(layers=2)  # a weight tied across the stages
    idx = torch.randint(0, 128, (8, 16))
    plan = fxpipe.Plan(stages=2, micro_batches=4, loss_fn=lambda out, t: out.mean())
    pipe = fxpipe.compile(model, plan, example_inputs=(idx,), cache=False)
    first = pipe.step_overhead
    assert 0 < first < 1.0  # seconds: no compute, so far below a second
    assert all(p.grad is None for p in pipe.parameters())  # nothing ran backward
    again = pipe.measure_step_overhead(idx)
    assert pipe.step_overhead == again and 0 < again < 1.0
    assert again < 20 * first and first < 20 * again  # the same work measured twice
    none = fxpipe.compile(model, fxpipe.Plan(stages=2, costs="none"), example_inputs=(idx,))
    assert none.step_overhead == 0.0  # not measured without costs


def test_the_step_overhead_is_a_steps_time_outside_its_actions(monkeypatch):
    # measured on steps: 2 ms more of the runtime's work before the actions start makes it
    # 2 ms larger; 2 ms more inside every forward action leaves it as it was
    pipe = fxpipe.compile(fxpipe.models.MLP(), fxpipe.Plan(stages=2, micro_batches=2),
                          example_inputs=(torch.randn(4, 32),), cache=False)
    x = torch.randn(4, 32)

    def overhead() -> float:
        return statistics.median(pipe.measure_step_overhead(x) for _ in range(3))

    plain = overhead()
    prepare = pipe.executor.transport.prepare

    def slower_prepare(*args):
        time.sleep(0.002)
        return prepare(*args)

    with monkeypatch.context() as patch:
        patch.setattr(pipe.executor.transport, "prepare", slower_prepare)
        assert overhead() - plain == pytest.approx(0.002, abs=1e-3)
    hooks = [stage.module.register_forward_hook(lambda *_: time.sleep(0.002))
             for stage in pipe.stages]
    try:
        assert overhead() == pytest.approx(plain, abs=1e-3)
    finally:
        for hook in hooks:
            hook.remove()
    assert pipe.last_trace() == [] and pipe.executor.last_schedule is None  # no step ran


def test_the_step_overhead_counts_what_the_others_messages_cost_the_first_stages_burst(
        monkeypatch):
    # a burst 2 ms longer while the other ranks' messages land than in a quiet rehearsal
    # makes the step's overhead 2 ms longer
    pipe = fxpipe.compile(fxpipe.models.MLP(), fxpipe.Plan(stages=2, micro_batches=2),
                          example_inputs=(torch.randn(4, 32),), cache=False)
    x = torch.randn(4, 32)
    coordinator = pipe.executor.coordinator
    overheads = []
    for loud in (0.003, 0.005):
        def burst(quiet: bool = False, loud: float = loud) -> float:
            seconds = 0.003 if quiet else loud
            time.sleep(seconds)
            return seconds

        monkeypatch.setattr(coordinator, "rehearsal_burst", burst)
        overheads.append(statistics.median(pipe.measure_step_overhead(x) for _ in range(5)))
    assert overheads[1] - overheads[0] == pytest.approx(0.002, abs=5e-4)


def test_compile_measures_the_runtimes_own_time_per_action_without_touching_gradients():
    torch.manual_seed(0)
    model = fxpipe.models.GPT(layers=2)  # a weight tied across the stages, timed at once
    idx = torch.randint(0, 128, (8, 16))
    plan = fxpipe.Plan(stages=2, micro_batches=4, loss_fn=lambda out, t: out.mean())
    pipe = fxpipe.compile(model, plan, example_inputs=(idx,), cache=False)
    for overhead in (pipe.forward_overhead, pipe.backward_overhead):
        assert len(overhead) == 2
        assert all(0 < figure < 0.05 for figure in overhead)  # no compute in it
    assert all(p.grad is None for p in pipe.parameters())
    assert all(runner.in_flight == 0 for runner in pipe.executor.runners.values())
    assert all("backpropagate" not in vars(runner) for runner in pipe.executor.runners.values())
    none = fxpipe.compile(model, fxpipe.Plan(stages=2, costs="none"), example_inputs=(idx,))
    assert none.forward_overhead == none.backward_overhead == (0.0, 0.0)  # not measured


def test_measure_runtime_overhead_measures_the_step_and_every_action_afresh():
    pipe = fxpipe.compile(fxpipe.models.MLP(), fxpipe.Plan(stages=2, costs="none"),
                          example_inputs=(torch.randn(4, 32),))
    assert pipe.step_overhead == 0.0 and pipe.forward_overhead == (0.0, 0.0)  # not measured
    pipe.measure_runtime_overhead(torch.randn(4, 32))
    assert 0 < pipe.step_overhead < 1.0
    for overhead in (pipe.forward_overhead, pipe.backward_overhead):
        assert len(overhead) == 2 and all(0 < figure < 0.05 for figure in overhead)


def _slowed(monkeypatch, obj, name: str, seconds: float = 0.002):
    """obj.name, on this instance only, taking `seconds` longer per call."""
    method = getattr(obj, name)

    def slower(*args, **kwargs):
        time.sleep(seconds)
        return method(*args, **kwargs)

    monkeypatch.setattr(obj, name, slower)


FORWARDS, BACKWARDS = 0, 1  # measure_action_overhead's two per-stage tuples


def test_the_action_overhead_is_the_runtimes_work_beside_the_module_and_autograd_calls(
        monkeypatch):
    # 2 ms more of the runner's own work per forward (per backward) makes that figure 2 ms
    # larger; 2 ms more in the stage module's call or in the autograd call (which the units'
    # timings hold) leaves it as it was
    pipe = fxpipe.compile(fxpipe.models.MLP(), fxpipe.Plan(stages=2, micro_batches=2),
                          example_inputs=(torch.randn(4, 32),), cache=False)
    x = torch.randn(4, 32)
    last = 1
    runner = pipe.executor.runners[last]
    plain = pipe.measure_action_overhead(x)
    # the runner detaching each input of a forward, and its hook, fired after each backward's
    # autograd call: what is slowed, on what, the kind of action it slows and the other kind
    for owner, name, slowed, other in ((runner, "_leaf", FORWARDS, BACKWARDS),
                                       (runner.hook, "fire", BACKWARDS, FORWARDS)):
        with monkeypatch.context() as patch:
            _slowed(patch, owner, name)
            slower = pipe.measure_action_overhead(x)
        assert slower[slowed][last] - plain[slowed][last] == pytest.approx(0.002, abs=1e-3)
        assert slower[other][last] == pytest.approx(plain[other][last], abs=1e-3)
        assert slower[slowed][0] == pytest.approx(plain[slowed][0], abs=1e-3)
    hook = runner.stage.module.register_forward_hook(lambda *_: time.sleep(0.002))
    try:
        with monkeypatch.context() as patch:
            _slowed(patch, runner, "backpropagate")
            own = runner.backpropagate
            in_calls = pipe.measure_action_overhead(x)
            assert runner.backpropagate is own  # the instance's own, put back
    finally:
        hook.remove()
    assert in_calls[FORWARDS][last] == pytest.approx(plain[FORWARDS][last], abs=1e-3)
    assert in_calls[BACKWARDS][last] == pytest.approx(plain[BACKWARDS][last], abs=1e-3)


def test_a_backward_with_no_autograd_call_is_the_runtimes_own_work_alone(monkeypatch):
    # the first stage's weights frozen: its outputs need no gradient, so its backward makes no
    # autograd call, and the module call before it counts for nothing in the figure
    model = fxpipe.models.MLP()
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2),
                          example_inputs=(torch.randn(4, 32),), cache=False)
    runner = pipe.executor.runners[0]
    for param in runner.stage.module.parameters():
        param.requires_grad_(False)
    hook = runner.stage.module.register_forward_hook(lambda *_: time.sleep(0.005))
    try:
        _slowed(monkeypatch, runner.hook, "fire")
        _, backwards = pipe.measure_action_overhead(torch.randn(4, 32))
    finally:
        hook.remove()
    assert backwards[0] == pytest.approx(0.002, abs=1e-3)


@contextlib.contextmanager
def _slowed_after(monkeypatch, runner, slowed_kind: str, seconds: float = 0.002):
    """Meanwhile the runner's stage module's call ("F") or its autograd call ("B") takes
    `seconds` longer where the runner's compute before it was of the other kind."""
    last = ["B"]
    forward, backward, backpropagate = runner.forward, runner.backward, runner.backpropagate

    def switching(kind: str) -> None:
        if kind == slowed_kind and last[0] != kind:
            time.sleep(seconds)

    def forwarding(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        finally:
            last[0] = "F"

    def backwarding(*args, **kwargs):
        try:
            return backward(*args, **kwargs)
        finally:
            last[0] = "B"

    def backpropagating(*args):
        switching("B")
        return backpropagate(*args)

    monkeypatch.setattr(runner, "forward", forwarding)
    monkeypatch.setattr(runner, "backward", backwarding)
    monkeypatch.setattr(runner, "backpropagate", backpropagating)
    # a forward hook runs inside the call's timing, which its own later hook ends
    hook = runner.stage.module.register_forward_hook(lambda *_: switching("F"))
    try:
        yield
    finally:
        hook.remove()


@pytest.mark.parametrize("slowed", [FORWARDS, BACKWARDS])
def test_the_switch_overhead_is_a_compute_slower_after_the_other_kind(monkeypatch, slowed):
    # the last stage's module call slowed 2 ms right after a backward (its autograd call
    # right after a forward): that figure of that stage is 2 ms larger, the others as they were
    pipe = fxpipe.compile(fxpipe.models.MLP(), fxpipe.Plan(stages=2, micro_batches=2),
                          example_inputs=(torch.randn(4, 32),), cache=False)
    x, last = torch.randn(4, 32), 1
    plain = pipe.measure_switch_overhead(x)
    assert all(v >= 0 for figures in plain for v in figures)
    with monkeypatch.context() as patch, _slowed_after(patch, pipe.executor.runners[last],
                                                       "FB"[slowed]):
        slower = pipe.measure_switch_overhead(x)
    assert (pipe.forward_switch, pipe.backward_switch) == slower
    assert slower[slowed][last] - plain[slowed][last] == pytest.approx(0.002, abs=1e-3)
    assert slower[1 - slowed][last] == pytest.approx(plain[1 - slowed][last], abs=1e-3)
    for kind in (FORWARDS, BACKWARDS):
        assert slower[kind][0] == pytest.approx(plain[kind][0], abs=1e-3)


def test_the_predicted_timeline_adds_the_switches_of_each_stage():
    plan = fxpipe.Plan(stages=2, micro_batches=3, link=(1e-4, 1e9), schedule="1f1b",
                       stage_threads="stage")  # a thread each: each stage's own last compute
    pipe = fxpipe.compile(fxpipe.models.MLP(), plan, example_inputs=(torch.randn(6, 32),),
                          cache=False)
    vars(pipe).update(forward_switch=(0.0, 0.0), backward_switch=(0.0, 0.0))
    plain = pipe.predicted_timeline()
    switch = {ActionKind.F: (0.001, 0.003), ActionKind.B: (0.002, 0.004)}
    vars(pipe).update(forward_switch=switch[ActionKind.F], backward_switch=switch[ActionKind.B])
    switching = pipe.predicted_timeline()
    for s, actions in enumerate(switching.schedule.actions):
        last = ActionKind.B  # a step follows the last one's backwards
        for a in (a for a in actions if a.kind.is_compute):
            added = switch[a.kind][s] if a.kind is not last else 0.0
            assert switching.event(a).duration == pytest.approx(plain.event(a).duration + added)
            last = a.kind


def test_the_predicted_timeline_adds_the_action_overhead_to_every_forward_and_backward():
    plan = fxpipe.Plan(stages=2, micro_batches=3, link=(1e-4, 1e9),  # no per-message terms
                       stage_threads="stage")  # a thread each, with no time of its own
    pipe = fxpipe.compile(fxpipe.models.MLP(), plan, example_inputs=(torch.randn(6, 32),),
                          cache=False)
    vars(pipe).update(forward_overhead=(0.001, 0.003), backward_overhead=(0.002, 0.004),
                      forward_switch=(0.0, 0.0), backward_switch=(0.0, 0.0))
    stages = pipe.partition.stages
    events = pipe.predicted_timeline().events
    forwards = [e for e in events if e.action.kind is ActionKind.F]
    backwards = [e for e in events if e.action.kind is ActionKind.B]
    assert len(forwards) == len(backwards) == 6
    for e in forwards:
        assert e.duration == pytest.approx(stages[e.stage].f + (0.001, 0.003)[e.stage])
    for e in backwards:
        assert e.duration == pytest.approx(stages[e.stage].b + (0.002, 0.004)[e.stage])


def test_measure_link_measures_the_link_again_and_keeps_it():
    model = fxpipe.models.MLP()
    x = torch.randn(8, 32)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2), example_inputs=(x,), cache=False)
    compiled = pipe.link
    again = pipe.measure_link(x)
    assert pipe.link is again and again is not compiled  # measured anew, kept
    assert again.source == compiled.source and again.latency > 0  # stage threads hand over
    given = fxpipe.compile(model, fxpipe.Plan(stages=2, link=(1e-3, 1e9)),
                           example_inputs=(x,), cache=False)
    assert given.measure_link(x) == given.link  # the plan's figures, as they were


@pytest.mark.parametrize("schedule, posting", [("gpipe", 1.0), ("1f1b", 3.0)])
def test_a_stage_posts_its_receives_as_the_runtime_does(schedule, posting):
    """A stage that runs its forwards first (GPipe) posts its receives back to back at the
    start (Link.post_recv); under 1F1B it posts each between two computes (post_recv_between).
    With a second of posting against milliseconds of compute, a receive whose message is
    already there takes exactly its posting."""
    x = torch.randn(8, 32)
    plan = fxpipe.Plan(stages=2, micro_batches=4, schedule=schedule, loss_fn=F.cross_entropy,
                       stage_threads="stage")  # a thread each, which posts its own receives
    pipe = fxpipe.compile(MLP(), plan, example_inputs=(x,))
    vars(pipe)["link"] = dataclasses.replace(pipe.link, post_recv=1.0, post_recv_between=3.0)
    receives = [e for e in pipe.predicted_timeline().events if e.action.kind.is_recv]
    assert len(receives) == 2 * 4
    assert min(e.duration for e in receives) == pytest.approx(posting)
    assert "3000000 us between computes" in str(pipe.link)


def _doubled_by(schedule: str, plain: dict, slowed: dict
                ) -> tuple[fxpipe.CompiledPipeline, list[str]]:
    """A 2-stage MLP pipeline of `schedule` and its predicted computes that the link's terms
    `slowed` (over `plain`) make twice as long; every other compute stays as it was."""
    x = torch.randn(8, 32)
    plan = fxpipe.Plan(stages=2, micro_batches=4, schedule=schedule, loss_fn=F.cross_entropy,
                       stage_threads="stage")  # a thread each, which the link's terms are of
    pipe = fxpipe.compile(MLP(), plan, example_inputs=(x,))
    durations = []
    for terms in (plain, slowed):
        vars(pipe)["link"] = dataclasses.replace(pipe.link, **terms)
        durations.append({str(e.action): e.duration for e in pipe.predicted_timeline().events
                          if e.action.kind.is_compute})
    before, after = durations
    doubled = [a for a in before if after[a] == pytest.approx(2 * before[a])]
    assert all(after[a] == pytest.approx(before[a]) for a in before if a not in doubled)
    return pipe, doubled


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_only_a_stage_posting_between_computes_pays_for_it_in_the_next_one(schedule):
    """A stage that posts its receives between computes (1F1B) posts each before the first
    compute ahead of it, which Link.after_post slows, at most doubling it; a forwards-first
    stage (GPipe) posts its receives at the start, while it waits, which costs its computes
    nothing."""
    pipe, doubled = _doubled_by(schedule, {"post_recv": 1e-3, "after_post": 0.0},
                                {"after_post": 1.0})
    if schedule == "gpipe":
        assert doubled == []
    else:  # stage 0 posts the receive of gradient 0 before F0 and each next before a
        # backward, stage 1 that of F1..F3 before F0..F2; the last computes post nothing
        assert doubled == ["0F0", "0B0", "0B1", "0B2", "1F0", "1F1", "1F2"]
    assert "1000000 us slower per tensor whose receive it posted" in str(pipe.link)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_waking_a_stage_that_posts_between_computes_costs_the_sender_after_wake(schedule):
    """A woken stage that posts its receives between computes (1F1B) posts its next one at
    once, whose notice lands beside the sender's next compute: Link.after_wake slows it, at
    most doubling it; a forwards-first one (GPipe) posted them all at the start."""
    _, doubled = _doubled_by(schedule, {"after_send": 0.0, "after_wake": 0.0},
                             {"after_wake": 1.0})
    assert (doubled == []) == (schedule == "gpipe")


def test_each_stage_pays_its_own_slowdown_after_a_wait():
    """Link.resume may hold one figure per stage (under torchrun compile measures each
    stage's own compute after a wait): a stage's first compute, after the wait every step
    starts with, takes exactly its own stage's figure longer."""
    x = torch.randn(8, 32)
    plan = fxpipe.Plan(stages=2, micro_batches=4, loss_fn=F.cross_entropy)
    pipe = fxpipe.compile(MLP(), plan, example_inputs=(x,))
    figures = (1.0, 2.0)
    vars(pipe)["link"] = dataclasses.replace(pipe.link, resume=0.0)
    plain = pipe.predicted_timeline().events
    vars(pipe)["link"] = dataclasses.replace(pipe.link, resume=figures)
    slowed = pipe.predicted_timeline().events

    def first_compute(events, stage):
        return min((e for e in events if e.stage == stage and e.action.kind.is_compute),
                   key=lambda e: e.start)

    for stage, figure in enumerate(figures):
        assert first_compute(slowed, stage).duration == pytest.approx(
            first_compute(plain, stage).duration + figure)
    assert "1000000/2000000 us slower after a wait (per stage)" in str(pipe.link)


@given(stages=st.integers(2, 16), cores=st.integers(1, 15), at_cores=st.floats(0.01, 16.0),
       at_stages=st.floats(0.01, 16.0))
def test_fewer_stages_are_advised_exactly_where_more_threads_got_clearly_less_done(
        stages, cores, at_cores, at_stages):
    from fxpipe.passes.analysis.capacity import BIND_FROM, FEWER_THREADS_BELOW, ThreadCapacity

    assume(stages > cores)
    capacity = ThreadCapacity(cores, stages, at_cores, at_stages)
    _, line, *lock = shared_cores_lines(stages, cores, capacity=capacity)
    # below one thread's work at once, a last line says the interpreter lock sets the pace
    assert bool(lock) == (at_stages < BIND_FROM)
    assert all(extra.startswith(f"interpreter lock: {stages} threads got through "
                                f"{at_stages:.3f}x, under one thread's work at once")
               for extra in lock)
    assert line.startswith(f"thread capacity: {stages} threads, each running all the model's "
                           f"units, got through {at_stages:.2f}x the work of one thread at "
                           f"once, {cores} thread")
    assert line.split(": ")[1].endswith(f" {at_cores:.2f}x")
    assert ("step faster" in line) == (at_stages < FEWER_THREADS_BELOW * at_cores)
    assert shared_cores_lines(stages, cores) == shared_cores_lines(stages, cores,
                                                                    capacity=None)[:1]


@given(stages=st.integers(2, 16), cores=st.integers(1, 15), threads=st.integers(1, 16),
       at_cores=st.floats(0.01, 16.0), at_stages=st.floats(0.01, 16.0))
def test_stages_on_fewer_threads_are_told_as_they_run(stages, cores, threads, at_cores,
                                                      at_stages):
    """Where fewer threads than the stages run them (Plan(stage_threads)), the lines say so
    instead of advising fewer stages per process; on one thread, the interpreter-lock line
    says the prediction follows it, on more, that steps may stray."""
    from fxpipe.passes.analysis.capacity import BIND_FROM, FEWER_THREADS_BELOW, ThreadCapacity

    assume(stages > cores and threads < stages)
    capacity = ThreadCapacity(cores, stages, at_cores, at_stages)
    first, line, *lock = shared_cores_lines(stages, cores, capacity=capacity, threads=threads)
    many = f"{threads} threads" if threads > 1 else "one thread"
    assert first.startswith(f"shared cores: {stages} stages compute on this host's {cores} CPU")
    assert f"they run on {many} (Plan(stage_threads))" in first
    assert ("splits the cores evenly among the threads" in first) == (threads > cores)
    assert "each has one" not in first and "step faster" not in line
    assert line.endswith(f"so the stages run on {many} here (Plan(stage_threads))") == (
        at_stages < FEWER_THREADS_BELOW * at_cores)
    assert bool(lock) == (at_stages < BIND_FROM)
    assert all(extra.endswith("whose pace the units' timings alone hold") == (threads == 1)
               for extra in lock)
    assert all(("may stray" in extra) == (threads > 1) for extra in lock)
    # a thread per stage, or none said: as before
    assert (shared_cores_lines(stages, cores, capacity=capacity, threads=stages)
            == shared_cores_lines(stages, cores, capacity=capacity))


@given(stages=st.integers(1, 16), cores=st.integers(1, 16), threads=st.integers(1, 16),
       at_stages=st.floats(0.01, 16.0), ranks=st.booleans())
def test_stage_threads_within_the_cores_are_told_only_of_the_interpreter_lock(
        stages, cores, threads, at_stages, ranks):
    """Two or more stage threads that each have a core get one line, and only where as many
    got through less than one thread's work at once: the lock, which the prediction follows
    on one thread; ranks, each an interpreter of its own, get none."""
    from fxpipe.passes.analysis.capacity import BIND_FROM, ThreadCapacity

    assume(stages <= cores)
    capacity = ThreadCapacity(cores, stages, at_stages, at_stages)
    lines = shared_cores_lines(stages, cores, ranks=ranks, capacity=capacity, threads=threads)
    assert bool(lines) == (stages >= 2 and at_stages < BIND_FROM and not ranks)
    for line in lines:
        assert line.startswith(f"interpreter lock: {stages} threads got through "
                               f"{at_stages:.3f}x, under one thread's work at once")
        assert line.endswith("whose pace the units' timings alone hold") == (threads == 1)
        assert "shared cores" not in line
