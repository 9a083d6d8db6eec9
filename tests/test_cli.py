"""The fxpipe command."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import re
import statistics
import subprocess
import sys
import types

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from fxpipe.bench import BenchRow, bench_plans
from fxpipe.cli import _against_even, main

_PROGRESS_BAR = re.compile(r"\[[#.]+\] \d+/\d+ ")


def _no_step_overhead(pipe, *inputs) -> float:
    """Stands in for CompiledPipeline.measure_step_overhead: none, kept as the method keeps
    its figure."""
    vars(pipe)["step_overhead"] = 0.0
    return 0.0


def test_demo_prints_stage_table_graph_and_a_falling_loss(capsys):
    assert main(["demo", "--steps", "3", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "CompiledPipeline(ResNet): traced with fx" in out
    assert "send(" in out and "recv(" in out and "hook(" in out
    losses = [float(line.split()[-1]) for line in out.splitlines() if "loss" in line
              and line.strip().startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "units and loss timed again, then 10 steps to settle and 10 more, without updating " \
           "the weights; the last measured against predicted, beside the range and median of " \
           "all 10:" in out
    assert "step (1f1b): measured " in out
    assert "\nthe last 10 steps like it: " in out  # the settled ones alone


def test_demo_reports_user_errors_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "fxpipe", "demo", "--model", "mlp",
                             "--stages", "50"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "fxpipe: error: Plan(stages=50) asks for more stages than MLP has units" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("command", "name"), [(["bench", "hf-gpt2", "--stages", "2"], "hf-gpt2"),
                                             (["demo", "--model", "hf-bert"], "hf-bert")])
def test_a_hf_model_without_transformers_says_how_to_install_it(capsys, monkeypatch, command,
                                                               name):
    """Before any work starts, whether or not transformers is installed here."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda module, *args: None if module == "transformers"
                        else find_spec(module, *args))
    assert main(command) == 2
    captured = capsys.readouterr()
    assert (f"fxpipe: error: the bundled model {name!r} is built with transformers, which is not "
            "installed here: pip install 'fxpipe[hf]', or choose another model (resnet, vgg, "
            "gpt, mlp).") in captured.err
    assert not _PROGRESS_BAR.search(captured.err + captured.out)


@pytest.mark.parametrize(("options", "error"), [
    (["--stages", "50"], "Plan(stages=50) asks for more stages than MLP has units"),
    (["--stages", "50", "--nproc", "50"], "Plan(stages=50) asks for more stages than MLP has"),
    (["--stages", "3", "--nproc", "2"], "--nproc 2 runs one stage per process: give --stages 2"),
    (["--stages", "2", "--nproc", "2", "--stage-threads", "1"],
     "--stage-threads 1 sets the threads of one process's stages, and under torchrun"),
    (["--stages", "2", "--stage-threads", "3"],
     "Plan(stage_threads=3) asks for more threads than the 2 stages"),
])
def test_bench_reports_user_errors_before_any_progress(capsys, options, error):
    assert main(["bench", "mlp", *options]) == 2
    captured = capsys.readouterr()
    assert f"fxpipe: error: {error}" in captured.err
    assert not _PROGRESS_BAR.search(captured.err + captured.out)  # no configuration started


