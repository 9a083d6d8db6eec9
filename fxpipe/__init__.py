"""fxpipe: automatic pipeline parallelism for PyTorch models, as inspectable torch.fx passes."""

from fxpipe import models
from fxpipe.calibrate import Calibration, calibrate
from fxpipe.compiler import Replan, compile, replan, units_of
from fxpipe.cost import CostTable, Partition
from fxpipe.distributed import gather_state_dict, shutdown
from fxpipe.errors import FxpipeError, FxpipeTraceError, PlanError
from fxpipe.pipeline import CompiledPipeline
from fxpipe.plan import Plan

__all__ = [
    "Calibration",
    "CompiledPipeline",
    "CostTable",
    "FxpipeError",
    "FxpipeTraceError",
    "Partition",
    "Plan",
    "PlanError",
    "Replan",
    "calibrate",
    "compile",
    "gather_state_dict",
    "models",
    "replan",
    "shutdown",
    "units_of",
]
__version__ = "0.1.0"
