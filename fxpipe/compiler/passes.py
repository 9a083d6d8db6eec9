"""The compiler's passes, in order, shared by one-process and torchrun compile."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
from torch import fx

from fxpipe.batching import batch_norm_of_one
from fxpipe.compiler.distributed import LinkGroups, agree, ping_pong, stage_device_types
from fxpipe.compiler.inputs import (
    check_batched_inputs,
    check_example_runs,
    check_micro_batch_count,
    check_per_sample_outputs,
    check_stage_count,
    check_stage_sizes,
    check_whole_inputs,
    shapes_on,
    stage_devices,
    whole_positions,
)
from fxpipe.compiler.intra_layer import split_heavy_layers
from fxpipe.compiler.loss import check_target, traced_loss
from fxpipe.compiler.model_loss import LABEL_NAMES, scalar_joins
from fxpipe.compiler.parameter_fit import check_parameters_fit
from fxpipe.compiler.partitioning import choose_partition
from fxpipe.compiler.state import Compilation, Pass, ensure
from fxpipe.cost import CostTable, Link
from fxpipe.cost_fit import fit_to_flops
from fxpipe.devices import timing_device
from fxpipe.distributed import launched, rank_device, rank_layout
from fxpipe.errors import FxpipeTraceError, PlanError
from fxpipe.inspect import format_bytes
from fxpipe.ir import CommTable
from fxpipe.materialize import check_meta_model, has_meta_tensors
from fxpipe.meta import AUTOCAST, SHAPE, SYMBOLIC
from fxpipe.passes.analysis.comm import default_link, measure_local_link
from fxpipe.passes.analysis.costs import cost_table
from fxpipe.passes.analysis.profile import (
    annotate_profile,
    model_outputs,
    profile_units,
    real_bytes,
    time_loss,
)
from fxpipe.passes.analysis.shape import annotate_autocast
from fxpipe.passes.analysis.symbolic import annotate_symbolic, flops_of_units
from fxpipe.passes.rewrite.stages import split_stages
from fxpipe.plan import VIRTUAL, Plan
from fxpipe.precision import check_autocast_runs
from fxpipe.recompute_spec import cannot_recompute, stage_recompute
from fxpipe.schedules import ActionKind, Schedule, ScheduleError, add_step, lower
from fxpipe.schedules.user import lower_user_schedule
from fxpipe.segments import recompute_segments
from fxpipe.trace import trace
from fxpipe.unit_chain import mark_segments
from fxpipe.units import cut_units, unit_parameters

__all__ = ["PASSES"]

# A meta model's weights up to this many bytes are made real all at once to time its units,
# whatever share of them a device holds: a small model's units timed in several runs meet
# cold caches at each run's start, which costs units of microseconds a noticeable share.
ALL_REAL_BELOW = 256 * 2**20


def check(c: Compilation) -> None:
    """The plan against the model, the example and where compile runs, before any work."""
    if c.target is not None:
        check_target(c.plan, c.target)
    if has_meta_tensors(c.model):
        check_meta_model(c.model, c.plan)
    check_whole_inputs(c.model, c.plan)
    if launched():
        if c.plan.device_count < c.plan.stages and c.plan.groups > 1:
            raise PlanError(
                f"Plan(groups={c.plan.groups}) replicates a pipeline whose ranks run several "
                "stages each; each rank of a replicated pipeline runs one stage so far. Use "
                "groups=1 with several stages per rank, or stages_per_device=1.")
        if c.plan.intra_layer is not None:
            raise PlanError("Plan(intra_layer=...) splits layers over the devices of one "
                            "process; under torchrun each rank runs one stage on one device. "
                            "Drop intra_layer, or run in one process with Plan(devices=[...]).")
        c.layout = rank_layout(c.plan)  # joining torchrun's process group if not yet joined
        c.devices = [rank_device(c.plan, c.layout)] * c.plan.stages  # its own stages' device
        c.link_groups = LinkGroups(c.layout)
        check_autocast_runs(c.plan.precision, c.devices[:1])
        return
    if c.plan.groups > 1:
        raise PlanError(
            f"Plan(groups={c.plan.groups}) replicates the pipeline over ranks of a torchrun "
            f"job; launch with torchrun --nproc-per-node {c.plan.stages * c.plan.groups}, or "
            "use groups=1 in one process."
        )
    c.devices = stage_devices(c.model, c.plan)
    check_autocast_runs(c.plan.precision, c.devices)


def trace_model(c: Compilation) -> None:
    """The model as an fx graph, every node's example value recorded (the shape check)."""
    try:
        c.traced = trace(c.model, c.args, c.kwargs, c.plan, check=shapes_on(c.args, c.kwargs))
    except FxpipeTraceError:
        check_example_runs(c.model, c.args, c.kwargs)  # the likelier cause, if so
        raise
    c.flat = c.traced.bind(c.args, c.kwargs)


