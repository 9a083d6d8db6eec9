"""Models built on the meta device: their tensors made real on a device only where needed."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.errors import PlanError

__all__ = ["check_meta_model", "has_meta_tensors", "kept_from", "materialize",
           "materialized_copy", "meta_twin", "on_meta"]


def has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def on_meta(values: Any) -> Any:
    """`values` (any nesting) with every tensor replaced by a meta tensor of its shape: what a
    model on the meta device can be run on to learn shapes."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), values)


def meta_twin(module: torch.nn.Module) -> torch.nn.Module:
    """`module` itself when all its tensors are on meta, else a copy moved there (a rank's
    pipeline holds its own stage real and the others on meta; shapes run on the meta twin)."""
    real = [t for t in [*module.parameters(), *module.buffers()] if not t.is_meta]
    if not real:
        return module
    # the copy gets meta stand-ins for the real tensors straight away: never a second real copy
    memo: dict[int, Any] = {id(t): _meta_like(t) for t in real}
    return copy.deepcopy(module, memo)


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
    return empty


def check_meta_model(model: torch.nn.Module, plan: Any) -> None:
    """A model on the meta device must be one a state dict can fill once it is real: every
    meta buffer persistent (a non-persistent one, say a mask made in __init__, would be left
    holding arbitrary values); and its layers are not split across devices."""
    if plan.intra_layer is not None:
        raise PlanError(
            "Plan(intra_layer=...) shards layers into views of their weights, which a model "
            "on the meta device does not have yet; build the model on a real device, or drop "
            "intra_layer."
        )
    lost = [f"{prefix}.{name}" if prefix else name
            for prefix, sub in model.named_modules()
            for name, buffer in sub.named_buffers(recurse=False)
            if buffer.is_meta and name in sub._non_persistent_buffers_set]
    if lost:
        raise PlanError(
            f"{type(model).__name__} is on the meta device and its non-persistent buffers "
            f"{lost} have no values: fxpipe makes each stage real with the modules' "
            "reset_parameters() and you load the weights from a state dict, which cannot fill "
            "a non-persistent buffer. Register it with persistent=True, compute it in "
            "forward(), or build the model on a real device."
        )


@torch.no_grad()
def materialize(module: torch.nn.Module, device: str | torch.device,
                holders: Sequence[torch.nn.Module] = ()) -> int:
    """Give every meta parameter and buffer of `module` storage on `device`: each is replaced,
    under every name it has in `module` and in the module trees `holders` (the same tensor
    stays one tensor, so tied weights stay tied). Values come from the modules'
    reset_parameters() where a module defines it for all its tensors (as FSDP initialises meta
    modules), else a small normal draw (floats) or zeros: placeholders until a state dict is
    loaded. Returns the number of bytes made real."""
    pending = {id(t): t for t in [*module.parameters(), *module.buffers()] if t.is_meta}
    made: dict[int, torch.Tensor] = {}
    for key, tensor in pending.items():
        real = torch.empty_like(tensor, device=device)
        if real.is_floating_point() or real.is_complex():
            real.normal_(0.0, 0.02)
        else:
            real.zero_()
        if isinstance(tensor, torch.nn.Parameter):
            real = torch.nn.Parameter(real, requires_grad=tensor.requires_grad)
        made[key] = real
    for root in (module, *holders):
        for sub in root.modules():
            for table in (sub._parameters, sub._buffers):
                for name, tensor in table.items():
                    if tensor is not None and id(tensor) in made:
                        table[name] = made[id(tensor)]
    # initialise with the modules' own reset_parameters(), looked up in every tree: an
    # exported stage holds its weights on plain containers, the model on its real modules
    new = {id(t) for t in made.values()}
    reset: set[int] = set()
    for root in (module, *holders):
        for sub in root.modules():
            own = [t for t in [*sub._parameters.values(), *sub._buffers.values()]
                   if t is not None]
            if (id(sub) not in reset and own and hasattr(sub, "reset_parameters")
                    and all(id(t) in new for t in own)):
                reset.add(id(sub))
                sub.reset_parameters()
    return sum(t.numel() * t.element_size() for t in made.values())


@contextlib.contextmanager
def materialized_copy(module: torch.nn.Module, device: str | torch.device
                      ) -> Iterator[torch.nn.Module]:
    """A copy of `module` with its meta tensors made real on `device` (the module itself is
    untouched), for timing a unit of a meta model: its weights exist only meanwhile. They are
    freed on exit, not whenever the garbage collector gets to the copy (a GraphModule is
    part of a reference cycle)."""
    twin = copy.deepcopy(module)
    materialize(twin, device)
    try:
        yield twin  # what is kept from it must not alias its tensors: see kept_from
    finally:
        for tensor in [*twin.parameters(), *twin.buffers()]:
            if tensor.grad is not None:
                tensor.grad.untyped_storage().resize_(0)
            tensor.untyped_storage().resize_(0)


def kept_from(module: torch.nn.Module, value: Any) -> Any:
    """`value` detached, copied if it shares storage with one of `module`'s tensors (an
    output such as `self.pos[:T]` is a view of a weight, which a materialized copy frees)."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    owned = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    return value.clone() if value.untyped_storage().data_ptr() in owned else value
