"""compile() is a named list of passes: each verified, summarised, printed on request; and a
compile and a step leave the process as they found it."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.compiler import PASSES
from fxpipe.compiler.state import Compilation, CompilerError, Pass, ensure, run_passes
from fxpipe.models import MLP

NAMES = ["check", "trace", "units", "shapes", "profile", "link", "partition", "rewrite",
         "schedule"]


def test_the_passes_run_in_order_and_the_pipeline_keeps_their_record():
    assert [p.name for p in PASSES] == NAMES
    pipe = fxpipe.compile(MLP(), fxpipe.Plan(stages=2, micro_batches=2),
                          example_inputs=(torch.randn(8, 32),), cache=False)
    assert [r.name for r in pipe.passes] == NAMES
    assert all(r.seconds >= 0 and r.summary for r in pipe.passes)
    table = str(pipe.passes)
    assert all(name in table for name in NAMES) and "9 passes" in table


def test_dump_prints_each_pass_as_it_completes(capsys):
    fxpipe.compile(MLP(), fxpipe.Plan(stages=2, costs="none", dump=True),
                   example_inputs=(torch.randn(8, 32),))
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("fxpipe: ")]
    assert [line.split()[1] for line in lines] == NAMES
    assert "no times (Plan(costs='none'))" in lines[NAMES.index("profile")]
    assert "units per stage" in lines[NAMES.index("partition")]


def test_nothing_is_printed_without_dump(capsys):
    fxpipe.compile(MLP(), fxpipe.Plan(stages=2, costs="none"),
                   example_inputs=(torch.randn(8, 32),))
    assert capsys.readouterr().out == ""


def test_a_pass_whose_result_fails_its_verifier_stops_compile():
    def broken(c):
        c.units = ["not", "units"]

    def verify(c):
        ensure(all(hasattr(u, "nodes") for u in c.units), "units are Units")

    compilation = Compilation(MLP(), fxpipe.Plan(stages=2), (torch.randn(4, 32),), {})
    with pytest.raises(CompilerError, match=r"fxpipe's broken pass made a result its verifier "
                                            r"refuses: units are Units should hold. This is a "
                                            r"bug in fxpipe"):
        run_passes([Pass("broken", broken, verify, lambda c: "")], compilation)


def test_the_profile_passs_verifier_refuses_times_that_are_not_finite(monkeypatch):
    """Under `python -O` too: the verifiers raise, they do not assert."""
    from fxpipe.compiler import passes

    profile_units = passes.profile_units

    def broken(*args, **kwargs):
        profile = profile_units(*args, **kwargs)
        profile.forward[0, 0] = float("nan")
        return profile

    monkeypatch.setattr(passes, "profile_units", broken)
    with pytest.raises(CompilerError, match="fxpipe's profile pass made a result its verifier "
                                            "refuses: finite, non-negative times should hold"):
        fxpipe.compile(MLP(), fxpipe.Plan(stages=2), example_inputs=(torch.randn(8, 32),),
                       cache=False)


@pytest.mark.parametrize("costs, splits", [("none", 1), ("measure", 2)])
def test_the_stages_are_rewritten_once(monkeypatch, costs, splits):
    """With measured costs the profile pass times the units through a split of its own, one
    unit a stage; the model's stages are rewritten once."""
    from fxpipe.compiler import passes

    calls = []
    split = passes.split_stages
    monkeypatch.setattr(passes, "split_stages", lambda *a: calls.append(a[2]) or split(*a))
    pipe = fxpipe.compile(MLP(), fxpipe.Plan(stages=2, costs=costs),
                          example_inputs=(torch.randn(8, 32),), cache=False)
    assert len(calls) == splits
    assert tuple(calls[-1]) == pipe.partition.bounds


