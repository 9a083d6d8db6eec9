"""What a rewritten graph keeps of the original: node metadata, codegen, modules and state."""

from __future__ import annotations

from typing import Any

from torch import fx

from fxpipe.meta import SHAPE, UNIT, ValueInfo

__all__ = ["copy_graph", "graph_module", "inherited_meta"]


def inherited_meta(origin: fx.Node, info: ValueInfo | None) -> dict[str, Any]:
    """What a new node inherits from the node it comes from (its unit, its module stack)."""
    meta = {key: origin.meta[key] for key in (UNIT, "nn_module_stack", "stack_trace")
            if key in origin.meta}
    if info is not None:
        meta[SHAPE] = info
    return meta


def graph_module(gm: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule running `graph` that holds gm's own modules, parameters and buffers."""
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    # GraphModule copies only what the graph names, under fresh parents: share gm's instead,
    # in gm's order, so state_dict() and the user's optimizer see the same objects.
    new._modules = dict(gm._modules)
    new._parameters = dict(gm._parameters)
    new._buffers = dict(gm._buffers)
    new._non_persistent_buffers_set = set(gm._non_persistent_buffers_set)
    new.meta = dict(getattr(gm, "meta", {}))
    new.train(gm.training)
    return new


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` with its codegen (input/output flattening) and output metadata."""
    copied = fx.Graph()
    copied.set_codegen(graph._codegen)
    value, output = copied.graph_copy(graph, {}, return_output_node=True)
    copied.output(value, type_expr=output.type).meta = dict(output.meta)
    return copied
