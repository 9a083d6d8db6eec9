"""Profile pass: per-unit times and bytes, cached, leaving the model untouched."""

from __future__ import annotations

import copy
import os
import threading
import time
from io import StringIO

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn

import fxpipe
from fxpipe.models import GPT, VGG
from fxpipe.passes.analysis import capacity as capacity_module
from fxpipe.passes.analysis import profile as profile_module
from fxpipe.passes.analysis.comm import default_link
from fxpipe.passes.analysis.costs import cost_table
from fxpipe.passes.analysis.memory import PeakMemory
from fxpipe.passes.analysis.profile import profile_units
from fxpipe.passes.rewrite.stages import split_stages


def _per_unit(model, x):
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=1, costs="none"), example_inputs=(x,))
    k = len(pipe.units)
    graph, table = split_stages(pipe.traced.gm, pipe.units, range(1, k + 1), ["cpu"] * k)
    return pipe, graph, table


def test_second_compile_reads_the_cache(tmp_path):
    model, x = VGG(), torch.randn(8, 3, 32, 32)
    first = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2),
                           example_inputs=(x,), cache=tmp_path)
    start = time.perf_counter()
    second = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2),
                            example_inputs=(x,), cache=tmp_path)
    assert list(tmp_path.glob("*.json"))
    np.testing.assert_array_equal(first.cost.f, second.cost.f)
    np.testing.assert_array_equal(first.cost.b, second.cost.b)
    assert time.perf_counter() - start < 5.0


def test_profile_shapes_and_bytes():
    model, x = VGG(), torch.randn(8, 3, 32, 32)
    pipe, graph, table = _per_unit(model, x)
    profile = profile_units(graph, table, [x], [2, 4, 8], warmup=1, repeats=2)
    k = len(pipe.units)
    assert profile.sizes == (2, 4, 8)
    for array in (profile.forward, profile.backward, profile.boundary_bytes,
                  profile.activation_bytes):
        assert array.shape == (3, k) and np.all(array >= 0)
    assert np.all(profile.forward > 0)
    # the first conv's output, 8 x 16 x 32 x 32 floats, crosses the cut after unit 0
    assert profile.boundary_bytes[2, 0] == 8 * 16 * 32 * 32 * 4
    assert profile.boundary_bytes[0, 0] == 2 * 16 * 32 * 32 * 4
    assert profile.boundary_bytes[2, -1] == 0
    assert profile.params.sum() == sum(p.numel() for p in model.parameters())
    # a unit's peak holds at least its own output (the boundary after it, for the first conv;
    # a flatten is a view and allocates nothing); the CPU's is measured by torch.profiler, and
    # grows with the micro-batch size
    assert np.all(np.isfinite(profile.peak_bytes)) and np.all(profile.peak_bytes >= 0)
    assert np.all(profile.peak_bytes[:, 0] >= profile.boundary_bytes[:, 0])
    assert np.all(np.diff(profile.peak_bytes.sum(axis=1)) > 0)


def test_peak_memory_of_a_span_counts_what_it_allocates():
    with PeakMemory("cpu") as peaks:
        with peaks.span("held"):
            kept = torch.empty(1000, 250)  # 1,000,000 bytes, still allocated after the span
        with peaks.span("transient"):
            for _ in range(3):
                torch.empty(500, 500)  # 1,000,000 bytes each, freed at once
        with peaks.span("nothing"):
            pass
    assert kept.nbytes == 1_000_000
    assert peaks.result == {"held": 1_000_000, "transient": 1_000_000, "nothing": 0}


def test_integer_values_carry_no_gradient_bytes():
    model, idx = GPT(layers=1), torch.randint(0, 128, (4, 16))

    class Split(nn.Module):  # token ids cross the first cut as well as embeddings
        def __init__(self):
            super().__init__()
            self.gpt = model

        def forward(self, idx):
            return self.gpt(idx) + self.gpt.wte(idx).sum()

    _, graph, table = _per_unit(Split(), idx)
    profile = profile_units(graph, table, [idx], [4], warmup=0, repeats=1)
    assert np.all(profile.boundary_grad_bytes <= profile.boundary_bytes)
    assert np.any(profile.boundary_grad_bytes < profile.boundary_bytes)