def test_print_and_the_pass_log_say_where_the_costs_came_from(tmp_path, monkeypatch):
    """On a timer that charges every call 1 ms (so the second compile's re-time agrees with
    the cache): the first compile measured and says where it cached, the second names the
    cache file it read and what its key holds."""
    from fxpipe.passes.analysis import profile as profile_module

    monkeypatch.setattr(profile_module, "_timer",
                        lambda device: lambda fn, *args, **kwargs: (fn(*args, **kwargs), 1e-3))
    x = torch.randn(8, 32)
    plan = fxpipe.Plan(stages=2, micro_batches=1)
    first = fxpipe.compile(MLP(), plan, example_inputs=(x,), cache=tmp_path)
    second = fxpipe.compile(MLP(), plan, example_inputs=(x,), cache=tmp_path)
    (path,) = tmp_path.glob("*.json")
    profiled = {r.name: r.summary for r in first.passes}["profile"]
    read = {r.name: r.summary for r in second.passes}["profile"]
    assert f"costs: measured now on cpu, cached at {path}" in repr(first)
    assert profiled.endswith(f"; costs: measured now on cpu, cached at {path}")
    threads = torch.get_num_threads()
    key = (f"(key: cpu on {platform.node()}, {threads} thread{'s' * (threads != 1)}, float32, "
           f"micro-batch sizes [8], torch {torch.__version__}; its times 1.00x a re-time's)")
    assert f"costs: from cache {path} {key}" in repr(second)
    assert read.endswith(f"; costs: from cache {path} {key}")
    assert (second.cost.f == first.cost.f).all()


def test_an_unwritable_cache_is_said_not_raised(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    pipe = fxpipe.compile(MLP(), fxpipe.Plan(stages=2), example_inputs=(torch.randn(8, 32),),
                          cache=blocked)
    assert "costs: measured now on cpu, not cached: " in repr(pipe)


def test_a_cache_that_is_not_a_folder_path_is_refused():
    with pytest.raises(fxpipe.FxpipeError, match=r"compile\(cache=3\) takes True"):
        fxpipe.compile(MLP(), fxpipe.Plan(stages=2), example_inputs=(torch.randn(8, 32),),
                       cache=3)


class _Calls:
    """Counts the shared libraries loaded meanwhile (an allocator tuning loads libc)."""

    def __init__(self, monkeypatch):
        self.loaded = []
        real = ctypes.CDLL

        def recording(name, *args, **kwargs):
            self.loaded.append(name)
            return real(name, *args, **kwargs)

        monkeypatch.setattr(ctypes, "CDLL", recording)
        monkeypatch.setattr(ctypes.cdll, "LoadLibrary", recording)


@pytest.mark.parametrize("costs, stages", [("measure", 3), ("none", 3), ("measure", 1)])
def test_compile_and_step_leave_the_process_as_they_found_it(monkeypatch, costs, stages):
    """No CPU binding, thread count, allocator call, environment, signal handler, random
    number generator state or grad mode changed, on the stage threads either; one stage runs
    on the caller's own thread."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads, interop = torch.get_num_threads(), torch.get_num_interop_threads()
    environment = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    calls = _Calls(monkeypatch)
    seen_by_stages = []
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Dropout(0.1),
                          nn.Linear(8, 2))
    x, y = torch.randn(8, 8), torch.randn(8, 2)
    plan = fxpipe.Plan(stages=stages, micro_batches=2, schedule="1f1b", loss_fn=F.mse_loss,
                       costs=costs)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,),
                          example_target=y if costs == "measure" else None, cache=False)
    assert torch.equal(torch.rand(3), expected)
    for s in range(stages):
        pipe.register_stage_hook(s, lambda _: seen_by_stages.append(
            (threading.current_thread().name, torch.get_num_threads(),
             os.sched_getaffinity(0) if affinity is not None else None)))
    pipe.step(x, y)
    with torch.no_grad():
        pipe.step(x, y)
        assert not torch.is_grad_enabled()
        pipe(x)
        assert not torch.is_grad_enabled()
    pipe(x).sum().backward()
    assert torch.is_grad_enabled()
    assert calls.loaded == []
    assert torch.get_num_threads() == threads
    assert torch.get_num_interop_threads() == interop
    assert dict(os.environ) == environment
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    if affinity is not None:
        assert os.sched_getaffinity(0) == affinity
    stage_threads = {name for name, _, _ in seen_by_stages}
    assert len(stage_threads) == stages  # a thread per stage (the caller's own for one)
    assert all(n == threads and (a is None or a == affinity) for _, n, a in seen_by_stages)
