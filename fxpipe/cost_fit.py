"""Plan(costs='fit'): a cost table whose unit times follow α·FLOPs + β between measured sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from fxpipe.cost import CostTable

__all__ = ["fit_to_flops"]


def fit_to_flops(cost: CostTable, flops: Callable[[float], np.ndarray],
                 loss: tuple[np.ndarray, np.ndarray] | None = None) -> CostTable:
    """The table with each unit's forward and backward time modelled as α·FLOPs(m) + β at
    micro-batch size m (least squares over the measured sizes, α, β >= 0), tabulated at the
    size B/p of every count p up to 512, so that `at(p)` follows the FLOP count
    between and beyond the measured sizes instead of a straight line. `flops(m)` is the (K,)
    FLOPs of each unit at size m (the symbolic pass's expressions); link times keep their
    interpolation (bytes are linear in m). One measured size fits α alone (β = 0).
    `loss`: the (M,) seconds of the loss's forward and backward at the measured sizes, which
    the last unit's f and b hold (cost_table): fitted as α·m + β of their own, as the loss's
    work grows with the micro-batch's rows, not with the last unit's FLOPs (a unit of no
    FLOPs, a reshape, would have made it a constant)."""
    if cost.batch is None:
        raise ValueError("fit_to_flops needs CostTable.batch (the mini-batch size)")
    measured = np.array([flops(m) for m in cost.sizes], dtype=np.float64)  # (M, K)
    counts = np.arange(1, min(cost.batch, 512) + 1)
    sizes = np.unique(np.concatenate([cost.sizes, cost.batch / counts]))
    grid = np.array([flops(m) for m in sizes], dtype=np.float64)
    tables = [cost.f.copy(), cost.b.copy()]
    losses = [np.zeros(len(sizes))] * 2
    if loss is not None:
        rows = np.asarray(cost.sizes, dtype=np.float64)[:, None]
        for table, seconds in zip(tables, loss):
            table[:, -1] -= seconds
        losses = [sizes * alpha[0] + beta[0] for alpha, beta in
                  (_affine_fit(rows, np.asarray(seconds)[:, None]) for seconds in loss)]
    fitted = [grid * alpha + beta for alpha, beta in
              (_affine_fit(measured, table) for table in tables)]
    for table, seconds in zip(fitted, losses):
        table[:, -1] += seconds
    links = cost._interpolation(cost.batch / sizes)
    return dataclasses.replace(
        cost, f=np.maximum(fitted[0], 0.0), b=np.maximum(fitted[1], 0.0),
        cf=links @ cost.cf, cb=links @ cost.cb, sizes=sizes,
        activation_bytes=np.maximum(links @ cost.activation_bytes, 0.0),
        **{field: np.maximum(links @ getattr(cost, field), 0.0) for field in (
            "boundary_bytes", "boundary_grad_bytes", "boundary_saved_bytes", "inner_grad_bytes")
           if getattr(cost, field) is not None},
        output_bytes=np.maximum(links @ cost.output_bytes, 0.0),
        lifetime_bytes=None if cost.lifetime_bytes is None else np.maximum(
            np.tensordot(links, cost.lifetime_bytes, 1), 0.0),
        source=f"{cost.source}, fitted as α·FLOPs + β (Plan(costs='fit'))",
    )


def _affine_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column, α >= 0 and β >= 0 minimising Σ_m (α·x[m] + β − y[m])²."""
    if len(x) == 1:
        with np.errstate(divide="ignore", invalid="ignore"):
            alpha = np.where(x[0] > 0, y[0] / x[0], 0.0)
        return alpha, np.where(x[0] > 0, 0.0, y[0])
    x_mean, y_mean = x.mean(0), y.mean(0)
    spread = ((x - x_mean) ** 2).sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = np.where(spread > 0, ((x - x_mean) * (y - y_mean)).sum(0) / spread, 0.0)
    alpha = np.maximum(alpha, 0.0)
    beta = np.maximum(y_mean - alpha * x_mean, 0.0)
    return alpha, beta
