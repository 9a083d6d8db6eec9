"""fxpipe.measure_memory: a stage's measured peak, beside the prediction in pipe.report()."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import fxpipe
from fxpipe.bench import BenchRow, format_rows
from fxpipe.cost import Partition
from fxpipe.models import MLP
from fxpipe.peak_memory import peak_rise
from fxpipe.preserve import gradients_set_aside, preserved_state
from fxpipe.report import MeasuredMemory, format_memory

CPU = torch.device("cpu")


class Hoarder(nn.Module):
    """Saves a tensor of `width` floats a sample for its backward (tanh saves its output)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.width = width
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        wide = torch.tanh(self.inp(x).repeat(1, self.width // 4))  # kept for backward
        return self.out(wide.view(x.shape[0], -1, 4).mean(1))


def _one_stage(model: nn.Module, x: torch.Tensor, micro_batches: int = 1):
    plan = fxpipe.Plan(stages=1, micro_batches=micro_batches, loss_fn=F.cross_entropy)
    return fxpipe.compile(model, plan, example_inputs=(x,), cache=False)


def test_peak_rise_sees_what_this_thread_allocates():
    with peak_rise([CPU]) as rise:
        kept = torch.ones(1000, 250)  # 1 MB
        del kept
    assert rise[CPU] >= 1000 * 250 * 4


def test_a_stage_that_saves_a_known_tensor_measures_at_least_its_bytes():
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    pipe = _one_stage(Hoarder(4096), x)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.0)
    pipe.step(x, y)
    optimizer.step()
    before = {name: p.grad.clone() for name, p in pipe.named_parameters()}
    measured = fxpipe.measure_memory(pipe, x, target=y, optimizer=optimizer)
    assert measured.activations[0] >= 16 * 4096 * 4
    weights = sum(p.nbytes for p in pipe.parameters())
    assert (measured.weights[0], measured.gradients[0]) == (weights, weights)
    assert measured.optimizer[0] >= 2 * weights  # Adam's two moments (and its step counts)
    assert measured.totals[0] == pytest.approx(sum(
        part[0] for part in (measured.weights, measured.gradients, measured.optimizer,
                             measured.activations)))
    # the measurement's steps leave the user's gradients as they were
    assert all(torch.equal(p.grad, before[name]) for name, p in pipe.named_parameters())


@contextlib.contextmanager
def _memory_events() -> Iterator[list[int]]:
    """The bytes each of this thread's memory events meanwhile allocated (+) or freed (-), in
    order (filled in when the block ends)."""
    changes: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as session:
        yield changes
    events = session.profiler.kineto_results.events()
    changes += [n for _, n in sorted((e.start_ns(), e.nbytes()) for e in events
                                     if e.name() == "[memory]"
                                     and e.device_type() == DeviceType.CPU)]


@settings(max_examples=6, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1"]), micro_batches=st.sampled_from([1, 4]),
       recompute=st.booleans(), precision=st.sampled_from([None, "bf16"]))
def test_the_measured_step_frees_only_what_it_allocated(schedule, micro_batches, recompute,
                                                        precision):
    """measure_memory profiles its measured step only, after unprofiled warm-up steps, and the
    profiler reports freeing a block only if it saw it allocated: a block the warm-up left and
    the step freed would never be subtracted. None is: a flushed step ends holding what it
    started with (the gradients accumulate in place into those gradients_set_aside made, no
    optimizer steps). Profiled from the warm-up on, the measured step's events sum to zero
    (nothing kept, nothing of the warm-up's freed) and rise to measure_memory's peak."""
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    plan = fxpipe.Plan(stages=1, schedule=schedule, micro_batches=micro_batches,
                       loss_fn=F.cross_entropy, recompute=recompute, precision=precision,
                       costs="none")
    pipe = fxpipe.compile(Hoarder(64), plan, example_inputs=(x,), cache=False)
    measured = fxpipe.measure_memory(pipe, x, target=y).activations[0]
    params = list(pipe.parameters())
    with preserved_state(pipe), gradients_set_aside(pipe), pipe.executor.runs_aside():
        made = [p.grad.data_ptr() for p in params]
        with _memory_events():  # the warm-up's blocks known to the profiler, so their frees too
            pipe.step(x, y)
        with _memory_events() as changes:
            pipe.step(x, y)
        assert [p.grad.data_ptr() for p in params] == made
    assert sum(changes) == 0, changes
    assert max(np.cumsum(changes)) == measured > 0


def test_report_shows_predicted_and_measured_memory_side_by_side():
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    pipe = _one_stage(Hoarder(64), x)
    measured = fxpipe.measure_memory(pipe, x, target=y)
    pipe.step(x, y)
    text = pipe.report(file=io.StringIO(), memory=measured)
    assert "memory pred" in text and "memory meas" in text and "pred/meas" in text
    assert "torch.profiler memory events" in text
    # no optimizer given: its state is not counted, and the table says so
    assert "no optimizer state counted" in text
    assert "memory pred" not in pipe.report(file=io.StringIO())  # not asked for


def test_report_refuses_what_measure_memory_did_not_return():
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    pipe = _one_stage(Hoarder(8), x)
    pipe.step(x, y)
    with pytest.raises(fxpipe.FxpipeError, match=r"pipe.report\(memory=...\) takes what "
                                                 r"fxpipe.measure_memory"):
        pipe.report(memory=[1.0])


def test_stages_on_threads_of_one_cpu_process_are_refused_with_the_fix():
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    plan = fxpipe.Plan(stages=2, partitioner="even", loss_fn=F.cross_entropy, costs="none")
    pipe = fxpipe.compile(MLP(), plan, example_inputs=(x,), cache=False)
    with pytest.raises(fxpipe.FxpipeError, match="measure under torchrun, one stage per rank "
                                                 r"\(torchrun --nproc-per-node 2"):
        fxpipe.measure_memory(pipe, x, target=y)


def test_measure_memory_needs_a_loss_and_a_flushed_schedule():
    x = torch.randn(8, 32)
    pipe = fxpipe.compile(MLP(), fxpipe.Plan(stages=1, costs="none"), example_inputs=(x,),
                          cache=False)
    with pytest.raises(fxpipe.FxpipeError, match=r"needs Plan\(loss_fn=\.\.\.\)"):
        fxpipe.measure_memory(pipe, x, target=torch.zeros(8, dtype=torch.long))


def test_bench_rows_show_the_measured_peak_beside_the_predicted_one():
    row = BenchRow("even", "1f1b", (2, 3), 2, 1.0, 1.0, 1.0, 1.0, 0.1, 0.1, (2048.0, 4096.0), 2,
                   1, measured_memory=(1024.0, 5120.0))
    text = format_rows([row])
    assert "memory per stage pred (meas)" in text
    assert "2.0 KiB (1.0 KiB) / 4.0 KiB (5.0 KiB)" in text
    assert "measured (in parentheses) where" not in text  # every row measured
    unmeasured = dataclasses.replace(row, measured_memory=())
    assert "measured (in parentheses) where each stage runs" in format_rows([unmeasured])


def test_format_memory_gives_the_ratio_per_stage():
    measured = MeasuredMemory((100.0, 200.0), (100.0, 200.0), (200.0, 400.0), (600.0, 200.0),
                              "a test")
    text = format_memory([1100.0, 900.0], measured)
    lines = text.splitlines()
    assert "a test" in lines[0]
    assert lines[2].split()[0] == "0" and "1.10" in lines[2]
    assert lines[3].split()[0] == "1" and "0.90" in lines[3]


@pytest.fixture(scope="module")
def wide_mlp():
    """One stage of an MLP whose activations outweigh its weights, compiled at batch 64 in 4
    micro-batches (its units profiled at micro-batches of 16), and Adam's state."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    pipe = _one_stage(MLP((32, 512, 512, 10)), x, micro_batches=4)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.0)
    pipe.step(x, y)
    optimizer.step()
    return pipe, optimizer, x, y


@settings(max_examples=3, deadline=None)
@given(sizes=st.lists(st.sampled_from([2, 4, 8, 16]), min_size=2, max_size=2, unique=True))
def test_the_prediction_grows_with_the_micro_batch_as_the_measured_peak_does(wide_mlp, sizes):
    """Between two micro-batch sizes (batches of 4 micro-batches), the predicted peak grows by
    what the measured one grows, within 15%: the bytes scale with the micro-batch."""
    pipe, optimizer, x, y = wide_mlp
    small, large = sorted(sizes)
    predicted, measured = [], []
    for size in (small, large):
        cost = dataclasses.replace(pipe.cost, batch=4 * size)  # the prediction for that batch
        predicted.append(Partition.evaluate(cost, pipe.partition.bounds, 4).stages[0].memory)
        measured.append(fxpipe.measure_memory(pipe, x[:4 * size], target=y[:4 * size],
                                              optimizer=optimizer).totals[0])
    grown = measured[1] - measured[0]
    assert grown > 0
    assert predicted[1] - predicted[0] == pytest.approx(grown, rel=0.15)
