"""Compiling a model into a pipeline: the one package where the IR, the passes and the runtime
meet (front: checks, tracing, costs; partitioning; local and distributed assembly;
re-planning; re-timing)."""

from fxpipe.compile.front import units_of
from fxpipe.compile.local import compile
from fxpipe.compile.partitioning import available_partitioners, compare_partitioners
from fxpipe.compile.replan import Replan, replan
from fxpipe.compile.retime import retime

__all__ = [
    "Replan", "available_partitioners", "compare_partitioners", "compile", "replan", "retime",
    "units_of",
]
