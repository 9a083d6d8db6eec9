"""A traced graph's calling convention: a model call's (args, kwargs) <-> flat graph values."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from fxpipe.errors import FxpipeError

__all__ = ["CallConvention", "argument_owners"]


def argument_owners(parameters: Sequence[str], args: tuple[Any, ...],
                    kwargs: Mapping[str, Any]) -> list[str]:
    """For each leaf of (args, kwargs), the forward() parameter it is passed as (`parameters`
    in forward()'s order)."""
    paths, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    return [parameters[p[1].idx] if p[0].idx == 0 else p[1].key for p, _ in paths]


class CallConvention:
    """Turns a call of the model into the graph's placeholder values, and its output back.

    Graphs from torch.export flatten their inputs with a pytree spec, laid out as the example
    call was. Graphs from torch.fx take one placeholder per parameter of forward(); they are
    bound through forward()'s signature, so defaults apply and concrete arguments take the
    value they were traced with. A call is refused where it gives another value to an argument
    the graph holds fixed: a concrete one, one that export took as a constant or a tracer
    left out of the graph.
    """

    def __init__(self, model: torch.nn.Module, gm: fx.GraphModule,
                 concrete: Mapping[str, Any] | None = None,
                 example: tuple[tuple[Any, ...], Mapping[str, Any]] = ((), {}),
                 concrete_source: str = "Plan(concrete_args=...)") -> None:
        self.in_spec = getattr(gm, "_in_spec", None)
        self.out_spec = getattr(gm, "_out_spec", None)
        self.signature = inspect.signature(model.forward)
        self.concrete = dict(concrete or {})
        self.concrete_source = concrete_source  # who fixed them, for the fix in a refusal
        self.names = [n.target.lstrip("*") for n in gm.graph.find_nodes(op="placeholder")]
        self.fixed = self._fixed(*example)

    def argument_of_each_input(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
                               ) -> list[str]:
        """For each flat graph input of a call, the forward() argument it comes from."""
        order = list(self.signature.parameters)
        if self.in_spec is None:
            return [name if name in self.signature.parameters else order[i]
                    for i, name in enumerate(self.names)]
        return argument_owners(order, args, kwargs)

    def unflatten(self, output: Any) -> Any:
        """The model's output structure from what the graph returned."""
        if self.out_spec is None:
            return output
        return pytree.tree_unflatten(list(output), self.out_spec)

    def _fixed(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
               ) -> dict[str, tuple[Any, str]]:
        """forward()'s arguments the graph holds at one value (as a _pattern), and the fix."""
        parameters = {n: p for n, p in self.signature.parameters.items()
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if self.in_spec is not None:
            bound = self._bind(args, kwargs)
            bound.apply_defaults()
            return {n: (_pattern(bound.arguments[n]), "torch.export fixed it at its value in "
                        "compile's example; for another value, compile another pipeline with "
                        f"it in the example (example_kwargs={{{n!r}: ...}})") for n in parameters}
        inputs = set(self.argument_of_each_input((), {}))
        fixed = {n: (p.default, f"the tracer left it out of the graph; trace it as an input, "
                     f"or call with {n}={p.default!r}")
                 for n, p in parameters.items() if n not in inputs and p.default is not p.empty}
        fixed.update((n, (_pattern(v), f"{self.concrete_source} fixed it at {v!r}; compile "
                      f"another pipeline with concrete_args={{{n!r}: ...}} for that value"))
                     for n, v in self.concrete.items())
        return fixed

    def __call__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
        bound = self._bind(args, kwargs)
        given = set(bound.arguments)
        bound.apply_defaults()
        for name, (value, fix) in self.fixed.items():
            # an omitted concrete argument takes its traced value, not forward()'s default
            now = _pattern(bound.arguments[name])
            if (name in given or name not in self.concrete) and not _equal(now, value):
                default = "" if name in given else " (its default)"
                raise FxpipeError(f"this call gives forward() argument {name!r} {now!r:.60}"
                                  f"{default}, but the pipeline's graph holds it at "
                                  f"{value!r:.60}: {fix}.")
        order = list(self.signature.parameters)
        if self.in_spec is not None:
            call = self._as_traced(args, kwargs, bound.arguments)
            return list(fx_pytree.tree_flatten_spec(call, self.in_spec))
        values = {**bound.arguments, **self.concrete}
        flat = []
        for position, name in enumerate(self.names):
            # fx renames a placeholder that clashes with a global (`double` -> `double_1`)
            key = name if name in values else order[position]
            flat.append(values[key])
        return flat

    def _bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> inspect.BoundArguments:
        try:
            return self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise FxpipeError(f"the model's forward{self.signature} cannot take this call: {e}"
                              ) from e

    def _as_traced(self, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   arguments: Mapping[str, Any]) -> tuple:
        """The call (`arguments`: bound, defaults applied) laid out as the exported example's
        (model(x, labels=y) fits a graph traced from model(input_ids=x, labels=y)); an argument
        the graph lacks is refused."""
        params = self.signature.parameters
        if any(p.kind is p.VAR_POSITIONAL for p in params.values()):
            return tuple(args), dict(kwargs)
        values = {}  # by name, those **kwargs took too
        for name, value in arguments.items():
            values.update(value if params[name].kind is params[name].VAR_KEYWORD
                          else {name: value})
        n = self.in_spec.child(0).num_children
        traced = [*list(params)[:n], *self.in_spec.child(1).context]
        missing = [name for name in traced if name not in values]
        extra = [name for name, value in values.items() if name not in traced
                 and (name not in params or value is not params[name].default)]
        if missing or extra:
            raise FxpipeError(f"this call {f'lacks {missing}' if missing else f'adds {extra}'}, "
                              f"and the pipeline was compiled from an example passing {traced}: "
                              "pass the same arguments, or compile from an example that does.")
        return tuple(values[k] for k in traced[:n]), {k: values[k] for k in traced[n:]}


_ANY_TENSOR = type("AnyTensor", (), {"__repr__": lambda self: "a tensor"})()


def _pattern(value: Any) -> Any:
    """`value` with each tensor in it standing for any tensor (as an export graph takes it)."""
    return pytree.tree_map(lambda x: _ANY_TENSOR if isinstance(x, torch.Tensor) else x, value)


def _equal(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # a value with no plain truth of equality
        return False
