"""Profile pass: per-unit times and bytes, cached, leaving the model untouched."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.models import GPT, MLP, VGG
from fxpipe.passes.analysis import profile as profile_module
from fxpipe.passes.analysis import profile_cache
from fxpipe.passes.analysis.comm import default_link
from fxpipe.passes.analysis.costs import cost_table
from fxpipe.passes.analysis.profile import model_outputs, profile_units, time_loss
from fxpipe.passes.rewrite.stages import split_stages
from fxpipe.units import unit_parameters


def _per_unit(model, x):
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=1, costs="none"), example_inputs=(x,))
    k = len(pipe.units)
    graph, table = split_stages(pipe.traced.gm, pipe.units, range(1, k + 1), ["cpu"] * k)
    return pipe, graph, table


@pytest.fixture
def steady_timer(monkeypatch):
    """A timer that charges every call 1 ms, whatever the machine does: a re-time always
    agrees with what was cached on it."""
    def timer(device):
        def timed(fn, *args, **kwargs):
            return fn(*args, **kwargs), 1e-3
        return timed

    monkeypatch.setattr(profile_module, "_timer", timer)


def turn_timer(monkeypatch):
    """Time every call the seconds of its turn: 1, 2, 3..."""
    turns = iter(range(1, 1000))

    def timer(device):
        def timed(fn, *args, **kwargs):
            return fn(*args, **kwargs), float(next(turns))
        return timed

    monkeypatch.setattr(profile_module, "_timer", timer)


def test_second_compile_reads_the_cache_after_a_short_re_time(tmp_path, monkeypatch,
                                                               steady_timer):
    model, x = MLP(), torch.randn(8, 32)
    plan = fxpipe.Plan(stages=2, micro_batches=2)
    first = fxpipe.compile(model, plan, example_inputs=(x,), cache=tmp_path)
    measure, measured = profile_module._measure, []
    monkeypatch.setattr(profile_module, "_measure",
                        lambda *args: measured.append(args[4:7]) or measure(*args))
    second = fxpipe.compile(model, plan, example_inputs=(x,), cache=tmp_path)
    (path,) = tmp_path.glob("*.json")
    assert measured == [(1, 3, 0.0)]  # a warm-up and 3 repetitions, not a whole profile
    assert first.cost.source.startswith(f"measured now on cpu, cached at {path}")
    assert second.cost.source.startswith(f"from cache {path} (key: cpu on ")
    np.testing.assert_array_equal(first.cost.f, second.cost.f)
    np.testing.assert_array_equal(first.cost.b, second.cost.b)
    np.testing.assert_array_equal(first.cost.activation_bytes, second.cost.activation_bytes)


@pytest.mark.parametrize("scale", [0.1, 0.5, 1.0, 2.0, 2.9, 3.1, 10.0])
def test_a_cache_entry_a_re_time_disagrees_with_is_measured_again(tmp_path, steady_timer,
                                                                    scale):
    """A cache entry whose times are `scale` times what the units take now (on a timer that
    charges every call 1 ms) is kept within STALE times either way, and otherwise measured
    afresh, the cache file overwritten, and the summary says why."""
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 8)
    _, graph, table = _per_unit(model, x)
    cache = profile_cache.ProfileCache(tmp_path)
    fresh = profile_units(graph, table, [x], [2, 8], cache=cache)
    (path,) = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    for times in ("forward", "backward"):
        entry[times] = (np.array(entry[times]) * scale).tolist()
    path.write_text(json.dumps(entry))
    again = profile_units(graph, table, [x], [2, 8], cache=cache)
    kept = 1 / profile_cache.STALE <= scale <= profile_cache.STALE
    assert (again.cached == path) == kept
    np.testing.assert_allclose(again.forward, fresh.forward * (scale if kept else 1))
    if kept:
        assert again.origin.startswith(f"from cache {path} (key: ")
        assert f"its times {scale:.2f}x a re-time's" in again.origin
    else:
        assert again.origin.startswith(f"measured now on cpu, cached at {path}; the cache's "
                                       f"entry had times {scale:.2g}x a re-time's")
        np.testing.assert_allclose(json.loads(path.read_text())["forward"], fresh.forward)


_SPLITS = {}


def _key(threads: int, dtype: torch.dtype, batch: int, training: bool, version: str) -> str:
    """The cache key of a small model's profile in `dtype`, on `batch` samples, in training
    or eval mode, with `threads` intra-op threads under torch `version` (the split made once
    per dtype)."""
    if dtype not in _SPLITS:
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 4)).to(dtype)
        _SPLITS[dtype] = _per_unit(model, torch.randn(2, 8, dtype=dtype))[1]
    graph = _SPLITS[dtype].train(training)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "get_num_threads", lambda: threads)
        patch.setattr(torch, "__version__", version)
        key, _ = profile_cache.cache_key(graph, [torch.randn(batch, 8, dtype=dtype)],
                                           (batch,), "cpu", 1, 5, 0.05, (), None)
    return key


_CONDITIONS = st.tuples(st.integers(1, 3), st.sampled_from([torch.float32, torch.float64]),
                        st.sampled_from([2, 4, 8]), st.booleans(),
                        st.sampled_from(["2.13.0", "2.14.0"]))


@settings(max_examples=30)
@given(_CONDITIONS, _CONDITIONS)
def test_the_cache_key_changes_with_threads_dtype_batch_mode_and_torch(a, b):
    """Two profiles share a cache entry exactly when their thread count, dtype, batch,
    train/eval mode and torch version agree (everything else the same)."""
    assert _key(*a) == _key(*a)
    assert (_key(*a) == _key(*b)) == (a == b)


def test_another_batch_size_or_thread_count_is_timed_afresh(tmp_path, monkeypatch):
    model = VGG()
    fxpipe.compile(model, fxpipe.Plan(stages=2), example_inputs=(torch.randn(8, 3, 32, 32),),
                   cache=tmp_path)
    fxpipe.compile(model, fxpipe.Plan(stages=2), example_inputs=(torch.randn(4, 3, 32, 32),),
                   cache=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another thread setting
    fxpipe.compile(model, fxpipe.Plan(stages=2), example_inputs=(torch.randn(4, 3, 32, 32),),
                   cache=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_profile_shapes_and_bytes():
    model, x = VGG(), torch.randn(8, 3, 32, 32)
    pipe, graph, table = _per_unit(model, x)
    profile = profile_units(graph, table, [x], [2, 4, 8], warmup=1, repeats=2, min_time=0)
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
    # by lifetime: a value made by unit m and read last by unit r crosses the cuts m..r-1
    crosses = [[profile.lifetime_bytes[:, m, r] for m in range(c + 1) for r in range(c + 1, k)]
               for c in range(k)]
    assert np.array_equal(profile.boundary_bytes, np.array(
        [np.sum(c, axis=0) if c else np.zeros(3) for c in crosses]).T)
    # what autograd keeps grows with the micro-batch: the first conv keeps its input at least
    assert np.all(profile.activation_bytes[:, 0] >= np.array([2, 4, 8]) * 3 * 32 * 32 * 4)
    assert np.all(np.diff(profile.activation_bytes.sum(axis=1)) > 0)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_unit_parameters_counted_from_the_graph_match_the_units_split(tracer):
    """Each unit's parameters are counted without splitting the graph; a tied weight counts
    once, in the first unit that reads it."""
    model, idx = GPT(layers=2), torch.randint(0, 128, (2, 16))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=1, costs="none", tracer=tracer),
                          example_inputs=(idx,))
    k = len(pipe.units)
    graph, _ = split_stages(pipe.traced.gm, pipe.units, range(1, k + 1), ["cpu"] * k)
    counts, nbytes = unit_parameters(pipe.traced.gm, pipe.units)
    seen: set = set()
    for i in range(k):  # each unit's module of the split, a tied weight in the first
        mine = [p for p in graph.get_submodule(f"stage{i}").module.parameters()
                if id(p) not in seen]
        seen |= {id(p) for p in mine}
        assert counts[i] == sum(p.numel() for p in mine)
        assert nbytes[i] == sum(p.nbytes for p in mine)
    assert counts.sum() == sum(p.numel() for p in model.parameters())


def test_integer_values_carry_no_gradient_bytes():
    model, idx = GPT(layers=1), torch.randint(0, 128, (4, 16))

    class Split(nn.Module):  # token ids cross the first cut as well as embeddings
        def __init__(self):
            super().__init__()
            self.gpt = model

        def forward(self, idx):
            return self.gpt(idx) + self.gpt.wte(idx).sum()

    _, graph, table = _per_unit(Split(), idx)
    profile = profile_units(graph, table, [idx], [4], warmup=0, repeats=1, min_time=0)
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


def test_the_loss_is_timed_on_the_models_outputs_and_counts_in_the_last_unit(monkeypatch):
    """On a timer that gives each call the seconds of its turn, 1, 2, 3...: the loss's
    forward and backward alternate, the first run at each size is dropped and the medians of
    the rest count, in the last unit."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.Sigmoid())
    x = torch.randn(8, 8)
    pipe, graph, table = _per_unit(model, x)
    profile = profile_units(graph, table, [x], [2, 4], warmup=0, repeats=1, min_time=0)
    seen = []

    def loss(outputs, size):  # binary cross-entropy takes the model's probabilities only
        (value,) = outputs.values()
        seen.append((tuple(value.shape), value.requires_grad, size))
        return F.binary_cross_entropy(value, torch.ones_like(value))

    turn_timer(monkeypatch)  # from here on: the compile above timed nothing on it
    outputs = model_outputs(pipe.traced.gm, [x], (), "cpu")
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    forward, backward = time_loss(outputs, [2, 4], loss, "cpu", repeats=2)
    assert torch.equal(torch.rand(3), expected)  # the random number generators as they were
    assert set(seen) == {((2, 4), True, 2), ((4, 4), True, 4)}  # the micro-batch's rows
    torch.testing.assert_close(outputs(2)[table.graph_outputs[0]], model(x[:2]))
    # size 2: turns 1-6, (1, 2) dropped, forwards 3 and 5, backwards 4 and 6; size 4: 7-12
    np.testing.assert_array_equal(forward, [4, 10])
    np.testing.assert_array_equal(backward, [5, 11])
    params = (np.zeros(4), np.zeros(4))
    cost = cost_table(profile, default_link("cpu", "cpu"), 8, ["a", "b", "c", "d"], params,
                      (forward, backward))
    np.testing.assert_allclose(cost.f[:, -1], profile.forward[:, -1] + forward)
    np.testing.assert_allclose(cost.b[:, -1], profile.backward[:, -1] + backward)
    np.testing.assert_allclose(cost.f[:, :-1], profile.forward[:, :-1])
    assert "with the loss timed" in cost.source


