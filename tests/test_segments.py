"""A recomputing stage's segments: the cuts minimise what they cost, the planners' table holds
every range's, the memory model counts them, and the compiled stages run them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from segment_chains import chains
from torch import nn

import fxpipe
from fxpipe.cost import stage_bytes
from fxpipe.memory import StageBytes, in_flight, peak_of, stage_terms
from fxpipe.schedules import build
from fxpipe.segments import (
    bound_grid,
    checkpointed,
    kept_by_cuts,
    kept_by_lifetimes,
    kept_bytes,
    objective,
    recompute_segments,
    segment_table,
    segmentation,
    sent_by_lifetimes,
)
from fxpipe.unit_chain import UnitChain


@settings(max_examples=60, deadline=None)
@given(chains())
def test_the_cuts_cost_the_least_of_every_set_of_cuts(chain):
    out, sent, saved, start, end = chain
    found = segmentation(out, saved, start, end, sent)
    inner = range(start + 1, end)
    least = min(objective(out, saved, start, end, cuts, sent) for n in range(len(inner) + 1)
                for cuts in itertools.combinations(inner, n))
    assert objective(out, saved, start, end, found.cuts, sent) == pytest.approx(
        least, rel=1e-12, abs=1e-9)
    assert all(start < c < end for c in found.cuts) and list(found.cuts) == sorted(found.cuts)
    # what it reports is what its cuts keep and the largest of their segments saves
    edges = [start, *found.cuts, end]
    assert found.kept == pytest.approx(kept_bytes(out, sent, start, end, found.cuts),
                                       rel=1e-12, abs=1e-9)
    assert found.largest == pytest.approx(max(saved[a:b].sum() for a, b in zip(edges, edges[1:])),
                                          rel=1e-12)


@settings(max_examples=15, deadline=None)
@given(chains(most=8))
def test_the_table_holds_every_ranges_segmentation(chain):
    out, sent, saved, _, _ = chain
    table_kept, table_largest = segment_table(out, saved, sent)
    for a in range(len(saved)):
        for e in range(a + 1, len(saved) + 1):
            found = segmentation(out, saved, a, e, sent)
            assert (table_kept[a, e], table_largest[a, e]) == (found.kept, found.largest)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6).flatmap(lambda k: st.lists(st.tuples(
    st.integers(0, k - 1), st.integers(0, k - 1), st.integers(1, 100)), max_size=8).map(
    lambda values: (k, values))), st.data())
def test_a_value_is_kept_once_unless_the_stage_sends_it(case, data):
    """kept_by_lifetimes and sent_by_lifetimes: the cuts of a stage [a, e) keep the values
    made in it that cross any of them, each once (a checkpoint holds a tensor once however
    many segments read it), except those read after the stage (its outputs, held anyway)."""
    units, values = case
    values = [(m, r, n) for m, r, n in values if m < r]
    lifetimes = np.zeros((units, units))
    for m, r, n in values:
        lifetimes[m, r] += n
    out, sent = kept_by_lifetimes(lifetimes), sent_by_lifetimes(lifetimes)
    start = data.draw(st.integers(0, units - 1))
    end = data.draw(st.integers(start + 1, units))
    cuts = tuple(sorted(data.draw(st.sets(st.integers(start + 1, max(end - 1, start + 1))))
                        - {start, end}))
    kept = kept_bytes(out, sent, start, end, cuts)
    assert kept == sum(n for m, r, n in values if start <= m and r < end
                       and any(m < c <= r for c in cuts))


def test_the_bounds_are_powers_of_one_ratio_shared_by_every_range():
    saved = np.array([3.0, 0.0, 100.0, 7.0])
    grid = bound_grid(saved)
    assert grid[0] == 0.0 and grid[1] <= 3.0 and grid[-1] >= saved.sum()
    assert np.allclose(grid[2:] / grid[1:-1], grid[2] / grid[1])
    assert set(bound_grid(saved[2:])) <= set(grid)  # a range's bounds are the chain's


def test_a_segment_keeps_what_crosses_its_cuts_instead_of_saving_its_activations():
    """Narrow cuts between wide units: cutting everywhere keeps little and recomputes one
    unit at a time; a wide value between two units is not cut at."""
    found = segmentation(kept_by_cuts(np.array([1.0, 1.0, 1.0])), np.full(4, 100.0))
    assert found.cuts == (1, 2, 3) and found.largest == 100.0
    found = segmentation(kept_by_cuts(np.array([1.0, 500.0, 1.0])), np.full(4, 100.0))
    assert found.cuts == (1, 3) and (found.kept, found.largest) == (2.0, 200.0)


def test_each_cut_begins_a_checkpoint_which_keeps_its_own_bytes():
    out = checkpointed(kept_by_cuts(np.array([1.0, 2.0])), 10.0)
    assert out[0, 1] == 11.0 and out[1, 2] == 12.0 and out[0, 2] == 12.0
    assert out[0, 3] == 0.0 and out[1, 1] == 0.0  # the chain's end and empty ranges: no cut


def test_bad_ranges_and_shapes_are_refused():
    with pytest.raises(ValueError, match="one row and column per cut"):
        segmentation(np.zeros((3, 3)), np.zeros(3))
    with pytest.raises(ValueError, match="not a range"):
        segmentation(np.zeros((4, 4)), np.zeros(3), 2, 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_recomputing_stage_keeps_its_cuts_per_micro_batch_and_one_segment_in_backward(
        schedule):
    q = StageBytes(saved=100.0, workspace=5.0, kept=7.0, segment=30.0)
    actions = build(schedule, 1, 3).actions[0]
    peak = peak_of(stage_terms(actions, recompute=True), q)
    held = in_flight(schedule, 1, 3)[0]  # gpipe: 3, 1f1b: 1
    assert (peak.activations, peak.workspace) == (held * 7.0, 5.0 + 30.0)
    assert peak_of(stage_terms(actions), q).activations == held * 100.0


class Blocks(nn.Module):
    """Blocks wide inside (8 -> 48 -> 8), so the cuts fall between blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(m for _ in range(3) for m in (
            nn.Linear(8, 48), nn.Tanh(), nn.Linear(48, 8))), nn.Linear(8, 3))

    def forward(self, x):
        return self.blocks(x)


