"""Partition passes: CostTable + stage count -> Partition, one function per planner."""

from fxpipe.passes.partition.even import even

__all__ = ["even"]
