"""Text renderings of a compiled pipeline: the stage table and the rewritten graph."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from torch import fx

from fxpipe.cost import Link, Partition
from fxpipe.ir import CommTable, Event, recv, send
from fxpipe.memory_spec import stage_limits
from fxpipe.meta import SHAPE, STAGE
from fxpipe.recompute_spec import stage_recompute
from fxpipe.units import Unit

__all__ = ["chrome_trace", "describe_pipeline", "format_bytes", "format_graph",
           "format_memory_cap", "format_ms", "format_sizes", "format_stage_table", "format_table"]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_sizes(sizes: Sequence[int]) -> str:
    """Units per stage, as `fxpipe plan` and `fxpipe bench` print them: (7, 15) -> "7+15"."""
    return "+".join(map(str, sizes))


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def format_stage_table(
    title: str,
    units: Sequence[Unit],
    partition: Partition,
    table: CommTable,
    devices: Sequence[str],
    params: Sequence[int],
    shared: dict[str, list[int]] | None = None,
    timed: bool = True,
    link: Link | None = None,
    simulated: tuple[str, float] | None = None,
    placed: bool = False,
    recompute: Sequence[bool] = (),
    memory_limits: Sequence[float] | None = None,
) -> str:
    """One row per stage: device, units, parameters, predicted times and memory, and what
    crosses its boundaries; then the prediction for the whole step the partitioners score
    (GPipe's closed form, or the plan's schedule simulated on a chain of stages), and
    `simulated`, (schedule, seconds) from the event simulator on the model's stage edges.
    `placed`: the schedule runs several stages per device (its simulation serialises them);
    `recompute`: per stage, whether it recomputes its forward in backward (marked "rc");
    `memory_limits` (bytes per stage): each stage's memory against its cap."""
    rows = []
    for s, stage in enumerate(partition.stages):
        start, end = stage.units
        span = f"{start}-{end - 1}" if end - start > 1 else str(start)
        names = (f"{units[start].name} .. {units[end - 1].name}" if end - start > 1
                 else units[start].name)
        times = ([format_ms(stage.f), format_ms(stage.b)] if timed else ["-", "-"])
        marked = f"{s} rc" if s < len(recompute) and recompute[s] else s
        rows.append([marked, devices[s], span, names, f"{params[s]:,}", *times,
                     _memory(partition, s, memory_limits), _traffic(table.recvs(s)),
                     _traffic(table.sends(s))])
    header = ["stage", "device", "units", "first .. last unit", "params", "fwd ms", "bwd ms",
              "memory", "receives", "sends"]
    lines = [title, format_table(header, rows)]
    if timed:
        lines.append(
            f"fwd/bwd ms: per micro-batch; predicted step ({partition.micro_batches} "
            f"micro-batch{'es' if partition.micro_batches != 1 else ''}, "
            + ("gpipe closed form" if partition.schedule == "gpipe" else
               f"{partition.schedule} simulated on a chain of stages"
               + (", several per device" if placed else ""))
            + f"): {format_ms(partition.predicted_time)} ms, bubble "
            f"{partition.bubble:.0%}, slowest forward {format_ms(partition.rho_f)} ms, slowest "
            f"backward {format_ms(partition.rho_b)} ms"
            + (f"; {simulated[0]} as the event simulator runs it: {format_ms(simulated[1])} ms"
               if simulated else "")
            + (f"; links: {link}" if link else "")
        )
    else:
        lines.append("no times measured (Plan(costs='none')): the partition ignores speed")
    if any(recompute):
        lines.append("rc: the stage keeps only the values entering some of its units and "
                     "recomputes its forward in its backward, a segment at a time "
                     "(Plan(recompute))")
    if memory_limits is not None:
        lines.append(format_memory_cap(partition, memory_limits))
    for name, stages in (shared or {}).items():
        lines.append(f"shared parameter {name}: used by stages {', '.join(map(str, stages))} "
                     "(one Parameter, gradients summed; counted in each stage above)")
    if table.edges:
        lines.append("boundary values (shapes at the example batch):")
        edge_rows = [[f"{e.src} -> {e.dst}", e.value, e.info, format_bytes(e.info.nbytes),
                      "skip" if e.dst - e.src > 1 else ""] for e in table.edges]
        lines.append(_indent(format_table(["edge", "value", "shape", "bytes", ""], edge_rows)))
    return "\n".join(lines)


def format_memory_cap(partition: Partition, limits: Sequence[float]) -> str:
    """One line: the memory cap and the stage closest to it (the one that binds)."""
    use = [stage.memory / limit for stage, limit in zip(partition.stages, limits)]
    s = max(range(len(use)), key=use.__getitem__)
    again = [str(k) for k, r in enumerate(partition.recompute) if r]
    return (f"memory cap (Plan(memory_limit)): {format_bytes(limits[s])} on stage {s}, which "
            f"binds: {format_bytes(partition.stages[s].memory)} predicted ({use[s]:.0%})"
            + (f"; recomputing the forward in backward: stage{'s' * (len(again) > 1)} "
               f"{', '.join(again)}" if again else ""))


