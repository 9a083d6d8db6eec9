"""From measured unit costs and a link model to the CostTable every planner reads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fxpipe.cost import CostTable, Link
from fxpipe.passes.analysis.profile_cache import UnitProfile

__all__ = ["cost_table"]


def cost_table(profile: UnitProfile, link: Link, batch: int, names: Sequence[str],
               params: tuple[np.ndarray, np.ndarray],
               loss: tuple[np.ndarray, np.ndarray] | None = None) -> CostTable:
    """Per-unit f and b from the profile; cf, cb from the bytes crossing each cut over `link`;
    `params`: each unit's parameter count and bytes. `loss`: its forward and backward seconds
    at the profile's sizes, which count in the last unit: the last stage runs it, whatever the
    partition."""
    f, b = profile.forward.copy(), profile.backward.copy()
    if loss is not None:
        f[:, -1] += loss[0]
        b[:, -1] += loss[1]
    source = profile.origin or f"measured on {profile.device}"
    return CostTable(
        f=f,
        b=b,
        cf=link.time(profile.boundary_bytes),
        cb=link.time(profile.boundary_grad_bytes),
        sizes=profile.sizes,
        batch=batch,
        params=params[0],
        names=tuple(names),
        param_bytes=params[1],
        activation_bytes=profile.activation_bytes,
        boundary_bytes=profile.boundary_bytes,
        boundary_grad_bytes=profile.boundary_grad_bytes,
        boundary_saved_bytes=profile.boundary_saved_bytes,
        inner_grad_bytes=profile.inner_grad_bytes,
        output_bytes=profile.output_bytes,
        weight_cast_bytes=(None if profile.weight_cast_bytes is None
                           else profile.weight_cast_bytes.max(axis=0)),
        lifetime_bytes=profile.lifetime_bytes,
        checkpoint_bytes=float(torch.get_rng_state().nbytes),
        source=source + (", with the loss timed on the last unit" if loss is not None else ""),
    )