def test_plan_prints_the_stage_table_compares_and_writes_json(capsys, tmp_path):
    import json

    from fxpipe import Plan

    path = tmp_path / "plan.json"
    assert main(["plan", "fxpipe.models:MLP", "--stages", "3", "--input-shape", "32",
                 "--batch", "8", "--micro-batches", "2", "--compare", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "CompiledPipeline(MLP)" in out and "predicted step (2 micro-batches" in out
    assert "partitioners compared" in out
    document = json.loads(path.read_text())
    assert document["plan"]["partitioner"] == [3, 3, 3]
    assert Plan.load(path).sizes == (3, 3, 3)


def test_plan_needs_an_input_description(capsys):
    assert main(["plan", "fxpipe.models:MLP", "--stages", "2"]) == 2
    assert "describe the model's input: --input-shape" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "nosuch", "--stages", "2"], "'nosuch' is neither a bundled model"),
    (["bench", "mlp", "--stages", "1", "--nproc", "1"], "--nproc 1 runs one process, as the "
     "run without --nproc does"),
    (["bench", "mlp", "--schedules", "gpipe,async-1f1b"], "async-1f1b trains only through "
     "pipe.step_many"),
    (["bench", "mlp", "--batch", "3"], "--batch 3 cannot fill --micro-batches 4"),
    (["bench", "mlp", "--partitioners", "even,"], "--partitioners 'even,' has an empty name"),
    (["bench", "mlp", "--csv", "/nonexistent/folder/rows.csv"],
     "--csv /nonexistent/folder/rows.csv: there is no folder /nonexistent/folder"),
    (["bench", "mlp", "--png", "chart.xyz"], "--png chart.xyz: matplotlib cannot write .xyz"),
    (["plan", "mlp", "--stages", "2", "--json", "/nonexistent/plan.json"],
     "--json /nonexistent/plan.json: there is no folder /nonexistent"),
    (["plan", ":make", "--stages", "2"], "':make' names no module: give MODULE:FACTORY"),
    (["plan", "fxpipe.models:", "--stages", "2"], "'fxpipe.models:' names no factory"),
    (["bench", "mlp", "--partitioners", "even,nope"], "Plan(partitioner='nope') is not known"),
    (["bench", "mlp", "--schedules", "gpipe,zb"], "Plan(schedule='zb') is not known"),
    (["bench", "mlp", "--stages", "2", "--nproc", "2", "--partitioners", "nope"],
     "Plan(partitioner='nope') is not known"),
    (["plan", "mlp", "--stages", "2", "--input-shape", "4"],
     "the bundled model 'mlp' makes its own inputs: drop the flag"),
    (["plan", "fxpipe.models:MLP", "--stages", "2", "--input-shape", "4,x"],
     "--input-shape '4,x': give sizes joined by x"),
    (["plan", "fxpipe.models:MLP", "--stages", "2", "--input-shape", "4", "--input-dtype",
      "flot"], "--input-dtype 'flot' is not a torch dtype"),
    (["plan", "torch.nn:Linear", "--stages", "2", "--input-shape", "4"],
     "must be callable with no arguments"),
])
def test_command_line_mistakes_are_reported_before_any_work(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not _PROGRESS_BAR.search(err)  # failed before the progress bar started


@pytest.mark.parametrize("argv, message", [
    (["bench", "mlp", "--repeats", "0"], "argument --repeats: give a whole number of at least "
     "1, not '0'"),
    (["bench", "mlp", "--rounds", "-2"], "argument --rounds: give a whole number of at least 1"),
    (["bench", "mlp", "--nproc", "0"], "argument --nproc: give a whole number of at least 1"),
    (["bench", "mlp", "--measure", "-0.1"], "argument --measure: give a number of seconds, 0 "
     "or more, not '-0.1'"),
    (["bench", "mlp", "--measure", "inf"], "argument --measure: give a number of seconds"),
    (["bench", "mlp", "--measure", "nan"], "argument --measure: give a number of seconds"),
    (["bench", "mlp", "--measure", "abc"], "argument --measure: give a number of seconds, 0 "
     "or more, not 'abc'"),
    (["bench", "mlp", "--micro-batches", "abc"], "argument --micro-batches: give a whole "
     "number of at least 1, or auto, not 'abc'"),
    (["plan", "mlp", "--stages", "2", "--micro-batches", "0"], "argument --micro-batches"),
    (["demo", "--stages", "0"], "argument --stages: give a whole number of at least 1"),
    (["bench", "mlp", "--npro", "2"], "unrecognized arguments: --npro 2"),  # torchrun's would
])
def test_options_that_are_not_numbers_of_the_right_kind_are_refused_by_name(capsys, argv,
                                                                            message):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_output_paths_that_cannot_be_written_are_refused_before_any_work(capsys, tmp_path,
                                                                         monkeypatch):
    assert main(["bench", "mlp", "--csv", str(tmp_path)]) == 2  # a folder
    assert f"--csv {tmp_path}: that is a folder" in capsys.readouterr().err
    # a folder this user may not write in (root may write anywhere, so the check is faked)
    monkeypatch.setattr(os, "access", lambda path, mode: os.path.abspath(path) != str(tmp_path))
    assert main(["bench", "mlp", "--png", str(tmp_path / "chart.png")]) == 2
    err = capsys.readouterr().err
    assert f"--png {tmp_path / 'chart.png'}: not writable here" in err
    assert not _PROGRESS_BAR.search(err)


def test_a_chart_named_without_an_extension_is_a_png_and_says_so(tmp_path, capsys):
    from fxpipe.cli import png_path

    assert png_path(str(tmp_path / "chart")) == str(tmp_path / "chart.png")
    assert png_path(str(tmp_path / "chart.svg")) == str(tmp_path / "chart.svg")
    assert png_path(str(tmp_path / "chart.")) == str(tmp_path / "chart.png")
    (tmp_path / "out").mkdir()  # a folder of that name is no matter: the chart is out.png
    assert main(["bench", "mlp", "--png", str(tmp_path / "out"), "--partitioners", "nope"]) == 2
    assert "Plan(partitioner='nope') is not known" in capsys.readouterr().err  # a later check


def test_a_model_factory_in_the_current_folder_is_found_and_a_model_instance_refused(
        capsys, tmp_path, monkeypatch):
    (tmp_path / "fxpipe_cli_models.py").write_text(
        "from torch import nn\n"
        "def make():\n    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))\n"
        "MADE = make()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "fxpipe_cli_models", raising=False)
    assert main(["plan", "fxpipe_cli_models:make", "--stages", "2", "--input-shape", "4"]) == 0
    assert "CompiledPipeline(Sequential)" in capsys.readouterr().out
    assert main(["plan", "fxpipe_cli_models:MADE", "--stages", "2", "--input-shape", "4"]) == 2
    assert ("fxpipe_cli_models:MADE is a model, not a function that makes one"
            in capsys.readouterr().err)


@pytest.mark.parametrize("spec, message", [
    ("fxpipe_nosuch_module:make", "no module 'fxpipe_nosuch_module' on the Python path; run "
     "fxpipe from the directory that holds it, or add that directory to PYTHONPATH"),
    ("fxpipe_nosuch_package.models:make", "no module 'fxpipe_nosuch_package' on the Python "
     "path"),
    ("fxpipe_cli_pkg.nosub:make", "'fxpipe_cli_pkg' has no submodule 'nosub'"),
    ("fxpipe_cli_needs:make", "importing 'fxpipe_cli_needs' failed (No module named "
     "'fxpipe_nosuch_dependency'); install it"),
    ("fxpipe_cli_pkg.wrong:make", "importing 'fxpipe_cli_pkg.wrong' failed (cannot import name "
     "'nothing' from 'fxpipe_cli_pkg'"),
    ("fxpipe_cli_pkg.wrong:nosuch", "fix that import"),  # the import fails first
    ("fxpipe.models:nosuch", "module 'fxpipe.models' has no 'nosuch'; give the name of a "
     "function defined in it"),
])
def test_a_factory_that_cannot_be_loaded_is_reported_with_what_to_do(
        capsys, tmp_path, monkeypatch, spec, message):
    (tmp_path / "fxpipe_cli_needs.py").write_text("import fxpipe_nosuch_dependency\n")
    (tmp_path / "fxpipe_cli_pkg").mkdir()
    (tmp_path / "fxpipe_cli_pkg" / "__init__.py").write_text("")
    (tmp_path / "fxpipe_cli_pkg" / "wrong.py").write_text("from fxpipe_cli_pkg import nothing\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder main adds goes with the test
    for name in ("fxpipe_cli_needs", "fxpipe_cli_pkg", "fxpipe_cli_pkg.wrong"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["plan", spec, "--stages", "2", "--input-shape", "4"]) == 2
    err = capsys.readouterr().err
    assert f"cannot load {spec!r}: " in err
    assert message in err


@pytest.mark.parametrize("spec, message", [
    ("models.py:make", "cannot load 'models.py:make': it names a file; give the module's "
     "dotted name, e.g. models:make"),
    ("sub/models.py:make", "e.g. sub.models:make"),
    ("sub\\models:make", "e.g. sub.models:make"),
    (".models:make", "'.models:make' names a relative module; give its full dotted name, e.g. "
     "mypkg.models:make"),
])
def test_a_factory_named_by_path_is_refused_with_its_dotted_name(capsys, spec, message):
    assert main(["plan", spec, "--stages", "2", "--input-shape", "4"]) == 2
    assert message in capsys.readouterr().err


def test_a_ranks_own_error_is_what_a_failed_torchrun_bench_reports():
    from fxpipe.bench import first_rank_error

    stderr = ("\r[........] 1/1 even/gpipe\n[rank1]: fxpipe: error: bad batch; fix itfxpipe: "
              "error: bad batch; fix it\nTraceback (most recent call last):\n  ...\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert first_rank_error(stderr, ranks=2) == "bad batch; fix it"
    # one rank's message and another's traceback: a rank failed otherwise, and that says more
    assert first_rank_error(stderr, ranks=3) is None
    assert first_rank_error("Traceback (most recent call last):\n  boom\n", ranks=1) is None


def test_the_progress_bar_ends_full_and_relayed_lines_cover_longer_ones(capsys):
    from fxpipe.bench import _progress, _relay_progress

    _progress(3, 2, "done")
    assert capsys.readouterr().err == f"\r[{'#' * 24}] 2/2 {'done':<32}"
    _relay_progress(io.StringIO(f"\r[........] 1/2 {'csimd/gpipe':<32}\n"
                                f"\r[####....] 2/2 {'ab':<32}\n"))
    assert f"2/2 {'ab':<32}" in capsys.readouterr().err  # covers "csimd/gpipe" before it


def test_bench_times_every_configuration_and_writes_csv_and_png(capsys, tmp_path):
    csv_path, png_path = tmp_path / "rows.csv", tmp_path / "rows.png"
    argv = ["bench", "mlp", "--stages", "2", "--batch", "8", "--micro-batches", "2",
            "--partitioners", "even,csimd", "--schedules", "gpipe,1f1b", "--repeats", "1",
            "--csv", str(csv_path), "--png", str(png_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # --repeats 1 leaves one round of the default 15: the title says how many ran
    assert "mlp: 2 stages, batch 8, micro-batches 2, 1 round\n" in out
    assert "memory per stage (estimate)" in out
    for schedule in ("gpipe", "1f1b"):  # the best automatic partition against even, each
        assert f"{schedule}: best automatic partition csimd (" in out
    assert out.count("the speed of even") == 2
    if os.path.exists("/proc/stat"):  # Linux: how much CPU the hypervisor took meanwhile
        assert re.search(r"CPU steal during the run: \d+\.\d% of this machine's CPU time", out)
    if hasattr(os, "sched_setaffinity"):  # the cores' own speed, from one round per row
        assert re.search(r"core speed during the run: a fixed piece of work took \d+\.\d{3} "
                         r"to \d+\.\d{3} ms on the slowest core after each round's steps, "
                         r"\d+% apart, over every row", out)
    rows = list(csv.DictReader(csv_path.open()))
    assert [(r["partitioner"], r["schedule"]) for r in rows] == [
        ("even", "gpipe"), ("even", "1f1b"), ("csimd", "gpipe"), ("csimd", "1f1b")]
    assert all(float(r["measured_ms"]) > 0 and float(r["predicted_ms"]) > 0 for r in rows)
    assert all(float(r["predicted_low_ms"]) <= float(r["predicted_ms"])
               <= float(r["predicted_high_ms"]) for r in rows)
    for r in rows:  # a figure per round, whose smallest and largest are the low and high
        for kind in ("predicted", "measured"):
            figures = [float(v) for v in r[f"round_{kind}_ms"].split()]
            assert len(figures) == int(r["rounds"]) == 1  # --repeats 1: one round
            assert (min(figures), max(figures)) == (
                float(r[f"{kind}_low_ms"]), float(r[f"{kind}_high_ms"]))
        # and what the round's prediction was made from: below it, for this model whose
        # compute and overhead per step each take a fraction of its step
        for kind in ("compute", "runtime"):
            [figure] = [float(v) for v in r[f"round_{kind}_ms"].split()]
            assert 0 < figure < float(r["predicted_ms"])
        if hasattr(os, "sched_setaffinity"):  # and the machine's speed after its steps
            [figure] = [float(v) for v in r["round_core_ms"].split()]
            assert 0.005 < figure < 50  # ms, for about 0.1 ms of work
    assert "pred spread" in out and "late steps: the timed steps in which a message" in out
    assert "meas spread: how far the rounds' median steps moved" in out
    assert all(0.0 <= float(r["late_steps"]) <= 1.0 for r in rows)
    # no late step, no late time; a late step adds over the threshold (0.5 ms) to its mean
    assert all((float(r["late_ms"]) > 0.5 * float(r["late_steps"])) if float(r["late_steps"])
               else float(r["late_ms"]) == 0 for r in rows)
    assert "late ms: those messages' delays beyond the predicted ones" in out
    assert {r["micro_batches"] for r in rows if r["partitioner"] == "even"} == {"2"}
    assert {r["on_cpu"] for r in rows} == {"True"}  # the bundled MLP's stages, on the CPU
    assert {r["sizes"] for r in rows if r["partitioner"] == "even"} == {"4+5"}
    assert all(len(r["memory"].split()) == 2 for r in rows)  # bytes per stage
    # one timed step: one round, so there is no spread of the rounds' predictions to show
    assert {r["rounds"] for r in rows} == {"1"}
    assert {r["predicted_spread"] for r in rows} == {r["measured_spread"] for r in rows} == {"nan"}
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_of_a_torchrun_bench_is_relayed_and_the_rest_kept_for_errors(capsys):
    from fxpipe.bench import _relay_progress

    stderr = io.StringIO("\r[........] 1/2 even/gpipe\nUserWarning: something\n"
                         "\r[####....] 2/2 even/1f1b\nTraceback: boom\n")
    rest = _relay_progress(stderr)
    shown = capsys.readouterr().err
    assert "1/2 even/gpipe" in shown and "2/2 even/1f1b" in shown
    assert "UserWarning" not in shown and "boom" not in shown
    assert "UserWarning: something" in rest and "Traceback: boom" in rest
    assert "1/2" not in rest


@pytest.mark.parametrize(("rounds", "title"), [
    ([15, 15], ", 15 rounds"), ([1], ", 1 round"), ([3, 5, 3], ", 3 to 5 rounds"), ([0], "")])
def test_bench_title_says_how_many_rounds_its_rows_ran(rounds, title):
    from fxpipe.cli import _rounds_of

    rows = [BenchRow("even", "gpipe", (2, 2), 2, 1.0, 1.0, 0.0, 0.0, (0.0, 0.0),
                     round_predicted_ms=(1.0,) * n, round_measured_ms=(1.0,) * n)
            for n in rounds]
    assert _rounds_of(rows) == title


def test_bench_reports_how_far_the_rounds_predictions_and_steps_spread(monkeypatch):
    import dataclasses

    import fxpipe.bench
    from fxpipe.cost import Partition
    from fxpipe.models import bundled
    from fxpipe.pipeline import CompiledPipeline

    spec = bundled("mlp")
    scales, scored, timed_for, pipes, computed = iter([1.0, 1.6, 1.2]), [], [], [], []

    def retime(pipe, inputs, min_time, **_):
        timed_for.append(min_time)
        pipes.append(pipe)
        scale = next(scales)  # the machine slows down by 60%, then recovers halfway
        cost = dataclasses.replace(pipe.cost, f=pipe.cost.f * scale, b=pipe.cost.b * scale)
        part = Partition.evaluate(cost, pipe.partition.bounds, pipe.partition.micro_batches,
                                  pipe.partition.partitioner, schedule=pipe.plan.schedule)
        scored.append(pipe.predicted_timeline(part).makespan)
        computed.append(sum(s.f + s.b for s in part.stages))
        return part

    monkeypatch.setattr(fxpipe.bench, "retime", retime)
    # a clock that only timed steps (the ones after the barrier) move: each takes the given
    # seconds, three a round, with an outlier in two rounds
    seconds = iter([0.001, 0.001, 0.051, 0.021, 0.021, 0.021, 0.011, 0.011, 0.001])
    clock, timed, step = [0.0], [False], CompiledPipeline.step
    monkeypatch.setattr(fxpipe.bench, "_barrier", lambda: timed.__setitem__(0, True))
    monkeypatch.setattr(fxpipe.bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def slowed_step(self, *args):
        if timed[0]:
            timed[0] = False
            clock[0] += next(seconds)
        return step(self, *args)

    monkeypatch.setattr(CompiledPipeline, "step", slowed_step)
    monkeypatch.setattr(CompiledPipeline, "measure_step_overhead", _no_step_overhead)

    def measure_action_overhead(self, x):  # at compile, and in each round: the same figures
        vars(self).update(forward_overhead=(1e-5, 2e-5), backward_overhead=(3e-5, 5e-5))
        return self.forward_overhead, self.backward_overhead

    monkeypatch.setattr(CompiledPipeline, "measure_action_overhead", measure_action_overhead)

    def measure_switch_overhead(self, x):  # likewise
        vars(self).update(forward_switch=(4e-6, 6e-6), backward_switch=(5e-6, 7e-6))
        return self.forward_switch, self.backward_switch

    monkeypatch.setattr(CompiledPipeline, "measure_switch_overhead", measure_switch_overhead)
    # the machine's own speed after each round's steps: its cores' times for the fixed work
    cores = iter([{0: 1e-4, 1: 1.2e-4}, {0: 1.5e-4, 1: 1e-4}, {0: 1e-4, 1: 1.1e-4}])
    monkeypatch.setattr(fxpipe.bench, "core_times", lambda: next(cores))

    def build():
        x, y = spec.batch(8, torch.Generator().manual_seed(0))
        return spec.build(), x, y, spec.loss_fn

    # a thread each: on one, each round measures the thread's own costs after retime
    [row] = fxpipe.bench.bench(build, 2, 2, ["even"], ["gpipe"], repeats=9, rounds=3,
                               progress=False, measure=0.0, stage_threads="stage")
    assert len(scored) == 3
    assert timed_for == [fxpipe.bench.PROFILE_SECONDS] * 3  # longer than compile's timing
    assert row.round_predicted_ms == pytest.approx([t * 1e3 for t in scored])  # in order
    assert (row.predicted_low_ms, row.predicted_ms, row.predicted_high_ms) == pytest.approx(
        [t * 1e3 for t in sorted(scored)])
    assert row.predicted_spread == pytest.approx(max(scored) / min(scored) - 1)
    assert row.predicted_spread > 0.3  # the compute scaled by 1.6; the links did not
    # the rounds' median steps (not their means, last steps, or the extremes of all steps),
    # and the median of all nine
    assert (row.measured_low_ms, row.measured_ms, row.measured_high_ms) == pytest.approx(
        (1, 11, 21))
    assert row.round_measured_ms == pytest.approx((1, 21, 11))  # in the order they ran
    assert row.measured_spread == pytest.approx(20)
    # what the predictions were made from: the compute as timed, in order; fxpipe's own
    # overhead, the same each round: none per step, and 2 forwards and 2 backwards on each of
    # the 2 stages at the figures per action above, in ms
    assert row.round_compute_ms == pytest.approx([t * 1e3 for t in computed])
    assert row.compute_spread == pytest.approx(max(computed) / min(computed) - 1)
    assert row.compute_spread > 0.3
    assert row.round_runtime_ms == pytest.approx([2 * (1 + 2 + 3 + 5) * 1e-2] * 3)
    assert row.runtime_spread == 0.0
    # the slowest core of each round, in order, whichever core it was
    assert row.round_core_ms == pytest.approx((0.12, 0.15, 0.11))
    assert row.core_spread == pytest.approx(0.15 / 0.11 - 1)


def test_every_configuration_compiles_before_any_round_and_their_rounds_take_turns(
        monkeypatch):
    import fxpipe.bench
    from fxpipe.models import bundled
    from fxpipe.pipeline import CompiledPipeline

    spec = bundled("mlp")
    log, compile = [], fxpipe.bench.compile

    def compiling(model, plan, **kwargs):
        pipe = compile(model, plan, **kwargs)
        log.append(("compile", plan.partitioner, plan.schedule, id(pipe)))
        return pipe

    def measure_link(self, x):  # a round begins: which configuration's
        log.append(("round", id(self)))

    monkeypatch.setattr(fxpipe.bench, "compile", compiling)
    monkeypatch.setattr(CompiledPipeline, "measure_link", measure_link)
    bar = []  # the progress bar's pieces: (index, total, label)
    monkeypatch.setattr(fxpipe.bench, "_progress", lambda *piece: bar.append(piece))

    def build():
        x, y = spec.batch(8, torch.Generator().manual_seed(0))
        return spec.build(), x, y, spec.loss_fn

    rows = fxpipe.bench.bench(build, 2, 2, ["even", "balanced"], ["gpipe", "1f1b"], repeats=3,
                              rounds=3, settle=0.0, measure=0.0, profile_time=0.0)
    compiled, rounds = log[:4], log[4:]
    assert [c[0] for c in compiled] == ["compile"] * 4
    pipes = [c[3] for c in compiled]
    assert len(set(pipes)) == 4
    assert rounds == [("round", pipe) for _ in range(3) for pipe in pipes]  # in turn
    assert [(r.partitioner, r.schedule) for r in rows] == [c[1:3] for c in compiled]
    assert all(r.rounds == 3 and r.timed_steps == 3 for r in rows)
    # 4 compiles and 3 rounds of each, counted one by one, then "done" past the total
    assert [(index, total) for index, total, _ in bar] == [(i, 16) for i in range(1, 18)]
    assert bar[0][2] == "compiling even/gpipe" and bar[4][2] == "round 1/3 even/gpipe"
    assert bar[-2][2] == "round 3/3 balanced/1f1b" and bar[-1][2] == "done"


def test_a_steps_peak_on_the_cpu_counts_what_the_pipeline_holds_and_one_steps_allocations():
    import fxpipe
    from fxpipe.bench import _step_peaks
    from fxpipe.models import bundled

    spec = bundled("mlp")
    x, y = spec.batch(8, torch.Generator().manual_seed(0))
    pipe = fxpipe.compile(spec.build(), fxpipe.Plan(stages=2, loss_fn=spec.loss_fn),
                          example_inputs=(x,), example_target=y, cache=False)
    pipe.step(x, y)  # the gradients exist from here on
    held = sum(p.nbytes + p.grad.nbytes for p in pipe.parameters())
    [peak] = _step_peaks(pipe, x, y, [torch.device("cpu")])
    # a step of 8 rows allocates activations of a few KiB on top: far less than 16 MiB
    assert held < peak < held + 16 * 2**20


def test_a_machine_whose_cores_cannot_be_timed_leaves_their_figures_out(monkeypatch):
    import fxpipe.bench
    from fxpipe.bench import core_speed_line
    from fxpipe.models import bundled

    spec = bundled("mlp")
    monkeypatch.setattr(fxpipe.bench, "core_times", lambda: {})  # no binding a thread

    def build():
        x, y = spec.batch(8, torch.Generator().manual_seed(0))
        return spec.build(), x, y, spec.loss_fn

    [row] = fxpipe.bench.bench(build, 2, 2, ["even"], ["gpipe"], repeats=2, rounds=2,
                               progress=False, measure=0.0, settle=0.0)
    assert row.rounds == 2 and row.round_core_ms == ()
    assert math.isnan(row.core_spread) and core_speed_line([row]) is None


@given(stages=st.integers(1, 4), micro_batches=st.integers(1, 6), name=st.sampled_from(
    ["gpipe", "1f1b"]), seconds=st.lists(st.floats(0, 1e-3), min_size=9, max_size=9))
def test_the_runtimes_time_per_step_counts_each_forward_and_backward_once(
        stages, micro_batches, name, seconds):
    from fxpipe.bench import _own_overhead_per_step
    from fxpipe.schedules import add_communication, add_step, build

    schedule = add_step(add_communication(build(name, stages, micro_batches)))
    forward, backward = tuple(seconds[:stages]), tuple(seconds[4:4 + stages])
    pipe = types.SimpleNamespace(
        executor=types.SimpleNamespace(latest_schedule=schedule),
        step_overhead=seconds[8], forward_overhead=forward, backward_overhead=backward)
    # the sends, receives and optimizer steps add nothing of their own
    assert _own_overhead_per_step(pipe) == pytest.approx(
        seconds[8] + micro_batches * (sum(forward) + sum(backward)))


def _off_row(predicted, measured, compute=(1.0, 1.5), runtime=(0.25, 0.25), core=()
             ) -> BenchRow:
    """A 1f1b row of even's with these rounds' figures (ms), at the median of each."""
    return BenchRow("even", "1f1b", (2, 2), 4, statistics.median(predicted),
                    statistics.median(measured), 0.0, 0.0, (0.0, 0.0),
                    round_predicted_ms=predicted, round_measured_ms=measured,
                    round_compute_ms=compute, round_runtime_ms=runtime, round_core_ms=core)


def test_a_row_off_its_prediction_says_what_its_rounds_inputs_did():
    from fxpipe.bench import what_moved_lines

    [line] = what_moved_lines([_off_row((1.5, 2.0), (2.5, 2.6)),  # 1.46x: a line
                               _off_row((2.0, 2.2), (2.2, 2.3)),  # 1.07x: within 15%
                               _off_row((2.0,), (3.0,), (1.0,), (0.25,))])  # one round
    assert line.startswith("even/1f1b: measured 1.46x its prediction. Between its 2 rounds "
                           "the predictions moved 33% (1.50 to 2.00 ms), the median steps 4% "
                           "(2.50 to 2.60 ms)")
    assert "the stages' compute 50% (1.00 to 1.50 ms per micro-batch, summed)" in line
    assert "fxpipe's own overhead 0% (0.25 to 0.25 ms per step); the CSV" in line
    # and the machine's own speed, where the rounds timed it
    [line] = what_moved_lines([_off_row((1.5, 2.0), (2.5, 2.6), core=(0.08, 0.1))])
    assert ("fxpipe's own overhead 0% (0.25 to 0.25 ms per step); the machine's own speed "
            "moved 25% (a fixed piece of work on its slowest core, 0.080 to 0.100 ms); the CSV"
            ) in line
    # the edge of OFF_BY, 15%, either way
    assert len(what_moved_lines([_off_row((2.0, 2.0), (2.32, 2.32))])) == 1  # 1.16x
    assert what_moved_lines([_off_row((2.0, 2.0), (2.28, 2.28))]) == []  # 1.14x
    assert len(what_moved_lines([_off_row((2.0, 2.0), (1.68, 1.68))])) == 1  # 0.84x
    assert what_moved_lines([_off_row((2.0, 2.0), (1.72, 1.72))]) == []  # 0.86x
    # rounds without what they were made from (rows of an older bench), or no prediction
    assert what_moved_lines([_off_row((1.5, 2.0), (2.5, 2.6), compute=())]) == []
    assert what_moved_lines([_off_row((0.0, 0.0), (2.5, 2.6))]) == []  # meas/pred nan


def test_the_bench_command_prints_what_moved_for_a_row_off_its_prediction(capsys,
                                                                          monkeypatch):
    import fxpipe.cli

    rows = [_off_row((1.5, 2.0), (2.5, 2.6)), _off_row((2.0, 2.2), (2.2, 2.3))]
    monkeypatch.setattr(fxpipe.cli, "bench", lambda *args, **kwargs: rows)
    assert main(["bench", "mlp", "--partitioners", "even", "--schedules", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert out.count("x its prediction. Between its 2 rounds") == 1
    assert "even/1f1b: measured 1.46x its prediction." in out


def test_the_bench_charts_whiskers_span_the_rounds_lowest_to_highest():
    from fxpipe.bench import _whiskers

    rows = [BenchRow("even", "gpipe", (2, 2), 2, 2.0, 3.0, 0.0, 0.0, (0.0, 0.0),
                     round_predicted_ms=(2.25, 1.5, 2.0), round_measured_ms=(3.0, 4.5, 2.0)),
            BenchRow("even", "1f1b", (2, 2), 2, 2.0, 3.0, 0.0, 0.0, (0.0, 0.0))]  # not known
    (below, above) = _whiskers(rows, "predicted")
    assert (below[0], above[0]) == (0.5, 0.25)
    assert math.isnan(below[1]) and math.isnan(above[1])  # drawn as nothing
    (below, above) = _whiskers(rows, "measured")
    assert (below[0], above[0]) == (1.0, 1.5)
    assert rows[0].measured_spread == pytest.approx(1.25)
    assert math.isnan(rows[1].measured_spread)


@pytest.mark.parametrize("cores, on_cpu, nproc", [(1, True, []), (2, True, []), (1, False, []),
                                                  (1, True, ["--nproc", "2"])])
def test_bench_says_when_its_stages_share_cores(capsys, monkeypatch, cores, on_cpu, nproc):
    import fxpipe.cli

    row = BenchRow("even", "gpipe", (2, 2), 2, 1.0, 1.0, 0.0, 0.0, (0.0, 0.0), on_cpu=on_cpu)
    monkeypatch.setattr(fxpipe.cli, "_bench_rows", lambda *args: [row])
    monkeypatch.setattr(fxpipe.cli, "usable_cores", lambda: cores)
    assert main(["bench", "mlp", "--stages", "2", "--partitioners", "even",
                 "--schedules", "gpipe", *nproc]) == 0
    out = capsys.readouterr().out
    shared = cores == 1 and on_cpu
    how = ("2 ranks compute on this host's 1 CPU core; the prediction runs every rank at the "
           "pace of the units timed on all the ranks at once" if nproc else
           "2 stages compute on this host's 1 CPU core; the units were timed with every stage "
           "thread busy, less the timing thread's waits for a core, and the prediction splits "
           "the cores evenly")
    assert (f"shared cores: {how}" in out) == shared
    assert ("shared cores" in out) == shared


@pytest.mark.timeout(120)
def test_bench_rows_keep_the_thread_capacity_compile_measured(monkeypatch, tmp_path):
    """Two stage threads on one core: each row keeps how much one and two threads got
    through, and whether compile bound them to cores from it; and a row read back from the
    JSON a torchrun rank writes is the row it wrote."""
    import importlib

    import fxpipe.bench
    from fxpipe.models import bundled
    from fxpipe.passes.analysis.capacity import BIND_FROM

    front = importlib.import_module("fxpipe.compile.front")
    monkeypatch.setattr(front, "usable_cores", lambda: 1)
    spec = bundled("mlp")

    def build():
        x, y = spec.batch(8, torch.Generator().manual_seed(0))
        return spec.build(), x, y, spec.loss_fn

    [row] = fxpipe.bench.bench(build, 2, 2, ["even"], ["gpipe"], repeats=1, rounds=1,
                               progress=False, settle=0.0, measure=0.0, profile_time=0.0)
    assert row.capacity_cores == 1.0 and row.capacity_stages > 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    assert row.bound == (cpus > 1 and row.capacity_stages >= BIND_FROM)
    both = [row, dataclasses.replace(row, capacity_cores=math.nan, capacity_stages=math.nan)]
    path = str(tmp_path / "rows.json")
    fxpipe.bench.rows_to_json(path, both)
    again = fxpipe.bench.rows_from_json(path)
    assert again[0] == row
    assert math.isnan(again[1].capacity_cores) and math.isnan(again[1].capacity_stages)


def _four_stage_bench_printing(capsys, monkeypatch, rows: list[BenchRow]) -> str:
    """What `fxpipe bench mlp --stages 4` on 2 cores prints around `rows` (run no further)."""
    import fxpipe.cli

    monkeypatch.setattr(fxpipe.cli, "_bench_rows", lambda *args: rows)
    monkeypatch.setattr(fxpipe.cli, "usable_cores", lambda: 2)
    assert main(["bench", "mlp", "--stages", "4", "--partitioners", "even"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_bench_says_whether_compile_bound_its_stage_threads(capsys, monkeypatch, bound):
    rows = [BenchRow("even", s, (1, 1, 1, 1), 2, 1.0, 1.0, 0.0, 0.0, (0.0,) * 4,
                     bound=index < bound) for index, s in enumerate(["gpipe", "1f1b"])]
    out = _four_stage_bench_printing(capsys, monkeypatch, rows)
    assert ("splits each core among the stages on it" in out) == (bound == 2)
    assert ("splits the cores evenly" in out) == (bound < 2)
    assert ("compile bound them to cores in 1 of the 2 rows (even/gpipe)" in out) == (bound == 1)


@pytest.mark.parametrize("affinity", ["auto", "none"])
def test_every_plan_of_the_bench_has_the_cpu_affinity_asked_for(affinity):
    plans = bench_plans(2, 4, ["even", "balanced", "csimd"], ["gpipe", "1f1b"], affinity)
    assert len(plans) == 6
    assert all(plan.cpu_affinity == affinity for plan in plans.values())


def _first_compiled_plan(monkeypatch, options: list[str]):
    """The plan `fxpipe bench mlp --stages 2 --partitioners even` with `options` hands its
    first compile (the benchmark stops there)."""
    import fxpipe.bench

    class Compiled(Exception):
        """Stops the benchmark at its first compile, with the plan it was given."""

    def record(model, plan, **kwargs):
        raise Compiled(plan)

    monkeypatch.setattr(fxpipe.bench, "compile", record)
    with pytest.raises(Compiled) as compiled:
        main(["bench", "mlp", "--stages", "2", "--partitioners", "even", *options])
    return compiled.value.args[0]


@pytest.mark.parametrize("affinity", [None, "auto", "none"])
def test_bench_compiles_with_the_cpu_affinity_asked_for(monkeypatch, affinity):
    """`--cpu-affinity none` reaches the configurations' compile (so their stage threads stay
    unbound, as test_compile checks); without the option, the plans keep Plan's default."""
    option = [] if affinity is None else ["--cpu-affinity", affinity]
    assert _first_compiled_plan(monkeypatch, option).cpu_affinity == (affinity or "auto")


def test_a_torchrun_bench_hands_its_ranks_the_cpu_affinity(monkeypatch):
    """Under --nproc each rank parses the bench's own words again: --cpu-affinity among them."""
    import fxpipe.cli

    handed = []
    monkeypatch.setattr(fxpipe.cli, "bench_under_torchrun",
                        lambda nproc, words: handed.append(list(words)))  # as on a rank
    main(["bench", "mlp", "--stages", "2", "--nproc", "2", "--cpu-affinity", "none",
          "--partitioners", "even"])
    [words] = handed
    assert words[words.index("--cpu-affinity") + 1] == "none" and "--nproc" not in words


def test_bench_rejects_an_unknown_cpu_affinity(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "mlp", "--cpu-affinity", "cores"])
    assert "argument --cpu-affinity: invalid choice: 'cores'" in capsys.readouterr().err


def test_a_torchrun_bench_hands_its_ranks_a_thread_per_stage(monkeypatch):
    """--stage-threads stage is what every rank does under torchrun: accepted, and handed on."""
    import fxpipe.cli

    handed = []
    monkeypatch.setattr(fxpipe.cli, "bench_under_torchrun",
                        lambda nproc, words: handed.append(list(words)))
    main(["bench", "mlp", "--stages", "2", "--nproc", "2", "--stage-threads", "stage",
          "--partitioners", "even"])
    [words] = handed
    assert words[words.index("--stage-threads") + 1] == "stage"


def test_bench_rejects_stage_threads_it_does_not_know(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "mlp", "--stage-threads", "many"])
    assert ("argument --stage-threads: give auto, stage or a whole number of at least 1, not "
            "'many'") in capsys.readouterr().err


@pytest.mark.parametrize("threads, plan", [(None, "auto"), ("stage", "stage"), ("1", 1)])
def test_bench_compiles_with_the_stage_threads_asked_for(monkeypatch, threads, plan):
    option = [] if threads is None else ["--stage-threads", threads]
    assert _first_compiled_plan(monkeypatch, option).stage_threads == plan


@pytest.mark.parametrize("shared", [0, 1, 2])
def test_bench_says_on_how_many_threads_its_stages_ran(capsys, monkeypatch, shared):
    rows = [BenchRow("even", s, (1, 1, 1, 1), 2, 1.0, 1.0, 0.0, 0.0, (0.0,) * 4,
                     threads=1 if index < shared else 0)
            for index, s in enumerate(["gpipe", "1f1b"])]
    out = _four_stage_bench_printing(capsys, monkeypatch, rows)
    assert ("they run on one thread (Plan(stage_threads))" in out) == (shared == 2)
    assert ("splits the cores evenly" in out) == (shared < 2)
    assert ("compile ran the stages on fewer threads than stages in 1 of the 2 rows "
            "(even/gpipe on 1 thread)" in out) == (shared == 1)


def test_bench_tells_the_median_thread_capacity_of_its_rows(capsys, monkeypatch):
    """Rows that measured it (stage threads beyond the cores) give the capacity line their
    median; a row without it (nan) is left out of the median, not counted as nothing."""
    import fxpipe.cli

    rows = [BenchRow("even", "gpipe", (1, 1, 1, 1), 2, 1.0, 1.0, 0.0, 0.0, (0.0,) * 4,
                     capacity_cores=at_cores, capacity_stages=at_stages)
            for at_cores, at_stages in [(1.0, 0.7), (1.2, 0.9), (1.1, 0.8),
                                        (float("nan"), float("nan"))]]
    monkeypatch.setattr(fxpipe.cli, "_bench_rows", lambda *args: rows)
    monkeypatch.setattr(fxpipe.cli, "usable_cores", lambda: 2)
    assert main(["bench", "mlp", "--stages", "4", "--partitioners", "even",
                 "--schedules", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert ("thread capacity: 4 threads, each running all the model's units, got through 0.80x "
            "the work of one thread at once, 2 threads 1.10x") in out
    assert "at most 2 stages per process" in out
    assert "interpreter lock: 4 threads got through 0.800x, under one thread's work" in out


@pytest.mark.parametrize(("measure", "timed", "another_rank_asks"),
                         [(0.0, 2, 0), (0.005, 3, 0), (0.02, 10, 0), (0.02, 10, 1)])
def test_each_round_of_bench_settles_then_times_its_share_or_what_fills_measure(
        monkeypatch, measure, timed, another_rank_asks):
    import dataclasses

    import fxpipe.bench
    from fxpipe.models import bundled
    from fxpipe.pipeline import CompiledPipeline

    spec = bundled("mlp")
    steps = []  # each step run: whether it was timed (after the barrier) or not
    timeline, step = CompiledPipeline.predicted_timeline, CompiledPipeline.step
    after_barrier = [False]
    monkeypatch.setattr(fxpipe.bench, "_barrier", lambda: after_barrier.__setitem__(0, True))
    # under torchrun every rank runs the most steps any rank asks for: here one more
    monkeypatch.setattr(fxpipe.bench, "_most_of_any_rank",
                        lambda *counts: tuple(c + another_rank_asks for c in counts))

    def predict(self, partition=None):  # a step predicted at 2 ms
        return dataclasses.replace(timeline(self, partition), makespan=0.002)

    def count(self, x, y):
        steps.append(after_barrier[0])
        after_barrier[0] = False
        return step(self, x, y)

    monkeypatch.setattr(CompiledPipeline, "predicted_timeline", predict)
    monkeypatch.setattr(CompiledPipeline, "measure_step_overhead", _no_step_overhead)
    monkeypatch.setattr(CompiledPipeline, "step", count)

    def build():
        x, y = spec.batch(8, torch.Generator().manual_seed(0))
        return spec.build(), x, y, spec.loss_fn

    [row] = fxpipe.bench.bench(build, 2, 2, ["even"], ["gpipe"], repeats=4, rounds=2,
                               warmup=3, progress=False, settle=0.05, measure=measure,
                               profile_time=0.0)
    # per round 0.05 s of 2 ms steps untimed, then its 2 of the 4 repeats or, where more, the
    # 2 ms steps that fill `measure` seconds
    timed += another_rank_asks
    assert steps == 2 * ([False] * (25 + another_rank_asks) + [True] * timed)
    assert row.timed_steps == 2 * timed


@given(counts=st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500)), min_size=1,
                       max_size=4))
def test_every_rank_takes_each_count_at_the_largest_any_rank_gives(counts):
    import unittest.mock

    import fxpipe.bench

    def gather(everyone, mine):  # what every rank gave, this one's included
        assert mine == counts[0]
        everyone[:] = counts

    with unittest.mock.patch.object(fxpipe.bench, "_world_size", lambda: len(counts)), \
            unittest.mock.patch.object(torch.distributed, "all_gather_object", gather):
        most = fxpipe.bench._most_of_any_rank(*counts[0])
    assert most == (max(c[0] for c in counts), max(c[1] for c in counts))


@given(least=st.integers(0, 5), seconds=st.floats(0, 1), predicted=st.floats(0, 1))
def test_steps_filling_a_time_fill_it_with_no_step_to_spare(least, seconds, predicted):
    from fxpipe.bench import FILLING_STEPS_MAX, _steps_filling

    steps = _steps_filling(seconds, predicted, least)
    if seconds == 0:  # nothing to fill, whatever the prediction
        assert steps == least
        return
    if predicted == 0:  # no prediction to count with: as many as allowed
        assert steps == max(least, FILLING_STEPS_MAX)
        return
    assert steps >= least
    if steps < FILLING_STEPS_MAX:
        assert steps * predicted >= seconds * (1 - 1e-12)
    needed = (steps - 1) * predicted < seconds * (1 + 1e-12)  # one fewer would not fill it
    assert steps in (least, FILLING_STEPS_MAX) or needed
    assert steps <= max(least, FILLING_STEPS_MAX)


@pytest.mark.parametrize("command", ["demo", "plan", "bench"])
def test_every_option_says_what_it_is_for(command, capsys):
    with pytest.raises(SystemExit) as ended:
        main([command, "--help"])
    assert ended.value.code == 0
    text = capsys.readouterr().out
    options = text[text.index("options:"):]
    # an option's help starts on its own line or after its name; one with none leaves its
    # name alone on a line followed by the next option's name
    lines = [line.strip() for line in options.splitlines()[1:] if line.strip()]
    bare = [line for line, after in zip(lines, [*lines[1:], "--"])
            if line.startswith("-") and len(line.split()) <= 2 and after.startswith("-")
            and not line.startswith("-h")]
    assert not bare, f"options without help: {bare}"
    if command != "plan":  # plan's --stages is required, so it has no default to show
        assert "(default: 2)" in text


_PARTITIONS = [((2, 2), 4), ((1, 3), 4), ((3, 1), 4), ((1, 3), 2),  # (sizes, p); even: first
               ((2, 2), 1)]


@given(st.lists(st.tuples(st.sampled_from(_PARTITIONS), st.floats(1.0, 100.0)),
                min_size=1, max_size=6), st.floats(1.0, 100.0))
def test_bench_compares_only_partitions_other_than_evens_own(automatic, even_ms):
    """Rows of even's own partition are never the "best automatic partition" (their
    difference from even is drift), and rows of one partition count as one, at their median."""
    def row(name, partition, ms):
        (sizes, p) = partition
        return BenchRow(name, "gpipe", sizes, p, 1.0, ms, 0.0, 0.0, (0.0, 0.0))

    rows = [row("even", _PARTITIONS[0], even_ms)]
    rows += [row(f"auto{i}", partition, ms) for i, (partition, ms) in enumerate(automatic)]
    (line,) = _against_even(rows)
    others: dict = {}
    for partition, ms in automatic:
        if partition != _PARTITIONS[0]:
            others.setdefault(partition, []).append(ms)
    if not others:
        assert "every automatic partition is even's own (2+2, p=4)" in line
        return
    medians = {partition: statistics.median(ms) for partition, ms in others.items()}
    (sizes, p), fastest = min(medians.items(), key=lambda item: item[1])
    assert f"({'+'.join(map(str, sizes))}, p={p}), {fastest:.1f} ms, is " in line
    assert f"{even_ms / fastest:.2f}x the speed of even" in line
    # a partition with even's units per stage differs from it in its micro-batch count alone
    assert ("so the difference is the micro-batch count's (p=1 against 4)" in line) == (
        sizes == (2, 2))


@pytest.mark.parametrize(("counts", "words"), [
    ((31, 31), "medians of 31 steps"), ((31, 40, 35), "medians of 31 to 40 steps"),
    ((1, 1), "one step each"), ((1, 3), "medians of 1 to 3 steps"),
    ((0, 31), "medians of the timed steps"),  # a row that does not say how many
])
def test_the_comparison_with_even_says_how_many_steps_its_medians_are_of(counts, words):
    rows = [BenchRow(name, "gpipe", sizes, 4, 1.0, ms, 0.0, 0.0, (0.0, 0.0), timed_steps=count)
            for name, sizes, ms, count in zip(["even", "balanced", "ampa"],
                                              [(2, 2), (1, 3), (1, 3)], [2.0, 1.0, 1.0], counts)]
    (line,) = _against_even(rows)
    assert line.endswith(f"is 2.00x the speed of even (2.0 ms; {words})")
