"""The fxpipe command."""

from __future__ import annotations

import csv
import io
import os
import pathlib
import re
import subprocess
import sys

import hypothesis.strategies as st
import pytest
from hypothesis import given

from fxpipe.bench import BenchRow, against_even
from fxpipe.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]

_PROGRESS_BAR = re.compile(r"\[[#.]+\] \d+/\d+ ")


def test_demo_prints_stage_table_graph_a_falling_loss_and_the_calibrated_report(capsys):
    assert main(["demo", "--steps", "3", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "CompiledPipeline(ResNet): traced with fx" in out
    assert re.search(r"\ncosts: (measured now on cpu, cached at|from cache) \S+\.json", out)
    assert "send(" in out and "recv(" in out and "hook(" in out
    losses = [float(line.split()[-1]) for line in out.splitlines() if "loss" in line
              and line.strip().startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "the last step, measured against predicted from the units' times:" in out
    assert "calibration over 10 steps: per action beyond the stage's predicted cost" in out
    assert re.search(r"10 more steps: median [0-9.]+ ms \(from [0-9.]+ to [0-9.]+\), "
                     r"calibrated prediction [0-9.]+ ms", out)
    assert out.count("step (1f1b): measured ") == 2 and "calibrated) (measured / predicted" in out


@pytest.mark.parametrize(("options", "error"), [
    (["--stages", "50"], "Plan(stages=50) asks for more stages than MLP has units"),
    (["--stages", "50", "--nproc", "50"], "Plan(stages=50) asks for more stages than MLP has"),
    (["--stages", "3", "--nproc", "2"], "--nproc 2 runs one stage per process: give --stages 2"),
])
def test_bench_reports_user_errors_before_any_progress(capsys, options, error):
    assert main(["bench", "mlp", *options]) == 2
    captured = capsys.readouterr()
    assert f"fxpipe: error: {error}" in captured.err
    assert not _PROGRESS_BAR.search(captured.err + captured.out)  # no configuration started


@pytest.mark.parametrize("argv, message", [
    (["bench", "mlp", "--steps", "0"], "argument --steps: give a whole number of at least "
     "1, not '0'"),
    (["bench", "mlp", "--rounds", "-2"], "argument --rounds: give a whole number of at least 1"),
    (["bench", "mlp", "--nproc", "0"], "argument --nproc: give a whole number of at least 1"),
    (["bench", "mlp", "--threads", "0"], "argument --threads: give auto, torch or a whole "
     "number of at least 1, not '0'"),
    (["bench", "mlp", "--micro-batches", "abc"], "argument --micro-batches: give a whole "
     "number of at least 1, or auto, not 'abc'"),
    (["plan", "mlp", "--stages", "2", "--micro-batches", "0"], "argument --micro-batches"),
    (["demo", "--stages", "0"], "argument --stages: give a whole number of at least 1"),
    (["demo", "--threads", "some"], "argument --threads: give auto, torch"),
    (["bench", "mlp", "--npro", "2"], "unrecognized arguments: --npro 2"),  # torchrun's would
    (["plan", "mlp", "--stages", "2", "--recompute", "maybe"], "argument --recompute: 'maybe' "
     "is not a recompute choice; give true (every stage), false (none), auto"),
    (["plan", "mlp", "--stages", "2", "--recompute", "1,2"], "'1,2' is not a recompute choice"),
    (["plan", "mlp", "--stages", "2", "--recompute", "1,,0"], "one true/false per stage such "
     "as 1,0,0,1"),
    (["plan", "mlp", "--stages", "2", "--optimizer", "lbfgs"], "argument --optimizer: 'lbfgs' "
     "is not an optimizer fxpipe knows; give adam, sgd, sgd-momentum"),
    (["plan", "mlp", "--stages", "2", "--optimizer", "-1"], "or the number of weight-sized "
     "state tensors it keeps per parameter"),
    (["plan", "mlp", "--stages", "2", "--precision", "fp8"], "argument --precision: invalid "
     "choice: 'fp8'"),
    (["demo", "--recompute", "sometimes"], "argument --recompute: 'sometimes'"),
    (["demo", "--recompute", "auto"], "auto recomputes only the stages a memory cap needs, "
     "and this command takes no memory cap"),
])
def test_options_that_are_not_numbers_of_the_right_kind_are_refused_by_name(capsys, argv,
                                                                            message):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_calibrates_times_every_configuration_and_writes_csv_the_chart_reads(
        capsys, tmp_path):
    csv_path, png_path = tmp_path / "rows.csv", tmp_path / "rows.png"
    argv = ["bench", "mlp", "--stages", "2", "--batch", "8", "--micro-batches", "2",
            "--partitioners", "even,csimd", "--schedules", "gpipe,1f1b", "--rounds", "2",
            "--steps", "2", "--csv", str(csv_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mlp: 2 stages, batch 8, micro-batches 2, 2 rounds of 2 steps\n" in out
    assert "memory per stage pred (meas)" in out and "rounds' range ms" in out
    # two CPU stages on threads of one process: their peaks cannot be told apart, and it says so
    assert "measured (in parentheses) where each stage runs in a process of its own" in out
    assert "predicted: the simulated step with the calibration's per-action times" in out
    rows = list(csv.DictReader(csv_path.open()))
    assert [(r["partitioner"], r["schedule"]) for r in rows] == [
        ("even", "gpipe"), ("even", "1f1b"), ("csimd", "gpipe"), ("csimd", "1f1b")]
    for r in rows:
        assert float(r["measured_ms"]) > 0 and float(r["predicted_ms"]) > 0
        assert float(r["measured_low_ms"]) <= float(r["measured_high_ms"])
        assert (r["rounds"], r["timed_steps"]) == ("2", "4")
        assert float(r["ratio"]) == pytest.approx(float(r["measured_ms"])
                                                  / float(r["predicted_ms"]))
        assert len(r["memory"].split()) == 2  # bytes per stage
        assert r["measured_memory"] == ""
    assert {r["micro_batches"] for r in rows if r["partitioner"] == "even"} == {"2"}
    assert {r["sizes"] for r in rows if r["partitioner"] == "even"} == {"4+5"}
    plot = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot_bench.py"),
                           str(csv_path), str(png_path)], capture_output=True, text=True)
    assert plot.returncode == 0, plot.stderr
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_bench_steps_on_the_clock_it_is_given():
    """Each timed step is the clock's difference around it: on a clock that moves 1 s a read,
    every step takes 1 s, whatever the machine does."""
    import itertools

    import torch

    from fxpipe.bench import bench
    from fxpipe.models import MLP

    def build():
        loss = torch.nn.functional.cross_entropy
        return MLP(), torch.randn(8, 32), torch.randint(0, 10, (8,)), loss

    ticks = itertools.count()
    (row,) = bench(build, 2, 2, ["even"], ["1f1b"], rounds=3, steps=2, progress=False,
                   clock=lambda: float(next(ticks)))
    assert (row.measured_ms, row.measured_low_ms, row.measured_high_ms) == (1e3, 1e3, 1e3)
    assert (row.timed_steps, row.rounds) == (6, 3) and row.predicted_ms > 0


_PARTITIONS = [((2, 2), 4), ((1, 3), 4), ((3, 1), 4), ((1, 3), 2),  # (sizes, p); even: first
               ((2, 2), 1)]


@given(st.lists(st.tuples(st.sampled_from(_PARTITIONS), st.floats(1.0, 100.0)),
                min_size=1, max_size=6), st.floats(1.0, 100.0))
def test_bench_compares_only_partitions_other_than_evens_own(automatic, even_ms):
    """Rows of even's own partition are never the fastest automatic partition: their
    difference from even is the machine's drift."""
    def row(name, partition, ms):
        (sizes, p) = partition
        return BenchRow(name, "gpipe", sizes, p, 1.0, ms, ms, ms, 0.0, 0.0, (0.0, 0.0), 5, 1)

    rows = [row("even", _PARTITIONS[0], even_ms)]
    rows += [row(f"auto{i}", partition, ms) for i, (partition, ms) in enumerate(automatic)]
    others = [(ms, i, partition) for i, (partition, ms) in enumerate(automatic)
              if partition != _PARTITIONS[0]]
    lines = against_even(rows)
    if not others:
        assert lines == []
        return
    (line,) = lines
    fastest, index, (sizes, p) = min(others)
    assert f"auto{index} ({'+'.join(map(str, sizes))}, p={p}), steps " in line
    assert f"{even_ms / fastest:.2f}x the speed of even" in line
    assert "medians of 5 and 5 steps" in line
    assert against_even(rows[1:]) == []  # no even row: nothing to compare with


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


def test_plan_prints_the_stage_table_compares_and_writes_json(capsys, tmp_path):
    import json

    from fxpipe import Plan

    path = tmp_path / "plan.json"
    assert main(["plan", "fxpipe.models:MLP", "--stages", "3", "--input-shape", "32",
                 "--batch", "8", "--micro-batches", "2", "--partitioner", "even", "--compare",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "CompiledPipeline(MLP)" in out and "predicted step (2 micro-batches" in out
    assert "partitioners compared" in out
    document = json.loads(path.read_text())
    assert document["plan"]["partitioner"] == [3, 3, 3]
    assert Plan.load(path).sizes == (3, 3, 3)


def test_plan_compares_schedules_for_the_chosen_partition(capsys):
    from fxpipe.schedules import build, peak_activations

    names = ["gpipe", "1f1b", "zb-h1"]
    assert main(["plan", "fxpipe.models:MLP", "--stages", "3", "--input-shape", "32",
                 "--batch", "8", "--micro-batches", "2", "--partitioner", "even", "--compare",
                 "--schedules", ",".join(names)]) == 0
    out = capsys.readouterr().out
    closed = re.search(r"gpipe closed form\): ([0-9.]+) ms", out)
    lines = out[out.index("schedules compared (even's partition for each"):].splitlines()
    assert lines[1].split() == ["schedule", "units", "per", "stage", "p", "simulated", "ms",
                                "bubble", "peak", "activations", "max", "memory"]
    rows = [line.split() for line in lines[2:5]]
    assert [row[0] for row in rows] == names
    for name, row in zip(names, rows):
        assert row[1:3] == ["3+3+3", "2"]  # even's stages at the plan's micro-batch count
        assert row[5] == "/".join(map(str, peak_activations(build(name, 3, 2))))
    assert rows[0][3] == closed.group(1)  # GPipe's simulated step is the closed form


def test_plan_and_demo_run_several_stages_per_device(capsys):
    from fxpipe.schedules import build, peak_activations

    assert main(["plan", "mlp", "--stages", "4", "--stages-per-device", "2", "--batch", "8",
                 "--schedule", "zbv", "--micro-batches", "4", "--partitioner", "even",
                 "--compare", "--schedules", "interleaved-1f1b,looped-bfs,dualpipev"]) == 0
    out = capsys.readouterr().out
    assert "zbv runs 4 stages on 2 devices, one worker each: device 0 stages 0, 3" in out
    rows = out[out.index("schedules compared"):].splitlines()[2:5]
    names = ["interleaved-1f1b", "looped-bfs", "dualpipev"]
    assert [row.split()[0] for row in rows] == names
    for name, row in zip(names, rows):
        peaks = peak_activations(build(name, 4, 4, devices=2))
        assert row.split()[0] == name and row.split()[5] == "/".join(map(str, peaks))
    assert main(["demo", "--model", "mlp", "--stages", "4", "--stages-per-device", "2",
                 "--schedule", "looped-bfs", "--micro-batches", "4", "--steps", "1",
                 "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "looped-bfs over 2 worker threads" in out
    assert out.count("of all device time") == 2  # the report counts idle per device


def test_plan_needs_an_input_description(capsys):
    assert main(["plan", "fxpipe.models:MLP", "--stages", "2"]) == 2
    assert "describe the model's input: --input-shape" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "nosuch", "--stages", "2"], "'nosuch' is neither a bundled model"),
    (["bench", "mlp", "--stages", "1", "--nproc", "1"], "--nproc 1 runs one process, as the "
     "run without --nproc does"),
    (["bench", "mlp", "--schedules", "gpipe,async-1f1b"], "async-1f1b trains only through "
     "pipe.step_many"),
    (["bench", "mlp", "--batch", "3", "--micro-batches", "4"],
     "--batch 3 cannot fill --micro-batches 4"),
    (["bench", "mlp", "--partitioners", "even,"], "--partitioners 'even,' has an empty name"),
    (["bench", "mlp", "--csv", "/nonexistent/folder/rows.csv"],
     "--csv /nonexistent/folder/rows.csv: there is no folder /nonexistent/folder"),
    (["plan", "mlp", "--stages", "2", "--json", "/nonexistent/plan.json"],
     "--json /nonexistent/plan.json: there is no folder /nonexistent"),
    (["plan", ":make", "--stages", "2"], "':make' names no module: give MODULE:FACTORY"),
    (["plan", "mlp", "--stages", "2", "--schedules", "gpipe,1f1b"],
     "--schedules compares schedules alongside the partitioners: add --compare"),
    (["plan", "mlp", "--stages", "2", "--compare", "--schedules", "gpipe,zb"],
     "--schedules: 'zb' is not a schedule fxpipe plans for; choose among gpipe,1f1b,"),
    (["plan", "mlp", "--stages", "2", "--compare", "--schedules", "gpipe,"],
     "--schedules 'gpipe,' has an empty name"),
    (["plan", "fxpipe.models:", "--stages", "2"], "'fxpipe.models:' names no factory"),
    (["plan", "mlp", "--stages", "3", "--stages-per-device", "2", "--schedule",
      "interleaved-1f1b"], "the 3 stages do not split evenly over devices of 2 stages each"),
    (["demo", "--stages-per-device", "2"], "'1f1b' runs one stage per device"),
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


def test_output_paths_that_cannot_be_written_are_refused_before_any_work(capsys, tmp_path,
                                                                         monkeypatch):
    assert main(["bench", "mlp", "--csv", str(tmp_path)]) == 2  # a folder
    assert f"--csv {tmp_path}: that is a folder" in capsys.readouterr().err
    # a folder this user may not write in (root may write anywhere, so the check is faked)
    monkeypatch.setattr(os, "access", lambda path, mode: os.path.abspath(path) != str(tmp_path))
    assert main(["bench", "mlp", "--csv", str(tmp_path / "rows.csv")]) == 2
    err = capsys.readouterr().err
    assert f"--csv {tmp_path / 'rows.csv'}: not writable here" in err
    assert not _PROGRESS_BAR.search(err)


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
    if command != "plan":
        assert "torch.set_num_threads" in text  # --threads


@pytest.mark.parametrize("options, partition", [
    (["--partitioner", "csimd"], "partition csimd"),
    (["--micro-batches", "auto"], "partition balanced"),
])
def test_demo_lets_the_planner_choose_the_micro_batch_count(capsys, options, partition):
    assert main(["demo", "--model", "mlp", "--steps", "1", "--batch", "8", *options]) == 0
    assert partition in capsys.readouterr().out.splitlines()[0]


def test_plan_defaults_to_what_plan_defaults_to(capsys):
    from fxpipe import Plan

    assert main(["plan", "mlp", "--stages", "2", "--batch", "8"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    default = Plan(stages=2)
    assert f"partition {default.partitioner} (" in title
    assert title.endswith(", 2 micro-batches")  # one per stage, chosen from the batch of 8


def test_bench_trains_a_factorys_model_whose_output_is_a_structure(capsys, tmp_path, monkeypatch):
    """Such as a HuggingFace model's output: the stand-in loss reads every float tensor in it."""
    (tmp_path / "fxpipe_cli_dict.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)\n"
        "    def forward(self, x):\n"
        "        h = self.a(x)\n"
        "        return {'hidden': h, 'logits': self.b(h), 'ids': x.argmax(-1)}\n"
        "def make():\n    return Net()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "fxpipe_cli_dict", raising=False)
    assert main(["bench", "fxpipe_cli_dict:make", "--input-shape", "4", "--batch", "4",
                 "--partitioners", "even", "--schedules", "gpipe", "--rounds", "1",
                 "--steps", "1"]) == 0
    captured = capsys.readouterr()
    assert "fxpipe_cli_dict:make: 2 stages, batch 4, micro-batches one per stage" in captured.out
    assert re.search(r"round 1/1 even/gpipe \(all: about \d+ (s|min)\)", captured.err)


@pytest.mark.parametrize("first, step, configurations, steps, shown", [
    (2.0, 0.1, 12, 35, " (all: about 66 s)"),  # 12 x (2 + 35 x 0.1)
    (8.0, 0.5, 12, 35, " (all: about 5 min)"),  # 12 x 25.5 = 306 s
    (1.0, 0.0, 1, 7, " (all: about 1 s)"),
])
def test_the_bench_estimates_its_time_from_its_first_configuration(first, step,
                                                                   configurations, steps, shown):
    from fxpipe.bench import _estimate

    assert _estimate(first, step, configurations, steps) == shown


def test_plan_sets_recompute_optimizer_and_precision_of_its_plan(capsys, tmp_path):
    from fxpipe import Plan

    path = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--stages", "2", "--batch", "4", "--partitioner", "even",
                 "--recompute", "1,0", "--optimizer", "sgd", "--precision", "bf16",
                 "--json", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith("0 rc ") and not table[3].startswith("1 rc")
    saved = Plan.load(path)
    assert (saved.recompute, saved.optimizer, saved.precision) == ((True, False), "sgd", "bf16")


@pytest.mark.parametrize("options, fields", [
    ([], {"recompute": False, "optimizer": None, "precision": None}),  # Plan's defaults
    (["--recompute", "auto", "--optimizer", "3", "--precision", "fp16"],
     {"recompute": "auto", "optimizer": 3, "precision": "fp16"}),
    (["--recompute", "TRUE", "--optimizer", "sgd-momentum"],
     {"recompute": True, "optimizer": "sgd-momentum"}),
    (["--recompute", "0,1,1"], {"recompute": (False, True, True)}),
])
def test_training_options_reach_the_plan_of_plan_and_demo(monkeypatch, capsys, options, fields):
    import fxpipe.cli
    from fxpipe.errors import FxpipeError

    plans = []

    def compiled(model, plan, **kwargs):  # the plan is all this test needs: stop there
        plans.append(plan)
        raise FxpipeError("stopped before compiling")

    monkeypatch.setattr(fxpipe.cli, "compile", compiled)
    assert main(["plan", "mlp", "--stages", "3", "--partitioner", "even", *options]) == 2
    # the demo has no memory cap, so no auto: it recomputes every stage instead
    demo_options = ["true" if o == "auto" else o for o in options
                    if o not in ("--optimizer", "3", "sgd-momentum")]
    assert main(["demo", "--model", "mlp", "--stages", "3", *demo_options]) == 2
    assert "stopped before compiling" in capsys.readouterr().err
    for field, value in fields.items():
        assert getattr(plans[0], field) == value
        if field != "optimizer":
            assert getattr(plans[1], field) == (True if value == "auto" else value)
    assert plans[1].optimizer == "sgd-momentum"  # the optimizer the demo trains with


@pytest.mark.parametrize("policy", ["stash", "2bw", "predict"])
def test_plan_counts_the_weight_copies_of_its_consistency_policy(capsys, policy):
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}

    def memory_column(options):
        assert main(["plan", "mlp", "--stages", "2", "--partitioner", "even", "--batch", "4",
                     "--schedule", "async-1f1b", *options]) == 0
        header, *rows = capsys.readouterr().out.splitlines()[1:4]
        column = header.index("memory")  # the table's columns are aligned
        return [float(row[column:].split()[0]) * scale[row[column:].split()[1]] for row in rows]

    plain, kept = memory_column([]), memory_column(["--consistency", policy])
    assert len(plain) == len(kept) == 2
    # the first stage, whose weights are furthest behind, keeps a copy or more (predict's
    # last stage runs on current weights and keeps none)
    assert kept[0] > plain[0] and kept[1] >= plain[1]


def test_plan_refuses_a_consistency_policy_on_a_synchronous_schedule(capsys):
    assert main(["plan", "mlp", "--stages", "2", "--consistency", "stash"]) == 2
    assert "use schedule='async-1f1b'" in capsys.readouterr().err
