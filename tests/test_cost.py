"""CostTable interpolation, links, and the memory estimate."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxpipe.cost import CostTable, Link, Partition
from fxpipe.cost_fit import fit_to_flops
from fxpipe.passes.analysis.comm import default_link


def test_interpolates_in_micro_batch_size_not_proportionally():
    # times at micro-batch sizes 2 and 8 for one unit; batch 8 -> p=1 is size 8, p=2 size 4
    cost = CostTable.from_arrays([[1.0], [2.0]], [[3.0], [5.0]], sizes=[2, 8], batch=8)
    f, b, _, _ = cost.at(2)
    assert f[0] == pytest.approx(1.0 + (4 - 2) / 6)
    assert b[0] == pytest.approx(3.0 + 2 * (4 - 2) / 6)
    assert cost.at(4)[0][0] == pytest.approx(1.0)  # size 2, measured
    assert cost.at(1)[0][0] == pytest.approx(2.0)  # size 8, measured


@given(st.lists(st.floats(0.01, 5.0), min_size=2, max_size=4, unique=True))
def test_rows_are_reproduced_at_measured_sizes(times):
    sizes = [2 ** i for i in range(len(times))]
    batch = sizes[-1]
    cost = CostTable.from_arrays(np.array(times)[:, None], np.array(times)[:, None],
                                 sizes=sizes, batch=batch)
    for time_, size in zip(times, sizes):
        assert cost.at(batch // size)[0][0] == pytest.approx(time_)


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="finite non-negative"):
        CostTable.from_arrays([-1.0], [1.0])
    with pytest.raises(ValueError, match="ascending micro-batch sizes"):
        CostTable.from_arrays([[1.0], [2.0]], [[1.0], [2.0]], sizes=[4, 2], batch=4)


def test_link_time_and_defaults():
    link = Link(1e-3, 1e6)
    np.testing.assert_allclose(link.time([0, 1e6]), [0.0, 1.0 + 1e-3])
    assert default_link("cpu", "cpu").time(1e9) == 0.0  # one process: references, no copy
    assert default_link("cpu", "cpu", distributed=True).time(2e9) == pytest.approx(1 + 50e-6)
    assert math.isfinite(default_link("cuda:0", "cuda:1").bandwidth)


def test_a_link_says_what_a_message_costs():
    assert str(Link(0.0, math.inf)) == "free (same memory, no copy; configured)"
    assert str(Link(2e-5, 1e10, per_message=5e-6, source="measured")) == (
        "20 us + bytes / 10.0 GB/s, 5 us to send each tensor (measured)")
    assert str(Link(3e-6, math.inf, source="plan")) == "3 us per message, no copy (plan)"


def test_memory_estimate_counts_weights_state_and_in_flight_activations():
    cost = CostTable.from_arrays([1.0, 1.0], [1.0, 1.0], params=[10, 20],
                                 param_bytes=[40, 80], activation_bytes=[100, 1000])
    gpipe = Partition.evaluate(cost, [1, 2], p=4, schedule="gpipe")
    one_f_one_b = Partition.evaluate(cost, [1, 2], p=4, schedule="1f1b")
    # + the workspace: over several micro-batches the largest unit's new gradient is held
    # beside .grad until added to it
    assert [s.memory for s in gpipe.stages] == [40 * 5 + 4 * 100, 80 * 5 + 4 * 1000]
    assert [s.memory for s in one_f_one_b.stages] == [40 * 5 + 2 * 100, 80 * 5 + 1 * 1000]


def test_fit_link_recovers_latency_and_bandwidth():
    from fxpipe.passes.analysis.comm import fit_link

    sizes = [1e3, 1e5, 1e6, 4e6]
    link = fit_link(sizes, [20e-6 + s / 3e9 for s in sizes], "synthetic")
    assert link.latency == pytest.approx(20e-6, rel=1e-6)
    assert link.bandwidth == pytest.approx(3e9, rel=1e-6)


@pytest.mark.parametrize("link, source", [(None, "default"), ("measure", "measured"),
                                          ((0.0, 1e9), "plan")])
def test_the_link_between_cpu_stage_threads_of_one_process_is_free_unless_given(link, source):
    """A value goes from one stage thread to another by reference: no copy, no ping-pong."""
    import torch

    import fxpipe
    from fxpipe.models import MLP

    pipe = fxpipe.compile(MLP(), fxpipe.Plan(stages=2, link=link, costs="none"),
                          example_inputs=(torch.randn(2, 32),))
    assert pipe.link.source.startswith(source) and pipe.link.per_message == 0
    assert pipe.link.time(1e9) == (1.0 if link == (0.0, 1e9) else 0.0)


@given(st.lists(st.tuples(st.floats(1e-9, 1e-6), st.floats(0, 1e-3), st.integers(0, 3)),
                min_size=1, max_size=5),
       st.sampled_from([[4, 16], [2, 8, 32], [1, 32]]))
def test_a_flop_fit_recovers_affine_times_at_every_micro_batch_size(units, measured):
    """Units whose time is exactly α·FLOPs(m) + β (FLOPs ∝ m^k, k = 0 for free units): the
    fitted table gives that time at sizes never measured, where interpolation would not."""
    alpha = np.array([a for a, _, _ in units])
    beta = np.array([b for _, b, _ in units])
    power = np.array([k for _, _, k in units])

    def flops(m):
        return np.where(power > 0, 1e6 * float(m) ** power, 0.0)

    sizes = np.array(measured, dtype=float)
    times = np.array([alpha * flops(m) + beta for m in sizes])
    cost = CostTable.from_arrays(times, times / 2, sizes=sizes, batch=32)
    fitted = fit_to_flops(cost, flops)
    for p in (1, 3, 5, 32):
        m = 32 / p  # the mean micro-batch size, where at(p) evaluates
        f, b, _, _ = fitted.at(p)
        want = alpha * flops(m) + beta
        np.testing.assert_allclose(f, want, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(b, want / 2, rtol=1e-6, atol=1e-12)
    if np.any(power >= 2):  # where interpolating the measured rows would be wrong
        between = 32 / 3
        assert not np.allclose(cost.at(3)[0], alpha * flops(between) + beta, rtol=1e-3)


@given(st.lists(st.tuples(st.floats(1e-9, 1e-6), st.floats(0, 1e-3), st.integers(0, 3)),
                min_size=1, max_size=4),
       st.tuples(st.floats(1e-7, 1e-4), st.floats(0, 1e-3)),
       st.sampled_from([[4, 16], [2, 8, 32], [1, 32]]))
def test_a_flop_fit_fits_the_loss_in_the_last_unit_by_its_rows(units, loss, measured):
    """The last unit's times hold the loss's, which grows as α·m + β with the micro-batch's
    rows whatever that unit's FLOPs do (none, for a reshape): the fit gives both at every
    size, the forward and the backward."""
    alpha = np.array([a for a, _, _ in units])
    beta = np.array([b for _, b, _ in units])
    power = np.array([k for _, _, k in units])

    def flops(m):
        return np.where(power > 0, 1e6 * float(m) ** power, 0.0)

    def loss_at(m):
        return loss[0] * m + loss[1]

    sizes = np.array(measured, dtype=float)
    units_only = np.array([alpha * flops(m) + beta for m in sizes])
    times = units_only.copy()
    times[:, -1] += [loss_at(m) for m in sizes]
    cost = CostTable.from_arrays(times, 2 * times, sizes=sizes, batch=32)
    losses = np.array([loss_at(m) for m in sizes])
    fitted = fit_to_flops(cost, flops, loss=(losses, 2 * losses))
    for p in (1, 3, 5, 32):
        m = 32 / p
        want = alpha * flops(m) + beta
        want[-1] += loss_at(m)
        f, b, _, _ = fitted.at(p)
        np.testing.assert_allclose(f, want, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(b, 2 * want, rtol=1e-6, atol=1e-12)


def test_a_flop_fit_needs_the_mini_batch_size():
    cost = CostTable.from_arrays([[1.0], [2.0]], [[1.0], [2.0]], sizes=[1, 2])
    with pytest.raises(ValueError, match=r"needs CostTable\.batch"):
        fit_to_flops(cost, lambda m: np.array([float(m)]))


def test_a_send_costs_its_sender_the_links_time_per_tensor_it_holds():
    """Two values cross from stage 0 to 1, one of them integer token ids: each forward send
    holds two tensors, each backward send one (the ids carry no gradient)."""
    import torch
    from torch import nn

    import fxpipe
    from fxpipe.schedules import ActionKind

    class TwoValues(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

        def forward(self, ids):
            hidden = self.embed(ids)
            return self.head(hidden) + ids.unsqueeze(-1).float()

    plan = fxpipe.Plan(stages=2, partitioner=[1, 1], costs="none", link=(0.0, 1e12, 1e-3))
    pipe = fxpipe.compile(TwoValues(), plan, example_inputs=(torch.randint(0, 16, (4, 3)),))
    assert len(pipe.comm.edges) == 2 and pipe.link.per_message == 1e-3
    sends = {e.action.kind: e.duration for e in pipe.predicted_timeline().events
             if e.action.kind.is_send}
    assert sends[ActionKind.SEND_F] == pytest.approx(2e-3)
    assert sends[ActionKind.SEND_B] == pytest.approx(1e-3)
