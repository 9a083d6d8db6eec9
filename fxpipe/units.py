"""How a traced graph is cut into partitionable units (ALGORITHMS §0)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch import fx

from fxpipe.meta import UNIT
from fxpipe.stacks import RNNLayer

__all__ = ["Unit", "cut_units", "in_place", "module_key", "unit_parameters"]

_OPAQUE_OPS = ("placeholder", "get_attr", "output")  # not owned by any one unit
_RNN_LAYER = f"{RNNLayer.__module__}.{RNNLayer.__qualname__}"


@dataclasses.dataclass(frozen=True)
class Unit:
    """One partitionable slice of the graph."""

    index: int
    name: str  # the owning module's qualified name, or the first node's name for root glue
    kind: str  # the owning module's class name, or "glue"
    nodes: tuple[str, ...]  # node names in graph order


def module_key(
    node: fx.Node, depth: int | None = None, leaf_paths: Sequence[str] = ()
) -> tuple[str, ...]:
    """The chain of module paths a node runs inside, cut at a leaf module and at `depth`.

    `depth` counts the components of a module path ("blocks.3" has two). Modules from torch.nn
    (other than containers) count as leaves, as torch.fx treats them, so an exported graph and an
    fx graph agree even though export records the ops inside e.g. nn.MultiheadAttention.
    """
    key: list[str] = []
    for path, module_type in _module_stack(node):
        if depth is not None and path.count(".") + 1 > depth:
            break
        key.append(path)
        if path in leaf_paths or _is_torch_leaf(module_type):
            break
    return tuple(key)


def cut_units(
    gm: fx.GraphModule, depth: int | None = None, leaf_paths: Sequence[str] = ()
) -> list[Unit]:
    """Cut `gm` into units and record each node's unit index under node.meta[UNIT].

    Walking the nodes in order, a node joins the current unit when its module chain is a prefix
    of the unit's (glue in an enclosing forward) or extends a unit that so far holds only glue;
    any other module chain starts a new unit.

    A unit is a contiguous run of nodes owned by one module call: a leaf module (a torch.nn
    layer, a module kept whole, or one at `depth`) with the functional glue after it in its
    parent's forward. The rule reads the `nn_module_stack` metadata both torch.fx and
    torch.export record, so both frontends cut a model into the same units.
    """
    groups: list[tuple[tuple[str, ...], list[fx.Node]]] = []
    for node in gm.graph.nodes:
        if node.op in _OPAQUE_OPS:
            continue
        key = module_key(node, depth, leaf_paths)
        if groups and in_place(gm, node):  # never first in a stage: it would write into the
            groups[-1][1].append(node)      # tensor another stage sent (autograd refuses that)
            continue
        if groups:
            unit_key, nodes = groups[-1]
            if key[: len(unit_key)] == unit_key or unit_key[: len(key)] == key:
                nodes.append(node)
                if len(key) > len(unit_key):  # glue followed by the module it leads into
                    groups[-1] = (key, nodes)
                continue
        groups.append((key, [node]))

    types = _module_types(gm)
    units = []
    for index, (key, nodes) in enumerate(groups):
        for node in nodes:
            node.meta[UNIT] = index
        name = key[-1] if key else nodes[0].name
        kind = types.get(name, "glue") if key else "glue"
        units.append(Unit(index, name, kind, tuple(n.name for n in nodes)))
    return units


def in_place(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether the node writes into an activation: an inplace=True module or function, a method
    like relu_(), or an in-place aten op (add_). Updates of buffers (BatchNorm's counter) are
    not activations and stay where their module is."""
    if node.args and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr":
        return False
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(node.target), "inplace", False))
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    return False


def _module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """(path, qualified class name) of each module the node runs in, outermost first, no root."""
    stack = node.meta.get("nn_module_stack") or {}
    entries = []
    for path, module_type in stack.values():
        if not path or path.startswith("_empty_nn_module_stack"):
            continue  # torch.export's records of the root module, or of no module
        if isinstance(module_type, type):
            module_type = f"{module_type.__module__}.{module_type.__qualname__}"
        entries.append((path, str(module_type)))
    return entries


def _is_torch_leaf(qualified_type: str) -> bool:
    if qualified_type == _RNN_LAYER:  # traced through (its weights keep their names), one unit
        return True
    if not qualified_type.startswith(("torch.nn.", "torch.ao.nn.")):
        return False
    return not qualified_type.endswith((".Sequential", ".ModuleList", ".ModuleDict"))


def _module_types(gm: fx.GraphModule) -> dict[str, str]:
    types = {}
    for node in gm.graph.nodes:
        for path, module_type in _module_stack(node):
            types[path] = module_type.rsplit(".", 1)[-1]
    return types


def unit_parameters(gm: fx.GraphModule, units: Sequence[Unit]) -> tuple[np.ndarray, np.ndarray]:
    """Parameter count and bytes of each unit of `gm` (a weight shared by units counts in the
    first): the parameters of the modules its nodes call, and those read by `get_attr` (which
    no unit owns) in the unit of their first reader."""
    unit_of = {name: unit.index for unit in units for name in unit.nodes}
    seen: set[int] = set()
    counts, nbytes = np.zeros(len(units)), np.zeros(len(units))
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.name in unit_of:
            owner, params = unit_of[node.name], gm.get_submodule(node.target).parameters()
        elif node.op == "get_attr":
            readers = [unit_of[user.name] for user in node.users if user.name in unit_of]
            owner_path, _, name = node.target.rpartition(".")
            value = getattr(gm.get_submodule(owner_path), name)
            if not readers or not isinstance(value, torch.nn.Parameter):
                continue
            owner, params = min(readers), [value]
        else:
            continue
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                counts[owner] += p.numel()
                nbytes[owner] += p.numel() * p.element_size()
    return counts, nbytes
