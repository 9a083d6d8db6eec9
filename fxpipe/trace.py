"""Tracing frontends: torch.fx symbolic tracing, torch.export, or the user's own tracer."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx._symbolic_trace import _assert_is_none as fx_assert_is_none
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils import _pytree as pytree

from fxpipe.batching import input_dims, resize
from fxpipe.errors import FxpipeTraceError
from fxpipe.graph_io import CallConvention, argument_owners
from fxpipe.materialize import has_meta_tensors, on_meta
from fxpipe.plan import Plan
from fxpipe.preserve import modes_kept
from fxpipe.stacks import unstacked

__all__ = ["Traced", "trace"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXPIPE_DIR = os.path.dirname(os.path.abspath(__file__))
_STDLIB_DIR = os.path.dirname(contextlib.__file__)


@dataclasses.dataclass(frozen=True)
class Traced:
    """A model as a graph, and how it was obtained."""

    gm: fx.GraphModule
    frontend: str  # "fx", "export" or "custom"
    training: bool  # the mode the model was in when traced (export bakes it into the graph)
    leaf_paths: tuple[str, ...]  # modules the user asked to keep whole
    bind: CallConvention  # a model call's (args, kwargs) <-> the graph's flat values
    mode_fixed: bool = False  # the graph fixes train/eval behaviour (export; fx if it reads it)


def trace(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    plan: Plan,
    check: Callable[[Traced], None] | None = None,
) -> Traced:
    """Turn `model` into an fx.GraphModule with the frontend the plan asks for.

    `check(traced)` runs on each candidate graph (e.g. shape propagation); a frontend whose graph
    fails it counts as failed, so `tracer="auto"` moves on to the next frontend.
    """
    leaf_paths = _leaf_paths(model, plan.leaf_modules)
    model = model if callable(plan.tracer) else unstacked(model, leaf_paths)
    if callable(plan.tracer):
        frontends: Sequence[str] = ("custom",)
    elif plan.tracer == "auto":
        frontends = ("fx", "export")
    else:
        frontends = (plan.tracer,)
    failures: list[tuple[str, str]] = []  # (frontend, what went wrong where)
    for frontend in frontends:
        recorder = _ModuleStack(model)
        try:
            with recorder, _without_cache(model):
                gm = _FRONTENDS[frontend](model, args, kwargs, plan, leaf_paths, recorder)
            concrete = (plan.concrete_args if frontend == "fx" else
                        specialized_arguments(gm) if frontend == "custom" else None)
            fixed = frontend == "export" or (
                frontend == "fx" and _reads_training(model, plan, leaf_paths, recorder, gm))
            bind = CallConvention(model, gm, concrete, (args, kwargs),
                                  "your tracer's concrete_args" if frontend == "custom"
                                  else "Plan(concrete_args=...)")
            traced = Traced(gm, frontend, model.training, leaf_paths, bind, fixed)
            if check is not None:
                check(traced)
        except FxpipeTraceError:
            raise
        except Exception as e:  # any failure of a frontend is reported, with its cause
            failures.append((frontend, _failure(recorder.innermost, e)))
            continue
        return traced
    raise FxpipeTraceError(_trace_error_message(model, failures)) from None


def specialized_arguments(gm: fx.GraphModule) -> dict[str, Any]:
    """forward()'s arguments a tracer fixed with fx's concrete_args, by name, and their values:
    fx keeps a placeholder for each and asserts it equals the value (or is None)."""
    fixed = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (torch._assert, fx_assert_is_none):
            continue
        message = node.args[1] if len(node.args) > 1 else ""
        name, marker, _ = str(message).partition(" has been specialized to have value")
        if not marker:
            continue
        test = node.args[0]
        if node.target is fx_assert_is_none:
            fixed[name] = None
        elif isinstance(test, fx.Node) and test.target is operator.eq:
            fixed[name] = test.args[1]
    return fixed


@contextlib.contextmanager
def _without_cache(model: torch.nn.Module):
    """A HuggingFace model whose config has use_cache on returns a key/value cache object,
    which is no graph output and of no use to a pipeline: it is traced with the cache off."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def _leaf_paths(model: torch.nn.Module, leaf_modules: Sequence[type | str]) -> tuple[str, ...]:
    classes = tuple(leaf for leaf in leaf_modules if isinstance(leaf, type))
    names = {leaf for leaf in leaf_modules if isinstance(leaf, str)}
    paths = [
        path for path, module in model.named_modules()
        if path and (isinstance(module, classes) or path in names or type(module).__name__ in names)
    ]
    matched = set(paths) | {type(model.get_submodule(p)).__name__ for p in paths}
    unknown = sorted(names - matched)
    if unknown:
        raise FxpipeTraceError(
            f"Plan(leaf_modules=...) names {unknown}, which match no submodule of "
            f"{type(model).__name__}; use qualified names from model.named_modules() "
            "(e.g. 'blocks.3.attn') or class names."
        )
    return tuple(paths)


