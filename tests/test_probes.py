"""The probes' shared compute burst."""

import torch

from fxpipe.probes import ComputeBurst


def test_a_burst_times_itself_and_runs_its_backward_only_when_asked():
    forward_only = ComputeBurst(size=16, depth=2)
    assert forward_only() > 0
    assert forward_only.w.grad is None
    with_backward = ComputeBurst(size=16, depth=2, backward=True)
    with torch.no_grad():  # the burst decides for itself whether to build a graph
        assert with_backward() > 0
    assert with_backward.w.grad is not None and with_backward.w.grad.abs().sum() > 0
