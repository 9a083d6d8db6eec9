"""fxpipe: automatic pipeline parallelism for PyTorch models, as inspectable torch.fx passes."""

from fxpipe import models
from fxpipe.compile import Replan, compile, replan, retime, units_of
from fxpipe.cost import CostTable, Partition
from fxpipe.distributed import gather_state_dict, shutdown
from fxpipe.errors import FxpipeError, FxpipeTraceError, PlanError
from fxpipe.pipeline import CompiledPipeline
from fxpipe.plan import Plan

__all__ = [
    "CompiledPipeline",
    "CostTable",
    "FxpipeError",
    "FxpipeTraceError",
    "Partition",
    "Plan",
    "PlanError",
    "Replan",
    "compile",
    "gather_state_dict",
    "models",
    "replan",
    "retime",
    "shutdown",
    "units_of",
]
__version__ = "0.1.0"
