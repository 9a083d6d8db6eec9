"""Rewrite pass: split Conv/Linear layers into channel shards, merge the per-channel ops after them.

ALGORITHMS §9 (Akintoye et al., Alg. 1). Four phases, each a module:

1. `layers`: every Conv1d/2d/3d and Linear call the pass can split, by layer name;
2. `propagate`: which values are held as channel pieces. A split layer's output is; so is the
   output of every op that acts on each channel alone (BatchNorm, activations, dropout, pooling,
   per-channel affine, elementwise ops between identically split values; the table is in `ops`).
   Any other consumer mixes channels and reads the gathered tensor;
3. `emit`: a new graph in which shard `i` of each merged chain computes its slice of channels
   on `devices[i]`, with one `cat` (a gather) per value that a channel-mixing op reads;
4. `outline` (optional): `outline_shards` makes each merged chain a `ShardGroup` submodule
   holding one GraphModule per shard, which can run its shards on a thread pool.

`api.split_merge` runs phases 1-3 and returns a `SplitMergeResult` (`records`, with the paper's
overlap cost model); `values` and `graphs` hold what the phases share about the original graph.

Parameters stay the user's: shards read `split` views of the original parameters and buffers
inside the graph, so autograd accumulates every shard's gradient into the original Parameter,
BatchNorm running statistics update the original buffers in place, and `state_dict()` is
unchanged.
"""

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
