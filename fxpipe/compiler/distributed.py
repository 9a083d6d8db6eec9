"""Compiling under torchrun: a rank's stages, its process groups and runtime."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fxpipe.compiler.assemble import materialize_stages, model_names
from fxpipe.compiler.inputs import output_names
from fxpipe.compiler.state import Compilation
from fxpipe.cost import Link
from fxpipe.devices import cuda_count, slot_device_types, wire_device
from fxpipe.distributed import RankLayout
from fxpipe.errors import PlanError
from fxpipe.ir import CommTable, tied_parameters
from fxpipe.passes.analysis.comm import default_link, measure_rank_link
from fxpipe.plan import Plan
from fxpipe.recompute_spec import stage_recompute
from fxpipe.runtime.coordinator import DistCoordinator
from fxpipe.runtime.dist import DistTransport
from fxpipe.runtime.executor import PipelineExecutor
from fxpipe.runtime.gradient_sync import GradientSync
from fxpipe.runtime.stage import StageRunner
from fxpipe.units import Unit

__all__ = ["LinkGroups", "agree", "build_rank_runtime", "owned_names", "ping_pong",
           "stage_device_types"]


def agree(layout: RankLayout, plan: Plan, units: Sequence[Unit]) -> None:
    """Every rank must compile the same plan for the same graph; say which ranks differ."""
    fingerprint = repr((sorted(plan.to_dict().items(), key=str), [u.nodes for u in units]))
    everyone: list[Any] = [None] * layout.world
    torch.distributed.all_gather_object(everyone, fingerprint)
    differ = [r for r, f in enumerate(everyone) if f != everyone[0]]
    if differ:
        raise PlanError(
            f"ranks {differ} compiled a different plan or model than rank 0; every rank must "
            "call fxpipe.compile with the same model class, example input shapes and Plan "
            "(or Plan.load the same saved plan)."
        )


class LinkGroups:
    """A process group for each direction between two stages, keyed by (sending stage,
    receiving stage), made on first use by every rank in the same order. A gloo connection
    carrying data both ways has its event thread spin while a sender holds the connection,
    which on a busy host takes a core from compute; one-way connections avoid that."""

    def __init__(self, layout: RankLayout) -> None:
        self.layout = layout
        self.made: dict[tuple[int, int], Any] = {}  # this rank's pipeline's, by stage pair

    def get(self, src: int, dst: int) -> Any:
        """The group of `src` -> `dst` in this rank's pipeline (None where this rank is
        neither, or where one rank runs both: their messages stay in the process)."""
        if (src, dst) not in self.made:
            layout = self.layout
            if layout.device_of(src) == layout.device_of(dst):
                self.made[src, dst] = None
                return None
            self.made[src, dst] = _new_groups(
                [[layout.rank_of(src, g), layout.rank_of(dst, g)] for g in range(layout.groups)],
                layout.rank)
        return self.made[src, dst]

    def of_edges(self, comm: CommTable) -> dict[tuple[int, int], Any]:
        """The groups of the directions to and from this rank's stages that the comm table's
        edges use (gradients flow back along them); made for every pair, kept for ours."""
        pairs = sorted({(e.src, e.dst) for e in comm.edges} | {(e.dst, e.src) for e in comm.edges})
        handles = {pair: self.get(*pair) for pair in pairs}
        held = set(self.layout.held)
        return {pair: handle for pair, handle in handles.items()
                if handle is not None and held & set(pair)}


def ping_pong(plan: Plan, layout: RankLayout, groups: LinkGroups, device: str) -> Link:
    """A link fitted to a ping-pong between the first two stages' ranks (the default link on
    the ranks that take no part, and with one stage; the partition pass shares rank 0's)."""
    link = default_link(device, device, True)
    if plan.stages < 2 or layout.rank_of(0, 0) == layout.rank_of(1, 0):
        return link
    kinds = stage_device_types(plan, layout)
    peer = kinds[1] if layout.rank == layout.rank_of(0, 0) else kinds[0]
    wire = str(wire_device(device, peer))  # the device the pipeline's messages travel from
    return measure_rank_link(layout.rank_of(0, 0), layout.rank_of(1, 0), groups.get(0, 1),
                             wire, reply_group=groups.get(1, 0)) or link


def stage_device_types(plan: Plan, layout: RankLayout) -> list[str]:
    """The device type ("cpu", "cuda") of every stage's rank, as every rank can tell."""
    count = cuda_count()
    kinds = slot_device_types(plan.devices, count, layout.devices)
    return [kinds[layout.device_of(s)] for s in range(plan.stages)]


