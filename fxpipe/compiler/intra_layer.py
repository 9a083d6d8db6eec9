"""Layer-wise split and merge inside stages: heavy Conv/Linear layers split (ALGORITHMS §9)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import fx

from fxpipe.cost import CostTable, Link, Partition
from fxpipe.ir import Stage, StageHook
from fxpipe.meta import SHAPE
from fxpipe.passes.analysis.shape import annotate_shapes
from fxpipe.passes.rewrite.split_merge import (
    SHARD,
    OverlapCost,
    SplitMergeResult,
    outline_shards,
    split_merge,
)
from fxpipe.units import Unit

__all__ = ["StageSplit", "outline_split_stages", "split_heavy_layers"]

SPLITTABLE = ("Conv1d", "Conv2d", "Conv3d", "Linear")


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """What split-and-merge did to one stage, and the paper's predicted speedup for it."""

    stage: int
    result: SplitMergeResult
    overlap: OverlapCost  # eqs. 11-13 for the split layers

    def format(self) -> str:
        o = self.overlap
        if o.t_o <= 0:
            return (f"stage {self.stage}: {self.result.format()}\n  eqs. 11-13 (n={o.n}): "
                    "no measured times (Plan(costs='none')), no predicted speedup")
        return (f"stage {self.stage}: {self.result.format()}\n  eqs. 11-13 (n={o.n}): "
                f"T_NO {o.t_no * 1e3:.2f} ms, T_O {o.t_o * 1e3:.2f} ms, predicted speedup "
                f"{o.speedup:.2f}x")


def split_heavy_layers(gm: fx.GraphModule, units: Sequence[Unit], partition: Partition,
                       cost: CostTable, spec: dict[str, Any], devices: Sequence[str],
                       flat_inputs: Sequence[Any], link: Link
                       ) -> tuple[fx.GraphModule, list[StageSplit]]:
    """Split, stage by stage, the layers named in `spec["layers"]`, or each Conv/Linear unit
    above `spec["threshold"]` of its stage's time, into `spec["shards"]` channel shards."""
    p = partition.micro_batches
    f, b, _, _ = cost.at(p)
    splits = []
    for s, stage in enumerate(partition.stages):
        start, end = stage.units
        times = f[start:end] + b[start:end]
        total = float(times.sum())
        chosen = [
            (unit, i) for i, unit in zip(range(start, end), units[start:end])
            if unit.kind in SPLITTABLE and (
                unit.name in spec["layers"] if spec["layers"] is not None
                else total > 0 and (f[i] + b[i]) / total > spec["threshold"])
        ]
        if not chosen:
            continue
        shard_devices = (spec["devices"][s] if spec["devices"] is not None
                         else [devices[s]] * spec["shards"])
        result = split_merge(gm, [unit.name for unit, _ in chosen], shard_devices,
                             example_inputs=flat_inputs, home=devices[s])
        gm = result.gm
        n = len(shard_devices)
        forward = p * sum(float(f[i]) for _, i in chosen)  # the mini-batch through the layers
        backward = p * sum(float(b[i]) for _, i in chosen)
        gathered = sum(_gather_bytes(result.gm, name) for name in result.gathers) / p
        overlap = result.predict(forward / n ** 2, backward / n ** 2,
                                 float(link.time(gathered / n)))
        splits.append(StageSplit(s, result, overlap))
    if splits:
        annotate_shapes(gm, flat_inputs)  # the new nodes need shapes for the send/recv table
    return gm, splits


def outline_split_stages(stages: Sequence[Stage], hooks: Sequence[StageHook],
                         splits: Sequence[StageSplit]) -> None:
    """Give each merged chain of a split stage its own submodule whose shards run concurrently
    (one worker per shard); the stage's hook then hands out the outlined module's weights."""
    for split in splits:
        stage = stages[split.stage]
        for node in stage.module.graph.nodes:
            if node.op == "placeholder":  # a stage input is whole here, not a shard
                node.meta.pop(SHARD, None)
        stage.module = outline_shards(stage.module, concurrent=True)
        hooks[split.stage]._weights = dict(stage.module.named_parameters())


def _gather_bytes(gm: fx.GraphModule, name: str) -> float:
    node = next(n for n in gm.graph.nodes if n.name == name)
    info = node.meta.get(SHAPE)
    return float(info.nbytes) if info is not None else 0.0
