"""Plan's memory fields (memory_limit, optimizer): parsed and checked, with fixes."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from fxpipe.errors import PlanError

__all__ = [
    "OPTIMIZER_SLOTS",
    "memory_fields",
    "memory_limit_spec",
    "optimizer_slots",
    "parse_bytes",
    "stage_limits",
]

# copies of the weights an optimizer keeps as state (Adam: two moments; SGD with momentum:
# one buffer; plain SGD: none)
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "radam": 2, "sgd": 0,
                   "sgd-momentum": 1, "rmsprop": 1, "adagrad": 1, "lion": 1}
DEFAULT_OPTIMIZER = "adam"  # the most common, and the most state: never under-counts by default
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_NUMBER = re.compile(r"^\s*((?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: object, where: str = "memory_limit") -> float:
    """Bytes from a positive number or a string such as "8GiB", "512MB", "1.5 GiB"."""
    fix = (f"give Plan({where}=...) bytes as a number, or a string such as '8GiB', '512MB' or "
           "'1.5 GiB' (KiB/MiB/GiB/TiB: powers of 1024; KB/MB/GB/TB: powers of 1000)")
    if isinstance(value, bool):
        raise PlanError(f"Plan({where}={value!r}) is not an amount of memory; {fix}.")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        match = _NUMBER.match(value)
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise PlanError(f"Plan({where}={value!r}) is not an amount of memory; {fix}.")
        number = float(match.group(1)) * _UNITS[unit]
    else:
        raise PlanError(f"Plan({where}={value!r}) is not an amount of memory; {fix}.")
    if not (number > 0 and math.isfinite(number)):
        raise PlanError(f"Plan({where}={value!r}) must be more than 0 bytes and finite; {fix}, "
                        "or None for no cap.")
    return number


def memory_limit_spec(value: object, devices: int) -> float | tuple[float, ...] | None:
    """None, one cap for every device, or one per device (a sequence of `devices` caps), in
    bytes."""
    if value is None:
        return None
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != devices:
            raise PlanError(
                f"Plan(memory_limit={list(value)!r}) gives {len(value)} caps for the plan's "
                f"{devices} device(s); give one per device (stages // stages_per_device), or "
                "a single value for every device.")
        return tuple(parse_bytes(v) for v in value)
    return parse_bytes(value)


def optimizer_slots(value: object) -> float:
    """Copies of the weights the optimizer keeps: a name of OPTIMIZER_SLOTS, a number of
    slots >= 0, or None (Adam's 2)."""
    if value is None:
        return float(OPTIMIZER_SLOTS[DEFAULT_OPTIMIZER])
    if isinstance(value, str) and value.lower() in OPTIMIZER_SLOTS:
        return float(OPTIMIZER_SLOTS[value.lower()])
    if (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
            and math.isfinite(value)):
        return float(value)
    known = ", ".join(repr(k) for k in OPTIMIZER_SLOTS)
    raise PlanError(f"Plan(optimizer={value!r}) is not known; give one of {known}, or the "
                    "number of weight-sized state tensors it keeps per parameter (Adam: 2, SGD "
                    "with momentum: 1, plain SGD: 0).")


def memory_fields(plan: Any) -> float | tuple[float, ...] | None:
    """A Plan's memory_limit, normalised, and its optimizer, checked; PlanError for a bad one.
    (Its recompute: fxpipe.recompute_spec.)"""
    optimizer_slots(plan.optimizer)
    if plan.memory_limit is not None and plan.costs == "none":
        raise PlanError("Plan(memory_limit=...) caps what each stage holds, activations and "
                        "messages included, which the profile measures, but costs='none' "
                        "measures nothing; use costs='measure' (the default) or drop "
                        "memory_limit.")
    return memory_limit_spec(plan.memory_limit, plan.device_count)


def stage_limits(plan: Any) -> tuple[float, ...] | None:
    """Each stage's cap in bytes under the plan's memory_limit (None without one): a device
    holding several stages gives each an equal share (so their sum fits; the planners cap
    each stage)."""
    if plan.memory_limit is None:
        return None
    per_device = (plan.memory_limit if isinstance(plan.memory_limit, tuple)
                  else (plan.memory_limit,) * plan.device_count)
    share = plan.stages // plan.device_count
    return tuple(per_device[d] / share for d in plan.placement)
