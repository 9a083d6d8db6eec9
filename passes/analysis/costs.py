"""From measured unit costs and a link model to the CostTable every planner reads."""

from __future__ import annotations

from collections.abc import Sequence

from fxpipe.cost import CostTable, Link
from fxpipe.passes.analysis.profile import UnitProfile

__all__ = ["cost_table"]


def cost_table(profile: UnitProfile, link: Link, batch: int, names: Sequence[str]) -> CostTable:
    """Per-unit f, b and a stage's backward call cost from the profile; cf, cb from the bytes
    crossing each cut over `link`. The loss, where timed, counts in the last unit: the last
    stage runs it, whatever the partition."""
    f, b = profile.forward.copy(), profile.backward.copy()
    f[:, -1] += profile.loss_forward
    b[:, -1] += profile.loss_backward
    return CostTable(
        f=f,
        b=b,
        cf=link.time(profile.boundary_bytes),
        cb=link.time(profile.boundary_grad_bytes),
        sizes=profile.sizes,
        batch=batch,
        params=profile.params,
        names=tuple(names),
        param_bytes=profile.param_bytes,
        activation_bytes=profile.activation_bytes,
        peak_bytes=profile.peak_bytes,
        backward_call=profile.backward_call,
    )
