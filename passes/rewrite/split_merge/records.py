"""What split-and-merge did, as frozen records, and the paper's overlap cost model (eqs. 11-13)."""

from __future__ import annotations

import dataclasses

from torch import fx

__all__ = ["MergedChain", "OverlapCost", "ShardTag", "SplitLayer", "SplitMergeResult",
           "overlap_cost"]


@dataclasses.dataclass(frozen=True)
class ShardTag:
    """Where a node of a merged chain runs: shard `shard` of chain `chain`, on `device`."""

    chain: int
    shard: int
    device: str


@dataclasses.dataclass(frozen=True)
class SplitLayer:
    """One split Conv/Linear call: output channels [bounds[i], bounds[i+1]) go to shard i."""

    name: str  # layer name (module path, or node name for a functional call)
    node: str  # the node it replaced
    kind: str  # e.g. "Conv2d", "conv3d", "Linear"
    channels: int
    groups: int
    bounds: tuple[int, ...]

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1


@dataclasses.dataclass(frozen=True)
class MergedChain:
    """Split layers and the per-channel ops merged after them; each shard runs them all."""

    index: int
    layers: tuple[str, ...]  # nodes of the split layers in the chain
    ops: tuple[str, ...]  # nodes of the merged per-channel ops, in graph order
    bounds: tuple[int, ...]
    devices: tuple[str, ...]
    gathers: tuple[str, ...]  # values of the chain read whole by a channel-mixing op


@dataclasses.dataclass(frozen=True)
class OverlapCost:
    """The paper's cost model (eqs. 11-13) for `n` devices, modules and micro-batches."""

    n: int
    t_f: float
    t_b: float
    t_c: float
    t_no: float  # eq. 11: forward and backward passes not overlapped
    t_o: float  # eq. 12: overlapped

    @property
    def speedup(self) -> float:  # eq. 13
        return self.t_no / self.t_o


def overlap_cost(n: int, t_f: float, t_b: float, t_c: float) -> OverlapCost:
    """Eqs. 11-13: T_NO = n²(T_F+T_B+2T_C), T_O = n(T_F+T_B+2T_C) + 2(n-1)·max(T_F, T_B).

    T_F, T_B are the forward/backward times of one sub-module on one micro-batch, T_C one
    transfer between devices.
    """
    if n < 1 or min(t_f, t_b, t_c) < 0:
        raise ValueError(f"overlap_cost needs n >= 1 and times >= 0, got n={n}, "
                         f"t_f={t_f}, t_b={t_b}, t_c={t_c}")
    step = t_f + t_b + 2 * t_c
    return OverlapCost(n, t_f, t_b, t_c, n * n * step, n * step + 2 * (n - 1) * max(t_f, t_b))


@dataclasses.dataclass(frozen=True)
class SplitMergeResult:
    """The rewritten graph and what the pass did to it."""

    gm: fx.GraphModule
    devices: tuple[str, ...]
    layers: tuple[SplitLayer, ...]
    chains: tuple[MergedChain, ...]
    gathers: tuple[str, ...]  # names of the inserted `cat` nodes
    scatters: tuple[str, ...]  # activations split into pieces to meet a chain (no parameters)

    def predict(self, t_f: float, t_b: float, t_c: float) -> OverlapCost:
        """Eqs. 11-13 for as many devices as the widest split uses."""
        return overlap_cost(max((layer.shards for layer in self.layers), default=1),
                            t_f, t_b, t_c)

    def format(self) -> str:
        lines = [f"split-and-merge over {len(self.devices)} device(s): "
                 f"{len(self.layers)} layer(s) split, {len(self.chains)} merged chain(s), "
                 f"{len(self.gathers)} gather(s), {len(self.scatters)} scatter(s)"]
        for layer in self.layers:
            sizes = [b - a for a, b in zip(layer.bounds, layer.bounds[1:])]
            grouped = f", groups={layer.groups}" if layer.groups > 1 else ""
            lines.append(f"  split {layer.name} ({layer.kind}, {layer.channels} channels"
                         f"{grouped}) -> {layer.shards} shards of {sizes}")
        for chain in self.chains:
            lines.append(f"  chain {chain.index} on {', '.join(chain.devices)}: "
                         f"{' -> '.join(chain.layers + chain.ops)}; "
                         f"gathered: {', '.join(chain.gathers) or 'none'}")
        return "\n".join(lines)
