"""Rewrite pass: split a traced graph into stage submodules joined by send/recv and hook nodes."""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from fxpipe.cost import check_bounds
from fxpipe.ir import CommTable, Edge, Stage, StageHook, StageIO, recv, send
from fxpipe.meta import AUTOCAST, SHAPE, STAGE, SYMBOLIC, UNIT, ValueInfo
from fxpipe.units import Unit

__all__ = ["assign_stages", "build_pipeline", "find_edges", "split_stages"]


def split_stages(
    gm: fx.GraphModule,
    units: Sequence[Unit],
    bounds: Sequence[int],
    devices: Sequence[str],
) -> tuple[fx.GraphModule, CommTable]:
    """Split `gm` at the unit `bounds` (exclusive stage ends) into a PipelineGraph.

    Three phases, each a function: assign every node a stage, find the values that cross
    stages (the send/recv table), clone the nodes into a graph per stage and stitch them in the
    top-level PipelineGraph. Unlike torch.fx's split_module, which turns every `get_attr` into a
    stage input, a `get_attr` is cloned into every stage that reads it under its original name:
    a stage owns its parameters, and a weight tied across stages stays one Parameter.
    """
    stage_of = assign_stages(gm, units, bounds)
    table = find_edges(gm, stage_of, len(bounds))
    return build_pipeline(gm, stage_of, table, devices), table


def assign_stages(
    gm: fx.GraphModule, units: Sequence[Unit], bounds: Sequence[int]
) -> dict[fx.Node, int]:
    """Each compute node's stage, from its unit; also written under node.meta[STAGE].

    Placeholders belong to the first stage and the output to the last; `get_attr` nodes belong
    to no single stage (they are cloned into each stage that reads them).
    """
    bounds = check_bounds(bounds, len(units))  # increasing, ending at the last unit
    stage_of_unit = [s for s, (start, end) in enumerate(zip((0, *bounds), bounds))
                     for _ in range(start, end)]
    stage_of: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            stage_of[node] = 0
        elif node.op == "output":
            stage_of[node] = len(bounds) - 1
        elif node.op != "get_attr":
            stage_of[node] = stage_of_unit[node.meta[UNIT]]
        if node in stage_of:
            node.meta[STAGE] = stage_of[node]
    return stage_of


def find_edges(gm: fx.GraphModule, stage_of: dict[fx.Node, int], n_stages: int) -> CommTable:
    """Which values each stage takes and returns, and every (value, src, dst) crossing."""
    inputs: list[dict[str, None]] = [{} for _ in range(n_stages)]
    outputs: list[dict[str, None]] = [{} for _ in range(n_stages)]
    edges: dict[tuple[str, int], Edge] = {}
    produced = {n.name: stage_of[n] for n in gm.graph.nodes if n.op not in ("get_attr", "output")}
    info = {n.name: _travelling(n) for n in gm.graph.nodes}
    shapes = {n.name: n.meta[SYMBOLIC].shapes[0] for n in gm.graph.nodes
              if SYMBOLIC in n.meta and n.meta[SYMBOLIC].shapes}

    def use(value: fx.Node, stage: int) -> None:
        if value.op == "get_attr":
            return
        src = produced[value.name]
        if src == stage and value.op != "placeholder":
            return
        inputs[stage].setdefault(value.name)
        if src != stage:
            if value.op != "placeholder":  # stage 0 holds the model's inputs without making them
                outputs[src].setdefault(value.name)
            edges.setdefault((value.name, stage), Edge(value.name, src, stage, info[value.name],
                                                       shapes.get(value.name)))

    last = n_stages - 1
    graph_outputs: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "output":
            for value in _flat_nodes(node.args[0]):
                graph_outputs.append(value.name)
                if value.op != "get_attr" and produced[value.name] != last:
                    use(value, last)
                elif value.op != "placeholder":
                    outputs[last].setdefault(value.name)
        elif node.op not in ("placeholder", "get_attr"):
            for value in node.all_input_nodes:
                use(value, stage_of[node])
    stages = tuple(
        StageIO(s, tuple(inputs[s]), tuple(outputs[s])) for s in range(n_stages)
    )
    graph_inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    return CommTable(stages, tuple(edges.values()), graph_inputs, tuple(graph_outputs))


def _travelling(node: fx.Node) -> ValueInfo:
    """What the node's value is as it crosses to another stage: the trace's, in the dtypes the
    plan's autocast makes it in where the shapes pass recorded them (node.meta[AUTOCAST])."""
    info = node.meta.get(SHAPE) or ValueInfo("object", ())
    cast = node.meta.get(AUTOCAST)
    if cast is None or len(cast.tensors) != len(info.tensors):
        return info
    return dataclasses.replace(info, tensors=tuple(
        dataclasses.replace(t, dtype=c.dtype) for t, c in zip(info.tensors, cast.tensors)))


