"""Partition passes: CostTable + stage count -> Partition, one function per planner."""

from fxpipe.passes.partition.ampa import ampa
from fxpipe.passes.partition.balanced import balanced, minmax_bounds
from fxpipe.passes.partition.csimd import CrossSearch, cross_search, csimd
from fxpipe.passes.partition.even import even
from fxpipe.passes.partition.exact import brute_force, exact
from fxpipe.passes.partition.imd import imd, masp
from fxpipe.passes.partition.odpa import divisors, odpa
from fxpipe.passes.partition.params import params

__all__ = [
    "CrossSearch",
    "ampa",
    "balanced",
    "brute_force",
    "cross_search",
    "csimd",
    "divisors",
    "even",
    "exact",
    "imd",
    "masp",
    "minmax_bounds",
    "odpa",
    "params",
]
