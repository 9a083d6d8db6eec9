"""What a pipeline's stages were built from, to tell a model changed since compile."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

from fxpipe.errors import FxpipeError

__all__ = ["ModelSnapshot"]


class ModelSnapshot:
    """The children, parameters and buffers of a pipeline module and of its model's modules,
    as objects: the stages hold these very objects, so a replaced one is a changed model."""

    def __init__(self, pipeline: torch.nn.Module, model: torch.nn.Module) -> None:
        self.model = model
        self.parts = [(m, dict(m._modules), dict(m._parameters), dict(m._buffers))
                      for m in (pipeline, *model.modules())]

    def check(self, model_name: str, parameters: bool = True) -> bool:
        """Refuse a model whose submodules (or `parameters`) were replaced, added or removed;
        whether a buffer was replaced (an assignment, the model's .to()), which the stages can
        take in. One pass over the modules."""
        buffers_replaced = False
        for module, *then in self.parts:
            now = (module._modules, module._parameters, module._buffers)
            for was, new in list(zip(then, now))[:1 + parameters]:
                if not _same(was, new):
                    name = next(n for n in {**was, **new} if was.get(n) is not new.get(n))
                    path = next((f"{n}." for n, m in self.model.named_modules()
                                 if m is module and n), "")
                    raise FxpipeError(
                        f"{model_name}'s {path}{name} changed after compile (replaced, added "
                        "or removed), and the pipeline's stages still run what compile saw; "
                        "compile again after changing the model: "
                        "pipe = fxpipe.compile(model, plan, ...).")
            buffers_replaced = buffers_replaced or not _same(then[2], now[2])
        return buffers_replaced


def _same(was: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """The same names holding the same objects."""
    return was.keys() == now.keys() and all(map(operator.is_, was.values(), now.values()))
