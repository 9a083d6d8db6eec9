"""Compiling under torchrun: one stage per rank, agreed on by every rank."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

from fxpipe.affinity import hosts, pin_rank, ranks_on_host, release_io_threads
from fxpipe.allocator import keep_for
from fxpipe.compile.front import (
    check_batched_inputs,
    measure_costs,
    output_names,
    stage_link,
    trace_and_cut,
    whole_positions,
)
from fxpipe.compile.loss import traced_loss
from fxpipe.compile.partitioning import choose_partition
from fxpipe.compile.retime import Timing
from fxpipe.cost import Link, Partition
from fxpipe.distributed import rank_device, rank_layout
from fxpipe.errors import PlanError
from fxpipe.passes.analysis.comm import default_link, measure_rank_link
from fxpipe.passes.analysis.symbolic import annotate_symbolic
from fxpipe.passes.rewrite.stages import split_stages
from fxpipe.pipeline import CompiledPipeline
from fxpipe.plan import Plan
from fxpipe.probes import preserved_state
from fxpipe.runtime.dist import DistCoordinator, DistTransport
from fxpipe.runtime.executor import PipelineExecutor
from fxpipe.runtime.hooks import GradientSync
from fxpipe.runtime.stage import StageRunner
from fxpipe.units import Unit

__all__ = ["compile_distributed"]


def compile_distributed(model, plan: Plan, args, kwargs, cache, target: Any = None
                        ) -> CompiledPipeline:
    """Under torchrun: every rank traces the same graph; rank 0 measures the costs and chooses
    the partition and every rank takes them from it; each rank then keeps only its stage on its
    device, and talks to the others over torch.distributed. `target`: an example target, for
    timing the plan's loss with the units (compile's example_target)."""
    if plan.intra_layer is not None:
        raise PlanError("Plan(intra_layer=...) splits layers over the devices of one process; "
                        "under torchrun each rank runs one stage on one device. Drop "
                        "intra_layer, or run in one process with Plan(devices=[...]).")
    if isinstance(plan.stage_threads, int):
        raise PlanError(f"Plan(stage_threads={plan.stage_threads}) runs several stages of one "
                        "process on a thread; under torchrun each rank runs its one stage on a "
                        "thread of its own. Drop stage_threads, or run in one process.")
    layout = rank_layout(plan)
    device = rank_device(plan, layout)
    everyone = hosts(device)  # before pin_rank narrows what this rank may use
    on_host = ranks_on_host(torch.distributed.get_rank(), everyone)
    cpus = pin_rank(device, plan.cpu_affinity, everyone)  # before anything is timed
    keep_for(plan.cpu_memory, [device])
    traced, units, flat = trace_and_cut(model, plan, args, kwargs)
    whole = whole_positions(traced, plan, args, kwargs)
    check_batched_inputs(traced, plan, args, kwargs, whole)
    _agree(layout, plan, units)
    links = _LinkGroups(layout)
    link = _ping_pong(plan, layout, links, device)  # the others take rank 0's, below
    threads = torch.get_num_threads()
    # every rank times the units at once, so the times include the ranks' contention for the
    # host's caches and memory; rank 0's table (and partition) is the one every rank uses
    # the other ranks are the concurrency; the rank will hold one stage, about 1/stages of the
    # weights, and times a meta model's units with no more real at once
    timing = Timing(device, threads, concurrency=1, held=1 / plan.stages)
    cost = measure_costs(traced.gm, units, flat, plan, [timing.device], link,
                         cache if layout.rank == 0 else None, timing.threads,
                         timing.concurrency, whole,
                         loss=traced_loss(traced, plan, target, flat, whole, device),
                         held=timing.held)
    if layout.rank == 0:
        chosen = choose_partition(model, plan, units, cost)
        shared: list[Any] = [cost, chosen.bounds, chosen.micro_batches, chosen.partitioner,
                             link]
    else:
        shared = [None] * 5
    torch.distributed.broadcast_object_list(shared, src=0)
    cost, bounds, micro_batches, name, link = shared
    partition = Partition.evaluate(cost, bounds, micro_batches, name, schedule=plan.schedule)
    annotate_symbolic(traced.gm, flat, whole)  # message shapes as functions of the micro-batch size
    devices = [device] * plan.stages
    graph, comm = split_stages(traced.gm, units, partition.bounds, devices)
    pipe = CompiledPipeline(model, plan, traced, units, partition, graph, comm, devices,
                            cost, link)
    stage = pipe.stages[layout.stage]
    pipe.materialize_stage(layout.stage, device, model)  # of a meta model, only this one
    stage.to(device)
    pipe.state_dict_keys, pipe.timing = list(model.state_dict()), timing
    pipe.host_cores = on_host
    pipe.restrict_to_stage(layout.stage, layout.rank, cpus)
    pipeline = _pipeline_group(layout)
    hook = pipe.stage_hook(layout.stage)
    runner = StageRunner(stage, hook, comm.stages[layout.stage], device, comm.carries_grad())
    transport = DistTransport(comm, layout.pipeline_ranks, device, group=pipeline,
                              links=links.of_edges(comm), rank=layout.rank)
    data_parallel = _data_parallel_group(layout, stage)
    sync = None
    if data_parallel is not None:
        sync = GradientSync(layout.stage, list(stage.parameters()), data_parallel,
                            plan.dp_sync, pipeline)
        hook.register(lambda s: sync.on_stage_backward(s, hook.finishing))
    coordinator = DistCoordinator(layout.pipeline_ranks, micro_batches, device, pipeline,
                                  _tied_groups(pipe, layout), sync=sync,
                                  data_parallel=data_parallel, group_index=layout.group,
                                  groups=layout.groups)
    pipe.executor = PipelineExecutor(
        {layout.stage: runner}, comm, transport, output_names(traced.gm), plan.schedule,
        micro_batches, traced.bind.unflatten, threads, coordinator,
    )
    pipe.executor.whole = whole
    pipe.link_probe = functools.partial(_measure_link, pipe, layout, links, device)
    if plan.costs != "none":  # what predicting whole steps takes, measured on the stages
        vars(pipe)["link"] = _with_stage_terms(pipe, link, layout, traced.bind(args, kwargs))
        pipe.measure_runtime_overhead(*args, **kwargs)  # per step and per action
    return pipe


def _link_measured(plan: Plan) -> bool:
    """Whether compile measures the link between the ranks: not where the plan gives its
    figures, nor for one stage, which has none."""
    return not isinstance(plan.link, tuple) and plan.stages > 1


def _ping_pong(plan: Plan, layout, links: _LinkGroups, device: str) -> Link:
    """The plan's link, or one fitted to a ping-pong between the first two stages' ranks
    (the default link on the ranks that take no part; compile shares rank 0's)."""
    if isinstance(plan.link, tuple):
        return stage_link(plan, [device, device])
    link = default_link(device, device, True)
    if not _link_measured(plan):
        return link
    return measure_rank_link(layout.rank_of(0, 0), layout.rank_of(1, 0), links.get(0, 1),
                             device, reply_group=links.get(1, 0),
                             resume=False) or link  # each stage's own: _with_stage_terms


def _with_stage_terms(pipe: CompiledPipeline, link: Link, layout, flat: Sequence[Any]
                      ) -> Link:
    """`link` with the terms measured on the pipeline's own stages: the runtime's own time to
    send a tensor (after a forward and after a backward) and to post its receive, and how much
    it slows the compute after a send (and after one that wakes its receiver), after posting a
    receive and while a message lands, measured on the first stage pair computing as its
    stages do (DistTransport.measure_posting) and shared by its first rank; and each
    stage's own slowdown after a wait, which depends on what the stage computes, in place of
    the ping-pong's small probe (the plan's link as it is)."""
    if not _link_measured(pipe.plan):
        return link
    with preserved_state(pipe):  # its forwards leave no trace in buffers (batch norm's)
        resume = pipe.executor.resume_penalty(flat)  # the list on every rank of the pipeline
    if resume is not None:
        link = dataclasses.replace(link, resume=tuple(resume))
    shared = [pipe.executor.posting_time(flat)]
    torch.distributed.broadcast_object_list(shared, src=layout.rank_of(0, 0))
    if shared[0] is None:
        return link
    posting = shared[0]
    return dataclasses.replace(link, post=posting.send, post_back=posting.send_back,
                               post_recv=posting.receive,
                               post_recv_between=posting.receive_between,
                               after_send=posting.after_send, after_wake=posting.after_wake,
                               after_receive=posting.after_receive, after_post=posting.after_post)


def _measure_link(pipe: CompiledPipeline, layout, links: _LinkGroups, device: str,
                  flat: Sequence[Any]) -> Link:
    """The link measured again as compile measured it, the same on every rank of a pipeline
    (and of the job, but for each pipeline group's own per-stage slowdown after a wait)."""
    shared: list[Any] = [_ping_pong(pipe.plan, layout, links, device)]
    torch.distributed.broadcast_object_list(shared, src=layout.rank_of(0, 0))
    return _with_stage_terms(pipe, shared[0], layout, flat)


def _agree(layout, plan: Plan, units: Sequence[Unit]) -> None:
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


def _new_group(ranks: Sequence[int]) -> Any:
    """A process group of `ranks` (every rank of the job must make it), its I/O threads free
    of the rank's binding as the others' are (release_io_threads)."""
    handle = torch.distributed.new_group(ranks)
    release_io_threads()
    return handle


def _pipeline_group(layout):
    """This rank's pipeline as a process group (the whole job when there is one pipeline)."""
    if layout.groups == 1:
        return None
    mine = None
    for group in range(layout.groups):  # every rank creates every group, in the same order
        ranks = [layout.rank_of(s, group) for s in range(layout.stages)]
        handle = _new_group(ranks)
        if layout.rank in ranks:
            mine = handle
    return mine


class _LinkGroups:
    """A process group for each direction between two stages, keyed by (sending stage,
    receiving stage), made on first use by every rank in the same order. A gloo connection
    carrying data both ways has its event thread spin while a sender holds the connection (it
    only try-locks it), which on a busy host takes a core from compute; one-way connections
    cut that (benchmarks/gloo_links.py compares the two)."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.made: dict[tuple[int, int], Any] = {}  # this rank's pipeline's, by stage pair

    def get(self, src: int, dst: int) -> Any:
        if (src, dst) not in self.made:
            for group in range(self.layout.groups):  # all ranks make all groups' handles
                ranks = [self.layout.rank_of(src, group), self.layout.rank_of(dst, group)]
                handle = _new_group(ranks)
                if group == self.layout.group:
                    self.made[src, dst] = handle
        return self.made[src, dst]

    def of_edges(self, comm) -> dict[tuple[int, int], Any]:
        """The groups of the directions to and from this rank's stage that the comm table's
        edges use (gradients flow back along them); made for every pair, kept for ours."""
        pairs = sorted({(e.src, e.dst) for e in comm.edges} | {(e.dst, e.src) for e in comm.edges})
        handles = {pair: self.get(*pair) for pair in pairs}
        return {pair: handle for pair, handle in handles.items() if self.layout.stage in pair}


def _data_parallel_group(layout, stage) -> Any:
    """The ranks running this rank's stage in every pipeline group, as a process group; the
    stage's parameters and buffers start as group 0's (as DistributedDataParallel does)."""
    if layout.groups == 1:
        return None
    mine = None
    for s in range(layout.stages):  # every rank creates every group, in the same order
        ranks = layout.data_parallel_ranks(s)
        handle = _new_group(ranks)
        if s == layout.stage:
            mine = handle
    source = layout.data_parallel_ranks(layout.stage)[0]
    with torch.no_grad():
        for tensor in [*stage.parameters(), *stage.buffers()]:
            torch.distributed.broadcast(tensor.data, source, mine)
    return mine


def _tied_groups(pipe: CompiledPipeline, layout) -> list[tuple[torch.nn.Parameter, Any]]:
    """For each weight tied across stages, the process group of the ranks holding it; the
    copies start equal (broadcast from the first holder) and stay equal (summed gradients)."""
    tied = []
    for _, param, stages in pipe.shared_parameter_objects():
        for group in range(layout.groups):
            ranks = [layout.rank_of(s, group) for s in stages]
            handle = _new_group(ranks)
            if layout.rank in ranks:
                with torch.no_grad():
                    torch.distributed.broadcast(param.data, ranks[0], handle)
                tied.append((param, handle))
    return tied
