"""Plan: what the user asks fxpipe to build, validated with errors that say how to fix them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fxpipe.errors import PlanError

__all__ = [
    "CONSISTENCY_POLICIES",
    "DP_SYNCS",
    "PARTITIONERS",
    "SCHEDULES",
    "TRACERS",
    "Plan",
]

PARTITIONERS = ("even", "params", "balanced", "ampa", "imd", "csimd", "exact")
SCHEDULES = ("gpipe", "1f1b", "async-1f1b")
CONSISTENCY_POLICIES = ("none", "stash", "2bw", "predict")
DP_SYNCS = ("delayed", "naive")
TRACERS = ("auto", "fx", "export")


def _choice(field: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        known = ", ".join(repr(a) for a in allowed)
        raise PlanError(f"Plan({field}={value!r}) is not known; choose one of {known}.")


def _positive_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"Plan({field}={value!r}) must be a positive integer.")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to build: pipeline depth, how to partition, how to schedule, where to run.

    Every field is checked here, so a wrong plan fails before any tracing or profiling.
    """

    stages: int
    partitioner: str | Sequence[int] = "even"
    schedule: str = "gpipe"
    micro_batches: int | str = 1
    devices: Sequence[str] | None = None
    groups: int = 1
    consistency: str = "none"
    dp_sync: str = "delayed"
    loss_fn: Callable[..., torch.Tensor] | None = None
    tracer: str | Callable[..., torch.fx.GraphModule] = "auto"
    leaf_modules: Sequence[type[torch.nn.Module] | str] = ()
    concrete_args: Mapping[str, Any] | None = None
    unit_depth: int | None = None

    def __post_init__(self) -> None:
        _positive_int("stages", self.stages)
        self._check_partitioner()
        _choice("schedule", self.schedule, SCHEDULES)
        if self.micro_batches != "auto":
            _positive_int("micro_batches", self.micro_batches)
        if self.devices is not None:
            self._check_devices()
        _positive_int("groups", self.groups)
        _choice("consistency", self.consistency, CONSISTENCY_POLICIES)
        if self.consistency != "none" and self.schedule != "async-1f1b":
            raise PlanError(
                f"Plan(consistency={self.consistency!r}) only applies to asynchronous pipelines; "
                f"use schedule='async-1f1b' or drop consistency (schedule is {self.schedule!r})."
            )
        _choice("dp_sync", self.dp_sync, DP_SYNCS)
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise PlanError(f"Plan(loss_fn={self.loss_fn!r}) must be callable(output, target).")
        if not callable(self.tracer):
            _choice("tracer", self.tracer, TRACERS)
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))
        for leaf in self.leaf_modules:
            if not (isinstance(leaf, str) or (isinstance(leaf, type)
                                              and issubclass(leaf, torch.nn.Module))):
                raise PlanError(
                    f"Plan(leaf_modules=...) holds {leaf!r}; give nn.Module classes or "
                    "qualified module names such as 'blocks.3.attn'."
                )
        if self.unit_depth is not None:
            _positive_int("unit_depth", self.unit_depth)

    def _check_partitioner(self) -> None:
        if isinstance(self.partitioner, str):
            _choice("partitioner", self.partitioner, PARTITIONERS)
            return
        sizes = tuple(self.partitioner)
        object.__setattr__(self, "partitioner", sizes)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise PlanError(
                f"Plan(partitioner={list(sizes)}) must list a positive number of units per stage."
            )
        if len(sizes) != self.stages:
            raise PlanError(
                f"Plan(partitioner={list(sizes)}) gives {len(sizes)} stage sizes for "
                f"stages={self.stages}; give exactly one size per stage."
            )

    def _check_devices(self) -> None:
        devices = tuple(self.devices)
        object.__setattr__(self, "devices", devices)
        if len(devices) != self.stages:
            raise PlanError(
                f"Plan(devices={list(devices)}) names {len(devices)} devices for "
                f"stages={self.stages}; give one device per stage, e.g. {['cpu'] * self.stages}."
            )
        for device in devices:
            try:
                torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise PlanError(
                    f"Plan(devices=...) holds {device!r}, which is not a device; "
                    "use strings such as 'cpu' or 'cuda:0'."
                ) from e

    @property
    def sizes(self) -> tuple[int, ...] | None:
        """The explicit units-per-stage list, or None when a named partitioner decides."""
        return None if isinstance(self.partitioner, str) else tuple(self.partitioner)