def _memory(partition: Partition, s: int, limits: Sequence[float] | None) -> str:
    memory = format_bytes(partition.stages[s].memory)
    return memory if limits is None else f"{memory} / {format_bytes(limits[s])}"


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds, two decimals."""
    return f"{seconds * 1e3:.2f}"


def _traffic(edges) -> str:
    if not edges:
        return "-"
    total = sum(e.info.nbytes for e in edges)
    return f"{len(edges)} value{'s' if len(edges) > 1 else ''}, {format_bytes(total)}"


def format_graph(gm: fx.GraphModule, title: str = "") -> str:
    """One line per node of a PipelineGraph: stage, name, operation, value."""
    rows = []
    for node in gm.graph.nodes:
        stage = node.meta.get(STAGE, "")
        info = node.meta.get(SHAPE)
        value = "" if info is None else str(info)
        rows.append([stage, node.name, _describe(node), value])
    text = format_table(["stage", "node", "operation", "value"], rows)
    legend = ("(hook: identity whose backward fires the stage's callbacks once the stage's "
              "backward is done; send/recv: a value crossing stages)")
    return "\n".join(filter(None, [title, legend, text]))


def _describe(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return f"return {fx.map_arg(node.args[0], lambda n: n.name)}"
    if node.op == "get_attr":
        return f"self.{node.target}"
    args = ", ".join(_arg(a) for a in node.args)
    if node.target is send:
        return f"send({args}, {node.kwargs['src']} -> {node.kwargs['dst']})"
    if node.target is recv:
        return (f"recv({args}, {node.kwargs['src']} -> {node.kwargs['dst']}, "
                f"on {node.kwargs['device']})")
    if node.target is operator.getitem:
        return f"{node.args[0]}[{node.args[1]}]"
    if node.op == "call_module" and str(node.target).startswith("hook"):
        return f"hook({args})"
    if node.op == "call_module":
        return f"{node.target}({args})"
    return f"{getattr(node.target, '__name__', node.target)}({args})"


def chrome_trace(timelines: dict[str, Sequence[Event]]) -> dict:
    """A Chrome/Perfetto trace: one process per timeline (e.g. measured, predicted), one track
    per stage, one slice per action; times in microseconds."""
    events: list[dict] = []
    for pid, (name, timeline) in enumerate(timelines.items()):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        for stage in sorted({e.stage for e in timeline}):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": stage,
                           "args": {"name": f"stage {stage}"}})
        for e in timeline:
            events.append({
                "ph": "X", "name": str(e.action), "cat": e.action.kind.name, "pid": pid,
                "tid": e.stage, "ts": e.start * 1e6, "dur": max(e.end - e.start, 0.0) * 1e6,
                "args": {"micro_batch": e.action.mb},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _arg(a: object) -> str:
    return a.name if isinstance(a, fx.Node) else repr(a)


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def describe_pipeline(pipe: Any) -> str:
    """print(pipe): the stage table of a CompiledPipeline, its costs' source, the schedule's
    placement, weight copies, intra-layer splits and scalar joins."""
    partition, p = pipe.partition, pipe.partition.micro_batches
    title = (f"CompiledPipeline({pipe.model_name}): traced with {pipe.frontend}, "
             f"{len(pipe.units)} units in {pipe.plan.stages} stages, "
             f"partition {partition.partitioner} ({' + '.join(map(str, partition.sizes))}), "
             f"{p} micro-batch{'es' if p > 1 else ''}")
    params = [sum(p.numel() for p in s.module.parameters()) for s in pipe.stages]
    timed = pipe.plan.costs != "none"
    simulated = ((pipe.executor.latest_schedule.name, pipe.predicted_timeline().makespan)
                 if timed else None)
    held = set(pipe.executor.runners)
    devices = [d if pipe.owned is None else f"{d} (rank {pipe.rank})" if s in held
               else "another rank" for s, d in enumerate(pipe.devices)]
    schedule = pipe.executor.schedule
    shared = schedule.devices < schedule.stages  # several stages per device
    if shared:
        devices = [f"{d} (device {schedule.device(s)})" for s, d in enumerate(devices)]
    table = format_stage_table(title, pipe.units, partition, pipe.comm, devices, params,
                               pipe.shared_parameters(), timed, pipe.link, simulated,
                               placed=shared, recompute=stage_recompute(pipe.plan, partition),
                               memory_limits=stage_limits(pipe.plan))
    if timed:
        table += f"\ncosts: {pipe.cost.source}"
    if shared:
        table += (f"\n{schedule.name} runs {schedule.stages} stages on {schedule.devices} "
                  "devices, one worker each: " + "; ".join(
                      f"device {d} stages {', '.join(map(str, schedule.stages_on(d)))}"
                      for d in range(schedule.devices)))
    if pipe.plan.schedule == "async-1f1b":
        table += "\n" + _weight_copies_line(pipe)
    for split in pipe.intra_layer:
        table += "\n" + split.format()
    for position, join in pipe.executor.scalar_joins.items():
        table += "\n" + join.describe(position)
    return table


def _weight_copies_line(pipe: Any) -> str:
    if not pipe.executor.optimizers_attached():
        return (f"async-1f1b weights (consistency={pipe.plan.consistency!r}): no optimizer "
                "attached yet (pipe.attach_optimizer)")
    parts = []
    for index, copies in pipe.executor.weight_copies().items():
        nbytes = copies * sum(p.nbytes for p in pipe.stages[index].module.parameters())
        parts.append(f"stage {index}: {copies} ({format_bytes(nbytes)})")
    return (f"async-1f1b weights (consistency={pipe.plan.consistency!r}), most extra "
            f"copies held so far: {'; '.join(parts)}")
