"""Rewrite pass: split Conv/Linear layers into channel shards, merge the per-channel ops after."""

from fxpipe.meta import GATHER, SHARD
from fxpipe.passes.rewrite.split_merge.api import split_merge
from fxpipe.passes.rewrite.split_merge.layers import splittable_layers
from fxpipe.passes.rewrite.split_merge.outline import ShardGroup, outline_shards
from fxpipe.passes.rewrite.split_merge.records import (
    MergedChain,
    OverlapCost,
    ShardTag,
    SplitLayer,
    SplitMergeResult,
    overlap_cost,
)

__all__ = [
    "GATHER",
    "SHARD",
    "MergedChain",
    "OverlapCost",
    "ShardGroup",
    "ShardTag",
    "SplitLayer",
    "SplitMergeResult",
    "outline_shards",
    "overlap_cost",
    "split_merge",
    "splittable_layers",
]
