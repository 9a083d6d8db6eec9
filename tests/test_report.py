"""Plan versus reality: the report, the trace JSON, the timeline picture, re-planning."""

from __future__ import annotations

import dataclasses
import io
import json
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fxpipe
from fxpipe.calibrate import Calibration
from fxpipe.errors import FxpipeError
from fxpipe.models import MLP, VGG
from fxpipe.report import step_time, unlike_prediction_lines
from fxpipe.schedules import ActionKind


@pytest.fixture(scope="module")
def trained():
    model = VGG()
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    plan = fxpipe.Plan(stages=3, micro_batches=4, schedule="1f1b", loss_fn=F.cross_entropy)
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


def test_timeline_picture_is_written(trained, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    trained.save_timeline(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replan_never_proposes_a_worse_partition(trained):
    result = fxpipe.replan(trained, threshold=0.0)
    assert result.proposed.predicted_time <= result.current.predicted_time
    assert sum(result.plan_sizes) == len(trained.units)


def test_replan_keeps_a_partition_by_time_over_one_by_parameters(monkeypatch):
    """On a timer that charges a unit 1 ns per value it reads (VGG's time sits in its early
    layers, its parameters in the late ones), and a run that took what was predicted:
    balancing parameters instead of time finds a slower partition; replan keeps the one that
    ran."""
    from fxpipe.passes.analysis import profile as profile_module

    def timer(device):
        def timed(fn, *args, **kwargs):
            values = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
            return fn(*args, **kwargs), values * 1e-9
        return timed

    monkeypatch.setattr(profile_module, "_timer", timer)
    plan = fxpipe.Plan(stages=3, micro_batches=4, schedule="1f1b", loss_fn=F.cross_entropy)
    pipe = fxpipe.compile(VGG(), plan, example_inputs=(torch.randn(16, 3, 32, 32),),
                          cache=False)
    monkeypatch.setattr(pipe, "full_trace", lambda what: pipe.predicted_timeline().events)
    by_params = fxpipe.replan(pipe, threshold=0.0, partitioner="params")
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
        vars(trained)["rank"] = None
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
            "calibrate() takes the pipeline fxpipe.compile returned, not Linear")):
        fxpipe.calibrate(torch.nn.Linear(2, 2), x, target=x)
    for call in (trained.report, trained.save_trace, trained.save_timeline,
                 trained.predicted_timeline):
        with pytest.raises(FxpipeError, match=r"\(calibration=...\) takes what "
                                              r"fxpipe.calibrate\(pipe, x, target=y\) returns"):
            saves = call in (trained.save_trace, trained.save_timeline)
            call(*([tmp_path / "unused"] if saves else []), calibration="fast")
    with pytest.raises(FxpipeError, match=re.escape("report(file=...) takes an open text file")):
        trained.report(file=str(tmp_path / "report.txt"))


def test_replan_moves_work_away_from_a_stage_measured_slower():
    model = MLP((32, 64, 64, 64, 64, 64, 64, 10))
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    plan = fxpipe.Plan(stages=2, partitioner="even", micro_batches=4, loss_fn=F.cross_entropy)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    pipe.step(x, y)
    # pretend stage 0 ran ten times slower than stage 1 (fixed durations: the test must not
    # depend on how fast this machine ran the step)
    slow = [type(e)(e.stage, e.action, e.start, e.start + (10e-3 if e.stage == 0 else 1e-3))
            for e in pipe.last_trace()]
    pipe.executor._trace = slow
    result = fxpipe.replan(pipe)
    assert result.changed and result.dispersion > 0.05
    assert result.proposed.sizes[0] < result.current.sizes[0]


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


def _calibration(pipe, forward: float = 0.0, backward: float = 0.0, send: float = 0.0,
                 step: float = 0.0, bounds=None) -> Calibration:
    """A calibration of `pipe`'s partition, at compile's micro-batch sizes."""
    stages = len(pipe.partition.stages)
    sizes = [4] * pipe.partition.micro_batches  # the fixture's batch of 16, in 4
    return Calibration((forward,) * stages, (backward,) * stages, (send,) * stages, step, 1,
                       tuple(sizes), tuple(bounds or pipe.partition.bounds))


def test_report_predicts_with_the_calibration_it_is_given(trained):
    """A calibration adding 1 ms to every forward adds it to each stage's predicted forward
    cell, and its time per step outside the actions to the predicted step; the measured
    cells stay."""
    def cells(text):  # stage 0's "fwd ms meas/pred" cell, and the predicted step
        row = next(line for line in text.splitlines() if line.startswith("0 "))
        step = re.search(r"predicted ([0-9.]+) ms", text.splitlines()[0])
        return float(row.split()[1]), float(row.split()[3]), float(step.group(1))

    plain = cells(trained.report(file=io.StringIO()))
    calibration = _calibration(trained, forward=1e-3, step=2e-3)
    given = cells(trained.report(file=io.StringIO(), calibration=calibration))
    assert given[0] == plain[0]
    assert given[1] == pytest.approx(plain[1] + 1.0, abs=0.011)
    predicted = trained.predicted_timeline(calibration).makespan
    assert given[2] == pytest.approx((predicted + 2e-3) * 1e3, abs=0.006)
    text = trained.report(file=io.StringIO(), calibration=calibration)
    assert "2.00 ms outside them, calibrated" in text