def cut(c: Compilation) -> None:
    """The graph cut into units; the plan's stage sizes, the batch's split into micro-batches
    and the example target checked against them, before any timing."""
    c.units = cut_units(c.traced.gm, c.plan.unit_depth, c.traced.leaf_paths)
    check_stage_count(c.model, c.plan, c.units)
    check_stage_sizes(c.model, c.plan, c.units)
    check_parameters_fit(c.model, c.plan, c.traced.gm, c.units)  # a cap too small, untimed
    c.whole = whole_positions(c.traced, c.plan, c.args, c.kwargs)
    batch_norm = batch_norm_of_one(c.traced.gm) if c.model.training else None
    # the default micro-batch count, from the example (two samples each for a batch norm)
    c.plan = c.plan.for_batch(c.batch // (2 if batch_norm else 1))
    if c.plan.costs != "none":  # the example's micro-batches are timed
        check_micro_batch_count(c.plan, c.batch, profile_sizes(c.batch, c.plan), batch_norm)
    owners = c.traced.bind.argument_of_each_input(c.args, c.kwargs)  # per graph input
    check_batched_inputs(c.traced, c.plan, c.flat, owners, c.whole)
    placeholders = [n.name for n in c.traced.gm.graph.nodes if n.op == "placeholder"]
    labels = next(((name, owner) for name, owner in zip(placeholders, owners)
                   if owner in LABEL_NAMES), None)
    c.scalar_joins = scalar_joins(
        c.model, c.args, c.kwargs, check_per_sample_outputs(c.traced, c.plan, c.batch), c.batch,
        {owners[i] for i in c.whole}, labels, c.distributed or c.plan.groups > 1)
    c.loss = traced_loss(c.traced, c.plan, c.target, c.flat, c.whole, timing_device(c.devices))
    if c.distributed:
        agree(c.layout, c.plan, c.units)


def shapes(c: Compilation) -> None:
    """Shapes as functions of the micro-batch size where ranks must agree on message shapes
    (the example's, recorded by the trace, serve in one process), and, under Plan(precision),
    the dtypes the stages' autocast makes each value in: a value crosses ranks as one process
    hands it over. Ranks of several device types (whose autocasts differ) send the trace's."""
    if c.distributed:
        annotate_symbolic(c.traced.gm, c.flat, c.whole)
        kinds = set(stage_device_types(c.plan, c.layout))
        if len(kinds) == 1:  # a value crosses as its sender's autocast made it
            problem = annotate_autocast(c.traced.gm, c.flat, kinds.pop(), c.plan.precision)
            if problem is not None:
                warnings.warn(problem, stacklevel=2)


def profile(c: Compilation) -> None:
    """Every unit timed at the plan's micro-batch size(s), and the loss with an example target
    (under torchrun every rank times at once, rank 0's counting)."""
    if c.plan.costs == "none":
        return
    device = timing_device(c.devices)
    unit_graph, unit_table = _units_as_stages(c)
    held = (len(c.layout.held) / c.plan.stages if c.distributed
            else c.devices.count(device) / len(c.devices))
    sizes = profile_sizes(c.batch, c.plan)
    cache = c.cache if c.layout is None or c.layout.rank == 0 else None
    c.profile = profile_units(unit_graph, unit_table, c.flat, sizes, device, cache=cache,
                              whole=c.whole, precision=c.plan.precision,
                              window=max(held * real_bytes(unit_graph), ALL_REAL_BELOW))
    annotate_profile(c.traced.gm, c.units, c.profile)
    if c.loss is not None:  # on the model's own outputs, as the last stage computes it
        outputs = model_outputs(c.traced.gm, c.flat, c.whole, device, c.plan.precision)
        c.loss_times = time_loss(outputs, sizes, c.loss, device, precision=c.plan.precision)


def _units_as_stages(c: Compilation) -> tuple[fx.GraphModule, CommTable]:
    """The model split with one unit per stage, each on the timing device: what the units are
    timed and counted through."""
    return split_stages(c.traced.gm, c.units, range(1, len(c.units) + 1),
                        [timing_device(c.devices)] * len(c.units))


def profile_sizes(batch: int, plan: Plan) -> list[int]:
    """Micro-batch sizes to time: the plan's; powers of two up to the batch when the
    micro-batch count is to be chosen ('auto', or the csimd partitioner), since time is not
    proportional to micro-batch size and the planner must see it at every size it considers."""
    if plan.micro_batches == "auto" or plan.partitioner == "csimd":
        return sorted({batch} | {2 ** k for k in range(batch.bit_length()) if 2 ** k <= batch})
    largest = -(-batch // plan.micro_batches)  # the largest micro-batch, ceil(B / p)
    if plan.costs == "fit":  # a line needs two points
        return sorted({largest, max(1, largest // 2)} if largest > 1 else {1, min(2, batch)})
    return [largest]


def link(c: Compilation) -> None:
    """The link between stages (the plan's figures, a ping-pong between ranks under torchrun,
    a default by device kind in one process), and with it the cost table."""
    plan, devices = c.plan, c.devices
    if isinstance(plan.link, tuple):
        c.link = Link(*plan.link, source="plan")  # latency, bandwidth[, per tensor]
    elif c.distributed:
        c.link = ping_pong(plan, c.layout, c.link_groups, devices[0])
    elif plan.link == "measure":
        c.link = measure_local_link(devices[0], devices[-1])
    else:
        c.link = default_link(devices[0], devices[-1])
    names = tuple(u.name for u in c.units)
    params = unit_parameters(c.traced.gm, c.units)
    if c.profile is None:
        zeros = [0.0] * len(c.units)
        c.cost = CostTable(zeros, zeros, zeros, zeros, [1.0], None, params[0], names, params[1],
                           source="not measured (Plan(costs='none'))")
        return
    c.cost = cost_table(c.profile, c.link, c.batch, names, params, c.loss_times)
    if plan.costs == "fit":  # time as α·FLOPs(m) + β per unit, from the symbolic pass
        c.cost = fit_to_flops(c.cost, flops_of_units(c.traced.gm, c.units, c.flat, c.whole),
                              loss=c.loss_times)


def partition(c: Compilation) -> None:
    """The plan's partitioner on the cost table (rank 0's, shared, under torchrun)."""
    if c.distributed:
        chosen = (choose_partition(c.model, c.plan, c.units, c.cost)
                  if c.layout.rank == 0 else None)
        shared = [c.cost, c.link, chosen]
        torch.distributed.broadcast_object_list(shared, src=0)  # rank 0's, on every rank
        c.cost, c.link, c.partition = shared
    else:
        c.partition = choose_partition(c.model, c.plan, c.units, c.cost)


def rewrite(c: Compilation) -> None:
    """Heavy layers split where the plan asks, then the graph split into stage submodules
    joined by send/recv and hook nodes."""
    gm = c.traced.gm
    if c.plan.intra_layer is not None:
        gm, c.splits = split_heavy_layers(gm, c.units, c.partition, c.cost, c.plan.intra_layer,
                                          c.devices, c.flat, c.link)
    c.cut_from = gm
    c.graph, c.comm = split_stages(gm, c.units, c.partition.bounds, c.devices)
    if c.plan.costs != "none":  # where the memory model counts them; else from the shapes
        spans = zip((0, *c.partition.bounds[:-1]), c.partition.bounds)
        for s, ((a, e), again) in enumerate(zip(spans, stage_recompute(c.plan, c.partition))):
            if again:
                chain = recompute_segments(c.cost, c.partition.micro_batches, a, e)
                mark_segments(c.graph.get_submodule(f"stage{s}").module, (a, *chain.cuts))


def schedule(c: Compilation) -> None:
    """The plan's schedule for the stage edges, with its sends and receives, checked to run."""
    n, p = c.plan.stages, c.partition.micro_batches
    edges = sorted({(e.src, e.dst) for e in c.comm.edges})
    if isinstance(c.plan.schedule, Schedule):  # the user's, checked by Plan on a chain
        try:
            c.schedule = lower_user_schedule(c.plan.schedule, edges)
        except ScheduleError as error:
            raise PlanError(f"Plan(schedule={c.plan.schedule_name!r}) cannot run on this "
                            f"model's stages: {error}.") from error
    else:
        virtual = c.plan.schedule in VIRTUAL
        try:
            c.schedule = lower(c.plan.schedule, n, p, edges,
                               devices=c.plan.device_count if virtual else None)
        except ValueError as error:  # e.g. a micro-batch count it cannot run
            if not virtual or isinstance(error, ScheduleError):
                raise
            raise PlanError(f"Plan(schedule={c.plan.schedule!r}) cannot run {p} micro-batches "
                            f"on {n} stages: {error}.") from error
    if _delayed_allreduce(c.plan):  # after the stage's last action, its last gradient sent
        # back included, so no stage waits for its launch; the optimizer step stays the user's
        c.schedule = add_step(c.schedule, allreduce=True, step=False)
    c.forward_schedule = c.schedule
    if c.plan.schedule == "async-1f1b":  # the drop-in forward handles one mini-batch, flushed
        c.forward_schedule = lower("gpipe", n, p, edges)
        c.streamed = functools.partial(lower, "async-1f1b", n, p, edges)  # (minibatches)


def _delayed_allreduce(plan: Plan) -> bool:
    """Whether each stage's all-reduce over its data-parallel group is a schedule action
    (GroPipe's delayed one; the naive one runs after the schedule)."""
    return plan.groups > 1 and plan.dp_sync == "delayed"


# --- verifiers: cheap checks of what a pass made (a failure is a bug in fxpipe) --------------


def _check_made(c: Compilation) -> None:
    ensure(len(c.devices) == c.plan.stages, "one device per stage")
    ensure(c.distributed == launched(), "a rank layout exactly under torchrun")


def _graph_made(c: Compilation) -> None:
    c.traced.gm.graph.lint()
    ensure(all(SHAPE in n.meta for n in c.traced.gm.graph.nodes), "every node has its shape")


def _units_cover(c: Compilation) -> None:
    covered = [name for unit in c.units for name in unit.nodes]
    ensure(len(covered) == len(set(covered)), "no node in two units")
    ensure([u.index for u in c.units] == list(range(len(c.units))), "units in order")
    ensure(all(u.nodes for u in c.units), "no empty unit")


def _shapes_made(c: Compilation) -> None:
    if c.distributed:  # the ranks size their messages from these
        ensure(all(SYMBOLIC in n.meta for n in c.traced.gm.graph.nodes),
               "every node has its symbolic shape")


def _profile_made(c: Compilation) -> None:
    if c.profile is None:
        ensure(c.plan.costs == "none", "a profile wherever costs are measured")
        return
    ensure(list(c.profile.sizes) == profile_sizes(c.batch, c.plan), "the plan's sizes timed")
    for table in (c.profile.forward, c.profile.backward, c.profile.activation_bytes):
        ensure(table.shape == (len(c.profile.sizes), len(c.units)), "a row a size, a column a "
               "unit")
        ensure(np.all(np.isfinite(table)) and np.all(table >= 0), "finite, non-negative times")


def _costs_valid(c: Compilation) -> None:  # CostTable refuses negative or non-finite times
    ensure(c.cost.units == len(c.units), "the cost table has a column per unit")


def _partition_valid(c: Compilation) -> None:  # Partition.evaluate checked the bounds
    ensure(len(c.partition.bounds) == c.plan.stages, "one bound per stage")
    chosen = tuple(getattr(c.partition, "recompute", ()) or ())
    ensure(not chosen or c.plan.recompute == "auto" or chosen == stage_recompute(c.plan, None),
           "the partition recomputes the stages the plan names")
    ensure(not any(chosen) or not cannot_recompute(c.plan), "no stage recomputes where the "
           "schedule cannot run recomputation")


def _rewrite_valid(c: Compilation) -> None:
    c.graph.graph.lint()
    ensure(len(c.comm.stages) == c.plan.stages, "one stage submodule per stage")
    last = len(c.comm.stages) - 1
    for edge in c.comm.edges:  # stage 0 sends the model's inputs, the last receives outputs
        made = c.comm.stages[edge.src].outputs + (c.comm.graph_inputs if edge.src == 0 else ())
        used = c.comm.stages[edge.dst].inputs + (c.comm.graph_outputs if edge.dst == last
                                                 else ())
        ensure(edge.value in made, f"{edge.value} is sent by a stage that has it")
        ensure(edge.value in used, f"{edge.value} is received by a stage that uses it")


def _schedule_made(c: Compilation) -> None:
    for schedule in (c.schedule, c.forward_schedule):
        ensure(schedule.stages == c.plan.stages, "a list per stage")
        ensure(schedule.micro_batches == c.partition.micro_batches, "the partition's micro-batches")
        ensure(schedule.lowered or not c.comm.edges, "sends and receives in the lists")
    reduces = [[a.kind for a in stage].count(ActionKind.ALLREDUCE) for stage in c.schedule.actions]
    given = (c.plan.schedule.actions if isinstance(c.plan.schedule, Schedule)
             else [()] * c.plan.stages)  # a user's own ALLREDUCE stays (one group: a no-op)
    ensure(reduces == [max(int(_delayed_allreduce(c.plan)),
                           [a.kind for a in stage].count(ActionKind.ALLREDUCE))
                       for stage in given],
           "an ALLREDUCE a stage exactly where the groups' all-reduce is delayed")


# --- summaries -------------------------------------------------------------------------------


def _show_check(c: Compilation) -> str:
    held = c.layout.held if c.distributed else ()
    where = (f"rank {c.layout.rank} of {c.layout.world}, stage"
             f"{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}"
             if c.distributed else "one process")
    return f"{where}; devices {', '.join(dict.fromkeys(c.devices))}"


def _show_trace(c: Compilation) -> str:
    nodes = len(c.traced.gm.graph.nodes)
    return f"traced with {c.traced.frontend}: {nodes} nodes, {len(c.flat)} graph inputs"


def _show_units(c: Compilation) -> str:
    names = ", ".join(u.name for u in c.units[:4]) + (", ..." if len(c.units) > 4 else "")
    whole = f"; whole inputs at {list(c.whole)}" if c.whole else ""
    return f"{len(c.units)} units ({names}){whole}"


def _show_shapes(c: Compilation) -> str:
    derived = any(AUTOCAST in n.meta for n in c.traced.gm.graph.nodes)
    dtypes = f", in their dtypes under {c.plan.precision} autocast" if derived else ""
    return (f"symbolic shapes in the micro-batch size{dtypes}, for the ranks' messages"
            if c.distributed else "the example's shapes, recorded by the trace")


def _show_profile(c: Compilation) -> str:
    if c.profile is None:
        return "no times (Plan(costs='none'))"
    f, b = c.profile.forward.sum(axis=1), c.profile.backward.sum(axis=1)
    sizes = ", ".join(f"{s}: {fi * 1e3:.2f} + {bi * 1e3:.2f} ms"
                      for s, fi, bi in zip(c.profile.sizes, f, b))
    loss = "; loss timed" if c.loss_times is not None else ""
    return (f"units' forward + backward per micro-batch of {sizes}{loss}; "
            f"costs: {c.profile.origin or 'measured on ' + c.profile.device}")


def _show_link(c: Compilation) -> str:
    return f"{c.link}; cost table of {c.cost.units} units"


def _show_partition(c: Compilation) -> str:
    p = c.partition
    scored = "closed form" if p.schedule == "gpipe" else f"{p.schedule}, simulated"
    time = (f", predicted {p.predicted_time * 1e3:.2f} ms ({scored})"
            if c.plan.costs != "none" else "")
    return (f"{p.partitioner}: units per stage {'+'.join(map(str, p.sizes))}, "
            f"{p.micro_batches} micro-batches{time}")


def _show_rewrite(c: Compilation) -> str:
    crossing = sum(e.info.nbytes for e in c.comm.edges)
    split = f", {len(c.splits)} stages with split layers" if c.splits else ""
    return (f"{len(c.comm.stages)} stage submodules, {len(c.comm.edges)} values crossing "
            f"({format_bytes(crossing)} at the example batch){split}")


def _show_schedule(c: Compilation) -> str:
    actions = sum(len(stage) for stage in c.schedule.actions)
    reduce = (", each stage's all-reduce after its last action" if _delayed_allreduce(c.plan)
              else "")
    placed = ("" if c.schedule.placement is None else
              f", on {c.schedule.devices} devices (stage: device "
              + " ".join(f"{s}:{d}" for s, d in enumerate(c.schedule.placement)) + ")")
    return (f"{c.schedule.name}: {actions} actions, sends and receives matched{placed}"
            f"{reduce}")


PASSES = (
    Pass("check", check, _check_made, _show_check),
    Pass("trace", trace_model, _graph_made, _show_trace),
    Pass("units", cut, _units_cover, _show_units),
    Pass("shapes", shapes, _shapes_made, _show_shapes),
    Pass("profile", profile, _profile_made, _show_profile),
    Pass("link", link, _costs_valid, _show_link),
    Pass("partition", partition, _partition_valid, _show_partition),
    Pass("rewrite", rewrite, _rewrite_valid, _show_rewrite),
    Pass("schedule", schedule, _schedule_made, _show_schedule),
)