class _LeafTracer(fx.Tracer):
    """torch.fx tracer that keeps the user's leaf modules whole."""

    def __init__(self, leaf_paths: Sequence[str], recorder: _ModuleStack) -> None:
        super().__init__()
        self.leaf_paths = frozenset(leaf_paths)
        self.recorder = recorder

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaf_paths or super().is_leaf_module(
            m, module_qualified_name
        )

    def call_module(self, m, forward, args, kwargs):
        # fx calls forward() directly, so module hooks do not fire; keep the stack here.
        self.recorder.push(m, args)
        result = super().call_module(m, forward, args, kwargs)
        self.recorder.pop(m, args, result)
        return result


def _trace_fx(model, args, kwargs, plan, leaf_paths, recorder) -> fx.GraphModule:
    tracer = _LeafTracer(leaf_paths, recorder)
    graph = tracer.trace(model, concrete_args=dict(plan.concrete_args or {}) or None)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _reads_training(model, plan, leaf_paths, recorder, gm) -> bool:
    """Whether fx baked `self.training` into the graph: tracing in the other mode differs."""
    with modes_kept(model):
        other = _trace_fx(model.train(not model.training), (), {}, plan, leaf_paths, recorder)
    return other.code != gm.code


def _trace_export(model, args, kwargs, plan, leaf_paths, recorder) -> fx.GraphModule:
    args, kwargs = _at_least_two_rows(model, *_unaliased(args, kwargs), plan.whole_inputs)
    if has_meta_tensors(model):  # export runs the model on fake tensors of the inputs' device
        args, kwargs = on_meta((tuple(args), dict(kwargs)))
    with _keywords_named(model, kwargs):
        exported = torch.export.export(
            model, tuple(args), dict(kwargs), strict=False,
            dynamic_shapes=_dynamic_shapes(model, args, kwargs, plan.whole_inputs))
    gm = exported.module()
    # The input guards re-check how the example was laid out (even the size of a view's base
    # tensor), which micro-batches legitimately differ in; the graph itself is shape-generic.
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
            delattr(gm, "_guards_fn")
    gm.recompile()
    return gm


@contextlib.contextmanager
def _keywords_named(model: torch.nn.Module, kwargs: Mapping[str, Any]):
    """forward(x, **kwargs) seen by torch.export as forward(x, *, name, ...) for the example's
    keywords: export cannot take dynamic shapes for values in **kwargs (pytorch#150022). The
    graph's input layout is the call's either way."""
    signature = inspect.signature(model.forward)
    params = list(signature.parameters.values())
    extra = [n for n in kwargs if n not in signature.parameters]
    if not extra or not any(p.kind is p.VAR_KEYWORD for p in params):
        yield
        return
    forward, own = model.forward, vars(model).get("forward")  # an instance's own forward too
    named = [p for p in params if p.kind is not p.VAR_KEYWORD]
    named += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in extra]

    def call(*args: Any, **kw: Any) -> Any:
        return forward(*args, **kw)
    call.__signature__ = signature.replace(parameters=named)  # type: ignore[attr-defined]
    model.forward = call
    try:
        yield
    finally:
        del model.forward
        if own is not None:
            model.forward = own


def _unaliased(args, kwargs):
    """torch.export makes one graph input of a tensor passed twice (input_ids as labels): a
    copy stands for each repeat."""
    seen: set[int] = set()

    def copy(x: Any) -> Any:
        again = isinstance(x, torch.Tensor) and id(x) in seen
        seen.add(id(x))
        return x.clone() if again else x
    return pytree.tree_map(copy, (tuple(args), dict(kwargs)))


def _whole_positions(model, args, kwargs, whole: Sequence[str]) -> set[int]:
    """Positions, among the leaves of (args, kwargs), of the arguments named in `whole`."""
    owners = argument_owners(list(inspect.signature(model.forward).parameters), args, kwargs)
    return {i for i, owner in enumerate(owners) if owner in whole}