def test_the_trace_and_the_picture_predict_with_the_calibration_they_are_given(
        trained, tmp_path, monkeypatch):
    calibration = _calibration(trained, forward=1e-3)
    forwards = 3 * trained.partition.micro_batches

    def predicted_forwards(calibration):  # microseconds the predicted track spends in F
        path = tmp_path / "trace.json"
        trained.save_trace(path, calibration=calibration)
        events = json.loads(path.read_text())["traceEvents"]
        pid = next(e["pid"] for e in events
                   if e["name"] == "process_name" and e["args"]["name"] == "predicted")
        return sum(e["dur"] for e in events if e["ph"] == "X" and e["pid"] == pid
                   and e["cat"] == "F")

    assert predicted_forwards(calibration) == pytest.approx(
        predicted_forwards(None) + forwards * 1e3, rel=1e-6)
    drawn: list = []  # the predicted forwards' microseconds of each picture drawn

    def draw(path, timelines, stages, title):
        drawn.append(sum(e.duration for e in timelines["predicted"]
                         if e.action.kind is ActionKind.F) * 1e6)

    monkeypatch.setattr("fxpipe.pipeline.save_timeline", draw)
    trained.save_timeline(tmp_path / "t.png")
    trained.save_timeline(tmp_path / "t.png", calibration=calibration)
    assert drawn[1] == pytest.approx(drawn[0] + forwards * 1e3, rel=1e-6)


def test_a_calibration_of_another_partition_or_batch_is_refused(trained):
    with pytest.raises(FxpipeError, match=r"measured on the partition with stage ends \[1, 2, "
                                          r"\d+\], and this pipeline's are"):
        trained.predicted_timeline(_calibration(trained, bounds=(1, 2, len(trained.units))))
    other = dataclasses.replace(_calibration(trained), sizes=(8, 8))
    with pytest.raises(FxpipeError, match=r"ran micro-batches of \[8, 8\] samples, and the "
                                          r"prediction is of compile's example's, \[4, 4, 4, 4\]"):
        trained.report(calibration=other)


def test_drawing_the_timeline_leaves_matplotlibs_backend_as_it_was(trained, tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    before = matplotlib.get_backend()
    trained.save_timeline(tmp_path / "t.png")
    assert matplotlib.get_backend() == before


@pytest.mark.parametrize("partitioner", ["imd", "csimd"])
def test_replan_proposes_as_many_stages_as_the_plan_has(partitioner):
    # with links this dear, imd and csimd alone would put everything in one stage
    model = MLP((16, 32, 32, 32, 10))
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    plan = fxpipe.Plan(stages=2, partitioner=partitioner, loss_fn=F.cross_entropy,
                       micro_batches=2 if partitioner == "imd" else "auto")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    pipe.step(x, y)
    dear = torch.ones(pipe.cost.cf.shape).numpy()
    vars(pipe)["cost"] = dataclasses.replace(pipe.cost, cf=dear, cb=dear)
    result = fxpipe.replan(pipe, threshold=0.0)
    assert len(result.proposed.bounds) == len(result.plan_sizes) == 2


@given(st.sampled_from(["interleaved-1f1b", "looped-bfs", "zbv"]), st.integers(1, 3),
       st.lists(st.floats(0.5, 3.0), min_size=4, max_size=4))
def test_with_several_stages_per_device_a_device_is_idle_only_when_none_of_its_stages_works(
        name, rounds, times):
    from fxpipe.schedules import build
    from fxpipe.simulate import simulate

    schedule = build(name, 4, 2 * rounds, devices=2)
    timeline = simulate(schedule, times, [2 * t for t in times], [0.0] * 4, [0.0] * 4)
    step = step_time(timeline.events, 4, schedule.placement)
    assert step.devices == 2
    assert step.bubble == pytest.approx(timeline.bubble)  # the simulator's, per device
    for row in step.stages:  # one device: both its stages show its idle time
        partner = next(r for r in step.stages
                       if r.stage != row.stage and step.device(r.stage) == step.device(row.stage))
        assert row.idle == pytest.approx(partner.idle)
        busy = row.compute + partner.compute  # (waits for messages are not idle)
        assert row.idle <= step.makespan - busy + 1e-9
    assert step.share("idle") <= step.bubble + 1e-9


def test_replan_scores_a_schedule_of_several_stages_per_device_as_compile_does():
    model = MLP((32, 64, 64, 64, 64, 64, 64, 10))
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    plan = fxpipe.Plan(stages=4, stages_per_device=2, schedule="interleaved-1f1b",
                       partitioner="even", micro_batches=4, loss_fn=F.cross_entropy)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    pipe.step(x, y)
    result = fxpipe.replan(pipe, threshold=0.0, partitioner="exact")
    assert len(result.proposed.sizes) == 4
    assert result.current.schedule == "interleaved-1f1b"  # its device programs, simulated