def test_the_compiled_stages_run_the_segments_the_memory_model_counts():
    model = Blocks().double()
    x, y = torch.randn(128, 8, dtype=torch.float64), torch.randint(0, 3, (128,))
    plan = fxpipe.Plan(stages=2, partitioner=[7, 3], micro_batches=2, recompute=True,
                       loss_fn=F.cross_entropy)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), cache=False)
    p = pipe.partition.micro_batches
    # a checkpoint keeps the CPU generator's state (preserve_rng_state) besides its inputs
    assert pipe.cost.checkpoint_bytes == torch.get_rng_state().nbytes
    for s, (a, e) in enumerate(zip((0, *pipe.partition.bounds[:-1]), pipe.partition.bounds)):
        chain = recompute_segments(pipe.cost, p, a, e)
        segments = UnitChain(pipe.graph.get_submodule(f"stage{s}").module).segments
        assert [seg.units[0] for seg in segments] == [a, *chain.cuts]
        q = stage_bytes(pipe.cost, p, pipe.partition.bounds, s, recompute=True)
        assert (q.kept, q.segment) == (chain.kept, chain.largest)
    assert len(UnitChain(pipe.graph.get_submodule("stage0").module).segments) > 1
    plain = Blocks().double()
    plain.load_state_dict(model.state_dict())
    loss = pipe.step(x, y)
    expected = F.cross_entropy(plain(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    grads = dict(pipe.named_parameters())
    for name, w in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad, w.grad, rtol=1e-10, atol=1e-12)
