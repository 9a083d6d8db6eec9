"""fxpipe: automatic pipeline parallelism for PyTorch models, as inspectable torch.fx passes."""

from fxpipe import models
from fxpipe.calibrate import Calibration, calibrate
from fxpipe.compiler import Replan, compile, replan, units_of
from fxpipe.cost import CostTable, Partition
from fxpipe.distributed import gather_state_dict, shutdown
from fxpipe.errors import FxpipeError, FxpipeTraceError, PlanError
from fxpipe.peak_memory import measure_memory
from fxpipe.pipeline import CompiledPipeline
from fxpipe.plan import Plan
from fxpipe.report import MeasuredMemory

__all__ = [
    "Calibration",
    "CompiledPipeline",
    "CostTable",
    "FxpipeError",
    "FxpipeTraceError",
    "MeasuredMemory",
    "Partition",
    "Plan",
    "PlanError",
    "Replan",
    "calibrate",
    "compile",
    "gather_state_dict",
    "measure_memory",
    "models",
    "replan",
    "shutdown",
    "units_of",
]
__version__ = "0.1.0"
