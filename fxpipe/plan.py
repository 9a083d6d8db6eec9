"""Plan: what the user asks fxpipe to build, validated with errors that say how to fix them."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fxpipe.errors import PlanError
from fxpipe.intra_layer_spec import intra_layer_spec
from fxpipe.memory_spec import memory_fields
from fxpipe.precision import check_precision
from fxpipe.recompute_spec import recompute_spec
from fxpipe.schedules.actions import ActionKind, Schedule, ScheduleError
from fxpipe.schedules.interleaved import round_robin, v_shape
from fxpipe.schedules.user import check_user_schedule, read_user_schedule

__all__ = ["CONSISTENCY_POLICIES", "COSTS", "DP_SYNCS", "PARTITIONERS", "SCHEDULES", "TRACERS",
           "Plan"]

PARTITIONERS = ("even", "params", "balanced", "ampa", "imd", "csimd", "exact")
SCHEDULES = ("gpipe", "1f1b", "async-1f1b", "zb-h1", "interleaved-1f1b", "looped-bfs", "zbv",
             "dualpipev")
# several stages per device (stages_per_device=v): each device holds stages d, d+N, d+2N, ...
# (round robin), or, for the V schedules, stages d and 2N-1-d
VIRTUAL = ("interleaved-1f1b", "looped-bfs", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
CONSISTENCY_POLICIES = ("none", "stash", "2bw", "predict")
DP_SYNCS = ("delayed", "naive")
TRACERS = ("auto", "fx", "export")
_FORMAT, _VERSION = "fxpipe.plan", 2
_REMOVED_IN_2 = {"cpu_affinity": "auto", "cpu_memory": "keep", "stage_threads": "auto"}
COSTS = ("measure", "fit", "none")
TIMED_PARTITIONERS = ("balanced", "ampa", "imd", "csimd", "exact")  # need measured costs


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
    stages_per_device: int = 1  # v: stages // v devices (ranks), each running v stages
    partitioner: str | Sequence[int] | None = None  # balanced; ampa with groups; even sans costs
    schedule: str | Schedule | os.PathLike = "gpipe"  # a name, or your own (a .csv path)
    micro_batches: int | str | None = None  # None: one per stage (up to the batch), at compile
    devices: Sequence[str] | None = None
    groups: int = 1
    consistency: str = "none"
    dp_sync: str = "delayed"
    loss_fn: Callable[..., torch.Tensor] | None = None
    tracer: str | Callable[..., torch.fx.GraphModule] = "auto"
    leaf_modules: Sequence[type[torch.nn.Module] | str] = ()
    concrete_args: Mapping[str, Any] | None = None
    unit_depth: int | None = None
    costs: str = "measure"  # measure: profile units; fit: and model α·FLOPs+β; none: no times
    # (latency s, bandwidth B/s[, sender's s per tensor]), or "measure"; None: measured
    # between ranks under torchrun (a ping-pong), defaults per device pair kind in one process
    link: tuple[float, ...] | str | None = None
    # torchrun: seconds a rank waits for another's message before every rank stops; at least
    # 10 x the longest step so far. None: 300 s until a step has completed, then 30 s
    timeout: float | None = None
    intra_layer: int | Mapping[str, Any] | None = None  # split-and-merge heavy layers
    whole_inputs: Sequence[str] = ()  # forward() arguments every micro-batch gets whole
    recompute: bool | str | Sequence[bool] = False  # True | False | "auto" | one bool a stage
    dump: bool = False  # print each compiler pass's result as it completes
    precision: str | None = None  # bf16 | fp16: stages under autocast (fp16: pipe.scaler)
    memory_limit: float | str | Sequence[float | str] | None = None  # bytes per device, or None
    optimizer: str | float | None = None  # its state slots the memory model counts; None: Adam

    def __post_init__(self) -> None:
        _positive_int("stages", self.stages)
        _positive_int("stages_per_device", self.stages_per_device)
        self._check_partitioner()
        if (isinstance(self.schedule, str) and self.schedule not in SCHEDULES
                and not self.schedule.endswith(".csv")):
            raise PlanError(f"Plan(schedule={self.schedule!r}) is not known; choose one of "
                            f"{', '.join(map(repr, SCHEDULES))}, or give your own: a "
                            "fxpipe.schedules.Schedule or a .csv file (docs/schedules.md).")
        if self.micro_batches not in (None, "auto"):
            _positive_int("micro_batches", self.micro_batches)
        self._check_micro_batch_choice()
        if not isinstance(self.schedule, str) or self.schedule.endswith(".csv"):
            self._check_user_schedule()
        else:
            self._check_virtual_stages()
        if self.devices is not None:
            self._check_devices()
        _positive_int("groups", self.groups)
        if self.groups > 1 and self.schedule == "async-1f1b":  # its in-run steps would not wait
            raise PlanError(  # for the groups' all-reduce, so each replica would drift apart
                "Plan(groups>1) cannot run schedule='async-1f1b': its optimizer steps inside the "
                "run would use gradients not yet averaged over the groups; use groups=1, or "
                "schedule='1f1b' or 'gpipe'.")
        _choice("consistency", self.consistency, CONSISTENCY_POLICIES)
        if self.consistency != "none" and self.schedule != "async-1f1b":
            raise PlanError(
                f"Plan(consistency={self.consistency!r}) only applies to asynchronous pipelines; "
                f"use schedule='async-1f1b' or drop consistency (schedule is "
                f"{self.schedule_name!r})."
            )
        _choice("dp_sync", self.dp_sync, DP_SYNCS)
        object.__setattr__(self, "recompute", recompute_spec(self))
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise PlanError(f"Plan(loss_fn={self.loss_fn!r}) must be callable(output, target).")
        try:  # it is called as loss_fn(output, target); a module's signature is its forward's
            if self.loss_fn is not None:
                inspect.signature(getattr(self.loss_fn, "forward", self.loss_fn)).bind(1, 2)
        except TypeError as error:
            raise PlanError(f"Plan(loss_fn=...) cannot take the model's output and the target "
                            f"({error}); give loss_fn(output, target).") from None
        except ValueError:  # no signature to read (some builtins)
            pass
        if not callable(self.tracer):
            _choice("tracer", self.tracer, TRACERS)
        if isinstance(self.leaf_modules, (str, type)):
            object.__setattr__(self, "leaf_modules", (self.leaf_modules,))
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
        _choice("costs", self.costs, COSTS)
        if self.costs == "none" and self.partitioner in TIMED_PARTITIONERS:
            raise PlanError(
                f"Plan(partitioner={self.partitioner!r}) balances measured times, but "
                "costs='none' measures nothing; use costs='measure' (the default) or "
                "partitioner='even', 'params' or a list of stage sizes."
            )
        if self.link is not None:
            self._check_link()
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(
                self.timeout, (int, float)) or not 0 < self.timeout < float("inf")):
            raise PlanError(f"Plan(timeout={self.timeout!r}) must be a number of seconds > 0, "
                            "or None (300 s until a step has completed, then 30 s).")
        if self.intra_layer is not None:
            object.__setattr__(self, "intra_layer", intra_layer_spec(
                self.intra_layer, self.stages, self.costs))
        if isinstance(self.whole_inputs, str):
            object.__setattr__(self, "whole_inputs", (self.whole_inputs,))
        object.__setattr__(self, "whole_inputs", tuple(self.whole_inputs))
        if not isinstance(self.dump, bool):
            raise PlanError(f"Plan(dump={self.dump!r}) must be True or False.")
        check_precision(self.precision, self.devices, self.schedule_name)
        if self.consistency == "predict" and self.precision is not None:
            raise PlanError(  # autocast saves its cast of the predicted weights, which the
                # backward would read instead of the current ones
                f"Plan(consistency='predict') cannot run with precision={self.precision!r} "
                "yet: the backward would read autocast's copy of the predicted weights; use "
                "consistency='stash' or '2bw', or precision=None.")
        object.__setattr__(self, "memory_limit", memory_fields(self))  # and optimizer, checked

    def _check_micro_batch_choice(self) -> None:
        """csimd chooses the micro-batch count with the partition; choosing it needs times."""
        if self.partitioner == "csimd":
            if self.micro_batches not in (None, "auto"):
                raise PlanError(
                    f"Plan(partitioner='csimd') chooses the micro-batch count itself, so "
                    f"micro_batches={self.micro_batches} would be ignored; drop micro_batches "
                    "(or give 'auto'), or fix it with another partitioner, e.g. 'imd'."
                )
            object.__setattr__(self, "micro_batches", "auto")
        if self.micro_batches == "auto" and self.costs == "none":
            raise PlanError(
                "Plan(micro_batches='auto') chooses the count from measured times, but "
                "costs='none' measures nothing; give micro_batches=N or use costs='measure'."
            )

    def _check_user_schedule(self) -> None:
        """Your own schedule (a Schedule, or a PyTorch pipelining CSV file): read, and checked
        to match the plan, to train every micro-batch once and never to hang, before any work.
        The model's skip edges are checked at compile, once the stages are known."""
        try:
            schedule = read_user_schedule(self.schedule)
        except ScheduleError as error:
            raise PlanError(f"Plan(schedule={str(self.schedule)!r}): {error}.") from error
        given, p = f"Plan(schedule={schedule.name!r})", schedule.micro_batches
        if schedule.stages != self.stages:
            raise PlanError(f"{given} has {schedule.stages} stages (one action list each) but "
                            f"Plan(stages={self.stages}); give stages={schedule.stages} or a "
                            f"schedule of {self.stages} stages.")
        if self.micro_batches == "auto":
            raise PlanError(f"{given} fixes the micro-batch count at {p}, so it cannot be "
                            "chosen (micro_batches='auto', or partitioner='csimd'); drop "
                            "micro_batches and use another partitioner.")
        if self.micro_batches is not None and self.micro_batches != p:
            raise PlanError(f"{given} runs {p} micro-batches but Plan(micro_batches="
                            f"{self.micro_batches}); drop micro_batches (the schedule sets it) "
                            f"or give micro_batches={p}.")
        try:
            check_user_schedule(schedule)
        except ScheduleError as error:
            raise PlanError(f"{given} cannot run: {error}.") from error
        reduces = any(a.kind is ActionKind.ALLREDUCE for st in schedule.actions for a in st)
        if reduces and self.groups > 1 and self.dp_sync == "naive":
            raise PlanError(f"{given} all-reduces gradients inside the run (ALLREDUCE), but "
                            "Plan(dp_sync='naive') all-reduces them after it, a second time; "
                            "use dp_sync='delayed' or drop the ALLREDUCE actions.")
        if schedule.placement is not None and schedule.devices < schedule.stages:
            held = {len(schedule.stages_on(d)) for d in range(schedule.devices)}
            if held != {self.stages_per_device}:
                counts = [len(schedule.stages_on(d)) for d in range(schedule.devices)]
                fix = (f"give stages_per_device={held.pop()}" if len(held) == 1 else
                       "place the same number of stages on every device")
                raise PlanError(f"{given} places {counts} stages on its {schedule.devices} "
                                f"devices but Plan(stages_per_device={self.stages_per_device}); "
                                f"{fix}.")
        elif self.stages_per_device != 1:
            raise PlanError(f"{given} runs one stage per device (it has no placement) but "
                            f"Plan(stages_per_device={self.stages_per_device}); give "
                            "stages_per_device=1, or a schedule with a placement and programs.")
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "micro_batches", p)

    def _check_virtual_stages(self) -> None:
        """A named schedule against stages_per_device: several stages per device need a
        schedule that interleaves them (and the V schedules exactly two), and divide the stages
        evenly; dualpipev also needs micro_batches >= stages."""
        v, s, name = self.stages_per_device, self.stages, self.schedule
        given = f"Plan(stages={s}, stages_per_device={v}, schedule={name!r})"
        if s % v:
            fits = [k for k in range(1, s + 1) if s % k == 0]
            raise PlanError(f"{given}: the {s} stages do not split evenly over devices of {v} "
                            f"stages each; give stages_per_device in {fits}, or a multiple of "
                            f"{v} stages.")
        if name in V_SHAPED and v != 2:
            raise PlanError(f"{given}: {name} places exactly two stages on each device (a V: "
                            f"stages d and 2N-1-d); give stages_per_device=2 (and an even number "
                            f"of stages), or schedule='interleaved-1f1b' or 'looped-bfs' for "
                            f"v={v}.")
        if v > 1 and name not in VIRTUAL:
            raise PlanError(f"{given}: {name!r} runs one stage per device; with several stages "
                            f"per device pick a schedule that interleaves them: "
                            f"'interleaved-1f1b', 'looped-bfs', 'zbv' or 'dualpipev' (v=2), or "
                            f"give stages_per_device=1.")
        n, p = s // v, self.micro_batches
        if name == "interleaved-1f1b" and v > 1 and isinstance(p, int) and p % n:
            near = " or ".join(str(c) for c in sorted({p - p % n, p - p % n + n}) if c)
            raise PlanError(f"{given} runs micro-batches through each device's stages in groups "
                            f"of one per device, so micro_batches={p} must be a multiple of the "
                            f"{n} devices; give micro_batches={near}.")
        if name == "dualpipev" and isinstance(p, int) and p < s:
            raise PlanError(f"{given} fills both arms of the V before its steady state, so it "
                            f"needs at least one micro-batch per stage: give micro_batches >= "
                            f"{s} (got {p}), or fewer stages.")
        if name in VIRTUAL and p == "auto":
            raise PlanError(f"{given} fixes its micro-batch count by its devices, so it cannot be "
                            "chosen (micro_batches='auto', or partitioner='csimd'); give "
                            "micro_batches=N and another partitioner.")

    @property
    def device_count(self) -> int:
        """Devices (ranks, under torchrun) of one pipeline: one per stage unless the schedule
        places several stages on each."""
        if isinstance(self.schedule, Schedule):
            return self.schedule.devices
        return self.stages // self.stages_per_device

    @property
    def placement(self) -> tuple[int, ...]:
        """The device (index into `devices`) of each stage, as the schedule places them."""
        if isinstance(self.schedule, Schedule):
            return tuple(self.schedule.device(s) for s in range(self.stages))
        if self.schedule in V_SHAPED:
            return v_shape(self.stages)
        return round_robin(self.stages, self.device_count)

    @property
    def schedule_name(self) -> str:
        return self.schedule if isinstance(self.schedule, str) else self.schedule.name

    def _check_link(self) -> None:
        if self.link == "measure":  # a copy between local devices, a ping-pong between ranks
            return
        if isinstance(self.link, str):
            raise PlanError(f"Plan(link={self.link!r}) is not known; give 'measure' or "
                            "(latency in seconds, bandwidth in bytes per second).")
        link = tuple(self.link)
        object.__setattr__(self, "link", link)
        ok = len(link) in (2, 3) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                         for v in link)
        if not ok or link[0] < 0 or link[1] <= 0 or (len(link) == 3 and link[2] < 0):
            raise PlanError(
                f"Plan(link={self.link!r}) must be (latency in seconds >= 0, bandwidth in "
                "bytes per second > 0), and optionally the sender's seconds per tensor sent "
                ">= 0, e.g. link=(20e-6, 10e9) or (20e-6, 10e9, 5e-6)."
            )

    def _check_partitioner(self) -> None:
        if self.partitioner is None:  # the default: balance measured times (AMPA, as GroPipe
            default = ("even" if self.costs == "none"  # does, across pipeline groups)
                       else "ampa" if self.groups > 1 else "balanced")
            object.__setattr__(self, "partitioner", default)
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
        if isinstance(self.devices, (str, torch.device)):  # one device for every stage
            object.__setattr__(self, "devices", (str(self.devices),) * self.device_count)
        devices = tuple(str(d) if isinstance(d, torch.device) else d for d in self.devices)
        object.__setattr__(self, "devices", devices)
        n = self.device_count
        if len(devices) != n:
            each = ("; give one device per stage" if n == self.stages else
                    f" on {n} devices; give one device per {self.stages // n} stages "
                    "(stages_per_device)")
            raise PlanError(
                f"Plan(devices={list(devices)}) names {len(devices)} devices for "
                f"stages={self.stages}{each}, e.g. {['cpu'] * n}."
            )
        for device in devices:
            try:
                torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise PlanError(
                    f"Plan(devices=...) holds {device!r}, which is not a device; "
                    "use strings such as 'cpu' or 'cuda:0'."
                ) from e

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (loss_fn is not data, nor how compile prints, dump)."""
        if callable(self.tracer):
            raise PlanError("a plan with a tracer callable cannot be saved; save it with "
                            "tracer='auto' and pass Plan.load(path, tracer=my_tracer).")
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("loss_fn", "dump")}
        data["leaf_modules"] = [leaf if isinstance(leaf, str) else leaf.__name__
                                for leaf in self.leaf_modules]
        for name in ("partitioner", "devices", "link", "whole_inputs", "memory_limit",
                     "recompute"):
            if isinstance(data[name], tuple):
                data[name] = list(data[name])
        data["concrete_args"] = dict(self.concrete_args) if self.concrete_args else None
        if isinstance(self.schedule, Schedule):  # its actions, in their compact form
            schedule = self.schedule
            data["schedule"] = {"name": schedule.name, "actions": [
                [str(a) for a in stage] for stage in schedule.actions]}
            if schedule.placement is not None:
                data["schedule"]["placement"] = list(schedule.placement)
                data["schedule"]["programs"] = [[str(a) for a in program]
                                                for program in schedule.device_programs]
        return data

    def save(self, path: str | os.PathLike, **extra: Any) -> None:
        """Write the plan as versioned JSON; `extra` adds informational fields (e.g. the
        predicted step time) that load() ignores."""
        document = {"format": _FORMAT, "version": _VERSION, "plan": self.to_dict(), **extra}
        pathlib.Path(path).write_text(json.dumps(document, indent=2, default=str) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike, **overrides: Any) -> Plan:
        """Read a plan written by save(); `overrides` replace fields (e.g. loss_fn=...)."""
        try:
            document = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError) as e:
            raise PlanError(f"cannot read a plan from {str(path)!r}: {e}") from e
        if not isinstance(document, dict) or document.get("format") != _FORMAT:
            raise PlanError(f"{str(path)!r} is not an fxpipe plan file.")
        version, data = document.get("version"), dict(document.get("plan", {}))
        if version == 1:  # its CPU fields are gone: at their defaults, they changed nothing
            for name, default in _REMOVED_IN_2.items():
                if data.pop(name, default) != default:
                    raise PlanError(f"{str(path)!r} sets {name}, which fxpipe no longer has: "
                                    "the CPU's threads and binding are the user's to set "
                                    "(docs/cpu.md); remove it from the file.")
        elif version != _VERSION:
            raise PlanError(f"{str(path)!r} is plan format version {version}; this fxpipe "
                            f"reads versions 1 and {_VERSION}.")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise PlanError(f"{str(path)!r} sets {unknown}, which this fxpipe's Plan does not "
                            "have; remove them from the file.")
        if isinstance(data.get("schedule"), dict):  # your own schedule, as to_dict wrote it
            try:
                saved = data["schedule"]
                data["schedule"] = Schedule.from_lists(
                    saved["actions"], saved["name"], placement=saved.get("placement"),
                    programs=saved.get("programs"))
            except (KeyError, TypeError, ValueError) as e:
                raise PlanError(f"{str(path)!r} holds a schedule fxpipe cannot read ({e}); "
                                "save the plan again with Plan.save.") from e
        if isinstance(data.get("link"), list):
            data["link"] = tuple(data["link"])
        return cls(**{**data, **overrides})

    def for_batch(self, batch: int) -> Plan:
        """The plan with the default micro-batch count chosen for an example `batch`: one per
        stage, which fills the pipeline, as far as each group's share of the batch allows."""
        if self.micro_batches is not None:
            return self
        p = max(1, min(self.stages, batch // self.groups))
        if self.schedule == "dualpipev" and p < self.stages:  # as _check_virtual_stages, but
            # the count is ours: the batch is what to change
            raise PlanError(f"schedule='dualpipev' needs at least one micro-batch per stage, so "
                            f"a batch of at least {self.stages * self.groups} samples; the "
                            f"example batch has {batch}: give a larger batch or fewer stages.")
        n = self.device_count
        if self.schedule == "interleaved-1f1b" and self.stages_per_device > 1 and p >= n:
            p -= p % n  # its micro-batches go through the chunks in groups of one per device
        return dataclasses.replace(self, micro_batches=p)

    @property
    def sizes(self) -> tuple[int, ...] | None:
        """The explicit units-per-stage list, or None when a named partitioner decides."""
        return None if isinstance(self.partitioner, str) else tuple(self.partitioner)