def test_profiling_a_training_model_leaves_no_trace():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model.train()
    x = torch.randn(16, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=4), example_inputs=(x,),
                   cache=False)
    assert torch.equal(torch.rand(2), expected)
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_peak_memory_inside_a_users_profiler_is_unknown_not_a_crash():
    from torch.profiler import profile

    with profile(), PeakMemory("cpu") as peaks, peaks.span("inner"):
        torch.empty(1000)
    assert np.isnan(peaks.result["inner"])  # profilers do not nest: nothing measured, no error


def test_the_background_load_runs_the_units_as_one_stage():
    """Its forwards feed each other and one backward runs through all of them: the weights get
    the plain model's gradients for an all-ones output gradient."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double(), \
        torch.randn(5, 4, dtype=torch.float64)
    _, graph, table = _per_unit(model, x)
    modules = [graph.get_submodule(f"stage{io.stage}").module for io in table.stages]
    profile_module.run_as_a_stage(table, modules, dict(zip(table.graph_inputs, [x])),
                                  profile_module.values_needing_grad(table))
    split = {name.split(".", 2)[-1]: p.grad for name, p in graph.named_parameters()}
    model.zero_grad()
    model(x).backward(torch.ones(5, 3, dtype=torch.float64))
    for name, param in model.named_parameters():
        torch.testing.assert_close(split[name], param.grad, msg=name)


@pytest.mark.parametrize("load, part",
                         [("stage", "run_as_a_stage"), ("crossed", "_backward_from")])
def test_a_failing_background_load_fails_the_timing(monkeypatch, load, part):
    model, x = VGG(), torch.randn(4, 3, 32, 32)
    _, graph, table = _per_unit(model, x)

    def broken(*args, **kwargs):
        raise ValueError("load broke")

    monkeypatch.setattr(profile_module, part, broken)  # run by the load's thread alone
    with pytest.raises(RuntimeError, match="background load") as failure:
        profile_units(graph, table, [x], [2], warmup=0, repeats=1, concurrency=2, load=load)
    assert isinstance(failure.value.__cause__, ValueError)


@given(st.lists(st.floats(0.0, 1e-2), min_size=2, max_size=12), st.floats(0.0, 1e-3),
       st.data())
def test_the_fixed_cost_of_a_backward_call_is_recovered(work, call, data):
    """Units timed one backward call each took their work plus the call's fixed cost; one
    connected call took all the work plus one fixed cost: both come back out."""
    called = np.array(data.draw(st.lists(st.booleans(), min_size=len(work),
                                         max_size=len(work))))
    work = np.where(called, work, 0.0)
    timed = np.where(called, work + call, 0.0)
    units, cost = profile_module._without_call_cost(timed, called, work.sum() + call)
    if called.sum() < 2:  # nothing to compare the connected call with
        assert cost == 0.0 and np.array_equal(units, timed)
        return
    assert cost == pytest.approx(call, abs=1e-12)
    np.testing.assert_allclose(units, work, atol=1e-12)


@given(st.lists(st.floats(0.0, 1e-2), min_size=2, max_size=12), st.floats(0.0, 1e-3),
       st.data())
def test_the_fixed_cost_of_a_backward_call_is_recovered_from_runs_of_units(work, call, data):
    """Units timed one backward call each took their work plus the call's fixed cost; in runs
    of consecutive units, one connected call per run took the run's work plus one fixed cost:
    both come back out whenever more units were called than runs."""
    cuts = sorted(data.draw(st.sets(st.integers(1, len(work) - 1), max_size=len(work) - 1)))
    runs = [range(a, b) for a, b in zip([0, *cuts], [*cuts, len(work)])]
    work = np.array(work)
    timed = work + call
    connected = sum(work[run].sum() + call for run in runs)
    units, cost = profile_module._without_call_cost(timed, np.ones(len(work), bool), connected,
                                                    len(runs))
    if len(runs) == len(work):  # every run one unit: nothing to compare the calls with
        assert cost == 0.0 and np.array_equal(units, timed)
        return
    assert cost == pytest.approx(call, abs=1e-12)
    np.testing.assert_allclose(units, work, atol=1e-12)


@given(st.lists(st.dictionaries(st.integers(0, 6), st.sampled_from([0, 1, 2, 3, 5]),
                                max_size=3), max_size=12),
       st.sampled_from([0.0, 2.0, 4.0, 6.0, float("inf")]))
def test_a_meta_model_is_timed_in_the_fewest_runs_within_the_window(units, window):
    """The runs cover the units in order, each holding at most the window's bytes of tensors
    (a tensor tied between its units once; or one heavier unit alone), and a run ends only
    where its next unit would take it past the window: no fewer runs could keep within it."""
    sizes = {}  # one size per tensor, whichever unit holds it
    units = [{t: sizes.setdefault(t, nbytes) for t, nbytes in unit.items()} for unit in units]

    def held(indices) -> int:
        return sum({t: n for i in indices for t, n in units[i].items()}.values())

    runs = profile_module._runs(units, window)
    assert [i for run in runs for i in run] == list(range(len(units)))
    for run, following in zip(runs, [*runs[1:], None]):
        assert len(run) >= 1 and (held(run) <= window or len(run) == 1)
        if following is not None:
            assert held([*run, following.start]) > window


def test_a_backward_call_never_costs_less_than_nothing():
    units, cost = profile_module._without_call_cost(np.array([1.0, 2.0]), np.array([True] * 2),
                                                    5.0)  # connected slower than the parts
    assert cost == 0.0 and units.sum() == pytest.approx(5.0)


def test_the_loss_is_timed_and_counts_in_the_last_unit():
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 8)
    _, graph, table = _per_unit(model, x)
    output = table.graph_outputs[0]

    def loss(outputs, size):
        time.sleep(0.01)
        value = outputs[output].square().mean()
        assert outputs[output].shape[0] == size  # the micro-batch's rows
        return value

    profile = profile_units(graph, table, [x], [2, 4], warmup=0, repeats=1, loss=loss)
    assert np.all(profile.loss_forward >= 0.01) and np.all(profile.loss_backward > 0)
    plain = profile_units(graph, table, [x], [2, 4], warmup=0, repeats=1)
    assert np.all(plain.loss_forward == 0) and np.all(plain.loss_backward == 0)
    cost = cost_table(profile, default_link("cpu", "cpu"), 8, ["a", "b", "c"])
    np.testing.assert_allclose(cost.f[:, -1], profile.forward[:, -1] + profile.loss_forward)
    np.testing.assert_allclose(cost.b[:, -1], profile.backward[:, -1] + profile.loss_backward)
    np.testing.assert_allclose(cost.f[:, :-1], profile.forward[:, :-1])
    np.testing.assert_array_equal(cost.backward_call, profile.backward_call)


@given(st.integers(0, 3), st.integers(1, 10), st.floats(0.0, 1.0), st.floats(1e-4, 0.1))
def test_short_repetitions_go_on_until_they_took_min_time(warmup, repeats, min_time, step):
    """On a clock where each repetition takes `step` seconds: the warm-up and `repeats` timed
    ones always run, and then more only while the timed ones took less than `min_time`, and
    never more than MOST_REPEATS timed ones in all."""
    clock = [0.0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_module.time, "perf_counter", lambda: clock[0])
        indices = []
        for rep in profile_module._repetitions(warmup, repeats, min_time):
            indices.append(rep)
            clock[0] += step
    timed = len(indices) - warmup
    assert indices == list(range(len(indices)))
    assert repeats <= timed <= profile_module.MOST_REPEATS
    if timed > repeats:  # the last one ran as the ones before still came short
        assert (timed - 1) * step < min_time + 1e-9
    if timed < profile_module.MOST_REPEATS:  # they stopped because they took long enough
        assert timed * step >= min_time - 1e-9


@pytest.fixture(scope="module")
def three_units():
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 8)
    _, graph, table = _per_unit(model, x)
    return graph, table, x


@given(call=st.floats(0.0, 1e-3), loss_work=st.floats(0.0, 1e-3))
def test_the_loss_backward_leaves_out_the_call_the_last_stage_pays_once(three_units, call,
                                                                        loss_work):
    """On a clock where every backward call costs `call` beyond its work (none for the units,
    `loss_work` for the loss), the units' one connected call and their own calls give the
    call's cost, and the loss's backward keeps its work alone: the last stage's one backward
    call runs it."""
    graph, table, x = three_units

    def clock(device, core_waits_out=False):
        def timed(fn, *args, **kwargs):
            result = fn(*args, **kwargs)
            if isinstance(getattr(fn, "__self__", None), torch.Tensor):  # loss.backward
                return result, loss_work + call
            return result, call if fn is torch.autograd.backward else 0.0
        return timed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_module, "_timer", clock)
        profile = profile_units(graph, table, [x], [4], warmup=0, repeats=1,
                                loss=lambda outputs, size: outputs[table.graph_outputs[0]].sum())
    assert profile.backward_call[0] == pytest.approx(call, abs=1e-15)
    assert profile.loss_backward[0] == pytest.approx(loss_work, abs=1e-15)


def test_an_unknown_background_load_is_named_with_the_choices():
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), torch.randn(4, 4)
    _, graph, table = _per_unit(model, x)
    with pytest.raises(ValueError, match="'crossed', 'same', 'stage', 'forwards', 'backwards'"):
        profile_units(graph, table, [x], [2], concurrency=2, load="sideways")


@pytest.mark.parametrize("load", ["crossed", "same"])
@pytest.mark.parametrize("concurrency", [1, 2])
def test_paired_timings_take_each_kind_beside_the_kind_they_name(three_units, concurrency,
                                                                  load):
    """On a clock whose every reading depends on what the neighbour runs, a crossed profile
    keeps the forward figures timed beside backwards only and the backward figures (the
    units', the fixed cost of a call, the loss's) timed beside forwards only, and a "same"
    profile the other way round; with one busy stage, the timed one, nothing runs beside the
    units."""
    graph, table, x = three_units
    beside: list[str | None] = [None]
    enter = profile_module._Load.__enter__

    def noting_the_neighbour(load):
        beside[0] = load.kind if load.workers else None
        return enter(load)

    # a unit by what runs beside it: seconds of its forward, and of its own backward call
    scale = {"backwards": 1.0, "forwards": 2.0, "stage": 3.0, None: 4.0}

    def clock(device, core_waits_out=False):
        def timed(fn, *args, **kwargs):
            result, unit = fn(*args, **kwargs), scale[beside[0]]
            if getattr(fn, "__name__", "") == "backward" and fn is not torch.autograd.backward:
                return result, 5 * unit  # the loss's, through its own call
            if fn is torch.autograd.backward:  # a unit's own call, or the units' one call
                return result, unit if "inputs" in kwargs else 2.4 * unit
            if isinstance(fn, fx.GraphModule) and hasattr(fn, "unit0"):  # the units as one
                return result, 2.1 * unit
            return result, unit
        return timed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_module._Load, "__enter__", noting_the_neighbour)
        patch.setattr(profile_module, "_timer", clock)
        prof = profile_units(graph, table, [x], [2, 4], warmup=0, repeats=1,
                             concurrency=concurrency, load=load,
                             loss=lambda outputs, size: outputs[table.graph_outputs[0]].sum())
    beside_forward, beside_backward = (("backwards", "forwards") if load == "crossed"
                                       else ("forwards", "backwards"))
    forward, backward = (scale[beside_forward], scale[beside_backward]) if concurrency == 2 \
        else (scale[None], scale[None])
    # 3 units of 1 each, 2.1 as one graph: 0.7 each as part of a stage's forward
    np.testing.assert_allclose(prof.forward, 0.7 * forward)
    assert np.all(prof.loss_forward == forward)
    # 3 calls of 1 against one of 2.4: a call costs 0.3 beyond the units' 0.7 each
    np.testing.assert_allclose(prof.backward_call, 0.3 * backward)
    np.testing.assert_allclose(prof.backward, 0.7 * backward)
    np.testing.assert_allclose(prof.loss_backward, 4.7 * backward)


@pytest.mark.parametrize("load", ["forwards", "backwards"])
def test_a_load_of_one_kind_runs_only_that_kind(monkeypatch, load):
    """A forwards load runs forwards again and again and no backward; a backwards load runs
    one forward per size and then backwards through that retained graph."""
    model, x = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)), \
        torch.randn(8, 16)
    _, graph, table = _per_unit(model, x)
    forwards, retained = [], []
    connected, backward = profile_module._connected_forward, torch.autograd.backward

    def in_the_load() -> bool:  # the timed units run on this thread, the load on another
        return threading.current_thread() is not threading.main_thread()

    def counted_forward(*args):
        forwards.extend([1] if in_the_load() else [])
        return connected(*args)

    def counted_backward(*args, **kwargs):
        if in_the_load():
            retained.append(bool(kwargs.get("retain_graph")))
        return backward(*args, **kwargs)

    monkeypatch.setattr(profile_module, "_connected_forward", counted_forward)
    monkeypatch.setattr(torch.autograd, "backward", counted_backward)
    # timed for 0.05 s a size at least, far longer than the interpreter's switch interval, so
    # that the load gets to run at each size (20 runs of units this small can end sooner)
    prof = profile_units(graph, table, [x], [2, 4], warmup=1, repeats=20, concurrency=2,
                         load=load, min_time=0.05)
    assert np.all(prof.forward > 0) and np.all(prof.backward >= 0)
    if load == "forwards":
        assert len(forwards) > 2 and not retained
    else:  # one graph per size, and backwards through it again and again
        assert len(forwards) == 2 and len(retained) > 2 and all(retained)
    assert all(p.grad is None for p in model.parameters())


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_a_run_of_units_as_one_graph_computes_what_the_units_do(data):
    """Whatever run of consecutive units, the graph fusing them takes the values the run reads
    from before it and returns, from the same weights, the values the units would pass on
    (here a GPT: skip connections, and a weight tied between its first and last unit)."""
    torch.manual_seed(0)
    model, idx = GPT(layers=2).double(), torch.randint(0, 128, (2, 6))
    _, graph, table = _per_unit(model, idx)
    k = len(table.stages)
    start = data.draw(st.integers(0, k - 1))
    run = range(start, data.draw(st.integers(start + 1, k)))
    modules = [graph.get_submodule(f"stage{io.stage}").module for io in table.stages]
    values = dict(zip(table.graph_inputs, [idx]))
    for io, module in zip(table.stages, modules):
        values.update(zip(io.outputs, module(*[values[v] for v in io.inputs])))
    fused = profile_module._fused(table, modules[run.start:run.stop], run)
    later = {*table.graph_outputs, *(v for io in table.stages[run.stop:] for v in io.inputs)}
    made = [v for io in table.stages[run.start:run.stop] for v in io.outputs]
    assert fused.passes == [v for v in made if v in later]
    assert not set(fused.reads) & set(made)  # it reads only what comes from before it
    outputs = fused.module(*[values[v] for v in fused.reads])
    for name, out in zip(fused.passes, outputs):
        torch.testing.assert_close(out, values[name], msg=name)


@given(st.lists(st.floats(0.0, 1e-2), min_size=1, max_size=10), st.data())
def test_the_units_forwards_are_scaled_to_their_run_as_one_graph(forward, data):
    """Each run's units add up to the run's time as one graph and keep their proportions; a
    run timed at nothing unit by unit is left as it is."""
    cuts = sorted(data.draw(st.sets(st.integers(1, len(forward) - 1),
                                    max_size=len(forward) - 1))) if len(forward) > 1 else []
    runs = [range(a, b) for a, b in zip([0, *cuts], [*cuts, len(forward)])]
    fused = [(run, data.draw(st.floats(0.0, 1e-2))) for run in runs]
    scaled = profile_module._as_fused(forward, fused)
    for run, seconds in fused:
        timed = sum(forward[i] for i in run)
        if timed == 0:
            assert all(scaled[i] == 0 for i in run)
            continue
        assert sum(scaled[i] for i in run) == pytest.approx(seconds, rel=1e-9, abs=1e-15)
        for i in run:
            assert scaled[i] == pytest.approx(forward[i] / timed * seconds, rel=1e-9)


def _timing_beside(graph, table, x, cores: int, known: bool = True, threads: int = 1,
                   concurrency: int = 3, cache=None) -> tuple[list[int], list[bool]]:
    """Profile on `cores` cores with `concurrency` stage threads: how many background workers
    each timing had, and whether its timer left the waits for a core out."""
    workers: list[int] = []
    waits_out: list[bool] = []
    enter, timer = profile_module._Load.__enter__, profile_module._timer

    def noting_the_load(load):
        workers.append(load.workers)
        return enter(load)

    def noting_the_timer(device, core_waits_out=False):
        waits_out.append(core_waits_out)
        return timer(device, core_waits_out)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_module, "usable_cores", lambda: cores)
        patch.setattr(profile_module, "_core_waits_known", lambda: known)
        patch.setattr(profile_module._Load, "__enter__", noting_the_load)
        patch.setattr(profile_module, "_timer", noting_the_timer)
        profile_units(graph, table, [x], [2], warmup=0, repeats=1, concurrency=concurrency,
                      threads=threads, cache=cache)
    # the crossed load's two timings (then the memory pass, which times nothing that counts)
    return workers[:2], waits_out[:2]


@pytest.mark.parametrize("cores", [1, 2, 3, 4])
def test_stage_threads_beyond_the_cores_are_timed_beside_every_other_without_core_waits(
        three_units, cores):
    """3 stage threads: on fewer cores the units are timed beside the 2 others, less the
    timing thread's waits for a core, which the simulator's split of the cores stands for;
    on enough cores beside the 2 others as they are."""
    workers, waits_out = _timing_beside(*three_units, cores=cores)
    assert workers == [2, 2]
    assert waits_out == [cores < 3] * 2


@pytest.mark.parametrize("known, threads", [(False, 1), (True, 2)])
def test_where_core_waits_cannot_be_left_out_the_units_are_timed_beside_a_stage_per_core(
        three_units, known, threads):
    """No schedstat, or intra-op threads whose waits the timing thread's leave out: 3 stage
    threads on 2 cores are timed beside one busy stage, with their waits in."""
    workers, waits_out = _timing_beside(*three_units, cores=2, known=known, threads=threads)
    assert workers == [1, 1] and waits_out == [False, False]


def test_the_waits_left_out_are_part_of_the_cached_timings_key(three_units, tmp_path):
    cache = profile_module.ProfileCache(tmp_path)
    for cores in (4, 1):  # the same 3 stage threads: waits for a core left in, then out
        _timing_beside(*three_units, cores=cores, concurrency=3, cache=cache)
    assert len(list(tmp_path.glob("*.json"))) == 2


@settings(deadline=None, max_examples=10)
@given(waited=st.floats(0.0, 0.02))
def test_a_timing_without_core_waits_is_the_wall_clock_less_the_wait(waited):
    readings = iter([7.0, 7.0 + waited])  # the thread's time waiting for a core, before/after
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_module, "_core_wait", lambda: next(readings))
        timer = profile_module._timer(torch.device("cpu"), core_waits_out=True)
        start = time.perf_counter()
        _, seconds = timer(time.sleep, 0.01)
        wall = time.perf_counter() - start
    assert max(0.01 - waited, 0.0) <= seconds + 1e-9
    assert seconds <= max(wall - waited, 0.0) + 1e-9


def test_a_plain_timing_reads_no_core_waits():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_module, "_core_wait", lambda: pytest.fail("read a core wait"))
        _, seconds = profile_module._timer(torch.device("cpu"))(time.sleep, 0.001)
    assert seconds >= 0.001


@given(ran=st.integers(0, 10**15), waited=st.integers(0, 10**15), slices=st.integers(0, 10**6))
def test_schedstat_is_read_as_time_on_a_core_then_time_waiting_for_one(ran, waited, slices):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_module, "open", lambda *args: StringIO(f"{ran} {waited} "
                                                                        f"{slices}\n"),
                      raising=False)
        assert profile_module._schedstat() == (ran / 1e9, waited / 1e9)
        assert profile_module._core_wait() == waited / 1e9
        assert profile_module._core_waits_known() == (ran > 0)


@pytest.mark.parametrize("text", ["", "12\n", "a b c\n"])
def test_unreadable_schedstat_counts_no_waits(text):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_module, "open", lambda *args: StringIO(text), raising=False)
        assert profile_module._schedstat() is None
        assert profile_module._core_wait() == 0.0 and not profile_module._core_waits_known()


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux only")
def test_this_kernel_counts_the_threads_waits_for_a_core():
    first = profile_module._core_wait()
    sum(range(10**6))
    assert profile_module._core_waits_known() and 0.0 <= first <= profile_module._core_wait()


def _unit_runs(monkeypatch, run) -> None:
    """Stand in `run()` for a run of the units wherever thread_capacity runs them."""
    monkeypatch.setattr(capacity_module, "run_as_a_stage", lambda *args: run())


@pytest.mark.timeout(60)
def test_threads_that_wait_on_nothing_shared_get_through_as_many_times_the_work(
        three_units, monkeypatch):
    """Runs that sleep (holding no core and no lock) overlap fully: k threads get through k
    times the work of one, whatever the machine's cores."""
    graph, table, x = three_units
    _unit_runs(monkeypatch, lambda: time.sleep(0.004))
    capacity = capacity_module.thread_capacity(graph, table, [x], 4, (2, 4), window=0.1)
    assert capacity[1] == 1.0 and sorted(capacity) == [1, 2, 4]
    assert 1.7 <= capacity[2] <= 2.3 and 3.2 <= capacity[4] <= 4.6


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:  # Python bytecode: holds the interpreter lock throughout
        pass


