"""What compiling builds up pass by pass, and running the passes: verified, timed, dumped."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import fx

from fxpipe.batching import ScalarJoin, input_dims
from fxpipe.cost import CostTable, Link, Partition
from fxpipe.distributed import RankLayout
from fxpipe.inspect import format_table
from fxpipe.ir import CommTable
from fxpipe.plan import Plan
from fxpipe.schedules import Schedule
from fxpipe.trace import Traced
from fxpipe.units import Unit

__all__ = ["Compilation", "CompilerError", "Pass", "PassLog", "PassRecord", "ensure",
           "run_passes"]


class CompilerError(RuntimeError):
    """A pass made something its verifier refuses: a bug in fxpipe, not in the user's model."""


def ensure(condition: object, what: str) -> None:
    """A verifier's check: raise CompilerError saying `what` should hold, unless it does."""
    if not condition:
        raise CompilerError(what)


@dataclasses.dataclass
class Compilation:
    """The model, the plan and the example, and what each pass adds (None until it has run)."""

    model: torch.nn.Module
    plan: Plan
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    target: Any = None  # an example target, to time the plan's loss with the units
    cache: Any = None  # a ProfileCache, or None
    layout: RankLayout | None = None  # this rank's place under torchrun (check)
    link_groups: Any = None  # under torchrun, the one-way process groups between stages (check)
    devices: list[str] = dataclasses.field(default_factory=list)  # per stage (check)
    traced: Traced | None = None  # trace
    units: list[Unit] = dataclasses.field(default_factory=list)  # units
    flat: list[Any] = dataclasses.field(default_factory=list)  # the example as graph inputs
    whole: tuple[int, ...] = ()  # positions of inputs every micro-batch gets whole (units)
    loss: Callable[[Mapping[str, Any], int], Any] | None = None  # the loss to time (units)
    scalar_joins: dict[int, ScalarJoin] = dataclasses.field(default_factory=dict)  # (units)
    profile: Any = None  # the units' UnitProfile, or None without costs (profile)
    loss_times: tuple[Any, Any] | None = None  # the loss's forward and backward (profile)
    link: Link | None = None  # link
    cost: CostTable | None = None  # link (the cost table needs the link for cf and cb)
    partition: Partition | None = None  # partition
    splits: list[Any] = dataclasses.field(default_factory=list)  # rewrite: split layers
    cut_from: fx.GraphModule | None = None  # rewrite: the traced graph, heavy layers split
    graph: fx.GraphModule | None = None  # rewrite: the PipelineGraph
    comm: CommTable | None = None  # rewrite
    schedule: Schedule | None = None  # schedule: a step's, lowered
    forward_schedule: Schedule | None = None  # schedule: the drop-in forward's (flushed)
    streamed: Callable[[int], Schedule] | None = None  # schedule: async over mini-batches

    @property
    def batch(self) -> int:
        """The example's batch size (once the units pass has found the inputs given whole)."""
        return input_dims(self.flat, self.whole).batch

    @property
    def distributed(self) -> bool:
        return self.layout is not None

    @property
    def speaks(self) -> bool:
        """Whether this process prints: always, or rank 0 under torchrun."""
        return self.layout is None or self.layout.rank == 0


class Pass(NamedTuple):
    """One named step of compiling: `run` fills in the Compilation, `verify` checks what it
    made (cheaply, with `ensure`), `show` summarises it."""

    name: str
    run: Callable[[Compilation], None]
    verify: Callable[[Compilation], None]
    show: Callable[[Compilation], str]


class PassRecord(NamedTuple):
    """What one pass did: its name, seconds and summary."""

    name: str
    seconds: float
    summary: str


class PassLog(tuple):
    """The passes compile ran, in order; prints as a table."""

    def __str__(self) -> str:
        rows = [[r.name, f"{r.seconds * 1e3:.0f}", r.summary] for r in self]
        total = sum(r.seconds for r in self)
        return (format_table(["pass", "ms", "result"], rows)
                + f"\n{len(self)} passes, {total:.2f} s")


def run_passes(passes: Sequence[Pass], compilation: Compilation) -> PassLog:
    """Run `passes` in order, each verified after it ran; with Plan(dump=True) print each
    pass's summary as it completes (rank 0 under torchrun)."""
    records = []
    for step in passes:
        start = time.perf_counter()
        step.run(compilation)
        seconds = time.perf_counter() - start
        try:
            step.verify(compilation)
        except CompilerError as error:
            raise CompilerError(f"fxpipe's {step.name} pass made a result its verifier "
                                f"refuses: {error} should hold. This is a bug in fxpipe, not "
                                "in your model; please report it.") from None
        record = PassRecord(step.name, seconds, step.show(compilation))
        records.append(record)
        if compilation.plan.dump and compilation.speaks:
            print(f"fxpipe: {record.name} ({record.seconds * 1e3:.0f} ms): {record.summary}",
                  file=sys.stdout, flush=True)
    return PassLog(records)