def _at_least_two_rows(model, args, kwargs, whole: Sequence[str]):
    """torch.export fixes a dimension of size 1 in the graph; an example batch of one sample is
    repeated to two so the batch stays symbolic (and micro-batches of any size run)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    dims = input_dims(leaves, _whole_positions(model, args, kwargs, whole))
    if dims.batch != 1:
        return args, kwargs
    return pytree.tree_unflatten(resize(leaves, dims, 2), spec)


def _dynamic_shapes(model, args, kwargs, whole: Sequence[str]) -> dict[str, Any]:
    """Batch (and token-sequence) dimensions stay symbolic, so the exported graph runs on
    micro-batches of any size, not only on the example's."""
    dims = input_dims(pytree.tree_leaves((tuple(args), dict(kwargs))),
                      _whole_positions(model, args, kwargs, whole))

    def spec(x: Any) -> dict[int, Any] | None:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != dims.batch:
            return None
        dynamic = {0: torch.export.Dim.AUTO}
        if dims.seq is not None and x.dim() == 2 and x.shape[1] == dims.seq \
                and not x.is_floating_point():
            dynamic[1] = torch.export.Dim.AUTO
        return dynamic

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: pytree.tree_map(lambda x: None, value) if name in whole
            else pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def _trace_custom(model, args, kwargs, plan, leaf_paths, recorder) -> fx.GraphModule:
    gm = plan.tracer(model, tuple(args))
    if not isinstance(gm, fx.GraphModule):
        raise FxpipeTraceError(
            f"Plan(tracer=...) returned {type(gm).__name__}; a tracer callable must return "
            "a torch.fx.GraphModule, e.g. lambda model, inputs: torch.fx.symbolic_trace(model)."
        )
    return gm


_FRONTENDS = {"fx": _trace_fx, "export": _trace_export, "custom": _trace_custom}


class _ModuleStack(contextlib.AbstractContextManager):
    """Records which submodule was running when tracing failed (global module hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {id(m): (path, type(m).__name__) for path, m in model.named_modules()}
        self.stack: list[tuple[str, str]] = []
        self.innermost: tuple[str, str] | None = None

    def push(self, module, args) -> None:
        entry = self.names.get(id(module))
        if entry is not None:
            self.stack.append(entry)

    def pop(self, module, args, output) -> None:
        if id(module) in self.names and self.stack:
            self.stack.pop()

    def __enter__(self) -> _ModuleStack:
        self.handles = [
            register_module_forward_pre_hook(self.push),
            register_module_forward_hook(self.pop),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        if self.stack:
            self.innermost = self.stack[-1]


def _failure(innermost: tuple[str, str] | None, error: BaseException) -> str:
    """Where a frontend failed (the innermost module running, the user's line) and why."""
    where = "in the model"
    if innermost is not None:
        path, cls = innermost
        where = f"in module '{path}' ({cls})" if path else f"in the top-level module {cls}"
    location = _user_location(error)
    return f"failed {where}{f' at {location}' if location else ''}: {_first_lines(error)}"


def _user_location(error: BaseException) -> str | None:
    """The innermost traceback frame in the user's code (not torch's, fxpipe's or stdlib's)."""
    frames = [
        frame for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith((_TORCH_DIR, _FXPIPE_DIR, _STDLIB_DIR))
    ]
    if not frames:
        return None
    frame = frames[-1]
    code = f" `{frame.line.strip()}`" if frame.line else ""
    return f"{os.path.basename(frame.filename)}:{frame.lineno}{code}"


def _first_lines(error: BaseException, limit: int = 2) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[:limit]) or type(error).__name__
    return f"{type(error).__name__}: {text}"


def _trace_error_message(model: torch.nn.Module, failures: Sequence[tuple[str, str]]) -> str:
    name = type(model).__name__
    tried = ", ".join(frontend for frontend, _ in failures)
    return "\n".join([
        f"fxpipe could not turn {name} into a graph (tried: {tried}).",
        *(f"  {frontend}: {what}" for frontend, what in failures),
        "How to fix it:",
        "  - keep the failing module whole, called as one unit: "
        "Plan(leaf_modules=[TheModuleClass]) or Plan(leaf_modules=['its.qualified.name']);",
        "  - fix arguments that steer Python control flow: Plan(concrete_args={'flag': True});",
        "  - try the other frontend: Plan(tracer='export') (torch.export, non-strict) "
        "or Plan(tracer='fx');",
        "  - bring your own tracer: Plan(tracer=lambda model, inputs: my_trace(model)) returning "
        "a torch.fx.GraphModule (e.g. transformers.utils.fx.symbolic_trace).",
        *(["  - the model returns a key/value cache, which a pipeline cannot pass on: call it "
           "with use_cache=False (example_kwargs={'use_cache': False})."]
          if any("Cache" in what for _, what in failures) else []),
    ])