@pytest.mark.timeout(60)
def test_threads_that_hold_the_interpreter_lock_get_through_no_more_than_one(
        three_units, monkeypatch):
    """Runs of pure Python take turns on Python's interpreter lock: more threads of them get
    through about one thread's work, not more, however many cores there are."""
    graph, table, x = three_units
    _unit_runs(monkeypatch, lambda: _spin(0.002))
    capacity = capacity_module.thread_capacity(graph, table, [x], 4, (3,), window=0.1)
    assert 0.5 <= capacity[3] <= 1.3


def test_thread_capacity_of_the_units_leaves_no_trace():
    """Gradients, buffers (a batch norm's running statistics) and the random number generator
    (dropout draws from it) are as they were."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model.train()
    x = torch.randn(16, 8)
    _, graph, table = _per_unit(model, x)
    before = {k: v.clone() for k, v in graph.state_dict().items()}
    generator = torch.get_rng_state()
    capacity = capacity_module.thread_capacity(graph, table, [x], 4, (2,), window=0.02)
    assert capacity[1] == 1.0 and capacity[2] > 0
    assert torch.equal(torch.get_rng_state(), generator)
    assert all(p.grad is None for p in graph.parameters())
    for key, value in graph.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_an_interrupted_thread_capacity_leaves_no_thread_running(three_units, monkeypatch):
    graph, table, x = three_units
    _unit_runs(monkeypatch, lambda: _spin(0.001))
    running = set(threading.enumerate())

    def interrupted(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(capacity_module.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        capacity_module.thread_capacity(graph, table, [x], 4, (3,), window=0.02)
    assert set(threading.enumerate()) == running


def test_a_failing_run_on_a_thread_fails_the_thread_capacity(three_units, monkeypatch):
    graph, table, x = three_units
    calls = []

    def run():  # the warm-up runs on this thread succeed, then a worker's fails
        calls.append(1)
        if len(calls) > 2:
            raise ValueError("boom")

    _unit_runs(monkeypatch, run)
    with pytest.raises(RuntimeError, match=r"units on 1 thread at once, on the same modules, "
                       r"failed .*Plan\(costs='none'\)") as raised:
        capacity_module.thread_capacity(graph, table, [x], 4, (2,), window=0.02)
    assert isinstance(raised.value.__cause__, ValueError)


def test_thread_capacity_needs_real_units_and_counts_of_threads(three_units):
    graph, table, x = three_units
    with pytest.raises(ValueError, match="at least 1"):
        capacity_module.thread_capacity(graph, table, [x], 4, (0,))
    with pytest.raises(ValueError, match="meta device"):
        capacity_module.thread_capacity(copy.deepcopy(graph).to("meta"), table, [x], 4, (2,))


@given(duration=st.floats(1e-4, 1.0), offset=st.floats(0.0, 1.0), window=st.floats(1e-3, 5.0))
def test_runs_back_to_back_count_as_the_window_over_their_duration(duration, offset, window):
    """Runs of `duration` one after another, from before a window to after it: the window
    holds window / duration of them, whatever their phase against its ends."""
    start = -duration * (1 + offset)
    count = int((window - start) / duration) + 2
    spans = [(start + i * duration, start + (i + 1) * duration) for i in range(count)]
    assert capacity_module._runs_inside(spans, 0.0, window) == pytest.approx(window / duration,
                                                                           rel=1e-6)


@pytest.mark.parametrize("stages", [(), (range(0, 1), range(1, 3)), (range(0, 2), range(2, 3))])
def test_each_stage_given_is_timed_as_a_run_of_its_own(monkeypatch, stages):
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 8)
    _, graph, table = _per_unit(model, x)
    fused, runs = profile_module._fused, []

    def recorded(table, modules, run):  # each run's units as one graph, once per run
        runs.append(run)
        return fused(table, modules, run)

    monkeypatch.setattr(profile_module, "_fused", recorded)
    profile = profile_units(graph, table, [x], [4], warmup=0, repeats=1, stages=stages)
    assert runs == (list(stages) or [range(3)])
    assert profile.forward.shape == profile.backward.shape == (1, 3)
    assert np.all(profile.forward > 0) and np.all(profile.backward > 0)


@pytest.mark.parametrize("stages", [(range(0, 2),), (range(1, 3),), (range(0, 2), range(1, 3)),
                                    (range(0, 3), range(3, 3)), (range(0, 3, 2), range(1, 2))])
def test_stages_that_do_not_cover_the_units_in_order_are_refused(stages):
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 8)
    _, graph, table = _per_unit(model, x)
    with pytest.raises(ValueError, match="do not cover the 3 units in order"):
        profile_units(graph, table, [x], [4], warmup=0, repeats=1, stages=stages)