def build_pipeline(
    gm: fx.GraphModule,
    stage_of: dict[fx.Node, int],
    table: CommTable,
    devices: Sequence[str],
) -> fx.GraphModule:
    """The PipelineGraph: stage and hook modules, and the top-level graph calling them."""
    modules: dict[str, torch.nn.Module] = {}
    for io in table.stages:
        stage = Stage(io.stage, _stage_module(gm, stage_of, io))
        modules[f"stage{io.stage}"] = stage
        trainable = dict(stage.module.named_parameters())
        modules[f"hook{io.stage}"] = StageHook(io.stage, trainable)
    graph = _top_level_graph(gm, table, devices)
    return fx.GraphModule(modules, graph, class_name="PipelineGraph")


def _stage_module(
    gm: fx.GraphModule, stage_of: dict[fx.Node, int], io: StageIO
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in io.inputs:
        source = by_name[name]
        env[source] = graph.placeholder(name)
        env[source].meta = dict(source.meta)
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if stage_of.get(node) != io.stage or node.op in ("placeholder", "output"):
            continue
        for value in node.all_input_nodes:
            if value.op == "get_attr" and value not in env:
                env[value] = graph.get_attr(value.target)
                env[value].meta = dict(value.meta)
                attrs[value.target] = operator.attrgetter(value.target)(gm)
        if node.op == "call_module":
            attrs[node.target] = operator.attrgetter(node.target)(gm)
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[by_name[name]] for name in io.outputs))
    return fx.GraphModule(attrs, graph, class_name=f"Stage{io.stage}")


def _top_level_graph(gm: fx.GraphModule, table: CommTable, devices: Sequence[str]) -> fx.Graph:
    graph = fx.Graph()  # takes the traced graph's flat placeholders, returns its output node
    nodes = {n.name: n for n in gm.graph.nodes}
    # value name -> top-level node holding it, per stage that can read it
    held: list[dict[str, fx.Node]] = [{} for _ in table.stages]
    for name in table.graph_inputs:
        source = nodes[name]
        placeholder = graph.placeholder(name, default_value=_default(source))
        placeholder.meta = dict(source.meta)
        held[0][name] = placeholder

    sent: dict[tuple[str, int], fx.Node] = {}
    for io in table.stages:
        s = io.stage
        for edge in table.recvs(s):
            held[s][edge.value] = _comm_node(
                graph, recv, (sent[edge.value, s],),
                {"src": edge.src, "dst": s, "device": devices[s]},
                f"{edge.value}_at_s{s}", edge,
            )
        args = tuple(held[s][v] for v in io.inputs)
        hook = graph.create_node("call_module", f"hook{s}", args, name=f"hook{s}")
        call = graph.create_node("call_module", f"stage{s}", (hook,), name=f"stage{s}")
        for node in (hook, call):
            node.meta[STAGE] = s
        for k, value in enumerate(io.outputs):
            item = graph.create_node("call_function", operator.getitem, (call, k), name=value)
            item.meta = {SHAPE: nodes[value].meta.get(SHAPE), STAGE: s}
            held[s][value] = item
        for edge in table.sends(s):
            sent[edge.value, edge.dst] = _comm_node(
                graph, send, (held[s][edge.value],), {"src": s, "dst": edge.dst},
                f"{edge.value}_to_s{edge.dst}", edge,
            )

    output = next(n for n in gm.graph.nodes if n.op == "output")
    last = held[-1]

    def lookup(node: fx.Node) -> fx.Node:
        if node.op == "get_attr" and node.name not in last:  # an output that is a parameter:
            last[node.name] = graph.get_attr(node.target)  # read it where it lives
        return last[node.name]

    result = graph.output(fx.map_arg(output.args[0], lookup), type_expr=output.type)
    result.meta[STAGE] = len(table.stages) - 1
    return graph


def _comm_node(graph, target, args, kwargs, name, edge: Edge) -> fx.Node:
    node = graph.create_node("call_function", target, args, kwargs, name=name)
    node.meta = {SHAPE: edge.info, STAGE: kwargs["dst"] if target is recv else edge.src}
    return node


def _default(placeholder: fx.Node) -> Any:
    return placeholder.args[0] if placeholder.args else inspect.Signature.empty


def _flat_nodes(arg: Any) -> list[fx.Node]:
    flat: list[fx.Node] = []
    fx.map_arg(arg, flat.append)
    return flat