@pytest.mark.parametrize("window", [0.0, 300_000.0])
def test_a_meta_model_timed_in_several_runs_counts_the_saved_bytes_of_one_run(window):
    """Each run's storages are freed before the next, whose may take their addresses, and a
    value a unit saves may come from an earlier run: neither changes what each unit counts."""
    from fxpipe.compiler import PASSES
    from fxpipe.compiler.passes import _units_as_stages
    from fxpipe.compiler.state import Compilation, run_passes

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(layers=4)
    x = torch.randint(0, 128, (8, 32))
    c = Compilation(model, fxpipe.Plan(stages=1), (x,), {})
    run_passes(PASSES[:4], c)  # up to the units: the model's weights still on the meta device
    graph, table = _units_as_stages(c)
    whole, runs = (profile_units(graph, table, [x], [8], warmup=0, repeats=1, window=w)
                   for w in (float("inf"), window))
    assert whole.activation_bytes[0].sum() > 0
    np.testing.assert_array_equal(runs.activation_bytes, whole.activation_bytes)


def test_a_meta_models_loss_is_timed_on_stand_ins_of_its_outputs_shapes():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid())
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=1, costs="none"),
                          example_inputs=(torch.randn(6, 8),))
    outputs = model_outputs(pipe.traced.gm, [torch.randn(6, 8)], (), "cpu")
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    (value,) = outputs(3).values()
    assert torch.equal(torch.rand(3), expected)  # drawn from a generator of their own
    assert value.shape == (3, 8) and value.requires_grad and not value.is_meta
    assert (value >= 0).all() and (value < 1).all()  # a probability as much as a logit


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


def test_the_units_times_are_the_medians_of_the_timed_repetitions(monkeypatch):
    """On a timer that gives each call of a unit's module the seconds of its turn, 1, 2, 3...:
    the warm-up's are dropped and the median of the rest counts."""
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 8)
    _, graph, table = _per_unit(model, x)
    turn_timer(monkeypatch)
    profile = profile_units(graph, table, [x], [8], warmup=1, repeats=3, min_time=0)
    # per repetition: 3 forwards, then 3 backwards (the ReLU's too): 6 turns; the warm-up's
    # are turns 1-6, then units 0, 1, 2 forward at 7, 8, 9 and backward at 12, 11, 10, ...
    np.testing.assert_array_equal(profile.forward[0], [13, 14, 15])
    np.testing.assert_array_equal(profile.backward[0], [18, 17, 16])