def build_rank_runtime(c: Compilation) -> PipelineExecutor:
    """This rank's stages made real on its device and its runtime: the executor, over the
    process groups of its pipeline, of its data-parallel group and of its tied weights."""
    layout, device = c.layout, c.devices[0]
    stages = [c.graph.get_submodule(f"stage{s}") for s in range(c.plan.stages)]
    materialize_stages(c, layout.held)
    runners, recompute = {}, stage_recompute(c.plan, c.partition)
    for s in layout.held:  # one worker thread runs them all: no lock on the RNG between them
        stages[s].to(device)
        runners[s] = StageRunner(stages[s], c.graph.get_submodule(f"hook{s}"), c.comm.stages[s],
                                 device, c.comm.carries_grad(), recompute[s])
    pipeline = _pipeline_group(layout)
    transport = DistTransport(c.comm, layout.pipeline_ranks, device, group=pipeline,
                              links=c.link_groups.of_edges(c.comm), rank=layout.rank,
                              timeout=c.plan.timeout,
                              stage_types=stage_device_types(c.plan, layout))
    stage = stages[layout.stage]  # data parallelism runs one stage per rank (check pass)
    data_parallel = _data_parallel_group(layout, stage)
    sync = None
    if data_parallel is not None:
        sync = GradientSync(layout.stage, list(stage.parameters()), data_parallel,
                            c.plan.dp_sync, pipeline, wait=transport.watchdog.wait)
    coordinator = DistCoordinator(layout.pipeline_ranks, c.partition.micro_batches, device,
                                  pipeline, _tied_groups(c.model, stages, layout), sync=sync,
                                  data_parallel=data_parallel, group_index=layout.group,
                                  groups=layout.groups, watchdog=transport.watchdog)
    return PipelineExecutor(
        runners, c.comm, transport, output_names(c.cut_from), c.schedule,
        c.forward_schedule, c.streamed, c.traced.bind.unflatten, coordinator, c.whole,
        precision=c.plan.precision,
    )


def owned_names(model: torch.nn.Module, stages: Sequence[torch.nn.Module]) -> frozenset[str]:
    """Every name in the model of a tensor this rank's stages hold: the model's state dict
    lists a tied weight under each of its names, a stage (an exported one) under one."""
    held = {id(t) for stage in stages for t in [*stage.parameters(), *stage.buffers()]}
    named = [*(item for stage in stages for item in [*stage.named_parameters(),
                                                     *stage.named_buffers()]),
             *model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    return frozenset(name for name, tensor in named if id(tensor) in held)


def _new_groups(rank_lists: Sequence[Sequence[int]], rank: int) -> Any:
    """A process group of each list of ranks, made by every rank in the same order (as
    torch.distributed requires); the one holding `rank`, or None."""
    mine = None
    for ranks in rank_lists:
        handle = torch.distributed.new_group(list(ranks))
        if rank in ranks:
            mine = handle
    return mine


def _pipeline_group(layout: RankLayout) -> Any:
    """This rank's pipeline as a process group (the whole job when there is one pipeline)."""
    if layout.groups == 1:
        return None
    return _new_groups([[layout.rank_of(s, g) for s in range(layout.stages)]
                        for g in range(layout.groups)], layout.rank)


def _data_parallel_group(layout: RankLayout, stage: torch.nn.Module) -> Any:
    """The ranks running this rank's stage in every pipeline group, as a process group; the
    stage's parameters and buffers start as group 0's (as DistributedDataParallel does)."""
    if layout.groups == 1:
        return None
    mine = _new_groups([layout.data_parallel_ranks(s) for s in range(layout.stages)],
                       layout.rank)
    source = layout.data_parallel_ranks(layout.stage)[0]
    with torch.no_grad():
        for tensor in [*stage.parameters(), *stage.buffers()]:
            torch.distributed.broadcast(tensor.data, source, mine)
    return mine


def _tied_groups(model: torch.nn.Module, stages: Sequence[Any], layout: RankLayout
                 ) -> list[tuple[torch.nn.Parameter, Any]]:
    """For each weight tied across stages, the process group of the ranks holding it; the
    copies start equal (broadcast from the first holder) and stay equal (summed gradients)."""
    tied = []
    for _, param, holders in tied_parameters(stages, model_names(model)):
        ranks = [list(dict.fromkeys(layout.rank_of(s, g) for s in holders))
                 for g in range(layout.groups)]
        if len(ranks[0]) == 1:  # one rank runs every stage using it: one Parameter there
            continue
        handle = _new_groups(ranks, layout.rank)
        if handle is not None:  # this rank holds the weight
            with torch.no_grad():
                torch.distributed.broadcast(param.data, layout.rank_of(holders[0]), handle)
            tied.append((param, handle))
    return tied
